"""Qwen3-MoE (HF ``modeling_qwen3_moe.py``): the Qwen3 attention half and ``moe.py``'s sparse MoE MLP.

No shared expert; configs with dense layers are rejected by ``ModelConfig``.
"""

from __future__ import annotations

from jaxllm.models import llama, moe
from jaxllm.models.common import Family

HF_LAYER_NAMES = {
    **{name: key for name, key in llama.HF_LAYER_NAMES.items() if not name.startswith("mlp.")},
    "mlp.gate.weight": ("router", True),
    "mlp.experts.*.gate_proj.weight": ("experts_gate", True),
    "mlp.experts.*.up_proj.weight": ("experts_up", True),
    "mlp.experts.*.down_proj.weight": ("experts_down", True),
}

FAMILY = Family(hf_layer_names=HF_LAYER_NAMES, layer_keys=moe.layer_keys, layer=moe.decoder_layer)
