"""Pieces shared by the Mosaic GPU (``plgpu``, Hopper) attention kernels: shared-memory tile layouts, what the
kernels can take, the paged KV chunk fetch by TMA, tensor-core products that also run in JAX's Mosaic GPU
interpreter, and the row metadata. Design: docs/design/kernels.md.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BLOCK_K = 64
STAGES = 2
# Tensor-core operand dtypes; a float32 or quantized cache takes the Triton kernels.
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Shared-memory tiles of 64-element rows swizzled by 128 bytes, and of 16-element rows by 32 bytes (the two
# operands of one product must share a swizzle).
WIDE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
NARROW = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
# Pallas's copies spread a copy's expected bytes evenly over the warpgroup's 128 threads, so every copy moves a
# multiple of 128 bytes: metadata rows are padded to 32 int32.
META_ALIGN = 32
# Shared memory one program may use on Hopper (227 KiB per block), and how Pallas lays it out: each buffer rounded
# up to 1 KiB, 2 KiB of scratch for a kernel's reductions, 8 bytes per barrier.
SMEM_BYTES = 227 * 1024
_SMEM_ALIGN = 1024
_REDUCTION_SCRATCH = 2048
_BARRIER_BYTES = 8
MAX_HEAD_DIM = 256


def meta_width(header: int, table_width: int, block_size: int) -> int:
    """Entries of a metadata row: ``header`` scalars, then block ids covering whole chunks, padded for the copy."""
    chunks = max(1, -(-table_width * block_size // BLOCK_K))
    return -(-(header + -(-chunks * BLOCK_K // block_size)) // META_ALIGN) * META_ALIGN


def meta_rows(header: list[jax.Array], tables: Optional[jax.Array], block_size: int) -> jax.Array:
    """int32[R, meta_width]: row r holds ``header[i][r]`` for each i, then ``tables[r]`` (padding: block 0; no
    tables: the header alone)."""
    width = 0 if tables is None else tables.shape[1]
    rows = header[0].shape[0] if header else tables.shape[0]
    size = meta_width(len(header), width, block_size) if width else -(-len(header) // META_ALIGN) * META_ALIGN
    meta = jnp.zeros((rows, size), jnp.int32)
    if header:
        meta = meta.at[:, :len(header)].set(jnp.stack([h.astype(jnp.int32) for h in header], axis=1))
    if width:
        meta = meta.at[:, len(header):len(header) + width].set(tables.astype(jnp.int32))
    return meta


def unsupported_reason(q_dtype, cache_dtype, head_dim: int, block_size: int, quantized: bool) -> Optional[str]:
    """Why the Mosaic kernels cannot take these inputs, checks they share (None when they can)."""
    if quantized:
        return "a quantized KV cache"
    if jnp.dtype(cache_dtype) not in DTYPES or jnp.dtype(q_dtype) != jnp.dtype(cache_dtype):
        return f"q {jnp.dtype(q_dtype).name} / cache {jnp.dtype(cache_dtype).name}: needs both bfloat16 or float16"
    if head_dim % 64 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim}: needs a multiple of 64 up to {MAX_HEAD_DIM}"
    if block_size % 8 or (BLOCK_K % block_size and block_size % BLOCK_K):
        return f"block_size {block_size} must be a multiple of 8 dividing {BLOCK_K} or a multiple of {BLOCK_K}"
    return None


def smem_total(buffers: list[int], barriers: int) -> int:
    """Shared memory (bytes) a program with these buffers (bytes each) and barriers requests from Pallas."""
    aligned = sum(-(-size // _SMEM_ALIGN) * _SMEM_ALIGN for size in buffers)
    return aligned + _REDUCTION_SCRATCH + _BARRIER_BYTES * barriers


def smem_reason(need: int, table_width: int) -> Optional[str]:
    """Why ``need`` bytes of shared memory per program do not fit (None when they do)."""
    if need > SMEM_BYTES:
        return f"block tables of {table_width} entries: {need} bytes of shared memory, over {SMEM_BYTES}"
    return None


def interpret_params(**options: Any):
    """The Mosaic GPU interpreter's parameters (``InterpretGPUParams``: ``detect_races``, ...), which JAX 0.10-0.11
    export only from a private module."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(**options)


def kernel_interpret(interpret: Any):
    """``plgpu.kernel``'s ``interpret`` for a kernel's ``interpret`` argument (True, False or the parameters)."""
    return interpret_params() if interpret is True else interpret or None


def layout_cast(x: jax.Array, layout, interpret: Any) -> jax.Array:
    """``x`` in a register layout (a loop carry must match the products' layouts); the interpreter has none."""
    return x if interpret else plgpu.layout_cast(x, layout)


def iota(shape: tuple[int, int], axis: int, interpret: Any) -> jax.Array:
    """int32 indices along ``axis`` in the tensor-core result layout."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, axis)
    return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def mma(a, b_ref, *, shape: tuple[int, int], interpret: Any, transpose_a: bool = False,
        transpose_b: bool = False, acc: Optional[jax.Array] = None) -> jax.Array:
    """``acc + op(a) @ op(b)`` in float32 (op: transposed where asked; no ``acc``: zeros of ``shape``) as a
    tensor-core product accumulating in place: ``b`` a shared-memory ref, ``a`` one too or a register array in the
    result layout (then not transposed). In interpret mode the same product by ``jnp.dot`` (the interpreter has
    neither transposed operands nor ``run_state``)."""
    if interpret:
        a = (a if isinstance(a, jax.Array) else a[...]).astype(jnp.float32)
        b = b_ref[...].astype(jnp.float32)
        product = jnp.dot(a.T if transpose_a else a, b.T if transpose_b else b)
        return product if acc is None else acc + product
    a = plgpu.transpose_ref(a, (1, 0)) if transpose_a else a
    b_ref = plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref
    if acc is not None:
        # Accumulating into the running value keeps one accumulator live, not two (head_dim 256 would spill).
        return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b_ref))(plgpu.ACC.init(acc))

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b_ref)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def fetch_chunk(meta, header: int, chunk, slot, head, k_ref, v_ref, k_tiles, v_tiles, k_bar, v_bar, *,
                block_size: int) -> None:
    """Start the TMA copies of KV positions ``[chunk * BLOCK_K, (chunk + 1) * BLOCK_K)`` of one KV head into ring
    slot ``slot``: one copy per page, ``k_ref[block, rows, head]`` (a strided slab of the cache as laid out),
    block ids from ``meta[header:]``. Each stage's barrier counts one arrival per page."""
    page_rows = min(block_size, BLOCK_K)
    for p in range(BLOCK_K // page_rows):
        token = chunk * BLOCK_K + p * page_rows
        block = meta[header + lax.div(token, block_size)]
        rows = pl.ds(lax.rem(token, block_size), page_rows)
        dst = pl.ds(p * page_rows, page_rows)
        plgpu.copy_gmem_to_smem(k_ref.at[block, rows, head], k_tiles.at[slot, dst], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[block, rows, head], v_tiles.at[slot, dst], v_bar.at[slot])


def pages_per_chunk(block_size: int) -> int:
    """TMA copies per K (or V) chunk: the pages of ``block_size`` tokens in ``BLOCK_K`` (1 for larger pages, of
    which a chunk is a slice)."""
    return BLOCK_K // min(block_size, BLOCK_K)


def copy_meta(meta_row, meta, barrier) -> None:
    """Copy one metadata row to shared memory. The row lies in bounds and contiguous: promising so takes the bulk
    copy, which has no 256-element limit."""
    plgpu.copy_gmem_to_smem(meta_row, meta, barrier, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
