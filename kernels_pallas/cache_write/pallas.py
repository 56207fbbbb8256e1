"""Scatter of a step's keys and values into the paged KV cache (Pallas GPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import _compat
from kernels_pallas.storage import quantize_kv


def _kv_cache_write_kernel(slot_ref, k_ref, v_ref, k_cache_in, v_cache_in, k_cache_ref, v_cache_ref):
    del k_cache_in, v_cache_in  # aliased to the outputs; only written through those
    slot = slot_ref[pl.program_id(0)]
    k_cache_ref[slot, :] = k_ref[...]
    v_cache_ref[slot, :] = v_ref[...]


@functools.partial(jax.jit, static_argnames=("interpret",))
def kv_cache_write(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Write this step's keys and values into their cache slots, in place (vLLM's ``reshape_and_cache``).

    Args:
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], any float dtype, or int8 /
        float8_e4m3fn with scales; aliased to the outputs.
      k, v: [T, num_kv_heads, head_dim], cast to the cache dtype, or ``storage.quantize_kv``'d with scales.
      slot_mapping: int32[T] flat slots ``block * block_size + offset``; padding into block 0 (which of several
        writes to one slot wins is unspecified).
      k_scale, v_scale: float32[num_kv_heads] of a quantized cache, or None.
      interpret: run the Pallas interpreter (CPU tests) instead of Triton.

    Returns:
      (k_cache, v_cache) of the input shapes and dtypes.

    Raises:
      ValueError: shapes disagree or head_dim is not a power of two.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = k.shape[0]
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"k {k.shape} and v {v.shape} must be [T, {num_kv_heads}, {head_dim}] to match the cache"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} must be [{num_tokens}]")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} must be a power of two")

    num_slots = num_blocks * block_size
    flat = (num_slots, num_kv_heads, head_dim)
    token_spec = pl.BlockSpec((_compat.SQUEEZED, _compat.SQUEEZED, head_dim), lambda t, h: (t, h, 0))
    cache_spec = pl.BlockSpec((num_slots, _compat.SQUEEZED, head_dim), lambda t, h: (0, h, 0))
    k_out, v_out = pl.pallas_call(
        _kv_cache_write_kernel,
        grid=(num_tokens, num_kv_heads),
        in_specs=[pl.BlockSpec(), token_spec, token_spec, cache_spec, cache_spec],
        out_specs=[cache_spec, cache_spec],
        out_shape=[jax.ShapeDtypeStruct(flat, k_cache.dtype), jax.ShapeDtypeStruct(flat, v_cache.dtype)],
        input_output_aliases={3: 0, 4: 1},
        compiler_params=_compat.compiler_params(num_warps=1, num_stages=1),
        interpret=interpret,
        name="kv_cache_write",
    )(
        slot_mapping.astype(jnp.int32),
        k.astype(k_cache.dtype) if k_scale is None else quantize_kv(k, k_scale, k_cache.dtype),
        v.astype(v_cache.dtype) if v_scale is None else quantize_kv(v, v_scale, v_cache.dtype),
        k_cache.reshape(flat),
        v_cache.reshape(flat),
    )
    return k_out.reshape(k_cache.shape), v_out.reshape(v_cache.shape)
