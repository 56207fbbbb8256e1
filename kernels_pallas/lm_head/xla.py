"""The lm_head by XLA's dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lm_head_xla(hidden: jax.Array, weight: jax.Array, *, tied: bool) -> jax.Array:
    """Logits float32 [M, V] of hidden [M, E]: ``hidden @ weight`` for an lm_head [E, V], or against a tied
    embedding [V, E] contracted on its second axis directly (``hidden @ embed.T`` would make XLA's CPU backend
    transpose the whole table on every step). Accumulated in float32."""
    if tied:
        return jax.lax.dot_general(hidden, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.dot(hidden, weight, preferred_element_type=jnp.float32)
