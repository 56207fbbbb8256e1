"""The stacked projection matmul by the C++ kernel (``matmul_cpu.cc``) through XLA's FFI: a layer's weight read in
place from the stack, only the leading rows a padded step fills computed. The ops table loads the library and registers
:data:`FFI_TARGETS` (``kernels_pallas.ops.native_kernels``) before any call. Design: docs/design/kernels.md.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

# This kernel's XLA FFI targets (float32 and bfloat16 weights) -> their C symbols in the library.
MATMUL_TARGET = "jaxllm_matmul_cpu"
MATMUL_BF16_TARGET = "jaxllm_matmul_bf16_cpu"
FFI_TARGETS = {MATMUL_TARGET: "JaxllmMatmulCpu", MATMUL_BF16_TARGET: "JaxllmMatmulBf16Cpu"}

# stacked_matmul_cpu's weights: float32 or bfloat16 (then an even contracted axis), output columns a multiple of
# this; matmul_nt_cpu's: float32, the contracted axis a multiple of it.
MATMUL_COLUMN_MULTIPLE = 16


def matmul_supports(w: jax.Array) -> bool:
    """Whether :func:`stacked_matmul_cpu` takes ``w``: ``[L, K, N]``, N a multiple of :data:`MATMUL_COLUMN_MULTIPLE`,
    float32, or bfloat16 / uint16 bfloat16 bits with K even.
    """
    if w.ndim != 3 or w.shape[2] % MATMUL_COLUMN_MULTIPLE != 0:
        return False
    return w.dtype == jnp.float32 or (w.dtype in (jnp.bfloat16, jnp.uint16) and w.shape[1] % 2 == 0)


def valid_rows(rows: Optional[jax.Array], m: int) -> jax.Array:
    """The kernels' ``rows`` operand: int32[] ``rows``, or ``m`` where None."""
    return jnp.asarray(m if rows is None else rows, jnp.int32)


def stacked_matmul_cpu(x: jax.Array, w: jax.Array, layer: jax.Array, rows: Optional[jax.Array] = None) -> jax.Array:
    """``x @ w[layer]`` with the weight read in place from the stacked ``w`` (the C++ kernel).

    Args:
      x: [M, K], any float dtype (float32 against float32 ``w``; rounded to bfloat16 against bfloat16).
      w: float32, bfloat16 or uint16 (bfloat16 bits) [L, K, N], N a multiple of :data:`MATMUL_COLUMN_MULTIPLE`
        (K even unless float32).
      layer: int32[] in [0, L).
      rows: int32[] leading rows to compute, clamped to [0, M]; the rest are zeros. None: all M.

    Returns:
      float32 [M, N], accumulated in float32.

    Raises:
      ValueError: w not :func:`matmul_supports`, or K not matching x.
      JaxRuntimeError (at run time): a layer outside [0, L).
    """
    if not matmul_supports(w) or x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"stacked_matmul_cpu: x {x.shape}, w {w.dtype} {w.shape}; expected x [M, K] and a float32 "
                         f"or bfloat16 w [L, K, N] with N a multiple of {MATMUL_COLUMN_MULTIPLE} (K even for bfloat16)")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32)
    layer, rows = jnp.asarray(layer, jnp.int32), valid_rows(rows, x.shape[0])
    if w.dtype != jnp.float32:
        return jax.ffi.ffi_call(MATMUL_BF16_TARGET, out)(x.astype(jnp.bfloat16), w, layer, rows)
    return jax.ffi.ffi_call(MATMUL_TARGET, out)(x.astype(jnp.float32), w, layer, rows)
