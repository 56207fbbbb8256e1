"""Causal attention for a mixed batch of prefill chunks and decode rows over a paged KV cache for Hopper, on
Pallas's Mosaic GPU backend (``plgpu``): ``pallas_ragged``'s plan (per-sequence query tiles, the group's query
heads packed into 64 rows, FlashAttention-2's online softmax over 64-token KV chunks) with TMA copies and tensor
cores.

One program per (tile, KV head) runs one warpgroup. The tile's 64 query rows arrive by one TMA copy (the rows are
contiguous in the head-major layout ``pallas_ragged`` uses); KV chunks arrive page by page into a two-stage ring,
as in ``mosaic_decode``. ``S = Q @ K^T`` takes both operands from shared memory and ``O += P @ V`` takes P from
registers, the FlashAttention-3 arrangement. Rows past the tile's last token belong to the next tile, so the
output leaves shared memory one token's rows at a time. Design: docs/design/kernels.md.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import _flash, _mosaic
from kernels_pallas._mosaic import BLOCK_K, STAGES, WIDE
from kernels_pallas.attention.pallas_ragged import group_rows, tile_schedule, ungroup_rows

# Query rows per tile (tokens x padded group): the tensor cores' row count.
BLOCK_M = 64
# A tile's header: KV position of its first query token, its token count, its first token in q, its sequence.
_HEADER = 4


def smem_bytes(head_dim: int, table_width: int, block_size: int, itemsize: int = 2) -> int:
    """Shared memory one program requests (bytes): the tile's header, its sequence's block ids, the Q tile, the K
    and V rings, the output tile; seven barriers."""
    tile, ring = BLOCK_M * head_dim * itemsize, STAGES * BLOCK_K * head_dim * itemsize
    buffers = [4 * _mosaic.META_ALIGN, 4 * _mosaic.meta_width(0, table_width, block_size), tile, ring, ring, tile]
    return _mosaic.smem_total(buffers, barriers=3 + 2 * STAGES)


def unsupported_reason(q_dtype, cache_dtype, head_dim: int, block_size: int, group: int, quantized: bool = False,
                       *, table_width: int) -> Optional[str]:
    """Why this kernel cannot take these inputs (None when it can): as ``mosaic_decode.unsupported_reason``, with
    groups of up to 64 query heads per KV head."""
    reason = _mosaic.unsupported_reason(q_dtype, cache_dtype, head_dim, block_size, quantized)
    if reason is None and group > BLOCK_M:
        reason = f"{group} query heads per KV head (at most {BLOCK_M})"
    return reason or _mosaic.smem_reason(smem_bytes(head_dim, table_width, block_size), table_width)


def _kernel(header_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, *, group: int, head_dim: int, block_size: int,
            scale: float, sliding_window: Optional[int], soft_cap: Optional[float], interpret: Any):
    head = lax.axis_index("head")
    # Tiles are taken last-first. The interpreter runs grid points in order, so each tile then runs before the one
    # ahead of it in the batch, and a tile writing past its last token would spoil a finished tile's rows, which
    # the tests see; on the GPU the order is the scheduler's.
    tile = header_ref.shape[0] - 1 - lax.axis_index("tile")
    block_q = BLOCK_M // group
    pages = _mosaic.pages_per_chunk(block_size)

    # Ring slots are reused as in mosaic_decode: ordered by the auto barriers before each copy and by each
    # product's result read.
    def body(header, meta, q_tile, k_tiles, v_tiles, o_tile, header_bar, meta_bar, q_bar, k_bar, v_bar):
        _mosaic.copy_meta(header_ref.at[tile], header, header_bar)
        plgpu.barrier_wait(header_bar)
        first_pos, num_tokens, token, seq = header[0], header[1], header[2], header[3]
        _mosaic.copy_meta(tables_ref.at[seq], meta, meta_bar)
        plgpu.copy_gmem_to_smem(q_ref.at[head, pl.ds(token * group, BLOCK_M)], q_tile, q_bar)
        plgpu.barrier_wait(meta_bar)
        end = jnp.where(num_tokens > 0, lax.div(first_pos + num_tokens - 1, BLOCK_K) + 1, 0)
        first = jnp.int32(0)
        if sliding_window is not None:
            first = lax.div(jnp.maximum(first_pos - sliding_window + 1, 0), BLOCK_K)
        fetch = functools.partial(_mosaic.fetch_chunk, meta, 0, head=head, k_ref=k_ref, v_ref=v_ref,
                                  k_tiles=k_tiles, v_tiles=v_tiles, k_bar=k_bar, v_bar=v_bar, block_size=block_size)

        @pl.when(first < end)
        def _():
            fetch(first, 0)

        plgpu.barrier_wait(q_bar)
        shape = (BLOCK_M, BLOCK_K)
        # Row r is query token r // group of the tile (its heads consecutive).
        row_token = lax.div(_mosaic.iota(shape, 0, interpret), group)
        row_pos = first_pos + row_token
        row_live = row_token < num_tokens

        def attend(chunk, carry):
            acc, row_max, row_sum = carry
            slot = lax.rem(chunk - first, STAGES)

            @pl.when(chunk + 1 < end)
            def _():
                fetch(chunk + 1, lax.rem(chunk + 1 - first, STAGES))

            plgpu.barrier_wait(k_bar.at[slot])
            scores = _mosaic.mma(q_tile, k_tiles.at[slot], transpose_b=True, shape=shape, interpret=interpret)
            scores = scores * scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            kv_pos = chunk * BLOCK_K + _mosaic.iota(shape, 1, interpret)
            visible = (kv_pos <= row_pos) & row_live
            if sliding_window is not None:
                visible &= kv_pos > row_pos - sliding_window
            scores = jnp.where(visible, scores, _flash.MASK_VALUE)
            new_max = jnp.maximum(row_max, scores.max(axis=1))
            probs = jnp.where(visible, jnp.exp(scores - lax.broadcast_in_dim(new_max, shape, [0])), 0.0)
            correction = jnp.exp(row_max - new_max)
            row_sum = row_sum * correction + probs.sum(axis=1)
            plgpu.barrier_wait(v_bar.at[slot])
            acc = _mosaic.mma(probs.astype(q_tile.dtype), v_tiles.at[slot], shape=(BLOCK_M, head_dim),
                              interpret=interpret, acc=acc * lax.broadcast_in_dim(correction, acc.shape, [0]))
            return acc, new_max, row_sum

        row = plgpu.Layout.WGMMA.reduce(1)
        carry = (_mosaic.layout_cast(jnp.zeros((BLOCK_M, head_dim), jnp.float32), plgpu.Layout.WGMMA, interpret),
                 _mosaic.layout_cast(jnp.full((BLOCK_M,), _flash.MASK_VALUE, jnp.float32), row, interpret),
                 _mosaic.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), row, interpret))
        acc, _, row_sum = lax.fori_loop(first, end, attend, carry)
        # Rows that saw no key (past the tile's tokens) have a zero sum and are never written.
        row_sum = jnp.where(row_sum == 0.0, 1.0, row_sum)
        o_tile[...] = (acc / lax.broadcast_in_dim(row_sum, acc.shape, [0])).astype(o_tile.dtype)
        plgpu.commit_smem()
        for i in range(block_q):
            @pl.when(i < num_tokens)
            def _():
                plgpu.copy_smem_to_gmem(o_tile.at[pl.ds(i * group, group)],
                                        o_ref.at[head, pl.ds((token + i) * group, group)])
        plgpu.wait_smem_to_gmem(0)

    dtype = q_ref.dtype
    pl.run_scoped(
        body,
        plgpu.SMEM(header_ref.shape[1:], jnp.int32),
        plgpu.SMEM(tables_ref.shape[1:], jnp.int32),
        plgpu.SMEM((BLOCK_M, head_dim), dtype, transforms=WIDE),
        plgpu.SMEM((STAGES, BLOCK_K, head_dim), dtype, transforms=WIDE),
        plgpu.SMEM((STAGES, BLOCK_K, head_dim), dtype, transforms=WIDE),
        # Untiled, so that one token's rows can be sliced out of it for their copy.
        plgpu.SMEM((BLOCK_M, head_dim), dtype),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=pages, num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=pages, num_barriers=STAGES),
    )


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret"))
def _ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *, scale,
                            sliding_window, soft_cap, interpret):
    _flash.check_attention_shapes(q, k_cache, v_cache, block_tables, triton=False)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seq_rows, width = block_tables.shape
    group = num_q_heads // num_kv_heads
    reason = unsupported_reason(q.dtype, k_cache.dtype, head_dim, block_size, group, table_width=width)
    if reason:
        raise ValueError(f"the Mosaic GPU ragged attention kernel cannot take {reason}")
    group_p = _flash.next_power_of_2(group)
    block_q = BLOCK_M // group_p
    num_tiles = min(num_tokens, num_seq_rows + num_tokens // block_q)
    sched = tile_schedule(seq_lens, query_start_loc, num_seqs, num_tiles=num_tiles, block_q=block_q)
    header = _mosaic.meta_rows([sched.pos, sched.rows, sched.token, sched.seq], None, block_size)
    tables = _mosaic.meta_rows([], block_tables, block_size)

    qg = group_rows(q, num_kv_heads, group_p=group_p, block_q=block_q)
    kernel = functools.partial(_kernel, group=group_p, head_dim=head_dim, block_size=block_size, scale=scale,
                               sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        # Tiles on the grid's fastest axis, whose size is not capped at 65,535.
        grid=(num_kv_heads, num_tiles), grid_names=("head", "tile"),
        interpret=_mosaic.kernel_interpret(interpret),
    )(header, tables, qg, k_cache, v_cache)
    return ungroup_rows(out, q.shape, group_p=group_p, live_tokens=query_start_loc[num_seqs])


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    scale: float,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of a ragged batch of new tokens over a paged KV cache (semantics:
    ``reference.ragged_paged_attention_reference``), on Hopper's tensor cores through Mosaic GPU.

    Args:
      q: [T, num_q_heads, head_dim] bfloat16 or float16, sequences concatenated in batch order, padded to T.
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] in q's dtype, holding this step's K/V.
      block_tables: int32[S, W]; seq_lens: int32[S] KV lengths incl. new tokens; query_start_loc: int32[S + 1];
      num_seqs: int32[]: as ``reference.ragged_paged_attention_reference``.
      scale: multiplier of q·k. sliding_window: keys in ``(p - sliding_window, p]``.
      soft_cap: scores become ``soft_cap * tanh(scores / soft_cap)``.
      interpret: run JAX's Mosaic GPU interpreter (CPU tests) instead of compiling for the GPU.

    Returns:
      [T, num_q_heads, head_dim] in q's dtype; padding rows zeros.

    Raises:
      ValueError: mismatched shapes, or inputs :func:`unsupported_reason` names.
    """
    return _ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                                   scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                   interpret=interpret)
