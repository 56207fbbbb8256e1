"""The Llama family: Llama (incl. Llama 3 rope), Mistral, Qwen2, Qwen3, SmolLM2.

Follows HF ``modeling_llama.py`` / ``modeling_qwen3.py`` (float32 logits match ``transformers``).
"""

from __future__ import annotations

import jax

from jaxllm.models.common import Family, KVCache, LayerContext, attention_block, gated_mlp, rms_norm
from jaxllm.models.config import ModelConfig

HF_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.bias": ("bo", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "mlp.gate_proj.bias": ("b_gate", False),
    "mlp.up_proj.bias": ("b_up", False),
    "mlp.down_proj.bias": ("b_down", False),
}


def attention_keys(cfg: ModelConfig) -> set[str]:
    """Keys of the attention half of a layer under ``cfg``'s flags."""
    keys = {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm"}
    if cfg.qkv_bias:
        keys |= {"bq", "bk", "bv"}
    if cfg.o_bias:
        keys.add("bo")
    if cfg.qk_norm:
        keys |= {"q_norm", "k_norm"}
    return keys


def layer_keys(cfg: ModelConfig) -> set[str]:
    """Pytree keys each layer must have under ``cfg``'s flags."""
    keys = attention_keys(cfg) | {"w_gate", "w_up", "w_down"}
    if cfg.mlp_bias:
        keys |= {"b_gate", "b_up", "b_down"}
    return keys


def attention_residual(layer: dict[str, jax.Array], x: jax.Array, kv: KVCache,
                       ctx: LayerContext) -> tuple[jax.Array, KVCache]:
    """``x + attention(rms_norm(x))``. x: [T, E] -> ([T, E], the caches with this layer's K/V)."""
    attn, kv = attention_block(layer, rms_norm(x, layer["attn_norm"], ctx.cfg.rms_norm_eps), kv, ctx)
    return x + attn, kv


def decoder_layer(layer: dict[str, jax.Array], x: jax.Array, kv: KVCache,
                  ctx: LayerContext) -> tuple[jax.Array, KVCache]:
    """One Llama decoder layer (HF ``LlamaDecoderLayer``). x: [T, E]."""
    x, kv = attention_residual(layer, x, kv, ctx)
    return x + gated_mlp(layer, rms_norm(x, layer["mlp_norm"], ctx.cfg.rms_norm_eps), ctx.cfg.hidden_act), kv


FAMILY = Family(hf_layer_names=HF_LAYER_NAMES, layer_keys=layer_keys, layer=decoder_layer)
