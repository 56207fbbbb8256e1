"""How the kernels store what they read: bit patterns of float types, quantized KV caches, compressed blocks.

bfloat16 may be held as uint16 bits, float8_e4m3fn as uint8 (:func:`to_storage`, :func:`from_storage`). A
quantized cache (int8 / float8_e4m3fn) holds ``x / scale``, one float32 scale per KV head and layer (vLLM's fp8
cache: per tensor). A scaled block pool (:class:`ScaledKV`; the compressed tier of
``LLM(kv_cache_compression=...)``) holds one-byte blocks with a scale per block and head; table id
``b >= num_blocks`` names pool block ``b - num_blocks``; writes never touch it. Why: docs/design/kernels.md.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


# Float types held as bit patterns on XLA's CPU backend -> the unsigned type holding them, and back.
BITS_STORAGE = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16), jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8)}
_BITS_OF = {bits: number for number, bits in BITS_STORAGE.items()}
# Largest magnitude a quantized cache stores (int8 symmetric; float8_e4m3fn's finite maximum).
KV_QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def number_dtype(storage_dtype) -> jnp.dtype:
    """The dtype of the numbers ``storage_dtype`` holds (uint16: bfloat16, uint8: float8_e4m3fn, else itself)."""
    dtype = jnp.dtype(storage_dtype)
    return _BITS_OF.get(dtype, dtype)


def from_storage(x: jax.Array) -> jax.Array:
    """A stored array as numbers: uint16 -> bfloat16, uint8 -> float8_e4m3fn (bit-cast), else as is."""
    dtype = jnp.dtype(x.dtype)
    return jax.lax.bitcast_convert_type(x, _BITS_OF[dtype]) if dtype in _BITS_OF else x


def to_storage(x: jax.Array, storage_dtype) -> jax.Array:
    """``x`` as stored in ``storage_dtype``: cast, then bit-cast for uint16 / uint8."""
    number = number_dtype(storage_dtype)
    if number != jnp.dtype(storage_dtype):
        return jax.lax.bitcast_convert_type(x.astype(number), storage_dtype)
    return x.astype(storage_dtype)


def quantize_kv(x: jax.Array, scale: jax.Array, storage_dtype) -> jax.Array:
    """Keys or values as a quantized cache stores them.

    x: [T, num_kv_heads, head_dim] float; scale: float32[num_kv_heads]; storage_dtype: int8, float8_e4m3fn or
    uint8 (float8 bits). Returns ``x / scale`` (rounded for int8) clipped to ``KV_QUANT_MAX`` (float8 has no
    infinity), in ``storage_dtype``.
    """
    number = number_dtype(storage_dtype)
    y = x.astype(jnp.float32) / scale[:, None]
    if number == jnp.int8:
        y = jnp.round(y)
    limit = KV_QUANT_MAX[number]
    return to_storage(jnp.clip(y, -limit, limit), storage_dtype)


def dequantize_kv(x: jax.Array, scale: Optional[jax.Array]) -> jax.Array:
    """Stored ``[..., num_kv_heads, head_dim]`` as float32, times ``scale`` (float32[num_kv_heads]) if given."""
    x = from_storage(x).astype(jnp.float32)
    return x if scale is None else x * scale[:, None]


class ScaledKV(NamedTuple):
    """A pool of one-byte KV blocks with one scale per block and KV head (the compressed tier's), a pytree.

    k, v: [num_pooled, block_size, num_kv_heads, head_dim] int8, or uint8 of float8_e4m3fn bits (or float8_e4m3fn).
    k_scale, v_scale: float32[num_pooled, num_kv_heads].
    """

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array


def quantize_blocks(x: jax.Array, storage_dtype) -> tuple[jax.Array, jax.Array]:
    """Blocks re-encoded with one scale per block and head.

    x: [..., block_size, num_kv_heads, head_dim] float (stored floats accepted); storage_dtype: int8,
    float8_e4m3fn or uint8. Returns (q in ``storage_dtype``, ``x / scale`` rounded for int8 within
    ``KV_QUANT_MAX``; scale float32 ``[..., num_kv_heads]``: the head's max ``|x|`` over the type's max, 1 if all zero).
    """
    x = from_storage(x).astype(jnp.float32)
    limit = KV_QUANT_MAX[number_dtype(storage_dtype)]
    peak = jnp.max(jnp.abs(x), axis=(-3, -1))
    scale = jnp.where(peak > 0, peak / limit, 1.0)
    y = x / scale[..., None, :, None]
    if number_dtype(storage_dtype) == jnp.int8:
        y = jnp.round(y)
    return to_storage(jnp.clip(y, -limit, limit), storage_dtype), scale


def gather_blocks(cache: jax.Array, ids: jax.Array, scale: Optional[jax.Array] = None,
                  pool: Optional[jax.Array] = None, pool_scale: Optional[jax.Array] = None) -> jax.Array:
    """Blocks ``ids`` as float32, each from the cache or the pool its id names.

    Args:
      cache: [num_blocks, block_size, Hkv, D], stored. ids: int32[...]; ``>= num_blocks`` names pool block
        ``id - num_blocks``. scale: float32[Hkv] of a quantized cache, or None.
      pool: the pool's K or V [C, block_size, Hkv, D], or None. pool_scale: float32[C, Hkv], with ``pool``.

    Returns:
      float32 ``[..., block_size, Hkv, D]``.
    """
    num_blocks = cache.shape[0]
    x = dequantize_kv(cache[jnp.minimum(ids, num_blocks - 1)], scale)
    if pool is None:
        return x
    in_pool = ids >= num_blocks
    slot = jnp.where(in_pool, ids - num_blocks, 0)
    y = from_storage(pool[slot]).astype(jnp.float32) * pool_scale[slot][..., None, :, None]
    return jnp.where(in_pool[..., None, None, None], y, x)


def check_pool_scales(k_scale: Optional[jax.Array], scaled_pool: Optional[ScaledKV]) -> None:
    """Raise ValueError for a quantized cache with a scaled pool: a one-byte cache has nothing to compress."""
    if k_scale is not None and scaled_pool is not None:
        raise ValueError("a scaled KV pool needs a cache of plain values: k_scale (a quantized cache) and "
                         "scaled_pool were both given")
