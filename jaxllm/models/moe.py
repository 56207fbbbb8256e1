"""The sparse mixture-of-experts MLP shared by Mixtral and Qwen3-MoE, in plain
``jnp`` with fixed shapes.

Routing (HF ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``): softmax over the
router logits in float32, the top ``k`` experts per token, their weights
renormalised to sum to 1 when ``cfg.norm_topk_prob`` (always for Mixtral:
a softmax over the top-k logits).

Dispatch by sort: the ``T * k`` (token, expert) assignments are sorted by
expert, so each expert's tokens are one contiguous run of rows, and a loop
over the experts runs each expert's SwiGLU MLP on its run in chunks of
``block`` rows (a ``fori_loop`` whose trip count is the run's chunk count),
then adds the weighted outputs back to their tokens. Every array has a shape
fixed by the bucket (``T``), so no routing ever recompiles; the work follows
the assignments (an expert no token chose costs nothing, padding tokens are
never routed) rather than ``T * num_experts``. Experts add to each token in
increasing expert order, as HF's loop does. On CPU this runs faster
than ``jax.lax.ragged_dot`` or a dense all-experts einsum at Mixtral's
sizes (both of which XLA's CPU backend computes densely).

Sharding: the expert weights split over the expert FFN dimension
(``jaxllm.worker.sharding.PARAM_AXES``: ``experts_gate``/``experts_up``
``[E, hidden, mlp]``, ``experts_down`` ``[E, mlp, hidden]``, the ``mlp``
axis on the mesh's ``model`` axis, the expert axis never split): each device
holds a slice of every expert, as a dense MLP under Megatron's rule, so
routing needs no all-to-all and the one all-reduce is the down projection's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.models import llama
from jaxllm.models.common import KVCache, LayerContext, gated_mlp, linear, rms_norm
from jaxllm.models.config import ModelConfig

EXPERT_KEYS = {"router", "experts_gate", "experts_up", "experts_down"}


def layer_keys(cfg: ModelConfig) -> set[str]:
    """Pytree keys of a MoE decoder layer: the Llama attention half, the router and the experts."""
    return llama.attention_keys(cfg) | EXPERT_KEYS


def route(h: jax.Array, router: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Each token's experts and their weights.

    h: [T, E] and router: [E, num_experts] -> (weights float32 [T, k],
    expert ids int32 [T, k]), k = ``cfg.num_experts_per_tok``.
    """
    probs = jax.nn.softmax(linear(h, router).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def block_rows(num_tokens: int, cfg: ModelConfig) -> int:
    """Rows each expert MLP call takes (static per bucket): about the
    assignments an expert gets on average, a power of two in [8, 128]."""
    mean = num_tokens * cfg.num_experts_per_tok / cfg.num_experts
    return int(min(128, max(8, 1 << max(0, int(mean - 1).bit_length()))))


def moe_mlp(layer: dict[str, jax.Array], h: jax.Array, cfg: ModelConfig, num_tokens: jax.Array) -> jax.Array:
    """The sparse MoE block (module docstring).

    Args:
      layer: ``router`` [E, X], ``experts_gate``/``experts_up`` [X, E, F],
        ``experts_down`` [X, F, E] (X experts of FFN width F).
      h: [T, E] normed hidden states; rows from ``num_tokens`` on are padding.
      cfg: the model configuration.
      num_tokens: int32[] real tokens of the batch.

    Returns:
      [T, E] in h's dtype: each real token's weighted sum of its experts'
      outputs (zeros for padding rows).
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
    """One MoE decoder layer (HF ``MixtralDecoderLayer`` / ``Qwen3MoeDecoderLayer``):
    the Llama attention half, then ``x + moe_mlp(rms_norm(x))``. x: [T, E]."""
    x, kv = llama.attention_residual(layer, x, kv, ctx)
    h = rms_norm(x, layer["mlp_norm"], ctx.cfg.rms_norm_eps)
    return x + moe_mlp(layer, h, ctx.cfg, ctx.num_tokens), kv
