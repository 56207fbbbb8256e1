"""How the kernels store what they read: bit patterns of float types, quantized KV caches and the pool of
compressed blocks. Shared by every op's backends.

Storage. The jnp ops also accept caches that hold bfloat16 values as their uint16 bit patterns (:func:`to_storage`,
:func:`from_storage`). XLA's CPU backend converts a bfloat16 array that a loop reads (the model's scan over layers,
the KV-chunk loop) to float32 as a whole before the loop and back inside it: a full copy of the cache (and of the
weights) every step. Integer arrays are left alone, so on CPU the engine keeps bfloat16 caches and layer weights as
uint16 and bit-casts them back where they are read. float8_e4m3fn caches (and weights) are held as uint8 bit
patterns for the same reason.

Quantized caches. A cache of int8 or float8_e4m3fn holds ``x / scale`` of each key and value, with one float32
scale per KV head and layer (``k_scale``, ``v_scale: [num_kv_heads]``; per-tensor scales in vLLM's fp8 KV cache,
per head here): :func:`quantize_kv` rounds (int8) and clips to the type's range on the write, and the attention ops
multiply back after loading (the kernels fold the K scale into the scores and the V scale into the output, which is
the same product). Without scales a cache holds the values themselves, cast to its dtype.

Compressed blocks (``LLM(kv_cache_compression="int8" | "fp8")``). Beside the cache, a second pool of one-byte blocks
(:class:`CompressedKV`) holds blocks re-encoded from it with one float32 scale per block and KV head, the block's
largest ``|x|`` mapped to the type's largest value (:func:`quantize_blocks`). A block-table id ``b >= num_blocks``
(``num_blocks``: the cache's first axis) names block ``b - num_blocks`` of that pool; the attention ops read each
block in its own dtype (:func:`gather_blocks`). Writes never touch the pool: only full blocks of computed tokens are
compressed.
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
    """The dtype of the numbers an array of ``storage_dtype`` holds (uint16: bfloat16, uint8: float8_e4m3fn)."""
    dtype = jnp.dtype(storage_dtype)
    return _BITS_OF.get(dtype, dtype)


def from_storage(x: jax.Array) -> jax.Array:
    """A stored array as numbers: uint16 is bfloat16 bit patterns, uint8 float8_e4m3fn ones, anything else is as is."""
    dtype = jnp.dtype(x.dtype)
    return jax.lax.bitcast_convert_type(x, _BITS_OF[dtype]) if dtype in _BITS_OF else x


def to_storage(x: jax.Array, storage_dtype) -> jax.Array:
    """``x`` as stored in an array of ``storage_dtype``: cast, then bit-cast for a uint16 or uint8 store."""
    number = number_dtype(storage_dtype)
    if number != jnp.dtype(storage_dtype):
        return jax.lax.bitcast_convert_type(x.astype(number), storage_dtype)
    return x.astype(storage_dtype)


def quantize_kv(x: jax.Array, scale: jax.Array, storage_dtype) -> jax.Array:
    """Keys or values as a quantized cache stores them.

    Args:
      x: [T, num_kv_heads, head_dim] float.
      scale: float32[num_kv_heads], the heads' scales.
      storage_dtype: int8, float8_e4m3fn or uint8 (float8_e4m3fn bits).

    Returns:
      ``x / scale`` rounded to the nearest integer for int8, clipped to
      ``KV_QUANT_MAX`` of the type (float8_e4m3fn has no infinity: an
      unclipped overflow would be NaN), in ``storage_dtype``.
    """
    number = number_dtype(storage_dtype)
    y = x.astype(jnp.float32) / scale[:, None]
    if number == jnp.int8:
        y = jnp.round(y)
    limit = KV_QUANT_MAX[number]
    return to_storage(jnp.clip(y, -limit, limit), storage_dtype)


def dequantize_kv(x: jax.Array, scale: Optional[jax.Array]) -> jax.Array:
    """A stored cache slice ``[..., num_kv_heads, head_dim]`` as float32 numbers, times ``scale``
    (float32[num_kv_heads]) when the cache is quantized."""
    x = from_storage(x).astype(jnp.float32)
    return x if scale is None else x * scale[:, None]


class CompressedKV(NamedTuple):
    """The pool of compressed KV blocks (module docstring), a pytree.

    k, v: [num_compressed, block_size, num_kv_heads, head_dim] int8, or uint8 holding float8_e4m3fn bits
      (or float8_e4m3fn itself).
    k_scale, v_scale: float32[num_compressed, num_kv_heads], each block's per-head scale.
    """

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array


def quantize_blocks(x: jax.Array, storage_dtype) -> tuple[jax.Array, jax.Array]:
    """Blocks re-encoded with one scale per block and head.

    Args:
      x: [..., block_size, num_kv_heads, head_dim] float (any stored float: see :func:`from_storage`).
      storage_dtype: int8, float8_e4m3fn or uint8 (float8_e4m3fn bits).

    Returns:
      (q, scale): q of ``x``'s shape in ``storage_dtype``, ``x / scale`` (rounded for int8, within
      ``KV_QUANT_MAX`` of the type); scale float32 ``[..., num_kv_heads]``, the block's largest ``|x|`` of
      that head over the type's largest value (1 for an all-zero head, so nothing divides by 0).
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
    """Blocks ``ids`` as float32 numbers, each from the cache or the compressed pool its id names.

    Args:
      cache: [num_blocks, block_size, Hkv, D], stored (``from_storage``).
      ids: int32[...] block ids; ``>= num_blocks`` names block ``id - num_blocks`` of ``pool``.
      scale: float32[Hkv] of a quantized cache, or None.
      pool: the compressed pool's K or V, [C, block_size, Hkv, D]; None: every id is the cache's.
      pool_scale: float32[C, Hkv], with ``pool``.

    Returns:
      float32 ``[..., block_size, Hkv, D]``.
    """
    num_blocks = cache.shape[0]
    x = dequantize_kv(cache[jnp.minimum(ids, num_blocks - 1)], scale)
    if pool is None:
        return x
    compressed = ids >= num_blocks
    slot = jnp.where(compressed, ids - num_blocks, 0)
    y = from_storage(pool[slot]).astype(jnp.float32) * pool_scale[slot][..., None, :, None]
    return jnp.where(compressed[..., None, None, None], y, x)


def check_pool_scales(k_scale: Optional[jax.Array], compressed: Optional[CompressedKV]) -> None:
    """Raise ValueError for a quantized cache with a compressed pool: a one-byte cache has nothing to compress."""
    if k_scale is not None and compressed is not None:
        raise ValueError("compressed KV blocks need a cache of plain values: k_scale (a quantized cache) and "
                         "compressed were both given")
