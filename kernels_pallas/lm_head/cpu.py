"""The lm_head's ``x @ w.T`` of a row-major ``w`` [N, K] by the C++ kernel (``matmul/matmul_cpu.cc``), via FFI.

The ops table loads the library and registers :data:`FFI_TARGETS` (``kernels_pallas.ops.native_kernels``) before
any call, and reads the build's panel width P (``kernels_pallas.ops.lm_head_panel_columns``: 64 with AVX-512, 16
with AVX2) that the packed layout takes.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kernels_pallas.matmul.cpu import MATMUL_COLUMN_MULTIPLE, valid_rows

# This kernel's XLA FFI targets (w as it is, and packed in panels) -> their C symbols in the library.
MATMUL_NT_TARGET = "jaxllm_matmul_nt_cpu"
MATMUL_NT_PACKED_TARGET = "jaxllm_matmul_nt_packed_cpu"
FFI_TARGETS = {MATMUL_NT_TARGET: "JaxllmMatmulNtCpu", MATMUL_NT_PACKED_TARGET: "JaxllmMatmulNtPackedCpu"}
# The library's panel width P (a no-argument C function returning int64).
PANEL_COLUMNS_SYMBOL = "jaxllm_matmul_panel_columns"


def matmul_nt_supports(w: jax.Array) -> bool:
    """Whether :func:`matmul_nt_cpu` takes ``w``: float32 ``[N, K]``, K a multiple of :data:`MATMUL_COLUMN_MULTIPLE`."""
    return w.ndim == 2 and w.dtype == jnp.float32 and w.shape[1] % MATMUL_COLUMN_MULTIPLE == 0 and w.shape[0] > 0


def nt_panels_shape(w: jax.Array, panel_columns: int) -> Optional[tuple[int, int, int]]:
    """``(N / P, K, P)`` for ``w`` [N, K] and P ``panel_columns``, or None (w not supported, N not a multiple of P)."""
    if not matmul_nt_supports(w):
        return None
    p = panel_columns
    return (w.shape[0] // p, w.shape[1], p) if w.shape[0] % p == 0 else None


def pack_nt_panels(w: jax.Array, panel_columns: int) -> jax.Array:
    """``w`` [N, K] float32 as :func:`matmul_nt_cpu`'s ``panels`` of P = ``panel_columns``: float32
    ``[N / P, K, P]``, ``panels[p, k, j] = w[p * P + j, k]``.

    Raises:
      ValueError: :func:`nt_panels_shape` is None (shape named).
    """
    shape = nt_panels_shape(w, panel_columns)
    if shape is None:
        raise ValueError(f"pack_nt_panels: w {w.dtype} {w.shape}; expected float32 [N, K] with K a multiple of "
                         f"{MATMUL_COLUMN_MULTIPLE} and N a multiple of the panel width {panel_columns}")
    return jnp.transpose(w.reshape(shape[0], shape[2], shape[1]), (0, 2, 1))


def matmul_nt_cpu(x: jax.Array, w: jax.Array, rows: Optional[jax.Array] = None,
                  panels: Optional[jax.Array] = None) -> jax.Array:
    """``x @ w.T`` for a row-major ``w`` [N, K] (a tied embedding) by the C++ kernel.

    Args:
      x: [M, K], any float dtype (computed in float32).
      w: float32 [N, K], K a multiple of :data:`MATMUL_COLUMN_MULTIPLE`.
      rows: int32[] leading rows to compute, clamped to [0, M]; the rest are zeros. None: all M.
      panels: :func:`pack_nt_panels` of w with the build's panel width, read in place of w, or None.

    Returns:
      float32 [M, N], accumulated in float32.

    Raises:
      ValueError: w not supported, K not matching x, or panels not float32 ``[N / P, K, P]`` of w.
      JaxRuntimeError (at run time): panels of another width than the build's P.
    """
    if not matmul_nt_supports(w) or x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul_nt_cpu: x {x.shape}, w {w.dtype} {w.shape}; expected x [M, K] and float32 w "
                         f"[N, K] with K a multiple of {MATMUL_COLUMN_MULTIPLE}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    if panels is not None:
        want = nt_panels_shape(w, panels.shape[-1]) if panels.ndim == 3 and panels.shape[-1] > 0 else None
        if panels.shape != want or panels.dtype != jnp.float32:
            raise ValueError(f"matmul_nt_cpu: panels {panels.dtype} {panels.shape}; expected float32 [N / P, K, P] "
                             f"of w {w.shape} (pack_nt_panels of w)")
        return jax.ffi.ffi_call(MATMUL_NT_PACKED_TARGET, out)(x.astype(jnp.float32), w, panels,
                                                              valid_rows(rows, x.shape[0]))
    return jax.ffi.ffi_call(MATMUL_NT_TARGET, out)(x.astype(jnp.float32), w, valid_rows(rows, x.shape[0]))
