"""Chained prefix-cache hashes of full KV blocks (vLLM v1 ``hash_block_tokens``)."""

from __future__ import annotations

from array import array
from typing import Optional, Sequence

import numpy as np
import xxhash

_ROOT = b"jaxllm-prefix-root"


def hash_block_tokens(parent_hash: Optional[bytes], token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """128-bit xxh3 digest (16 bytes) of one full block.

    The digest covers the parent block's hash (None for the first block), the
    block's token ids as int64, and ``extra_key`` (the request's cache salt on
    the first block). Chaining the parent makes a hit on block i imply a hit
    on blocks 0..i-1, as in vLLM v1.
    """
    parent = _ROOT if parent_hash is None else parent_hash
    return xxhash.xxh3_128_digest(parent + extra_key + array("q", token_ids).tobytes())


def extend_block_hashes(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    num_full_blocks: int,
    block_size: int,
    cache_salt: Optional[str],
    prefix_array: Optional[np.ndarray] = None,
) -> None:
    """Append hashes to ``block_hashes`` until it covers ``num_full_blocks`` blocks of ``token_ids``.

    Same digests as :func:`hash_block_tokens`. Each block is hashed once over a
    request's life; the caller guarantees the first ``num_full_blocks *
    block_size`` token ids are final. ``prefix_array`` (int64, e.g. the
    prompt) equal to the first tokens of ``token_ids``, when it covers the
    blocks, supplies their bytes without converting Python ints.
    """
    start = len(block_hashes)
    if start >= num_full_blocks:
        return
    begin, end = start * block_size, num_full_blocks * block_size
    if prefix_array is not None and end <= len(prefix_array):
        raw = prefix_array[begin:end].tobytes()
    else:
        # One int64 conversion for all the new blocks, then cheap bytes slices.
        raw = array("q", token_ids[begin:end]).tobytes()
    width = 8 * block_size
    parent = block_hashes[-1] if start else _ROOT
    offset = 0
    if start == 0 and cache_salt is not None:
        parent = xxhash.xxh3_128_digest(parent + cache_salt.encode() + raw[:width])
        block_hashes.append(parent)
        offset = width
    digest = xxhash.xxh3_128_digest
    append = block_hashes.append
    for i in range(offset, len(raw), width):
        parent = digest(parent + raw[i : i + width])
        append(parent)
