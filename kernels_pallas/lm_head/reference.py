"""The plain ``jnp`` reference of the lm_head's transposed product, with ``matmul_nt_cpu``'s signature."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def matmul_nt_reference(x: jax.Array, w: jax.Array, rows: Optional[jax.Array] = None,
                        panels: Optional[jax.Array] = None) -> jax.Array:
    """``x @ w.T`` in float32 for x [M, K] and w [N, K], the rows at or past ``rows`` (int32 [], None: all M)
    zeros; ``panels`` is accepted for signature parity (the product is w's). Returns float32 [M, N]."""
    del panels
    y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32).T, preferred_element_type=jnp.float32)
    if rows is None:
        return y
    return jnp.where(jnp.arange(x.shape[0])[:, None] < rows, y, 0.0)
