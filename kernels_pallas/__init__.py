"""Paged-attention kernels for jaxllm: Pallas GPU kernels and their jnp references.

Knows nothing of models or the scheduler. See ``reference.py`` for the cache
layout and the exact semantics every kernel here shares.
"""

from kernels_pallas.reference import (
    kv_cache_write_reference,
    paged_attention_reference,
    ragged_paged_attention_reference,
)

__all__ = [
    "kv_cache_write_reference",
    "paged_attention_reference",
    "ragged_paged_attention_reference",
]
