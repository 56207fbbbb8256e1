"""Chained prefix-cache hashes of full KV blocks (vLLM v1 ``hash_block_tokens``)."""

from __future__ import annotations

from array import array
from typing import Optional, Sequence

import xxhash

_ROOT = b"jaxllm-prefix-root"


def hash_block_tokens(parent_hash: Optional[bytes], token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """128-bit xxh3 digest (16 bytes) of one full block.

    The digest covers the parent block's hash (None for the first block), the
    block's token ids as int64, and ``extra_key`` (the request's cache salt on
    the first block). Chaining the parent makes a hit on block i imply a hit
    on blocks 0..i-1, as in vLLM v1.
    """
    h = xxhash.xxh3_128()
    h.update(_ROOT if parent_hash is None else parent_hash)
    h.update(extra_key)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    block_hashes: list[bytes], token_ids: Sequence[int], num_full_blocks: int, block_size: int, cache_salt: Optional[str]
) -> None:
    """Append hashes to ``block_hashes`` until it covers ``num_full_blocks`` blocks of ``token_ids``.

    Each block is hashed once over a request's life; the caller guarantees the
    first ``num_full_blocks * block_size`` token ids are final.
    """
    salt = b"" if cache_salt is None else cache_salt.encode()
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[i - 1] if i else None
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        block_hashes.append(hash_block_tokens(parent, tokens, salt if i == 0 else b""))
