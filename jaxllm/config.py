"""Model and engine configuration.

``ModelConfig`` is read from a Hugging Face ``config.json`` dict (or the
equivalent dict the GGUF loader builds); it keeps only what the decoders of
``jaxllm.models`` need and rejects what they cannot run. ``EngineConfig`` holds the
serving knobs, named as vLLM names them; the scheduler's share of them is built from it
(``EngineConfig.scheduler_config``), never copied by hand.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Optional, Sequence, Union

from jaxllm import registry
from jaxllm.core.kv_events import KVEventsConfig
from jaxllm.spec_decode.config import SpeculativeConfig
from scheduler.buckets import geometric_ladder, half_step_ladder
from scheduler.config import SchedulerConfig
from scheduler.degradation import GracefulDegradation

# HF architecture -> model_type (the key of its family in ``jaxllm.models``).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# The other way, for a config.json without ``architectures`` (transformers writes ``null`` when it saves a model it
# loaded from a GGUF): each model_type names its causal LM, as transformers' and vLLM's registries map it.
ARCHITECTURE_OF_MODEL_TYPE = {model_type: arch for arch, model_type in SUPPORTED_ARCHITECTURES.items()}
# HF ``hidden_act`` names of the gated MLP's activation that the models implement.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# The config.json fields a registered architecture must have (``jaxllm.models.register_model``).
REGISTERED_MODEL_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF ``rope_parameters`` / ``rope_scaling``).

    rope_type: "default", "linear" (positions divided by ``factor``),
      "llama3" (Llama 3.1 frequency-dependent scaling) or "longrope" (Phi-3's
      "su"/LongRoPE: per-frequency ``short_factor`` divisors, ``long_factor``
      ones for a sequence longer than ``original_max_position_embeddings``,
      and cos/sin scaled by ``attention_factor``).
    partial_rotary_factor: the fraction of each head's dimensions rotated
      (the first ones; the rest pass through), as HF.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    partial_rotary_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape and flags of a decoder of ``jaxllm.models``.

    One class covers every family: ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3,
    Qwen3-MoE, Gemma 3), ``sliding_windows`` (Mistral, Phi-3, or per-layer
    ``layer_types``: Gemma 3's local layers), rope scaling (Llama 3, Phi-3's
    LongRoPE), ``local_rope`` (the rope of Gemma 3's sliding-window layers),
    ``hidden_act`` (SwiGLU or Gemma's GeGLU), ``query_pre_attn_scalar`` and the
    final logit soft cap (Gemma; HF's Gemma 3 attention ignores
    ``attn_logit_softcapping``, and so does jaxllm), the experts (Mixtral,
    Qwen3-MoE: ``num_experts > 0``; ``moe_intermediate_size`` is each
    expert's FFN width), tied embeddings.
    Follows the fields of the HF ``*Config`` classes of these models. A registered
    architecture (``jaxllm.models.register_model``) fills the same fields; its family
    reads ``hidden_act`` as it likes and ``rms_norm_eps`` as its norms' epsilon.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[Optional[int], ...] = ()
    local_rope: Optional[RopeConfig] = None
    hidden_act: str = "silu"
    query_pre_attn_scalar: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: Optional[str] = None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], generation_config: Optional[dict[str, Any]] = None) -> "ModelConfig":
        """Build from a HF ``config.json`` dict and, when the model has one,
        its ``generation_config.json`` dict.

        ``eos_token_ids`` is every ``eos_token_id`` (an int or a list) of
        ``generation_config`` then ``cfg``, without repeats, as vLLM stops on
        the generation config's eos ids besides the model's.

        The family is the first of ``architectures`` in
        ``SUPPORTED_ARCHITECTURES`` or registered (``jaxllm.models.register_model``,
        after the ``jaxllm.general_plugins`` have run); a config without
        ``architectures`` (absent, null or empty), or naming none of them, is
        named by its ``model_type`` alone (``ARCHITECTURE_OF_MODEL_TYPE``, or a
        model_type registered without architectures). A registered family's
        ``hf_config`` maps the dict first.

        Raises:
          ValueError: an architecture nothing runs, or without architectures a
            ``model_type`` none of them has (both name the supported ones), an
            unsupported activation or rope type, heads that do not divide, a
            mixture-of-experts model whose layers are not all MoE layers, or a
            registered architecture's config without ``REGISTERED_MODEL_FIELDS``
            (the missing ones named).
        """
        arch, model_type = _architecture_from_hf(cfg)
        if model_type not in ARCHITECTURE_OF_MODEL_TYPE:
            cfg = _registered_hf_config(cfg, model_type)
        gemma = model_type == "gemma3_text"
        act = cfg.get("hidden_activation" if gemma else "hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        if act not in ACTIVATIONS and model_type in ARCHITECTURE_OF_MODEL_TYPE:
            raise ValueError(f"unsupported hidden_act {act!r}: the gated MLP implements {list(ACTIVATIONS)}")
        if gemma and cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True (Gemma 3 as an encoder) is not supported: "
                             "jaxllm runs causal decoders")
        hidden = int(cfg["hidden_size"])
        num_q_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_q_heads)
        if num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_q_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        head_dim = int(cfg.get("head_dim") or hidden // num_q_heads)
        num_layers = int(cfg["num_hidden_layers"])
        qkv_bias = bool(cfg.get("attention_bias") or False) or model_type == "qwen2"
        rope, local_rope = _ropes_from_hf(cfg, model_type)
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            qkv_bias=qkv_bias,
            o_bias=bool(cfg.get("attention_bias") or False) and model_type != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias") or False),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            sliding_windows=_sliding_windows_from_hf(cfg, model_type, num_layers),
            local_rope=local_rope,
            hidden_act=act,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256) if gemma else None,
            final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping")),
            **_experts_from_hf(cfg, model_type, num_layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_token_ids(generation_config or {}, cfg),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    @property
    def attention_scale(self) -> float:
        """The factor of q.k before the softmax: ``query_pre_attn_scalar ** -0.5``
        (Gemma), else ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, per byte of dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def eos_token_ids(*configs: dict[str, Any]) -> tuple[int, ...]:
    """The ``eos_token_id`` entries (each an int, a list of ints, or None) of
    HF config dicts, in order, without repeats."""
    ids: dict[int, None] = {}
    for cfg in configs:
        eos = cfg.get("eos_token_id")
        for e in eos if isinstance(eos, (list, tuple)) else [eos]:
            if e is not None:
                ids[int(e)] = None
    return tuple(ids)


def _optional_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def _architecture_from_hf(cfg: dict[str, Any]) -> tuple[str, str]:
    """(architecture, model_type) that runs a HF config dict (see ``ModelConfig.from_hf_config``)."""
    registry.load_general_plugins()
    archs = cfg.get("architectures") or []
    for arch in archs:
        model_type = SUPPORTED_ARCHITECTURES.get(arch) or registry.architecture_owner(arch)
        if model_type is not None:
            return arch, model_type
    model_type = cfg.get("model_type")
    own = registry.registered(model_type) if isinstance(model_type, str) else None
    if own is not None and not own.hf_architectures:
        return (archs[0] if archs else model_type), model_type
    runs = sorted(SUPPORTED_ARCHITECTURES) + [a for r in registry.registrations() for a in r.hf_architectures]
    if archs:
        raise ValueError(f"unsupported architecture {archs!r}: jaxllm runs {runs} (jaxllm.register_model adds one)")
    if model_type not in ARCHITECTURE_OF_MODEL_TYPE:
        raise ValueError(f"unsupported model_type {model_type!r} (config.json names no architectures): jaxllm "
                         f"runs model_type {sorted(ARCHITECTURE_OF_MODEL_TYPE)}")
    return ARCHITECTURE_OF_MODEL_TYPE[model_type], model_type


def _registered_hf_config(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A registered architecture's config dict, mapped by its family's ``hf_config``, with every
    :data:`REGISTERED_MODEL_FIELDS` (ValueError naming the missing ones)."""
    mapping = getattr(registry.resolve_family(model_type), "hf_config", None)
    mapped = mapping(dict(cfg)) if mapping is not None else cfg
    missing = [name for name in REGISTERED_MODEL_FIELDS if mapped.get(name) is None]
    if missing:
        raise ValueError(f"config.json of the registered model_type {model_type!r} lacks {missing}: a registered "
                         f"architecture's config needs {list(REGISTERED_MODEL_FIELDS)} (Family.hf_config can map "
                         "its own names to them)")
    return mapped


def _ropes_from_hf(cfg: dict[str, Any], model_type: str) -> tuple[RopeConfig, Optional[RopeConfig]]:
    """(the rope of every layer, or of the global ones; the rope of sliding-window
    layers when it differs: Gemma 3's ``sliding_attention`` entry or
    ``rope_local_base_freq``, 10000 by default)."""
    params = cfg.get("rope_parameters") or {}
    if model_type != "gemma3_text":
        return _rope_from_hf(cfg, {**(cfg.get("rope_scaling") or {}), **params}, model_type), None
    if "full_attention" in params or "sliding_attention" in params:  # transformers >= 5 writes them per layer type
        global_params = params.get("full_attention") or {}
        local_params = params.get("sliding_attention") or {}
    else:
        global_params = {**(cfg.get("rope_scaling") or {}), **params}
        local_params = {"rope_theta": cfg.get("rope_local_base_freq") or 10000.0}
    global_params = {"rope_theta": cfg.get("rope_theta") or 1_000_000.0, **global_params}
    return _rope_from_hf(cfg, global_params, model_type), _rope_from_hf(cfg, local_params, model_type)


def _rope_from_hf(cfg: dict[str, Any], params: dict[str, Any], model_type: str) -> RopeConfig:
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    partial = float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "su" or (model_type == "phi3" and rope_type == "yarn"):
        rope_type = "longrope"  # their old names, as HF's Phi3Config reads them
    if rope_type == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]),
                          partial_rotary_factor=partial)
    if rope_type == "llama3":
        return RopeConfig(
            theta=theta,
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
            partial_rotary_factor=partial,
        )
    if rope_type == "longrope":
        # HF's _compute_longrope_parameters: a top-level original_max_position_embeddings (Phi-3) wins.
        original = int(cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                       or cfg["max_position_embeddings"])
        factor = params.get("factor") or cfg["max_position_embeddings"] / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeConfig(
            theta=theta, rope_type="longrope", factor=float(factor), original_max_position_embeddings=original,
            short_factor=tuple(float(f) for f in params["short_factor"]),
            long_factor=tuple(float(f) for f in params["long_factor"]),
            attention_factor=float(attention_factor), partial_rotary_factor=partial,
        )
    raise ValueError(f"unsupported rope_type {rope_type!r}: jaxllm implements 'default', 'linear', 'llama3', "
                     "'longrope' (or 'su')")


def _experts_from_hf(cfg: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields of ``ModelConfig`` (none for a dense model).

    The decoder scans one stacked layer, so every layer must be a MoE layer:
    Qwen3-MoE configs whose ``mlp_only_layers`` or ``decoder_sparse_step``
    make some layers dense are rejected.
    """
    if model_type == "mixtral":
        return dict(num_experts=int(cfg.get("num_local_experts", 8)),
                    num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    if model_type != "qwen3_moe":
        return {}
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = sorted(set(cfg.get("mlp_only_layers") or []) | {i for i in range(num_layers) if (i + 1) % step})
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes the latter
    if dense or not num_experts:
        raise ValueError(f"Qwen3-MoE layers {dense or 'all'} are dense (mlp_only_layers, decoder_sparse_step="
                         f"{step}, num_experts={num_experts}): jaxllm runs models whose layers are all MoE layers")
    return dict(num_experts=int(num_experts), num_experts_per_tok=int(cfg.get("num_experts_per_tok", 8)),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 768)),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def _sliding_windows_from_hf(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[Optional[int], ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if model_type == "gemma3_text" and not layer_types:
        # HF's Gemma3TextConfig: every sliding_window_pattern-th layer is global (default 6: 5 local, 1 global).
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if layer_types:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries, expected num_hidden_layers={num_layers}")
        return tuple(int(window) if t == "sliding_attention" and window else None for t in layer_types)
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = None
    return tuple(int(window) if window else None for _ in range(num_layers))


# Weight-only quantizations and KV cache dtypes (jaxllm.worker.quantization), by vLLM's names.
WEIGHT_QUANTIZATIONS = ("int8", "fp8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")
# EngineConfig.kv_cache_compression: the one-byte types compressed KV blocks are re-encoded in.
KV_COMPRESSION_DTYPES = ("int8", "fp8")
# SchedulerConfig fields that EngineConfig.scheduler_config fills in itself (enable_kv_cache_events from
# kv_events_config, the rest at start-up); every other one is an
# EngineConfig field of the same name (a test checks both).
SCHEDULER_FIELDS_FROM_START_UP = ("num_blocks", "max_model_len", "num_lookahead_tokens", "enable_kv_cache_events",
                                  "num_offload_blocks", "num_compressed_blocks")
# Token buckets below the default ladder's first value (16): steps of a few decode rows.
SMALL_TOKEN_BUCKETS = (4, 8)
# "vllm": the metrics under vLLM's names and labels (jaxllm.frontend.metrics).
METRICS_NAMESPACES = ("jaxllm", "vllm")


@dataclasses.dataclass
class EngineConfig:
    """Serving configuration, vLLM's names and meanings.

    Attributes:
      block_size: tokens per KV block.
      num_kv_blocks: force the number of KV blocks (block 0, the null block,
        included); None sizes it from ``kv_cache_memory_bytes``.
      kv_cache_memory_bytes: device bytes for the KV cache (all layers, K+V).
      max_num_seqs: sequences per step at most.
      max_num_batched_tokens: tokens per step at most (the token budget).
      max_model_len: prompt + output tokens per request at most. None: the
        model's ``max_position_embeddings``, or, when the KV cache is sized
        from ``kv_cache_memory_bytes`` (or its default) and holds no sequence
        that long, the longest it holds, with a warning naming both (vLLM's
        ``max_model_len=-1``). A value the cache cannot hold is an error naming
        the largest that fits.
      dtype: "auto", "float32", "bfloat16" or "float16" (compute, and the KV
        cache unless ``kv_cache_dtype`` quantizes it).
      quantization: None, "int8" or "fp8": weight-only quantization of the
        dense projections and an untied lm_head, per output channel
        (``jaxllm.worker.quantization``); an orbax checkpoint converted quantized is
        served as it was converted.
      kv_cache_dtype: "auto" (the compute dtype), "int8", or "fp8" /
        "fp8_e4m3" (float8_e4m3fn): the KV cache's numbers, quantized with
        per-layer, per-head scales calibrated at start-up (vLLM's name).
      seed: engine seed for requests without their own.
      attention_backend: "pallas", "xla", "reference" or None (pallas on GPU, xla
        elsewhere; see ``kernels_pallas.ops.get_attention_ops``).
      interpret: run Pallas kernels in interpret mode (CPU testing).
      token_buckets, seq_buckets, width_buckets: explicit bucket ladders
        (T tokens, S rows, W block-table width); None derives each from the
        limits (see :meth:`bucket_ladders`); each must reach its limit.
      precompile: when to build the step programs: ``True`` every bucket at
        start-up; ``"background"`` the largest token bucket and the smallest
        of at least 16 tokens at start-up and the rest in a background thread, each program once the engine
        has been idle a second (or busy 15 s without a pause: ``worker.model_runner.IDLE_SECONDS``), so a
        short script neither shares the CPU with compiles nor waits for one at exit (a step pads up to a
        ready bucket meanwhile, so none waits on a compile); ``False`` each bucket on first use (logged
        while the step waits).
      async_scheduling: schedule step N+1 while the device runs step N
        (outputs are identical; see ``LLMEngine.step``). None (the default,
        as in vLLM): on, unless ``speculative_config`` is set; resolved here,
        the one place that decides it. True with ``speculative_config`` is a
        ValueError: a step's drafts need the previous step's tokens. A step
        holding a row whose multi-token ``bad_words`` or grammar need the
        token the step in flight samples for it waits for that token first;
        other steps keep the overlap.
      compilation_cache: folder of JAX's persistent compilation cache;
        "default" is ``<jaxllm cache>/xla``, None turns it off.
      tensor_parallel_size: devices one model step is split over (Megatron
        tensor parallelism, see ``jaxllm.worker.sharding``); must divide the model's
        q heads, and its KV heads must divide it or be divisible by it.
      data_parallel_size: engine replicas, each with its own scheduler and
        KV cache on ``tensor_parallel_size`` devices, one engine-core process
        each (``jaxllm.core.client.MPClient``).
      batching: "continuous", or "static" (a new batch of up to
        ``max_num_seqs`` requests starts only when the previous one has
        finished entirely; the baseline for benchmarks).
      log_stats: log a one-line stats summary to stderr every 5 seconds.
      metrics_port: serve the Prometheus metrics on this port (None: don't).
      metrics_namespace: "jaxllm", or "vllm": the series vLLM also has under vLLM 0.32's names, each series
        with vLLM's ``model_name`` label (``jaxllm.frontend.metrics``).
      speculative_config: speculative decoding, a dict (or its JSON text)
        as vLLM's: ``{"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_min": .., "prompt_lookup_max": ..}`` or
        ``{"method": "draft_model", "model": PATH, "num_speculative_tokens":
        k}``; held as a ``spec_decode.SpeculativeConfig`` once checked. None:
        off (see ``async_scheduling``). A draft model's
        weights and KV cache (as many blocks as the target's, in the compute
        dtype, unquantized) come on top of the memory the target's blocks were
        sized for (``kv_cache_memory_bytes`` or its default share of the
        device): on an accelerator with a large draft, set
        ``kv_cache_memory_bytes`` or ``num_kv_blocks`` to leave room.
      graceful_degradation: under KV pressure (few free blocks, or
        preemptions), lower the effective ``max_num_seqs`` and prefill token
        budget step by step and restore them when calm, instead of thrashing
        (``scheduler.degradation``). True: the default thresholds; False: off;
        a dict (or its JSON text, as the CLI passes it) of
        ``GracefulDegradation`` fields, e.g. ``{"low_free_fraction": 0.2,
        "recover_steps": 4}``: those thresholds (the rest default). Held as
        True, False or a ``GracefulDegradation`` once checked.
      aging_rate: for ``scheduling_policy="aging"``: priority units a waiting
        request gains per second, >= 0.
      reserve_predicted_output: admit a request beside running ones only when
        the free KV blocks also hold every running request's predicted output
        (``SchedulerConfig.reserve_predicted_output``); off by default.
      preload_prompts: a file of common prompts (a ``.json`` list of strings,
        or text with one prompt per line) computed at start-up so the first
        request sharing one hits the prefix cache (``jaxllm.frontend.prefix_warmup``).
      kv_events_config: publish the prefix cache's stored and evicted blocks, vLLM's ``--kv-events-config``: a
        dict (or its JSON text) of ``jaxllm.core.kv_events.KVEventsConfig`` fields, e.g.
        ``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}``;
        held as a ``KVEventsConfig`` once checked. None: off.
      max_waiting_requests: shed load: refuse a new request
        (``jaxllm.core.client.QueueFullError``; 503 at the server) while this
        many sequences or more wait for a batch seat. None: no limit.
      kv_offloading_size: GiB of host memory for a host tier of the prefix cache (vLLM's
        ``--kv-offloading-size`` with its native backend; ``scheduler.host_tier``), >= 0; 0 (the default): no
        tier. A hashed block about to be reused on the device is copied there first, and a prefix missing on the
        device is loaded back from there instead of recomputed. Holds ``GiB * 2**30 // bytes per block`` blocks
        (all layers, K and V, in the KV cache's dtype); a draft model's runner keeps as many blocks of its own
        KV beside them. Needs ``enable_prefix_caching``.
      kv_offloading_prefetch: load the host-tier hits of the requests at the head of the waiting queue a step
        before their admission, into free blocks (cached ones offloaded first, never the requests' own hits;
        ``SchedulerConfig``'s field of the name). Off by default: ``scripts/bench_multiturn.py`` measures it no
        better than loading on admission (README). Needs ``kv_offloading_size > 0``.
      kv_cache_compression: None (the default: ``scripts/bench_kv_compression.py`` measures it, README), "int8"
        or "fp8" (float8_e4m3fn): when free KV blocks run short, before preempting, the scheduler re-encodes full
        blocks of running requests in this one-byte type, with a scale per block and KV head, into a second
        pool and frees their blocks (``scheduler.compressed_pool``; the attention reads each block in its own
        dtype). Requests with ``SamplingParams(allow_kv_compression=False)`` or ``priority < 0`` are never
        compressed. Needs ``kv_cache_dtype="auto"`` and the xla or reference attention; not with
        ``speculative_config``, ``preemption_mode="swap"``, ``kv_offloading_size``, ``tensor_parallel_size > 1``
        or ``batching="static"``, nor with ``kv_cache_compact``/``kv_cache_resize``.
      kv_cache_compression_fraction: with ``kv_cache_compression``, the share of the KV budget
        (``kv_cache_memory_bytes``, its default, or ``num_kv_blocks`` blocks of the cache's dtype) given to the
        compressed pool, in (0, 1); the device blocks get the rest, so both pools together take the budget
        (``worker.kv_cache.split_kv_budget``). 0.5 measured better than 0.25 (README).
      enable_sleep_mode: allow ``sleep()`` / ``wake_up()`` (vLLM's flag;
        ``jaxllm.core.engine_core.EngineCore.sleep``); without it sleep is
        refused, naming this flag.

    The scheduler's knobs (``SchedulerConfig``'s fields of the same names) are
    checked by ``SchedulerConfig`` itself, once, when this config is made.

    Raises:
      ValueError: a value out of range, naming it and the limit.
    """

    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: Optional[int] = None
    dtype: str = "auto"
    quantization: Optional[str] = None
    kv_cache_dtype: str = "auto"
    seed: int = 0
    scheduling_policy: Any = "fcfs"
    preemption_mode: str = "recompute"
    num_host_blocks: int = 0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    attention_backend: Optional[str] = None
    interpret: bool = False
    token_buckets: Optional[Sequence[int]] = None
    seq_buckets: Optional[Sequence[int]] = None
    width_buckets: Optional[Sequence[int]] = None
    precompile: Union[bool, str] = "background"
    async_scheduling: Optional[bool] = None
    compilation_cache: Optional[str] = "default"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    batching: str = "continuous"
    log_stats: bool = False
    metrics_port: Optional[int] = None
    metrics_namespace: str = "jaxllm"
    speculative_config: Union[SpeculativeConfig, dict, str, None] = None
    graceful_degradation: Union[bool, dict, str, GracefulDegradation] = True
    aging_rate: float = 1.0
    reserve_predicted_output: bool = False
    max_waiting_requests: Optional[int] = None
    preload_prompts: Optional[str] = None
    kv_events_config: Union[KVEventsConfig, dict, str, None] = None
    enable_sleep_mode: bool = False
    kv_offloading_size: float = 0.0
    kv_offloading_prefetch: bool = False
    kv_cache_compression: Optional[str] = None
    kv_cache_compression_fraction: float = 0.5

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if isinstance(self.block_size, int) and self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive int (or None: the model's "
                             "max_position_embeddings)")
        if self.max_waiting_requests is not None and (
                not isinstance(self.max_waiting_requests, int) or self.max_waiting_requests < 0):
            raise ValueError(f"max_waiting_requests={self.max_waiting_requests!r} must be an int >= 0 (or None: no "
                             "limit)")
        if self.preload_prompts is not None:
            from jaxllm.frontend.prefix_warmup import read_preload_prompts

            read_preload_prompts(self.preload_prompts)  # a missing or malformed file fails before any loading
        if self.kv_cache_memory_bytes is not None and (not isinstance(self.kv_cache_memory_bytes, int)
                                                       or self.kv_cache_memory_bytes < 1):
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes!r} must be a positive int (or None: "
                             "90% of the accelerator's free memory, 1 GiB on CPU)")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 2 (block 0 is reserved)")
        if self.metrics_namespace not in METRICS_NAMESPACES:
            raise ValueError(f"metrics_namespace={self.metrics_namespace!r} must be one of {METRICS_NAMESPACES}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be one of 'auto', 'float32', 'bfloat16', 'float16'")
        if self.quantization is not None and self.quantization not in WEIGHT_QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} must be None or one of {WEIGHT_QUANTIZATIONS}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
        if self.preemption_mode == "swap" and self.num_host_blocks < 1:
            raise ValueError(f"preemption_mode='swap' needs host blocks to swap to: num_host_blocks="
                             f"{self.num_host_blocks} must be >= 1")
        size = self.kv_offloading_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size >= 0:
            raise ValueError(f"kv_offloading_size={size!r} must be a number of GiB >= 0 (0: no host tier)")
        if size and not self.enable_prefix_caching:
            raise ValueError(f"kv_offloading_size={size!r} needs enable_prefix_caching=True: the host tier holds "
                             "prefix-cache blocks")
        if self.kv_offloading_prefetch is True and not size:
            raise ValueError("kv_offloading_prefetch=True needs a host tier to prefetch from: kv_offloading_size="
                             f"{size!r} must be > 0")
        if self.precompile not in (True, False, "background"):
            raise ValueError(f"precompile={self.precompile!r} must be True, False or 'background'")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching={self.batching!r} must be 'continuous' or 'static'")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        spec = self.speculative_config
        if self.async_scheduling is None:
            self.async_scheduling = spec is None
        elif not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} must be True, False or None (on unless "
                             "speculative_config is set)")
        elif self.async_scheduling and spec is not None:
            raise ValueError("async_scheduling=True cannot be used with speculative_config: a step's drafts need "
                             "the previous step's tokens (leave async_scheduling unset, or turn it off)")
        self._check_compression()
        self.graceful_degradation = _parse_degradation(self.graceful_degradation)
        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        # The scheduler's knobs are checked by SchedulerConfig, here rather than at start-up; the block count and
        # the model's length are not known yet (placeholders; the real config is built by the engine core).
        self.scheduler_config(num_blocks=2, max_model_len=self.max_model_len or 1)
        if spec is not None and spec.num_speculative_tokens >= self.max_num_batched_tokens:
            raise ValueError(f"speculative_config num_speculative_tokens={spec.num_speculative_tokens} must be below "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}: a decode row carries 1 + that many")

    def _check_compression(self) -> None:
        """Raise ValueError for a bad ``kv_cache_compression`` (or fraction) or a setting it does not work with."""
        mode, fraction = self.kv_cache_compression, self.kv_cache_compression_fraction
        if mode is not None and mode not in KV_COMPRESSION_DTYPES:
            raise ValueError(f"kv_cache_compression={mode!r} must be None or one of {KV_COMPRESSION_DTYPES}")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            raise ValueError(f"kv_cache_compression_fraction={fraction!r} must be a number in (0, 1)")
        if mode is None:
            return
        conflicts = (
            (self.kv_cache_dtype != "auto", f"kv_cache_dtype={self.kv_cache_dtype!r} (the cache is one byte a "
                                            "number already; use 'auto')"),
            (self.speculative_config is not None, "speculative_config (a draft model reads the same block tables)"),
            (self.preemption_mode == "swap", "preemption_mode='swap' (swaps copy device blocks only)"),
            (bool(self.kv_offloading_size), f"kv_offloading_size={self.kv_offloading_size!r} (the host tier copies "
                                            "device blocks only)"),
            (self.tensor_parallel_size > 1, f"tensor_parallel_size={self.tensor_parallel_size}"),
            (self.batching == "static", "batching='static'"),
            (self.attention_backend == "pallas", "attention_backend='pallas' (its kernels read one pool; use "
                                                 "'xla' or 'reference')"),
        )
        for bad, setting in conflicts:
            if bad:
                raise ValueError(f"kv_cache_compression={mode!r} cannot be used with {setting}")

    def scheduler_config(self, *, num_blocks: int, max_model_len: int,
                         num_offload_blocks: Optional[int] = None,
                         num_compressed_blocks: Optional[int] = None) -> SchedulerConfig:
        """The scheduler's configuration: every ``SchedulerConfig`` field this config has, by the same name,
        plus the fields known only at start-up (:data:`SCHEDULER_FIELDS_FROM_START_UP`).

        Args:
          num_blocks: device KV blocks, the null block included.
          max_model_len: the resolved ``max_model_len`` (:meth:`resolve_max_model_len`).
          num_offload_blocks: the host tier's blocks (from ``kv_offloading_size``, :meth:`num_offload_blocks`);
            None, for a check before start-up knows them: a placeholder, 1 when ``kv_offloading_size`` is set.
          num_compressed_blocks: the compressed pool's slots (``worker.kv_cache.split_kv_budget``); None: a
            placeholder, 2 when ``kv_cache_compression`` is set.

        Raises:
          ValueError: a scheduler knob out of range (``SchedulerConfig`` names it and its limit).
        """
        spec = self.speculative_config
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerConfig)
                  if f.name not in SCHEDULER_FIELDS_FROM_START_UP}
        # A draft model writes its proposals' K/V into slots its row reserves beyond the scheduled tokens.
        lookahead = spec.num_speculative_tokens if spec is not None and spec.method == "draft_model" else 0
        events = self.kv_events_config is not None and self.kv_events_config.publishes
        return SchedulerConfig(**shared, num_blocks=num_blocks, max_model_len=max_model_len,
                               num_lookahead_tokens=lookahead, enable_kv_cache_events=events,
                               num_offload_blocks=int(bool(self.kv_offloading_size)) if num_offload_blocks is None
                               else num_offload_blocks,
                               num_compressed_blocks=(2 * bool(self.kv_cache_compression) if num_compressed_blocks
                                                      is None else num_compressed_blocks))

    def num_offload_blocks(self, bytes_per_block: int) -> int:
        """Blocks of ``bytes_per_block`` bytes that ``kv_offloading_size`` GiB hold (0 without a tier)."""
        return int(self.kv_offloading_size * 2**30) // bytes_per_block

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        """``max_model_len`` or the model's ``max_position_embeddings`` (which start-up may then fit to the KV cache:
        ``jaxllm.worker.kv_cache.fit_max_model_len``).

        Raises:
          ValueError: a ``max_model_len`` above the model's positions.
        """
        if self.max_model_len is None:
            return model.max_position_embeddings
        if not 1 <= self.max_model_len <= model.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} is out of range: the model has "
                f"max_position_embeddings={model.max_position_embeddings}"
            )
        return self.max_model_len

    def max_blocks_per_seq(self, max_model_len: int) -> int:
        """Block-table width that covers ``max_model_len`` tokens."""
        return math.ceil(max_model_len / self.block_size)

    def bucket_ladders(self, max_model_len: int, attention_backend: str) -> tuple[tuple[int, ...], ...]:
        """The (T, S, W) ladders steps are padded to.

        Defaults, each ending exactly at its maximum: T takes 4 and 8, then
        powers of two from 16 and the halfway points between them (16, 24, 32,
        48, ...) up to ``max_num_batched_tokens``, since padded tokens cost real
        matmul work (a lone request decoding in the T=4 program instead of T=16
        takes 0.65-0.75x the step time on XLA's CPU backend,
        ``scripts/bench_throughput.py --single``; T below 4 gains nothing);
        S is T capped at ``max_num_seqs`` (each T is paired with one S, see
        ``BucketTable``), so a decode step of n rows pads to at most 1.5 n; W
        is the maximum alone (``ceil(max_model_len / block_size)``) for the
        ``xla`` and ``pallas`` attention, whose cost follows each sequence's
        length rather than the table width, and quadruples from 4 blocks for
        the ``reference``, whose cost grows with W.

        Raises:
          ValueError: an explicit ladder that stops short of its limit (named
            with the limit).
        """
        max_width = self.max_blocks_per_seq(max_model_len)
        tokens = self.token_buckets or (tuple(t for t in SMALL_TOKEN_BUCKETS if t < min(16, self.max_num_batched_tokens))
                                        + half_step_ladder(16, self.max_num_batched_tokens))
        seqs = self.seq_buckets or tuple(sorted({min(t, self.max_num_seqs) for t in tokens}))
        if self.width_buckets:
            widths = self.width_buckets
        elif attention_backend == "reference":
            widths = geometric_ladder(4, max_width, 4)
        else:
            widths = (max_width,)
        limits = (("token_buckets", tokens, self.max_num_batched_tokens, "max_num_batched_tokens"),
                  ("seq_buckets", seqs, self.max_num_seqs, "max_num_seqs"),
                  ("width_buckets", widths, max_width, "ceil(max_model_len / block_size)"))
        for name, ladder, limit, limit_name in limits:
            if max(ladder) < limit:
                raise ValueError(f"{name}={list(ladder)} must reach {limit_name}={limit}: a step that size "
                                 "would have no bucket")
        return tuple(tokens), tuple(seqs), tuple(widths)


def _parse_degradation(value: Any) -> Union[bool, GracefulDegradation]:
    """``EngineConfig.graceful_degradation`` as the scheduler takes it: True, False or a ``GracefulDegradation``.

    Raises:
      ValueError: a value that is none of a bool, "true"/"false", a dict or JSON object of
        ``GracefulDegradation`` fields (an unknown field is named with the known ones), or an instance.
    """
    if isinstance(value, (bool, GracefulDegradation)):
        return value
    if isinstance(value, str):
        if value.lower() in ("true", "false"):
            return value.lower() == "true"
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"graceful_degradation={value!r} must be true, false or a JSON object of "
                             f"GracefulDegradation fields: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"graceful_degradation={value!r} must be a bool, a dict or JSON object of "
                         "GracefulDegradation fields, or a GracefulDegradation")
    known = [f.name for f in dataclasses.fields(GracefulDegradation)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"graceful_degradation has unknown field {unknown[0]!r}; the fields are {known}")
    try:
        return GracefulDegradation(**value)
    except TypeError as e:  # a threshold of the wrong type, e.g. "0.2" for a fraction
        raise ValueError(f"graceful_degradation={value!r}: {e}") from None
