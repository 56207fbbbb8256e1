"""The plain ``jnp`` reference of the stacked projection matmul, with ``stacked_matmul_cpu``'s signature."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kernels_pallas.storage import from_storage


def stacked_matmul_reference(x: jax.Array, w: jax.Array, layer: jax.Array,
                             rows: Optional[jax.Array] = None) -> jax.Array:
    """``x @ w[layer]`` in float32, rows at or past ``rows`` zeros (``stacked_matmul_cpu``'s signature).

    x: [M, K] (rounded to bfloat16 against a bfloat16 ``w``); w: float32, bfloat16 or uint16 [L, K, N];
    layer: int32[] in [0, L); rows: int32[] clamped to [0, M], or None. Returns float32 [M, N].
    """
    weight = from_storage(w[layer])
    y = jnp.dot(x.astype(weight.dtype), weight, preferred_element_type=jnp.float32)
    if rows is None:
        return y
    return jnp.where(jnp.arange(x.shape[0])[:, None] < rows, y, 0.0)
