"""The one place that knows the Pallas GPU backend is Triton: compiler params and masked stores."""

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
