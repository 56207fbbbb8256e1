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

from kernels_pallas import _flash
from kernels_pallas.attention.pallas_decode import TARGET_PROGRAMS

BLOCK_K = 64
STAGES = 2
# Tensor-core operand dtypes; a float32 or quantized cache takes the Triton kernel.
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Shared-memory tiles: K and Q rows of 64 elements swizzled by 128 bytes; V and P^T share the 32-byte swizzle the
# products' operands must agree on, which P^T's 16 columns allow (128 would need 64).
_WIDE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_NARROW = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
# Pallas's copies spread a copy's expected bytes evenly over the warpgroup's 128 threads, so every copy moves a
# multiple of 128 bytes: the per-row metadata is padded to 32 int32.
_META_ALIGN = 32
# Shared memory one program may use on Hopper (227 KiB per block).
SMEM_BYTES = 227 * 1024
MAX_HEAD_DIM = 256


def _columns(group: int) -> int:
    return 16 if group <= 16 else 32


def _meta_width(table_width: int, block_size: int) -> int:
    """Entries of a row's metadata: its length, then block ids covering whole chunks, padded for the copy."""
    chunks = max(1, -(-table_width * block_size // BLOCK_K))
    return -(-(1 + -(-chunks * BLOCK_K // block_size)) // _META_ALIGN) * _META_ALIGN


def smem_bytes(head_dim: int, group: int, table_width: int, block_size: int, itemsize: int = 2) -> int:
    """Shared memory one program of the kernel uses (bytes): the K and V rings, Q and P^T tiles, the float32
    partial result and the row's metadata."""
    cols = _columns(group)
    tiles = (2 * STAGES * BLOCK_K * head_dim + cols * head_dim + BLOCK_K * cols) * itemsize
    return tiles + (head_dim + 2) * cols * 4 + 4 * _meta_width(table_width, block_size)


def unsupported_reason(q_dtype, cache_dtype, head_dim: int, block_size: int, group: int, quantized: bool = False,
                       table_width: int = 1) -> Optional[str]:
    """Why this kernel cannot take these inputs (None when it can): a cache other than bfloat16/float16 in q's
    dtype, a quantized cache, head_dim not a multiple of 64 up to 256, block_size not a multiple of 8 that
    divides 64 or is a multiple of 64, a GQA group over 32, or block tables of ``table_width`` entries whose
    metadata would not fit in shared memory beside the tiles (:func:`smem_bytes` over :data:`SMEM_BYTES`)."""
    if quantized:
        return "a quantized KV cache"
    if jnp.dtype(cache_dtype) not in DTYPES or jnp.dtype(q_dtype) != jnp.dtype(cache_dtype):
        return f"q {jnp.dtype(q_dtype).name} / cache {jnp.dtype(cache_dtype).name}: needs both bfloat16 or float16"
    if head_dim % 64 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim}: needs a multiple of 64 up to {MAX_HEAD_DIM}"
    if block_size % 8 or (BLOCK_K % block_size and block_size % BLOCK_K):
        return f"block_size {block_size} must be a multiple of 8 dividing {BLOCK_K} or a multiple of {BLOCK_K}"
    if group > 32:
        return f"{group} query heads per KV head (at most 32)"
    if (need := smem_bytes(head_dim, group, table_width, block_size)) > SMEM_BYTES:
        return f"block tables of {table_width} entries: {need} bytes of shared memory, over {SMEM_BYTES}"
    return None


def _mma(a_ref, b_ref, *, transpose_a: bool, transpose_b: bool, shape, interpret: bool) -> jax.Array:
    """``op(a) @ op(b)`` in float32 from two shared-memory refs (op: transposed where asked): a tensor-core
    product, or in interpret mode the same product by ``jnp.dot`` (the interpreter has no transposed operands)."""
    if interpret:
        a, b = a_ref[...].astype(jnp.float32), b_ref[...].astype(jnp.float32)
        return jnp.dot(a.T if transpose_a else a, b.T if transpose_b else b)

    def run(acc_ref):
        plgpu.wgmma(acc_ref, plgpu.transpose_ref(a_ref, (1, 0)) if transpose_a else a_ref,
                    plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _kernel(meta_ref, q_ref, k_ref, v_ref, acc_out, max_out, sum_out, *, cols: int, head_dim: int,
            block_size: int, chunks_per_split: int, scale: float, sliding_window: Optional[int],
            soft_cap: Optional[float], interpret: bool):
    seq, head, split = lax.axis_index("seq"), lax.axis_index("head"), lax.axis_index("split")
    page_rows = min(block_size, BLOCK_K)
    pages = BLOCK_K // page_rows
    # The interpreter runs values without register layouts; compiled, the loop carry needs the products' layouts.
    cast = (lambda x, layout: x) if interpret else plgpu.layout_cast

    # Reuse of a ring slot, and of the P^T tile, is ordered by the warpgroup barrier Pallas puts before each copy
    # and by the wait for each product's result (its accumulator's read); kernels here keep those auto barriers.
    def body(meta, q_tile, k_tiles, v_tiles, p_tile, acc_tile, max_tile, sum_tile, meta_bar, q_bar, k_bar, v_bar):
        # The row lies in bounds and contiguous: promising so takes the bulk copy, which has no 256-element limit.
        plgpu.copy_gmem_to_smem(meta_ref.at[seq], meta, meta_bar, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_tile, q_bar)
        plgpu.barrier_wait(meta_bar)
        seq_len = meta[0]
        first = split * chunks_per_split
        if sliding_window is not None:
            first = jnp.maximum(first, lax.div(jnp.maximum(seq_len - sliding_window, 0), BLOCK_K))
        end = jnp.minimum((split + 1) * chunks_per_split, lax.div(seq_len + BLOCK_K - 1, BLOCK_K))

        def fetch(chunk, slot):
            for p in range(pages):
                token = chunk * BLOCK_K + p * page_rows
                block = meta[1 + lax.div(token, block_size)]
                rows = pl.ds(lax.rem(token, block_size), page_rows)
                dst = pl.ds(p * page_rows, page_rows)
                plgpu.copy_gmem_to_smem(k_ref.at[block, rows, head], k_tiles.at[slot, dst], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[block, rows, head], v_tiles.at[slot, dst], v_bar.at[slot])

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
            scores = _mma(k_tiles.at[slot], q_tile, transpose_a=False, transpose_b=True, shape=(BLOCK_K, cols),
                          interpret=interpret) * scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            shape = (BLOCK_K, cols)
            pos = chunk * BLOCK_K + (lax.broadcasted_iota(jnp.int32, shape, 0) if interpret else
                                     plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA))
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
            pv = _mma(v_tiles.at[slot], p_tile, transpose_a=True, transpose_b=False, shape=(head_dim, cols),
                      interpret=interpret)
            acc = acc * lax.broadcast_in_dim(correction, acc.shape, [1]) + pv
            return acc, new_max, row_sum

        col = plgpu.Layout.WGMMA.reduce(0)
        carry = (cast(jnp.zeros((head_dim, cols), jnp.float32), plgpu.Layout.WGMMA),
                 cast(jnp.full((cols,), _flash.MASK_VALUE, jnp.float32), col),
                 cast(jnp.zeros((cols,), jnp.float32), col))
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
        plgpu.SMEM((cols, head_dim), dtype, transforms=_WIDE),
        plgpu.SMEM((STAGES, BLOCK_K, head_dim), dtype, transforms=_WIDE),
        plgpu.SMEM((STAGES, BLOCK_K, head_dim), dtype, transforms=_NARROW),
        plgpu.SMEM((BLOCK_K, cols), dtype, transforms=_NARROW),
        plgpu.SMEM((head_dim, cols), jnp.float32),
        plgpu.SMEM((cols,), jnp.float32),
        plgpu.SMEM((cols,), jnp.float32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=pages, num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=pages, num_barriers=STAGES),
    )


def _interpret_params(**options: Any):
    """The Mosaic GPU interpreter's parameters (``InterpretGPUParams``: ``detect_races``, ...), which JAX 0.10-0.11
    export only from a private module."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(**options)


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

    # Row s: [seq_len, block ids covering every chunk (padding: block 0, masked)], padded for the copy.
    meta = jnp.zeros((num_seq_rows, _meta_width(width, block_size)), jnp.int32)
    meta = meta.at[:, 0].set(seq_lens.astype(jnp.int32)).at[:, 1:1 + width].set(block_tables.astype(jnp.int32))
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
        interpret=_interpret_params() if interpret is True else interpret or None,
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
