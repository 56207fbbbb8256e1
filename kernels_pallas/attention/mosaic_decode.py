"""Decode attention over a paged KV cache for Hopper, on Pallas's Mosaic GPU backend (``plgpu``), the lowering JAX
keeps after its Triton backend; the same split-K (flash-decoding) plan as ``pallas_decode``, merged the same way.

One program per (sequence, KV head, split) runs one warpgroup. Each 64-token chunk of the sequence's context
arrives by TMA, one copy per KV page (``k_cache[block, :, head]``, a strided 2-D slab), into a two-stage ring of
shared-memory tiles, the next chunk's copies in flight while the current one is attended. The tensor cores need
at least 64 rows, and a decode step has one query row per head, so both products put the chunk's tokens (or the
head dimension) on the 64-row side: ``S^T = K_chunk @ Q^T`` ([64, N]) and ``O^T += V_chunk^T @ P^T`` ([D, N]),
with the group's query heads padded to N = 16 columns (32 for groups over 16). The softmax runs over the columns
of ``S^T``. Design: docs/design/kernels.md.
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
from kernels_pallas._mosaic import BLOCK_K, NARROW, STAGES, WIDE
from kernels_pallas.attention.pallas_decode import TARGET_PROGRAMS

# The row metadata's header: the sequence's KV length.
_HEADER = 1


def _columns(group: int) -> int:
    return 16 if group <= 16 else 32


def smem_bytes(head_dim: int, group: int, table_width: int, block_size: int, itemsize: int = 2) -> int:
    """Shared memory one program of the kernel requests (bytes): the row's metadata, the Q tile, the K and V
    rings, the P^T tile, the float32 partial result, its row maxima and sums; six barriers."""
    cols = _columns(group)
    ring = STAGES * BLOCK_K * head_dim * itemsize
    buffers = [4 * _mosaic.meta_width(_HEADER, table_width, block_size), cols * head_dim * itemsize, ring, ring,
               BLOCK_K * cols * itemsize, head_dim * cols * 4, cols * 4, cols * 4]
    return _mosaic.smem_total(buffers, barriers=2 + 2 * STAGES)


def unsupported_reason(q_dtype, cache_dtype, head_dim: int, block_size: int, group: int, quantized: bool = False,
                       *, table_width: int) -> Optional[str]:
    """Why this kernel cannot take these inputs (None when it can): a cache other than bfloat16/float16 in q's
    dtype, a quantized cache, head_dim not a multiple of 64 up to 256, block_size not a multiple of 8 that
    divides 64 or is a multiple of 64, a GQA group over 32, or block tables of ``table_width`` entries whose
    metadata would not fit in shared memory beside the tiles (:func:`smem_bytes` over ``_mosaic.SMEM_BYTES``)."""
    reason = _mosaic.unsupported_reason(q_dtype, cache_dtype, head_dim, block_size, quantized)
    if reason is None and group > 32:
        reason = f"{group} query heads per KV head (at most 32)"
    return reason or _mosaic.smem_reason(smem_bytes(head_dim, group, table_width, block_size), table_width)


def _kernel(meta_ref, q_ref, k_ref, v_ref, acc_out, max_out, sum_out, *, cols: int, head_dim: int,
            block_size: int, chunks_per_split: int, scale: float, sliding_window: Optional[int],
            soft_cap: Optional[float], interpret: Any):
    seq, head, split = lax.axis_index("seq"), lax.axis_index("head"), lax.axis_index("split")
    pages = _mosaic.pages_per_chunk(block_size)

    # Reuse of a ring slot, and of the P^T tile, is ordered by the warpgroup barrier Pallas puts before each copy
    # and by the wait for each product's result (its accumulator's read); kernels here keep those auto barriers.
    def body(meta, q_tile, k_tiles, v_tiles, p_tile, acc_tile, max_tile, sum_tile, meta_bar, q_bar, k_bar, v_bar):
        _mosaic.copy_meta(meta_ref.at[seq], meta, meta_bar)
        plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_tile, q_bar)
        plgpu.barrier_wait(meta_bar)
        seq_len = meta[0]
        first = split * chunks_per_split
        if sliding_window is not None:
            first = jnp.maximum(first, lax.div(jnp.maximum(seq_len - sliding_window, 0), BLOCK_K))
        end = jnp.minimum((split + 1) * chunks_per_split, lax.div(seq_len + BLOCK_K - 1, BLOCK_K))
        fetch = functools.partial(_mosaic.fetch_chunk, meta, _HEADER, head=head, k_ref=k_ref, v_ref=v_ref,
                                  k_tiles=k_tiles, v_tiles=v_tiles, k_bar=k_bar, v_bar=v_bar, block_size=block_size)

        @pl.when(first < end)
        def _():
            fetch(first, 0)

        plgpu.barrier_wait(q_bar)

        def attend(chunk, carry):
            acc, row_max, row_sum = carry
            slot = lax.rem(chunk - first, STAGES)

            @pl.when(chunk + 1 < end)
            def _():
                fetch(chunk + 1, lax.rem(chunk + 1 - first, STAGES))

            plgpu.barrier_wait(k_bar.at[slot])
            shape = (BLOCK_K, cols)
            scores = _mosaic.mma(k_tiles.at[slot], q_tile, transpose_b=True, shape=shape, interpret=interpret)
            scores = scores * scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            pos = chunk * BLOCK_K + _mosaic.iota(shape, 0, interpret)
            visible = pos < seq_len
            if sliding_window is not None:
                visible &= pos >= seq_len - sliding_window
            scores = jnp.where(visible, scores, _flash.MASK_VALUE)
            new_max = jnp.maximum(row_max, scores.max(axis=0))
            probs = jnp.where(visible, jnp.exp(scores - lax.broadcast_in_dim(new_max, shape, [1])), 0.0)
            correction = jnp.exp(row_max - new_max)
            row_sum = row_sum * correction + probs.sum(axis=0)
            p_tile[...] = probs.astype(p_tile.dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])
            acc = _mosaic.mma(v_tiles.at[slot], p_tile, transpose_a=True, shape=(head_dim, cols),
                              interpret=interpret, acc=acc * lax.broadcast_in_dim(correction, acc.shape, [1]))
            return acc, new_max, row_sum

        col = plgpu.Layout.WGMMA.reduce(0)
        carry = (_mosaic.layout_cast(jnp.zeros((head_dim, cols), jnp.float32), plgpu.Layout.WGMMA, interpret),
                 _mosaic.layout_cast(jnp.full((cols,), _flash.MASK_VALUE, jnp.float32), col, interpret),
                 _mosaic.layout_cast(jnp.zeros((cols,), jnp.float32), col, interpret))
        acc, row_max, row_sum = lax.fori_loop(first, end, attend, carry)
        acc_tile[...] = acc
        max_tile[...] = row_max
        sum_tile[...] = row_sum
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(acc_tile, acc_out.at[seq, head, split])
        plgpu.copy_smem_to_gmem(max_tile, max_out.at[seq, head, split])
        plgpu.copy_smem_to_gmem(sum_tile, sum_out.at[seq, head, split])
        plgpu.wait_smem_to_gmem(0)

    dtype = q_ref.dtype
    pl.run_scoped(
        body,
        plgpu.SMEM(meta_ref.shape[1:], jnp.int32),
        plgpu.SMEM((cols, head_dim), dtype, transforms=WIDE),
        plgpu.SMEM((STAGES, BLOCK_K, head_dim), dtype, transforms=WIDE),
        # V^T and P^T share a swizzle; P^T's 16 columns of 2 bytes allow 32 bytes (128 would need 64 columns).
        plgpu.SMEM((STAGES, BLOCK_K, head_dim), dtype, transforms=NARROW),
        plgpu.SMEM((BLOCK_K, cols), dtype, transforms=NARROW),
        plgpu.SMEM((head_dim, cols), jnp.float32),
        plgpu.SMEM((cols,), jnp.float32),
        plgpu.SMEM((cols,), jnp.float32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=pages, num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=pages, num_barriers=STAGES),
    )


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret", "num_splits"))
def _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, *, scale, sliding_window, soft_cap, interpret,
                     num_splits):
    _flash.check_attention_shapes(q, k_cache, v_cache, block_tables, triton=False)
    num_seq_rows, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    width = block_tables.shape[1]
    reason = unsupported_reason(q.dtype, k_cache.dtype, head_dim, block_size, group, table_width=width)
    if reason:
        raise ValueError(f"the Mosaic GPU decode kernel cannot take {reason}")
    cols = _columns(group)
    num_chunks = max(1, -(-width * block_size // BLOCK_K))
    if num_splits is None:
        num_splits = max(1, min(num_chunks, -(-TARGET_PROGRAMS // (num_seq_rows * num_kv_heads))))
    chunks_per_split = -(-num_chunks // num_splits)
    num_splits = -(-num_chunks // chunks_per_split)

    meta = _mosaic.meta_rows([seq_lens], block_tables, block_size)
    qg = q.reshape(num_seq_rows, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, cols - group), (0, 0)))

    part = (num_seq_rows, num_kv_heads, num_splits)
    kernel = functools.partial(
        _kernel, cols=cols, head_dim=head_dim, block_size=block_size, chunks_per_split=chunks_per_split,
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
    acc, row_max, row_sum = plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct((*part, head_dim, cols), jnp.float32),
                  jax.ShapeDtypeStruct((*part, cols), jnp.float32),
                  jax.ShapeDtypeStruct((*part, cols), jnp.float32)],
        grid=part, grid_names=("seq", "head", "split"),
        interpret=_mosaic.kernel_interpret(interpret),
    )(meta, qg, k_cache, v_cache)
    out = _flash.merge_splits(jnp.swapaxes(acc, -1, -2), row_max, row_sum)[:, :, :group]
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
) -> jax.Array:
    """Decode attention: one new query per sequence over its paged context (semantics:
    ``reference.paged_attention_reference``), on Hopper's tensor cores through Mosaic GPU.

    Args:
      q: [S, num_q_heads, head_dim] bfloat16 or float16, each sequence's last token (position ``seq_lens[s] - 1``).
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] in q's dtype.
      block_tables: int32[S, W]; seq_lens: int32[S] (0 marks a padding row).
      scale: multiplier of q·k. sliding_window: keys in ``(p - sliding_window, p]``.
      soft_cap: scores become ``soft_cap * tanh(scores / soft_cap)``.
      interpret: run JAX's Mosaic GPU interpreter (CPU tests) instead of compiling for the GPU.

    Returns:
      [S, num_q_heads, head_dim] in q's dtype; zeros where seq_lens is 0.

    Raises:
      ValueError: mismatched shapes, or inputs :func:`unsupported_reason` names.
    """
    return _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, sliding_window=sliding_window,
                            soft_cap=soft_cap, interpret=interpret, num_splits=None)
