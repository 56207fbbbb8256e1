"""The sparse MoE MLP of Mixtral and Qwen3-MoE, in plain ``jnp`` with shapes fixed by the bucket.

Routing as HF's ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``: float32 softmax, top ``k`` per token,
renormalised when ``cfg.norm_topk_prob``. Assignments are sorted by expert and each expert runs on its
contiguous rows in ``block``-row chunks; experts add in increasing order, as HF. Expert weights shard
on their FFN axis (``PARAM_AXES``). Design: docs/design/models.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.models import llama
from jaxllm.models.common import KVCache, LayerContext, gated_mlp, linear, rms_norm
from jaxllm.models.config import ModelConfig

EXPERT_KEYS = {"router", "experts_gate", "experts_up", "experts_down"}


def layer_keys(cfg: ModelConfig) -> set[str]:
    """Pytree keys of a MoE layer: Llama's attention half, the router and the experts."""
    return llama.attention_keys(cfg) | EXPERT_KEYS


def route(h: jax.Array, router: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Each token's experts and weights.

    h: [T, E]; router: [E, num_experts] -> (float32 [T, k], int32 [T, k]), k = ``cfg.num_experts_per_tok``.
    """
    probs = jax.nn.softmax(linear(h, router).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def block_rows(num_tokens: int, cfg: ModelConfig) -> int:
    """Rows per expert MLP call (static): the mean assignments per expert, a power of two in [8, 128]."""
    mean = num_tokens * cfg.num_experts_per_tok / cfg.num_experts
    return int(min(128, max(8, 1 << max(0, int(mean - 1).bit_length()))))


def moe_mlp(layer: dict[str, jax.Array], h: jax.Array, cfg: ModelConfig, num_tokens: jax.Array) -> jax.Array:
    """The sparse MoE block.

    Args:
      layer: ``router`` [E, X], ``experts_gate``/``experts_up`` [X, E, F], ``experts_down`` [X, F, E].
      h: [T, E] normed; rows from ``num_tokens`` on are padding.
      cfg: the model configuration. num_tokens: int32[] real tokens.

    Returns:
      [T, E] in h's dtype: each token's weighted sum of its experts' outputs (zeros for padding).
    """
    t, k, num_experts = h.shape[0], cfg.num_experts_per_tok, cfg.num_experts
    weights, experts = route(h, layer["router"], cfg)
    token = jnp.repeat(jnp.arange(t, dtype=jnp.int32), k)
    # Padding tokens go to a virtual last expert, which sorts last and never runs.
    expert = jnp.where(token < num_tokens, experts.reshape(-1), num_experts)
    order = jnp.argsort(expert, stable=True)
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[expert].add(1)[:num_experts]
    starts = jnp.cumsum(counts) - counts
    block = block_rows(t, cfg)
    token = jnp.concatenate([token[order], jnp.zeros(block, jnp.int32)])
    weight = jnp.concatenate([weights.reshape(-1)[order], jnp.zeros(block, jnp.float32)])
    rows = h[token]

    def run_expert(e, out):
        mlp = {f"w_{part}{suffix}": layer[f"experts_{part}{suffix}"][e]
               for part in ("gate", "up", "down") for suffix in ("", "_scale") if f"experts_{part}{suffix}" in layer}

        def run_chunk(c, out):
            first = starts[e] + c * block
            y = gated_mlp(mlp, jax.lax.dynamic_slice_in_dim(rows, first, block), cfg.hidden_act)
            w = jax.lax.dynamic_slice_in_dim(weight, first, block)
            w = jnp.where(jnp.arange(block) < counts[e] - c * block, w, 0.0)
            tokens = jax.lax.dynamic_slice_in_dim(token, first, block)
            return out.at[tokens].add((y.astype(jnp.float32) * w[:, None]).astype(out.dtype))

        return jax.lax.fori_loop(0, (counts[e] + block - 1) // block, run_chunk, out)

    return jax.lax.fori_loop(0, num_experts, run_expert, jnp.zeros_like(h))


def decoder_layer(layer: dict[str, jax.Array], x: jax.Array, kv: KVCache,
                  ctx: LayerContext) -> tuple[jax.Array, KVCache]:
    """One MoE layer (HF ``MixtralDecoderLayer`` / ``Qwen3MoeDecoderLayer``). x: [T, E]."""
    x, kv = llama.attention_residual(layer, x, kv, ctx)
    h = rms_norm(x, layer["mlp_norm"], ctx.cfg.rms_norm_eps)
    return x + moe_mlp(layer, h, ctx.cfg, ctx.num_tokens), kv
