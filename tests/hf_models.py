"""Tiny randomly initialised HF models saved with ``save_pretrained`` (test helpers)."""

from __future__ import annotations

from pathlib import Path

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

ARCH_OVERRIDES = {
    "llama": dict(),
    "llama3": dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=16),
                   tie_word_embeddings=True),
    "mistral": dict(sliding_window=8),
    "qwen2": dict(),
    "qwen3": dict(),
    # 5 layers: (local, global) twice then a local one; a window shorter than the prompt; a global rope
    # with linear scaling; a final logit soft cap; an attention soft cap, which HF's Gemma 3 ignores;
    # query_pre_attn_scalar unlike head_dim.
    "gemma3": dict(num_hidden_layers=5, sliding_window=4, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"],
                   rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                                    "sliding_attention": dict(rope_type="default", rope_theta=1e4)},
                   attn_logit_softcapping=30.0, final_logit_softcapping=20.0, tie_word_embeddings=True,
                   pad_token_id=0),
    # LongRoPE with its short factors (sequences up to 29 < 64 tokens), a partial rotary embedding.
    "phi3": dict(rope_scaling=dict(type="su", short_factor=[1.0, 1.5, 2.0, 4.0],
                                   long_factor=[2.0, 3.0, 5.0, 8.0], original_max_position_embeddings=64),
                 partial_rotary_factor=0.5, original_max_position_embeddings=64, pad_token_id=0),
    # LongRoPE's long factors: every forward pass here sees more than 4 tokens.
    "phi3_long": dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 8,
                                        long_factor=[1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                                        original_max_position_embeddings=4),
                      original_max_position_embeddings=4, pad_token_id=0),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=False),
}


def make_tiny_hf_model(arch: str, folder: Path, seed: int = 0, **overrides):
    """Build, save (safetensors) and return a tiny float32 HF causal LM."""
    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "phi3_long": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    config = config_cls(**{**TINY, **ARCH_OVERRIDES[arch], **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval().to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model
