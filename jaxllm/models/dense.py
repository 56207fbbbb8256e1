"""A dense-attention, differentiable forward over the engine's parameter pytree (for training).

:func:`dense_forward` runs any family's ``Family.layer`` over ``[B, L]`` whole sequences with plain
causal attention (:class:`DenseContext` stands in for ``LayerContext``): no paged cache, works with
``jax.grad``. Positions are ``0 .. L-1`` per row; right padding leaves earlier logits unchanged.
"""

from __future__ import annotations

import types
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxllm.models.common import KVCache, Params, apply_rope, compute_logits, layer_segments, rope_cos_sin
from jaxllm.models.config import ModelConfig


class DenseContext(NamedTuple):
    """Stands in for ``LayerContext`` (same field names layers read).

    shape: ``(B, L)`` (static); window: static or None; cos, sin: ``[B * L, R // 2]`` float32;
    num_tokens: int32[] ``B * L``.
    """

    cfg: ModelConfig
    shape: tuple[int, int]
    window: Optional[int]
    cos: jax.Array
    sin: jax.Array
    num_tokens: jax.Array

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, kv: KVCache) -> tuple[jax.Array, KVCache]:
        """Rope, then causal attention per row; ``LayerContext.attend``'s contract, ``kv`` returned untouched."""
        cfg, (b, n) = self.cfg, self.shape
        q, k = apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
        group = cfg.num_q_heads // cfg.num_kv_heads
        q = q.reshape(b, n, cfg.num_kv_heads, group, cfg.head_dim)
        k, v = (a.reshape(b, n, cfg.num_kv_heads, cfg.head_dim) for a in (k, v))
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * cfg.attention_scale
        pos = jnp.arange(n)
        mask = pos[None, :] <= pos[:, None]
        if self.window is not None:
            mask &= pos[None, :] > pos[:, None] - self.window
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1).astype(v.dtype)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v, preferred_element_type=jnp.float32).astype(q.dtype)
        return out.reshape(b * n, cfg.num_q_heads * cfg.head_dim), kv


def dense_forward(params: Params, input_ids: jax.Array, *, cfg: ModelConfig, family=None) -> jax.Array:
    """Logits of every position of whole sequences, through the family's layers and dense causal attention.

    Args:
      params: the engine's pytree (``jaxllm.models.common``), float leaves (not bit storage, not quantized).
      input_ids: int32 ``[B, L]``, each row from position 0 (right padding allowed).
      cfg: static. family: default ``jaxllm.models.family(cfg)``.

    Returns:
      float32 ``[B, L, vocab]``, equal to the engine's logits within float32 rounding.
    """
    from jaxllm.models import family as family_of

    fam = family if family is not None else family_of(cfg)
    b, n = input_ids.shape
    flat = input_ids.reshape(-1)
    # rope_cos_sin reads a batch's positions (and, for LongRoPE, each row's length and start).
    rows = types.SimpleNamespace(positions=jnp.tile(jnp.arange(n, dtype=jnp.int32), b),
                                 seq_lens=jnp.full((b,), n, jnp.int32),
                                 query_start_loc=jnp.arange(b + 1, dtype=jnp.int32) * n)
    ropes = {None: rope_cos_sin(cfg.rope, cfg.head_dim, rows)}
    if cfg.local_rope is not None:
        ropes["local"] = rope_cos_sin(cfg.local_rope, cfg.head_dim, rows)
    x = fam.embed(params, flat, cfg)
    layers = params["layers"]
    for start, stop, window in layer_segments(cfg.sliding_windows or (None,) * cfg.num_layers):
        cos, sin = ropes["local" if window is not None and cfg.local_rope is not None else None]
        ctx = DenseContext(cfg, (b, n), window, cos, sin, jnp.int32(b * n))

        def step(x, layer, ctx=ctx):
            return fam.layer(layer, x, None, ctx)[0], None

        x, _ = jax.lax.scan(step, x, jax.tree_util.tree_map(lambda a: a[start:stop], layers))
    x = fam.final_norm(params, x, cfg)
    return compute_logits(params, x, cfg=cfg).reshape(b, n, -1)
