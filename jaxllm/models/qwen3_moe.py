"""Qwen3-MoE (HF ``modeling_qwen3_moe.py``): the Qwen3 attention half (q/k
RMSNorm) and a sparse MoE MLP of ``num_experts`` SwiGLU experts of width
``moe_intermediate_size``, top ``num_experts_per_tok`` per token, their
softmax weights renormalised when ``norm_topk_prob`` (``moe.py`` runs it).
HF's Qwen3-MoE has no shared expert; models whose ``mlp_only_layers`` or
``decoder_sparse_step`` make some layers dense are rejected by
``ModelConfig`` (the layer scan needs one kind of MLP)."""

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
