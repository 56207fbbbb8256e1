"""The one place that knows which Pallas GPU backend the kernels target.

Kernel bodies stay portable Pallas (BlockSpecs, ``ref[...]`` loads and stores,
``lax.dot_general``). Two things are Triton-specific and live here: the
compiler params (``num_warps``, ``num_stages``) and masked stores. JAX 0.10
and 0.11 both ship them as ``jax.experimental.pallas.triton.CompilerParams``
and ``.store``. When the Triton lowering is retired in favour of Mosaic GPU,
this file is what has to change.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SQUEEZED = pl.squeezed
"""Block-shape entry for a dimension the kernel does not see."""


def compiler_params(*, num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Triton launch parameters for ``pallas_call(compiler_params=...)``; interpret mode ignores them."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def masked_store(ref, idx: tuple, value: jax.Array, mask: jax.Array) -> None:
    """``ref[idx] = value`` only where ``mask`` (broadcast to value's shape)."""
    plgpu.store(ref.at[idx], value, mask=jnp.broadcast_to(mask, value.shape))
