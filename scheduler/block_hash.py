"""Chained prefix-cache hashes of full KV blocks (vLLM v1 ``hash_block_tokens``)."""

from __future__ import annotations

from array import array
from typing import Optional, Sequence

import numpy as np
import xxhash

_ROOT = b"jaxllm-prefix-root"


def hash_block_tokens(parent_hash: Optional[bytes], token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """128-bit xxh3 digest (16 bytes) of one full block: the parent's hash (None first), its token ids as int64 and
    ``extra_key`` (the cache salt, first block). Chaining makes a hit on block i imply hits on 0..i-1 (vLLM v1)."""
    parent = _ROOT if parent_hash is None else parent_hash
    return xxhash.xxh3_128_digest(parent + extra_key + array("q", token_ids).tobytes())


def extend_block_hashes(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    num_full_blocks: int,
    block_size: int,
    cache_salt: Optional[str],
    prefix_array: Optional[np.ndarray] = None,
    lora_key: Optional[bytes] = None,
) -> None:
    """Append :func:`hash_block_tokens` digests to ``block_hashes`` up to ``num_full_blocks`` blocks of ``token_ids``
    (whose first ``num_full_blocks * block_size`` must be final). ``prefix_array``: int64 equal to the first tokens
    (e.g. the prompt), read instead of Python ints where it covers. ``lora_key``: the adapter's
    (``Request.lora_key``), mixed into the first block after the salt as vLLM's extra keys."""
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
    if start == 0 and (cache_salt is not None or lora_key):
        extra = (b"" if cache_salt is None else cache_salt.encode()) + (lora_key or b"")
        parent = xxhash.xxh3_128_digest(parent + extra + raw[:width])
        block_hashes.append(parent)
        offset = width
    digest = xxhash.xxh3_128_digest
    append = block_hashes.append
    for i in range(offset, len(raw), width):
        parent = digest(parent + raw[i : i + width])
        append(parent)
