"""Decode attention over a paged KV cache, split over the KV length (flash-decoding) to fill the GPU;
splits merged by log-sum-exp. Design: docs/design/kernels.md.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import _compat, _flash

BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 2
# About two waves of programs on a 132-SM H100/H200; more splits than this
# only add merge work.
TARGET_PROGRAMS = 264
# Triton's dot needs at least 16 rows.
MIN_BLOCK_H = 16


def _decode_kernel(
    seq_lens_ref, tables_ref, k_scale_ref, v_scale_ref, q_ref, k_ref, v_ref, acc_ref, max_ref, sum_ref,
    *, chunks_per_split: int, block_k: int, block_size: int, table_width: int,
    scale: float, sliding_window: Optional[int], soft_cap: Optional[float],
):
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_scale = scale * k_scale_ref[head]
    seq_len = seq_lens_ref[seq]
    pos = seq_len - 1
    q = q_ref[...]
    block_h, head_dim = q.shape

    start_chunk = split * chunks_per_split
    if sliding_window is not None:
        start_chunk = jnp.maximum(start_chunk, lax.div(jnp.maximum(pos - sliding_window + 1, 0), block_k))
    end_chunk = jnp.minimum((split + 1) * chunks_per_split, lax.div(seq_len + block_k - 1, block_k))

    def body(chunk, carry):
        kv_pos, k, v = _flash.load_kv_chunk(
            tables_ref, seq * table_width, chunk, k_ref, v_ref, block_k=block_k, block_size=block_size
        )
        visible = kv_pos <= pos
        if sliding_window is not None:
            visible &= kv_pos > pos - sliding_window
        mask = jnp.broadcast_to(visible[None, :], (block_h, block_k))
        return _flash.attend_chunk(carry, q, k, v, mask, scale=k_scale, soft_cap=soft_cap)

    carry = lax.fori_loop(start_chunk, end_chunk, body, _flash.init_carry(block_h, head_dim))
    acc_ref[...] = carry.acc * v_scale_ref[head]
    max_ref[...] = carry.row_max
    sum_ref[...] = carry.row_sum


def _num_splits(num_programs: int, num_chunks: int) -> int:
    return max(1, min(num_chunks, -(-TARGET_PROGRAMS // num_programs)))


@functools.partial(
    jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret", "block_k", "num_splits")
)
def _paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, k_scale=None, v_scale=None,
    *, scale, sliding_window, soft_cap, interpret, block_k, num_splits,
):
    _flash.check_attention_shapes(q, k_cache, v_cache, block_tables)
    ones = jnp.ones(k_cache.shape[2], jnp.float32)  # an unquantized cache
    k_scale, v_scale = ones if k_scale is None else k_scale, ones if v_scale is None else v_scale
    num_seq_rows, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    block_h = max(MIN_BLOCK_H, _flash.next_power_of_2(group))

    tables, table_width = _flash.pad_tables(block_tables, block_k=block_k, block_size=block_size)
    num_chunks = -(-block_tables.shape[1] * block_size // block_k)
    if num_splits is None:
        num_splits = _num_splits(num_seq_rows * num_kv_heads, num_chunks)
    chunks_per_split = -(-num_chunks // num_splits)
    num_splits = -(-num_chunks // chunks_per_split)

    qg = q.reshape(num_seq_rows, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))

    num_slots = num_blocks * block_size
    flat = (num_slots, num_kv_heads, head_dim)
    sq = _compat.SQUEEZED
    cache_spec = pl.BlockSpec((num_slots, sq, head_dim), lambda s, h, j: (0, h, 0))
    part = (num_seq_rows, num_kv_heads, num_splits, block_h)
    kernel = functools.partial(
        _decode_kernel, chunks_per_split=chunks_per_split, block_k=block_k, block_size=block_size,
        table_width=table_width, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )
    acc, row_max, row_sum = pl.pallas_call(
        kernel,
        grid=(num_seq_rows, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec(),
            pl.BlockSpec(),
            pl.BlockSpec(),
            pl.BlockSpec(),
            pl.BlockSpec((sq, sq, block_h, head_dim), lambda s, h, j: (s, h, 0, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=[
            pl.BlockSpec((sq, sq, sq, block_h, head_dim), lambda s, h, j: (s, h, j, 0, 0)),
            pl.BlockSpec((sq, sq, sq, block_h), lambda s, h, j: (s, h, j, 0)),
            pl.BlockSpec((sq, sq, sq, block_h), lambda s, h, j: (s, h, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ],
        compiler_params=_compat.compiler_params(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="paged_attention",
    )(seq_lens.astype(jnp.int32), tables, k_scale, v_scale, qg, k_cache.reshape(flat), v_cache.reshape(flat))

    out = _flash.merge_splits(acc, row_max, row_sum)[:, :, :group]
    return out.reshape(num_seq_rows, num_q_heads, head_dim).astype(q.dtype)


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    interpret: bool = False,
    k_scale: Optional[jax.Array] = None,
    v_scale: Optional[jax.Array] = None,
) -> jax.Array:
    """Decode attention: one new query per sequence over its paged context (semantics:
    ``reference.paged_attention_reference``).

    Args:
      q: [S, num_q_heads, head_dim] float32 or bfloat16, each sequence's last token (position ``seq_lens[s] - 1``).
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] in q's dtype, or int8 / float8_e4m3fn
        with ``k_scale``, ``v_scale``.
      block_tables: int32[S, W]; seq_lens: int32[S] (0 marks a padding row).
      scale: multiplier of q·k. sliding_window: keys in ``(p - sliding_window, p]``.
      soft_cap: scores become ``soft_cap * tanh(scores / soft_cap)``.
      interpret: run the Pallas interpreter (CPU tests) instead of Triton.
      k_scale, v_scale: float32[num_kv_heads] of a quantized cache, or None.

    Returns:
      [S, num_q_heads, head_dim] in q's dtype; zeros where seq_lens is 0.

    Raises:
      ValueError: mismatched shapes, num_q_heads not a multiple of num_kv_heads, or head_dim not a power of
        two >= 16.
    """
    return _paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale,
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret,
        block_k=BLOCK_K, num_splits=None,
    )
