"""The one place that knows which JAX release and Pallas GPU backend we run on.

Kernel bodies stay portable Pallas (BlockSpecs, ``ref[...]`` loads,
``lax.dot_general``). What differs between releases lives here:

* the Triton compiler-params class (``TritonCompilerParams`` in older
  releases, ``jax.experimental.pallas.triton.CompilerParams`` in current ones);
* masked stores (``pl.store(ref, idx, val, mask=...)`` in old releases,
  ``plgpu.store(ref.at[idx], val, mask=...)`` once ``pl.store`` was removed);
* how a squeezed block dimension is spelled (``None`` or ``pl.squeezed``).

When the Triton lowering is retired in favour of Mosaic GPU, this file and the
``compiler_params`` call sites are what has to change.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as _plgpu
except ImportError:  # a JAX build without the Triton lowering; interpret mode still works
    _plgpu = None

SQUEEZED: Any = getattr(pl, "squeezed", None)
"""Block-shape entry for a dimension the kernel does not see."""


def compiler_params(*, num_warps: int, num_stages: int) -> Any:
    """Triton launch parameters for ``pallas_call(compiler_params=...)``.

    Returns None where no Triton params class exists; ``pallas_call`` then uses
    its defaults (and interpret mode ignores them anyway).
    """
    if _plgpu is None:
        return None
    params_cls = getattr(_plgpu, "CompilerParams", None) or getattr(_plgpu, "TritonCompilerParams", None)
    if params_cls is None:
        params_cls = getattr(pl, "TritonCompilerParams", None)
    if params_cls is None:
        return None
    return params_cls(num_warps=num_warps, num_stages=num_stages)


def masked_store(ref: Any, idx: tuple, value: jax.Array, mask: jax.Array) -> None:
    """``ref[idx] = value`` only where ``mask`` (broadcast to value's shape)."""
    mask = jax.numpy.broadcast_to(mask, value.shape)
    if _plgpu is not None and hasattr(_plgpu, "store"):
        _plgpu.store(ref.at[idx], value, mask=mask)
    else:
        pl.store(ref, idx, value, mask=mask)
