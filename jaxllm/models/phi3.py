"""Phi-3 (HF ``modeling_phi3.py``): a Llama layer whose checkpoints fuse the
q/k/v projections (``qkv_proj``, rows ``[q | k | v]``) and the gate/up
projections (``gate_up_proj``, rows ``[gate | up]``), with LongRoPE ("su")
scaling in its long-context configs and optionally a partial rotary
embedding (``RopeConfig``; ``common.rope_cos_sin``).

The loader splits the fused tensors (:func:`unfuse`), so every device keeps
the Megatron split of separate q/k/v and gate/up weights
(``jaxllm.worker.sharding``) and the step is the Llama one.
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
    """Split a fused Phi-3 tensor (HF ``[out, in]``) into its parts' HF names;
    any other tensor passes through. ``tensor`` is sliced on its first axis
    (numpy, or a lazy tensor with ``rows(start, stop)``).

    Raises:
      ValueError: a fused tensor whose rows do not match the config's sizes.
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
