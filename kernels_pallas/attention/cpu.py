"""Ragged paged attention by the C++ kernel (``paged_attention_cpu.cc``) through XLA's FFI: KV blocks read in place
through the block table, online softmax per run of up to 16 tokens of one sequence. The ops table loads the library
and registers :data:`FFI_TARGETS` (``kernels_pallas.ops.native_kernels``) before any call. Design:
docs/design/kernels.md.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

# This kernel's XLA FFI target -> its C symbol in the library.
ATTENTION_TARGET = "jaxllm_paged_attention_cpu"
FFI_TARGETS = {ATTENTION_TARGET: "JaxllmPagedAttentionCpu"}
# The library's count of cascade units formed (a no-argument C function returning int64).
CASCADE_UNITS_SYMBOL = "jaxllm_cascade_units"
CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16))
# The kernel's largest block (paged_attention_cpu.cc: kMaxBlockSize).
MAX_BLOCK_SIZE = 256


def supports(num_q_heads: int, block_size: int, num_kv_heads: int) -> bool:
    """Whether the kernel takes these shapes: Hq a multiple of Hkv, block_size <= :data:`MAX_BLOCK_SIZE`."""
    return num_q_heads % num_kv_heads == 0 and block_size <= MAX_BLOCK_SIZE


def token_rows_and_positions(query_start_loc: jax.Array, seq_lens: jax.Array, num_seqs: jax.Array,
                             num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Each query token's sequence row and position, from the ragged layout.

    ``query_start_loc: int32[S + 1]``, ``seq_lens: int32[S]``, ``num_seqs: int32[]`` as in the reference;
    ``num_tokens``: T. Returns ``(row, pos)``, int32 [T] each; a padding token has row -1, position 0.
    """
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    ends = query_start_loc[1:]
    row = jnp.minimum(jnp.searchsorted(ends, token, side="right"), seq_lens.shape[0] - 1).astype(jnp.int32)
    live = (token < query_start_loc[num_seqs]) & (row < num_seqs)
    pos = seq_lens[row] - (ends[row] - token)
    return jnp.where(live, row, -1), jnp.where(live, pos, 0)


def ragged_paged_attention_cpu(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, tables: jax.Array,
                               token_row: jax.Array, token_pos: jax.Array, *, scale: float,
                               soft_cap: Optional[float] = None, sliding_window: Optional[int] = None) -> jax.Array:
    """Every query token over its sequence's paged KV, read in place through the block table (the C++ kernel).

    Args:
      q: [T, Hq, D], any float dtype (computed in float32).
      k_cache, v_cache: [N, block_size, Hkv, D], float32, bfloat16 or uint16 (bfloat16 bits).
      tables: int32[S, W], block ids in [0, N).
      token_row: int32[T] each token's row of ``tables``; -1: padding (zeros).
      token_pos: int32[T] each token's position; it sees ``[0, pos]`` (the last ``sliding_window`` if set).
      scale: score scale. soft_cap: ``soft_cap * tanh(scores / soft_cap)``, or None. sliding_window: or None.

    Returns:
      float32 [T, Hq, D].

    Raises:
      ValueError: another cache dtype, or shapes not :func:`supports`.
      JaxRuntimeError (at run time): a row outside [0, S), a position ``>= W * block_size``, or a read block id
        outside [0, N).
    """
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
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k_cache.reshape(rows), v_cache.reshape(rows), tables.astype(jnp.int32),
                token_row.astype(jnp.int32), token_pos.astype(jnp.int32), scale=np.float32(scale),
                soft_cap=np.float32(soft_cap or 0.0), sliding_window=np.int32(sliding_window or 0),
                block_size=np.int32(block_size), num_kv_heads=np.int32(num_kv_heads))
