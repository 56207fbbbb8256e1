"""The decoder families, one file each, and the model step that dispatches on
``ModelConfig.model_type``.

=============  =========================================  ===========================
model_type     family file                                HF architectures
=============  =========================================  ===========================
llama          ``llama.py``                               LlamaForCausalLM (SmolLM2)
mistral        ``llama.py``                               MistralForCausalLM
qwen2, qwen3   ``llama.py``                               Qwen2/Qwen3ForCausalLM
phi3           ``phi3.py`` (the Llama layer)              Phi3ForCausalLM
gemma3_text    ``gemma3.py``                              Gemma3ForCausalLM
mixtral        ``mixtral.py`` (``moe.py``)                MixtralForCausalLM
qwen3_moe      ``qwen3_moe.py`` (``moe.py``)              Qwen3MoeForCausalLM
=============  =========================================  ===========================

``common.py`` holds what they share: norms, rope, the attention block, the
gated MLP, the scan over stacked layers and the logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import jax
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.models import gemma3, llama, mixtral, phi3, qwen3_moe
from jaxllm.models.common import Family, KVCache, Params, compute_logits, loop_storage
from jaxllm.models.common import hidden_states as _hidden_states
from jaxllm.models.layout import layout_table, leaf_layout
from kernels_pallas import AttentionOps

if TYPE_CHECKING:
    from jaxllm.worker.step_batch import StepBatch

FAMILIES: dict[str, Family] = {
    "llama": llama.FAMILY,
    "mistral": llama.FAMILY,
    "qwen2": llama.FAMILY,
    "qwen3": llama.FAMILY,
    "phi3": phi3.FAMILY,
    "gemma3_text": gemma3.FAMILY,
    "mixtral": mixtral.FAMILY,
    "qwen3_moe": qwen3_moe.FAMILY,
}

__all__ = ["FAMILIES", "AttentionOps", "Family", "KVCache", "Params", "compute_logits", "family", "forward",
           "hidden_states", "layout_table", "loop_storage", "param_layout"]


def family(cfg: ModelConfig) -> Family:
    """The family that runs ``cfg`` (by its ``model_type``)."""
    return FAMILIES[cfg.model_type]


def param_layout(cfg: ModelConfig, dtype: Any = np.float32, quantization: Optional[str] = None) -> dict:
    """Every leaf of ``cfg``'s parameter pytree, path -> (shape, dtype): ``layout.leaf_layout`` over its family's
    layer keys (what ``LLM(params=...)`` takes and ``LLM.get_params()`` gives)."""
    return leaf_layout(cfg, family(cfg).layer_keys(cfg), dtype, quantization)


def hidden_states(params: Params, kv_cache: KVCache, batch: StepBatch, *, cfg: ModelConfig,
                  ops: AttentionOps) -> tuple[jax.Array, KVCache]:
    """``common.hidden_states`` of ``cfg``'s family: the decoder up to the final
    norm, hidden ``[T, hidden_size]``, and the caches with this step's K/V."""
    return _hidden_states(params, kv_cache, batch, cfg=cfg, ops=ops, family=family(cfg))


def forward(
    params: Params,
    kv_cache: KVCache,
    batch: StepBatch,
    *,
    cfg: ModelConfig,
    ops: AttentionOps,
    all_logits: bool = False,
) -> tuple[jax.Array, KVCache]:
    """One model step: :func:`hidden_states`, then :func:`compute_logits` of
    the rows at ``batch.logits_indices: int32[S]``.

    Args:
      params, kv_cache, batch, cfg, ops: as :func:`hidden_states`.
      all_logits: return logits for every token row instead of ``logits_indices``.

    Returns:
      (logits, kv_cache): logits float32 ``[S, vocab]`` (``[T, vocab]`` with
      ``all_logits``), and the caches with this step's K/V written.
    """
    hidden, kv_cache = hidden_states(params, kv_cache, batch, cfg=cfg, ops=ops)
    if not all_logits:
        hidden = hidden[batch.logits_indices]
    return compute_logits(params, hidden, cfg=cfg), kv_cache
