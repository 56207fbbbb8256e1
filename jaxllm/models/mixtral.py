"""Mixtral (HF ``modeling_mixtral.py``): the Llama attention half and ``moe.py``'s sparse MoE MLP."""

from __future__ import annotations

from jaxllm.models import llama, moe
from jaxllm.models.common import Family

HF_LAYER_NAMES = {
    **{name: key for name, key in llama.HF_LAYER_NAMES.items() if not name.startswith("mlp.")},
    "block_sparse_moe.gate.weight": ("router", True),
    "block_sparse_moe.experts.*.w1.weight": ("experts_gate", True),
    "block_sparse_moe.experts.*.w3.weight": ("experts_up", True),
    "block_sparse_moe.experts.*.w2.weight": ("experts_down", True),
}

FAMILY = Family(hf_layer_names=HF_LAYER_NAMES, layer_keys=moe.layer_keys, layer=moe.decoder_layer)
