"""The projection matmul by XLA's dot of the layer's weight (sliced from the stack by the caller)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_xla(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` accumulated in float32: x [M, K], w [K, N] of any float dtype -> float32 [M, N]."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32)
