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
