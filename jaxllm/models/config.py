"""``ModelConfig``: a decoder's shape and flags from a HF ``config.json`` dict (or the GGUF equivalent)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from jaxllm import registry
from jaxllm.paths import eos_token_ids

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

    rope_type: "default", "linear" (positions / ``factor``), "llama3" or "longrope" (Phi-3's
      "su": ``short_factor``/``long_factor`` divisors, cos/sin scaled by ``attention_factor``).
    partial_rotary_factor: fraction of each head's leading dims rotated, as HF.
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
    """The shape and flags of a decoder of ``jaxllm.models``, for every family (fields of the HF ``*Config``s).

    ``num_experts > 0`` for MoE (``moe_intermediate_size``: each expert's FFN width); ``local_rope``:
    Gemma 3's sliding-window rope; ``attn_logit_softcapping`` is ignored as in HF's Gemma 3. A
    registered family reads ``hidden_act`` as it likes and ``rms_norm_eps`` as its norms' epsilon.
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
        """Build from a HF ``config.json`` dict and the optional ``generation_config.json`` dict.

        ``eos_token_ids``: every ``eos_token_id`` of ``generation_config`` then ``cfg``, deduplicated (as vLLM).
        The family is the first of ``architectures`` supported or registered; without a known one, the
        ``model_type`` alone (``ARCHITECTURE_OF_MODEL_TYPE`` or a registration without architectures). A
        registered family's ``hf_config`` maps the dict first.

        Raises:
          ValueError: an unrunnable architecture/model_type, an unsupported activation or rope type, heads
            that do not divide, an MoE model with dense layers, or a registered config lacking
            ``REGISTERED_MODEL_FIELDS`` (named).
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
        """q.k factor: ``query_pre_attn_scalar ** -0.5`` (Gemma), else ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, per byte of dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _optional_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def _architecture_from_hf(cfg: dict[str, Any]) -> tuple[str, str]:
    """(architecture, model_type) running a HF config dict."""
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
    """A registered model's config mapped by ``hf_config``; ValueError naming missing required fields."""
    mapping = getattr(registry.resolve_family(model_type), "hf_config", None)
    mapped = mapping(dict(cfg)) if mapping is not None else cfg
    missing = [name for name in REGISTERED_MODEL_FIELDS if mapped.get(name) is None]
    if missing:
        raise ValueError(f"config.json of the registered model_type {model_type!r} lacks {missing}: a registered "
                         f"architecture's config needs {list(REGISTERED_MODEL_FIELDS)} (Family.hf_config can map "
                         "its own names to them)")
    return mapped


def _ropes_from_hf(cfg: dict[str, Any], model_type: str) -> tuple[RopeConfig, Optional[RopeConfig]]:
    """(rope of every/global layers, sliding-window layers' rope where it differs: Gemma 3)."""
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
    """The MoE fields of ``ModelConfig`` (none if dense); ValueError if some Qwen3-MoE layers are dense."""
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
