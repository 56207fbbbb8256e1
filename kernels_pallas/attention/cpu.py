"""Ragged paged attention by the C++ kernel (``paged_attention_cpu.cc``), called through XLA's FFI.

It reads the KV blocks in place through the block table (the ``jnp`` backend gathers them into copies first), for
runs of up to 16 query tokens of one sequence at a time (a decode row is a run of one) on XLA's intra-op threads,
with the online softmax of flash-attention; a run of several tokens (a prefill chunk) is computed as register-tiled
multiply-adds over its (token, head) pairs.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import cpu_build

CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16))
# The kernel's largest block (paged_attention_cpu.cc: kMaxBlockSize).
MAX_BLOCK_SIZE = 256


def cascade_units_formed() -> int:
    """How many cascade units the attention kernel has formed in this process (decode rows whose block tables begin
    with the same blocks, attended over them together: ``paged_attention_cpu.cc``'s ``form_cascades``); 0 where the
    kernels are not built. A count for tests and profiles; raises nothing."""
    return cpu_build.library_int("jaxllm_cascade_units") if cpu_build.available() else 0


def supports(num_q_heads: int, block_size: int, num_kv_heads: int) -> bool:
    """Whether the kernel takes these shapes: query heads a multiple of the KV heads, at most
    :data:`MAX_BLOCK_SIZE` tokens per block."""
    return num_q_heads % num_kv_heads == 0 and block_size <= MAX_BLOCK_SIZE


def ragged_paged_attention_cpu(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, tables: jax.Array,
                               token_row: jax.Array, token_pos: jax.Array, *, scale: float,
                               soft_cap: Optional[float] = None, sliding_window: Optional[int] = None) -> jax.Array:
    """Every query token over its sequence's paged KV, in place through the block table (the C++ kernel).

    Args:
      q: [T, Hq, D], any float dtype (computed in float32).
      k_cache, v_cache: [N, block_size, Hkv, D], float32, bfloat16 or uint16 bit patterns of bfloat16.
      tables: int32 [S, W], block ids in [0, N).
      token_row: int32 [T], the row of ``tables`` each token belongs to; -1 marks a padding token (zeros out).
      token_pos: int32 [T], each token's position in its sequence: it sees positions ``[0, pos]`` (the last
        ``sliding_window`` of them when set).
      scale: the score scale (``1 / sqrt(D)`` or the model's).
      soft_cap: scores become ``soft_cap * tanh(scores / soft_cap)``; None: no cap.
      sliding_window: None: no window.

    Returns:
      float32 [T, Hq, D].

    Raises:
      ValueError: a cache dtype other than those above, shapes it does not take (:func:`supports`), or the
        kernel is not ``cpu_build.available()``.
      JaxRuntimeError (at run time): a row outside [0, S), a position at or past ``W * block_size``, or a block
        id outside [0, N) that a token would read (named in the message).
    """
    if not cpu_build.available():
        raise ValueError(f"ragged_paged_attention_cpu is not available: {cpu_build.unavailable_reason()}")
    if jnp.dtype(k_cache.dtype) not in CACHE_DTYPES or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"ragged_paged_attention_cpu: cache dtypes {k_cache.dtype}, {v_cache.dtype}; expected both "
                         f"one of {[str(d) for d in CACHE_DTYPES]}")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if not supports(q.shape[1], block_size, num_kv_heads):
        raise ValueError(f"ragged_paged_attention_cpu: {q.shape[1]} query heads, {num_kv_heads} KV heads, block_size "
                         f"{block_size}; the kernel takes query heads a multiple of the KV heads and block_size <= "
                         f"{MAX_BLOCK_SIZE}")
    if k_cache.dtype == jnp.bfloat16:
        # As bit patterns: XLA's CPU backend would otherwise convert a bfloat16 operand of the call.
        k_cache, v_cache = (jax.lax.bitcast_convert_type(c, jnp.uint16) for c in (k_cache, v_cache))
    # Each block one row: with one KV head, a [N, block_size, 1, D] operand lets XLA's CPU layout assignment move
    # the unit axis and copy the whole cache on every layer.
    rows = (k_cache.shape[0], block_size * num_kv_heads * head_dim)
    call = jax.ffi.ffi_call(cpu_build.ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k_cache.reshape(rows), v_cache.reshape(rows), tables.astype(jnp.int32),
                token_row.astype(jnp.int32), token_pos.astype(jnp.int32), scale=np.float32(scale),
                soft_cap=np.float32(soft_cap or 0.0), sliding_window=np.int32(sliding_window or 0),
                block_size=np.int32(block_size), num_kv_heads=np.int32(num_kv_heads))
