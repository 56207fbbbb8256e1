"""Gemma 3's text decoder (HF ``modeling_gemma3.py``, ``Gemma3ForCausalLM``).

Differs from Llama: RMSNorm scales by ``1 + weight`` in float32; norms before and after
attention and MLP; per-head q/k norm, scale ``query_pre_attn_scalar ** -0.5``, no attention
soft cap (as HF); GeGLU; embedding times ``sqrt(hidden_size)``; sliding-window layers with
their own rope (``local_rope``) interleaved with global ones; optional final logit soft cap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.models import llama
from jaxllm.models.common import Family, KVCache, LayerContext, Params, attention_block, embed_tokens, gated_mlp
from jaxllm.models.config import ModelConfig

# Llama's names, but HF's post_attention_layernorm here normalises the attention output
# (the MLP has its own pre- and post-norms).
HF_LAYER_NAMES = {
    **llama.HF_LAYER_NAMES,
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
}


def layer_keys(cfg: ModelConfig) -> set[str]:
    """Pytree keys each layer must have under ``cfg``'s flags."""
    keys = {"attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm",
            "w_gate", "w_up", "w_down"}
    if cfg.qkv_bias:
        keys |= {"bq", "bk", "bv"}
    if cfg.o_bias:
        keys.add("bo")
    return keys


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF ``Gemma3RMSNorm``: ``x / rms(x) * (1 + weight)`` in float32, in x's dtype. x: [..., N]; weight: [N]."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def embed(params: Params, input_ids: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Embeddings times ``sqrt(hidden_size)`` in their dtype (HF ``Gemma3TextScaledWordEmbedding``): [T] -> [T, E]."""
    x = embed_tokens(params, input_ids, cfg)
    return x * jnp.asarray(cfg.hidden_size ** 0.5, dtype=x.dtype)


def decoder_layer(layer: dict[str, jax.Array], x: jax.Array, kv: KVCache,
                  ctx: LayerContext) -> tuple[jax.Array, KVCache]:
    """One Gemma 3 decoder layer (HF ``Gemma3DecoderLayer``). x: [T, E]."""
    eps = ctx.cfg.rms_norm_eps
    attn, kv = attention_block(layer, rms_norm(x, layer["attn_norm"], eps), kv, ctx, norm=rms_norm)
    x = x + rms_norm(attn, layer["post_attn_norm"], eps)
    mlp = gated_mlp(layer, rms_norm(x, layer["mlp_norm"], eps), ctx.cfg.hidden_act)
    return x + rms_norm(mlp, layer["post_mlp_norm"], eps), kv


def final_norm(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """:func:`rms_norm` of x [T, E] by ``final_norm``."""
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


FAMILY = Family(hf_layer_names=HF_LAYER_NAMES, layer_keys=layer_keys, layer=decoder_layer, embed=embed,
                final_norm=final_norm)
