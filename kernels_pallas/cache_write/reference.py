"""The plain ``jnp`` KV write: the reference of the Pallas kernel and the write every non-GPU backend runs."""

from __future__ import annotations

from typing import Optional

import jax

from kernels_pallas.storage import quantize_kv, to_storage


def kv_cache_write_reference(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    k_scale: Optional[jax.Array] = None,
    v_scale: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's keys and values into the paged cache.

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; k, v: [T, num_kv_heads, head_dim], stored
    as the cache's dtype (:func:`to_storage`) or :func:`quantize_kv`'d with ``k_scale, v_scale: float32[num_kv_heads]``;
    slot_mapping: int32[T] flat slots (padding into block 0). Returns the caches written (in place when donated).
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat = (num_blocks * block_size, num_kv_heads, head_dim)
    k, v = (to_storage(x, c.dtype) if s is None else quantize_kv(x, s, c.dtype)
            for x, s, c in ((k, k_scale, k_cache), (v, v_scale, v_cache)))
    k_cache = k_cache.reshape(flat).at[slot_mapping].set(k).reshape(k_cache.shape)
    v_cache = v_cache.reshape(flat).at[slot_mapping].set(v).reshape(v_cache.shape)
    return k_cache, v_cache
