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
gated MLP, the scan over stacked layers and the logits. An architecture from
outside jaxllm joins them through :func:`register_model`.
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
    """The family that runs ``cfg`` (by its ``model_type``): a built-in one, or one :func:`register_model` added.

    Raises:
      ValueError: a ``model_type`` nothing runs, or a registered import string that does not import or names
        something other than a ``Family`` (named).
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

    After ``register_model("my_gptj", "my_pkg.gptj:FAMILY", hf_architectures=["MyGPTJForCausalLM"])``, a HF
    folder whose config.json names that architecture (or, when ``hf_architectures`` is empty, that
    ``model_type``) loads into ``LLM``, ``jaxllm serve`` and ``jaxllm generate`` like a built-in model, with the
    paged KV cache, prefix caching, chunked prefill, preemption, sampling and structured output.

    Registrations reach the engine-core processes (``jaxllm serve``, ``data_parallel_size > 1``) as import
    strings, replayed there; a ``Family`` object is found by its module (the one defining its ``layer``), so
    one defined in ``__main__`` serves in-process only. A package can instead register from an entry point of
    the group ``jaxllm.general_plugins`` (``jaxllm.registry``), which every process calls before it reads a
    model.

    The protocol (``jaxllm.models.common`` has the built-in families' pieces to reuse: ``project``,
    ``linear``, ``rms_norm``, ``gated_mlp``, ``attention_block``):

    * Config: config.json (through ``Family.hf_config`` when it names them otherwise) gives
      ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers`` and
      ``num_attention_heads``; optionally ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps`` (the
      epsilon of whatever norm the family uses), ``rope_theta``/``rope_scaling``/``partial_rotary_factor``,
      ``max_position_embeddings``, ``tie_word_embeddings``, ``sliding_window``, ``hidden_act`` (read by the
      family as it likes), ``bos_token_id``/``eos_token_id``. ``ModelConfig.from_hf_config`` names what is missing.
    * Weights: every layer leaf is stacked ``[L, ...]`` (``L = num_hidden_layers``), dense weights ``[in, out]``
      (``transpose=True`` in ``hf_layer_names`` turns HF's ``[out, in]`` around); the top level holds at least
      ``embed: [V, E]`` and ``final_norm``, and ``lm_head: [E, V]`` unless tied (the logits are
      ``jaxllm.models.compute_logits``: no lm_head bias). Leaf names outside ``PARAM_AXES`` are replicated
      under tensor parallelism unless ``Family.param_axes`` declares their axes; weight-only quantization
      covers the shared projection names (``wq``, ``wk``, ``wv``, ``wo``, ``w_gate``, ``w_up``, ``w_down``).
    * Layer: ``layer(w, x, kv, ctx) -> (x, kv)`` with ``w`` this layer's leaves (dict of arrays without the
      ``L`` axis, in the compute dtype: float32 on CPU, bfloat16 on accelerators), ``x: [T, E]`` the step's
      tokens (prefill chunks and decode rows of several sequences, concatenated, padded to the bucket ``T``),
      ``kv`` the paged caches, to be passed through ``ctx.attend`` untouched, and ``ctx`` a
      ``LayerContext``. ``ctx.attend(q, k, v, kv)`` (q ``[T, Hq, D]``, k, v ``[T, Hkv, D]``, x's dtype) ropes
      q and k (``cfg.rope``), writes k and v into the cache at each token's slot and attends causally over
      each sequence's cached tokens with scale ``cfg.attention_scale``; it returns ``([T, Hq * D], kv)``.
      Call it once per layer. ``ctx.cfg`` is the ``ModelConfig``; ``ctx.batch.positions: int32[T]`` each
      token's position.
    * Tracing: the layer is traced once per step bucket (inside ``jax.jit`` and a ``lax.scan`` over the
      layers): no Python branching on array values (``jnp.where``, ``lax.cond``), no host callbacks or
      prints of values, no shapes that depend on values (each step's shapes are fixed by its bucket). Rows
      past the real tokens are padding: they must not mix into real rows (only ``ctx.attend`` mixes tokens).
      Python branching on ``ctx.cfg`` fields (static) is fine.

    Args:
      model_type: the HF ``model_type`` of the architecture (not a built-in one).
      family: a ``Family``, or the import string ``"module:attr"`` of one (imported on first use, in every
        process that runs the model).
      hf_architectures: config.json ``architectures`` entries that select this family (not a built-in's); a
        string is one architecture.

    Raises:
      ValueError: an empty or built-in ``model_type``, a family that is neither a ``Family`` nor
        ``"module:attr"``, or an architecture jaxllm or another registered model_type already runs (named).
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
    """Every leaf of ``cfg``'s parameter pytree, path -> (shape, dtype): ``layout.leaf_layout`` over its family's
    layer keys (what ``LLM(params=...)`` takes and ``LLM.get_params()`` gives)."""
    return leaf_layout(cfg, family(cfg).layer_keys(cfg), dtype, quantization)


def hidden_states(params: Params, kv_cache: KVCache, batch: StepBatch, *, cfg: ModelConfig,
                  ops: AttentionOps, compressed: Any = None) -> tuple[jax.Array, KVCache]:
    """``common.hidden_states`` of ``cfg``'s family: the decoder up to the final
    norm, hidden ``[T, hidden_size]``, and the caches with this step's K/V
    (``compressed``: the pool of compressed KV blocks, or None)."""
    return _hidden_states(params, kv_cache, batch, cfg=cfg, ops=ops, family=family(cfg), compressed=compressed)


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
    the rows at ``batch.logits_indices: int32[S]`` (on the CPU, both on the
    C++ kernels where the ops table picks them, which have no derivative:
    ``dense_forward`` is the differentiable forward).

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
    return compute_logits(params, hidden, cfg=cfg, native_kernels=True), kv_cache
