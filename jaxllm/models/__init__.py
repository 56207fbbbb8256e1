"""The decoder families, one file each, and the model step dispatching on ``ModelConfig.model_type``.

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

Shared pieces live in ``common.py``; outside architectures join through :func:`register_model`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import jax
import numpy as np

from jaxllm import registry
from jaxllm.models import gemma3, llama, mixtral, phi3, qwen3_moe
from jaxllm.models.common import Family, KVCache, LayerContext, Params, compute_logits, loop_storage
from jaxllm.models.common import with_head_panels
from jaxllm.models.common import hidden_states as _hidden_states
from jaxllm.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from jaxllm.models.dense import dense_forward
from jaxllm.models.layout import layout_table, leaf_layout
from kernels_pallas.ops import AttentionOps

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

__all__ = ["FAMILIES", "AttentionOps", "Family", "KVCache", "LayerContext", "Params",
           "compute_logits", "dense_forward", "family", "forward", "hidden_states", "layout_table", "loop_storage",
           "param_layout", "register_model", "with_head_panels"]


def family(cfg: ModelConfig) -> Family:
    """The family running ``cfg.model_type``: built-in or registered by :func:`register_model`.

    Raises:
      ValueError: an unknown ``model_type``, or a registered import string that fails or names no ``Family``.
    """
    if cfg.model_type in FAMILIES:
        return FAMILIES[cfg.model_type]
    if registry.registered(cfg.model_type) is None:
        raise ValueError(f"model_type {cfg.model_type!r} has no family: jaxllm runs {sorted(FAMILIES)} and the "
                         f"registered {[r.model_type for r in registry.registrations()]}")
    found = registry.resolve_family(cfg.model_type)
    if not isinstance(found, Family):
        raise ValueError(f"model_type {cfg.model_type!r} is registered as {registry.registered(cfg.model_type).family!r}"
                         f", a {type(found).__name__}, not a jaxllm.models.Family")
    return found


def register_model(model_type: str, family: Union[Family, str], *, hf_architectures: Sequence[str] = ()) -> None:
    """Serve an architecture jaxllm does not ship (vLLM's ``ModelRegistry.register_model``).

    A HF folder whose config.json names one of ``hf_architectures`` (or, with none, ``model_type``) then
    loads into ``LLM``, ``jaxllm serve`` and ``jaxllm generate`` like a built-in model. Engine-core processes
    replay registrations as import strings (a ``Family`` defined in ``__main__`` serves in-process only).
    The protocol (config fields, weight layout, tracing rules) is in docs/models.md; in short, the family's
    ``layer(w, x [T, E], kv, ctx) -> (x, kv)`` gets the layer's leaves without ``L`` in the compute dtype and
    calls ``ctx.attend(q [T, Hq, D], k, v [T, Hkv, D], kv) -> ([T, Hq * D], kv)`` once, passing ``kv``
    untouched; it is traced once per bucket (no branching on values, padding rows must not mix in).

    Args:
      model_type: the HF ``model_type`` (not a built-in one).
      family: a ``Family`` or its import string ``"module:attr"`` (imported on first use, per process).
      hf_architectures: config.json ``architectures`` selecting this family; a string is one.

    Raises:
      ValueError: an empty or built-in ``model_type``, a bad ``family``, or an architecture already run
        by jaxllm or another registration.
    """
    if not isinstance(model_type, str) or not model_type or model_type in FAMILIES:
        raise ValueError(f"register_model: model_type={model_type!r} must be a non-empty string other than the "
                         f"built-in {sorted(FAMILIES)}")
    if not isinstance(family, Family) and not (isinstance(family, str) and family.count(":") == 1
                                               and all(family.split(":"))):
        raise ValueError(f"register_model({model_type!r}): family={family!r} must be a jaxllm.models.Family or "
                         "an import string 'module:attr'")
    archs = (hf_architectures,) if isinstance(hf_architectures, str) else tuple(hf_architectures)
    for arch in archs:
        owner = SUPPORTED_ARCHITECTURES.get(arch) or registry.architecture_owner(arch)
        if owner not in (None, model_type):
            raise ValueError(f"register_model({model_type!r}): architecture {arch!r} already runs model_type "
                             f"{owner!r}")
    registry.add(registry.Registration(model_type, family, archs))


def param_layout(cfg: ModelConfig, dtype: Any = np.float32, quantization: Optional[str] = None) -> dict:
    """Every leaf of ``cfg``'s pytree, path -> (shape, dtype) (what ``LLM(params=...)`` takes)."""
    return leaf_layout(cfg, family(cfg).layer_keys(cfg), dtype, quantization)


def hidden_states(params: Params, kv_cache: KVCache, batch: StepBatch, *, cfg: ModelConfig,
                  ops: AttentionOps, scaled_pool: Any = None) -> tuple[jax.Array, KVCache]:
    """``common.hidden_states`` of ``cfg``'s family: hidden ``[T, hidden_size]`` and the caches with this step's K/V."""
    return _hidden_states(params, kv_cache, batch, cfg=cfg, ops=ops, family=family(cfg), scaled_pool=scaled_pool)


def forward(
    params: Params,
    kv_cache: KVCache,
    batch: StepBatch,
    *,
    cfg: ModelConfig,
    ops: AttentionOps,
    all_logits: bool = False,
) -> tuple[jax.Array, KVCache]:
    """One model step: :func:`hidden_states`, then :func:`compute_logits` of rows ``batch.logits_indices: int32[S]``.

    May run C++ kernels (no derivative; ``dense_forward`` is the differentiable forward).

    Args:
      params, kv_cache, batch, cfg, ops: as :func:`hidden_states`.
      all_logits: logits for every token row instead of ``logits_indices``.

    Returns:
      (logits float32 ``[S, vocab]`` (``[T, vocab]`` with ``all_logits``), the caches with this step's K/V).
    """
    hidden, kv_cache = hidden_states(params, kv_cache, batch, cfg=cfg, ops=ops)
    if not all_logits:
        hidden = hidden[batch.logits_indices]
    return compute_logits(params, hidden, cfg=cfg, native_kernels=True), kv_cache
