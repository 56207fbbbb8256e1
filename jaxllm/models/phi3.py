"""Phi-3 (HF ``modeling_phi3.py``): the Llama layer; checkpoints fuse ``qkv_proj`` (``[q | k | v]``) and
``gate_up_proj`` (``[gate | up]``), which the loader splits (:func:`unfuse`); LongRoPE via ``RopeConfig``.
"""

from __future__ import annotations

from typing import Any

from jaxllm.models import llama
from jaxllm.models.common import Family
from jaxllm.models.config import ModelConfig

_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def unfuse(name: str, tensor: Any, cfg: ModelConfig) -> list[tuple[str, Any]]:
    """Split a fused Phi-3 tensor (HF ``[out, in]``, sliced on axis 0; numpy or lazy with ``rows(start, stop)``)
    into its parts' HF names; other tensors pass through.

    Raises:
      ValueError: fused rows that do not match the config's sizes.
    """
    if name not in _FUSED:
        return [(name, tensor)]
    q, kv, f = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    sizes = (q, kv, kv) if name.startswith("self_attn") else (f, f)
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"{name} has {tensor.shape[0]} rows; the config implies {' + '.join(map(str, sizes))}")
    parts, start = [], 0
    for part, size in zip(_FUSED[name], sizes):
        rows = tensor.rows(start, start + size) if hasattr(tensor, "rows") else tensor[start:start + size]
        parts.append((part, rows))
        start += size
    return parts


FAMILY = Family(hf_layer_names=llama.HF_LAYER_NAMES, layer_keys=llama.layer_keys, layer=llama.decoder_layer,
                unfuse=unfuse)
