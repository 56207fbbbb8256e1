"""The stacked projection matmul by the C++ kernel (``matmul_cpu.cc``), called through XLA's FFI.

:func:`stacked_matmul_cpu` reads a layer's weight (float32 or bfloat16) in place from the stacked parameters (XLA's
dynamic-slice of it is a copy per layer per step) and computes only the leading rows a padded step fills.
``matmul_cpu.cc`` also holds the lm_head's transposed product (``kernels_pallas.lm_head.cpu``), which shares its
tiles and thread pool.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_build

# stacked_matmul_cpu's weights: float32 or bfloat16 (then an even contracted axis), output columns a multiple of
# this; matmul_nt_cpu's: float32, the contracted axis a multiple of it.
MATMUL_COLUMN_MULTIPLE = 16


def matmul_supports(w: jax.Array) -> bool:
    """Whether :func:`stacked_matmul_cpu` takes this stacked weight: ``[L, K, N]`` with N a multiple of
    :data:`MATMUL_COLUMN_MULTIPLE`, float32, or bfloat16 (or uint16 bfloat16 bits, as the engine stores its layer
    weights on CPU: ``jaxllm.models.common.loop_storage``) with K even (its kernel takes K two rows at a time)."""
    if w.ndim != 3 or w.shape[2] % MATMUL_COLUMN_MULTIPLE != 0:
        return False
    return w.dtype == jnp.float32 or (w.dtype in (jnp.bfloat16, jnp.uint16) and w.shape[1] % 2 == 0)


def valid_rows(rows: Optional[jax.Array], m: int) -> jax.Array:
    """The kernels' ``rows`` operand: int32 [], ``rows`` or all ``m`` rows where None."""
    return jnp.asarray(m if rows is None else rows, jnp.int32)


def stacked_matmul_cpu(x: jax.Array, w: jax.Array, layer: jax.Array, rows: Optional[jax.Array] = None) -> jax.Array:
    """``x @ w[layer]`` with the layer's weight read in place from the stacked ``w`` (the C++ kernel).

    Inside a scan over layers, ``w[layer]`` would be a dynamic-slice that XLA's CPU backend copies on every step;
    passing the whole stack and the index reads each weight once (``matmul_cpu.cc``). A bfloat16 ``w`` (or its
    uint16 bits) multiplies bfloat16 x (x is rounded to it, as XLA's bfloat16 dot does), products summed in
    float32: with the CPU's ``vdpbf16ps`` where it has AVX-512-BF16, else converted to float32 as they are read.

    Args:
      x: [M, K], any float dtype (computed in float32 against a float32 ``w``, in bfloat16 against a bfloat16 one).
      w: float32, bfloat16 or uint16 (bfloat16 bits) [L, K, N], N a multiple of :data:`MATMUL_COLUMN_MULTIPLE` (K
        even unless float32).
      layer: int32 [] in [0, L).
      rows: int32 [], the leading rows of x to compute (a padded step's tokens), clamped to [0, M]; the other
        rows of the result are zeros. None: all M.

    Returns:
      float32 [M, N], accumulated in float32.

    Raises:
      ValueError: a weight :func:`matmul_supports` does not take, K not matching x, or the kernel is not
        ``cpu_build.available()``.
      JaxRuntimeError (at run time): a layer outside [0, L) (named in the message).
    """
    if not cpu_build.available():
        raise ValueError(f"stacked_matmul_cpu is not available: {cpu_build.unavailable_reason()}")
    if not matmul_supports(w) or x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"stacked_matmul_cpu: x {x.shape}, w {w.dtype} {w.shape}; expected x [M, K] and a float32 "
                         f"or bfloat16 w [L, K, N] with N a multiple of {MATMUL_COLUMN_MULTIPLE} (K even for bfloat16)")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32)
    layer, rows = jnp.asarray(layer, jnp.int32), valid_rows(rows, x.shape[0])
    if w.dtype != jnp.float32:
        return jax.ffi.ffi_call(cpu_build.MATMUL_BF16_TARGET, out)(x.astype(jnp.bfloat16), w, layer, rows)
    return jax.ffi.ffi_call(cpu_build.MATMUL_TARGET, out)(x.astype(jnp.float32), w, layer, rows)
