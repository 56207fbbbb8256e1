"""Load a llama.cpp GGUF file as an HF-style config dict and HF-named, dequantized numpy weights.

Reverses llama.cpp's ``convert_hf_to_gguf.py`` (names, llama's q/k permutation, Gemma 3's ``1 + weight``
norms, stacked experts split per expert); dequantizes with ``gguf.quants``. The parse and the float32
dequantized tensors are cached (``$JAXLLM_DEQUANT_CACHE_GB``, default 4; 0 off): docs/design/gguf.md.
"""

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
from typing import AbstractSet, Any

import gguf
import numpy as np
from gguf.quants import dequantize

# GGUF `general.architecture` -> (HF model_type, HF architectures[0]).
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
_MISTRAL = ("mistral", "MistralForCausalLM")
_MIXTRAL = ("mixtral", "MixtralForCausalLM")  # llama.cpp writes Mixtral as `llama` with experts

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Per-architecture names that differ from the Llama ones above.
_ARCH_LAYER_TENSORS = {
    "gemma3": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
# Stacked experts: GGUF name -> (HF prefix, HF name of expert j's tensor with {j}), by HF model_type.
_EXPERT_TENSORS = {
    "qwen3_moe": {"ffn_gate_inp.weight": "mlp.gate.weight",
                  "ffn_gate_exps.weight": "mlp.experts.{j}.gate_proj.weight",
                  "ffn_up_exps.weight": "mlp.experts.{j}.up_proj.weight",
                  "ffn_down_exps.weight": "mlp.experts.{j}.down_proj.weight"},
    "mixtral": {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
                "ffn_gate_exps.weight": "block_sparse_moe.experts.{j}.w1.weight",
                "ffn_up_exps.weight": "block_sparse_moe.experts.{j}.w3.weight",
                "ffn_down_exps.weight": "block_sparse_moe.experts.{j}.w2.weight"},
}
_ATTENTION_TENSORS = ("attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                      "attn_output.weight")
_MLP_TENSORS = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_QK_NORM = ("attn_q_norm.weight", "attn_k_norm.weight")
_EXPERTS = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# Every layer tensor each HF model_type needs.
_REQUIRED_LAYER_TENSORS = {
    "llama": _ATTENTION_TENSORS + _MLP_TENSORS,
    "mistral": _ATTENTION_TENSORS + _MLP_TENSORS,
    "qwen2": _ATTENTION_TENSORS + _MLP_TENSORS + ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": _ATTENTION_TENSORS + _MLP_TENSORS + _QK_NORM,
    "gemma3_text": _ATTENTION_TENSORS + _MLP_TENSORS + _QK_NORM + ("post_attention_norm.weight",
                                                                  "post_ffw_norm.weight"),
    "phi3": ("attn_norm.weight", "ffn_norm.weight", "attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
             "ffn_down.weight"),
    "qwen3_moe": _ATTENTION_TENSORS + _QK_NORM + _EXPERTS,
    "mixtral": _ATTENTION_TENSORS + _EXPERTS,
}

_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "model",
    "tokenizer.ggml.pre": "pre",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.token_type": "token_types",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_bos_token": "add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_eos_token",
    "tokenizer.ggml.add_space_prefix": "add_space_prefix",
    "tokenizer.chat_template": "chat_template",
}


def load_gguf(path: str | os.PathLike, dtype=np.float32,
              keep_q8_0: bool = False) -> tuple[dict, dict[str, np.ndarray]]:
    """Read a GGUF checkpoint into ``(config, weights)`` in Hugging Face form.

    Args:
        path: a ``.gguf`` of architecture ``llama`` (Mistral, Mixtral too), ``qwen2``, ``qwen3``, ``gemma3``,
            ``phi3`` or ``qwen3moe``; any tensor type ``gguf.quants.dequantize`` handles.
        dtype: numpy floating dtype of the weights (default float32; ml_dtypes' bfloat16 works).
        keep_q8_0: keep the dense projections' Q8_0 tensors quantized: ``<name>`` int8 [out, in] and
            ``<name>_scale`` float32 [out, in / 32], so ``q * scale`` per 32-block is the tensor.

    Returns:
        config: a ``config.json``-style dict (``model_type``, sizes, rope and eos settings the file states).
        weights: HF names to arrays in HF orientation, e.g. ``...q_proj.weight`` [heads*head_dim, hidden];
            ``lm_head.weight`` only when the embedding is not tied.

    Raises:
        ValueError: an unsupported architecture, a missing metadata key or tensor, an unknown tensor or a
            type that cannot be dequantized (the item and the file named).
    """
    path = os.fspath(path)
    dtype = _check_dtype(dtype)
    config = read_gguf_config(path)
    reader = _reader(path)
    arch = _field(reader, "general.architecture", path)
    hf_names = {t.name: _hf_name(t.name, arch, config["model_type"], path) for t in reader.tensors}
    kept = {t.name for t in reader.tensors if keep_q8_0 and t.tensor_type == gguf.GGMLQuantizationType.Q8_0
            and hf_names[t.name].endswith(_Q8_0_KEPT)}
    floats = _dequantized(reader, path, skip=kept)
    weights = {}
    for tensor in reader.tensors:
        hf_name = hf_names[tensor.name]
        if tensor.name in kept:
            values, scales = _q8_0_blocks(tensor)
            weights[hf_name] = _arrange(values, hf_name, tensor, arch, config)
            weights[hf_name + "_scale"] = _arrange(scales, hf_name, tensor, arch, config)
            continue
        for name, array in _split_experts(hf_name, _arrange(floats[tensor.name], hf_name, tensor, arch, config)):
            weights[name] = array.astype(dtype, copy=False)
    return config, weights


# HF names (suffixes) of the dense projections `keep_q8_0` keeps quantized.
_Q8_0_KEPT = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
              "up_proj.weight", "down_proj.weight", "lm_head.weight")


def _q8_0_blocks(tensor: "_Tensor") -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's int8 values [rows, n] and float32 block scales [rows, n / 32] (34-byte blocks)."""
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][1]
    blocks = np.asarray(tensor.data).reshape(tensor.data.shape[0], -1, block_bytes)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(tensor.data.shape[0], -1)
    return values, scales


def _arrange(array: np.ndarray, hf_name: str, tensor: "_Tensor", arch: str, config: dict) -> np.ndarray:
    """One GGUF tensor's array (or Q8_0 values/scales) in HF's order: llama's q/k unpermuted, Gemma 3's norms - 1."""
    if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute_rows(array, config["num_attention_heads"])
    if arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute_rows(array, config["num_key_value_heads"])
    if arch == "gemma3" and tensor.name.endswith("norm.weight"):
        return array - 1.0  # the converter stores Gemma's zero-centred norm weights plus one
    return array


def _split_experts(hf_name: str, array: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """HF-named arrays of one tensor: expert j's slice of a stacked expert tensor (`{j}` in the name)."""
    if "{j}" in hf_name:
        return [(hf_name.format(j=j), array[j]) for j in range(array.shape[0])]
    return [(hf_name, array)]


def read_gguf_config(path: str | os.PathLike) -> dict:
    """The `config.json`-style dict of a GGUF file (see `load_gguf`), without reading tensor data.

    Raises:
        ValueError: as `load_gguf`, but for tensor types (no tensor is dequantized).
    """
    path = os.fspath(path)
    reader = _reader(path)
    arch = _field(reader, "general.architecture", path)
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; "
                         f"supported: {sorted(_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    config = _config(reader, arch, tensors, path)
    _check_complete(tensors, config["model_type"], config["num_hidden_layers"], path)
    return config


def gguf_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file under short names (only the keys the file has).

    Keys: ``model``, ``pre``, ``tokens``, ``token_types`` (llama.cpp's 1 normal .. 6 byte), ``scores``,
    ``merges``, ``bos/eos/unk/pad_token_id``, ``add_bos_token``, ``add_eos_token``, ``add_space_prefix``,
    ``chat_template``.

    Raises:
        ValueError: the file has no ``tokenizer.ggml.tokens``.
    """
    path = os.fspath(path)
    reader = _reader(path)
    meta = {short: reader.fields[key] for key, short in _TOKENIZER_KEYS.items() if key in reader.fields}
    if "tokens" not in meta:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens; the file carries no tokenizer")
    return meta


def gguf_has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether the GGUF file carries a tokenizer (`tokenizer.ggml.tokens`)."""
    return "tokenizer.ggml.tokens" in _reader(os.fspath(path)).fields


def _check_dtype(dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"dtype {dtype!r} is not a numpy dtype") from exc
    if dt.kind != "f" and dt.name != "bfloat16":  # ml_dtypes' bfloat16 is not kind "f"
        raise ValueError(f"dtype {dtype!r} is not a floating-point dtype")
    return dt


@dataclasses.dataclass
class _Tensor:
    """One GGUF tensor: its type and raw bytes (a read-only memmap view) shaped as ``gguf.GGUFReader`` shapes them."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: list[int]  # ggml order, innermost dimension first
    data: np.ndarray


@dataclasses.dataclass
class _Contents:
    """A parsed GGUF file: metadata values by key (`ReaderField.contents()`) and its tensors."""

    fields: dict[str, Any]
    tensors: list[_Tensor]
    cache_stem: pathlib.Path  # where this file's cached parse and dequantized tensors live, less suffix


# Bump when the cached parse changes shape, so stale entries are ignored.
_PARSE_CACHE_VERSION = 1


def _reader(path: str) -> _Contents:
    """The parsed contents of ``path`` (the two most recent in memory, and on disk in the jaxllm cache)."""
    stat = os.stat(path)
    return _cached_reader(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> _Contents:
    from jaxllm.paths import cache_dir

    key = hashlib.sha256(f"{_PARSE_CACHE_VERSION}|{path}|{mtime_ns}|{size}".encode()).hexdigest()[:16]
    stem = cache_dir() / "gguf" / f"{pathlib.Path(path).stem}-{key}"
    cached = stem.with_suffix(".json")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        parse = json.loads(cached.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        parse = _parse(path)
        _write_atomically(cached, json.dumps(parse, default=_plain))
    tensors = []
    for name, type_id, ggml_shape, offset, dtype, shape in parse["tensors"]:
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        tensors.append(_Tensor(name, gguf.GGMLQuantizationType(type_id), ggml_shape,
                               raw[offset:offset + nbytes].view(dt).reshape(shape)))
    return _Contents(parse["fields"], tensors, stem)


def _parse(path: str) -> dict:
    """``gguf.GGUFReader``'s parse as a JSON-able dict: ``fields`` and ``tensors`` (name, type, shapes, offset)."""
    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = [[t.name, int(t.tensor_type), [int(n) for n in t.shape], int(t.data_offset), t.data.dtype.str,
                list(t.data.shape)] for t in reader.tensors]
    return {"fields": fields, "tensors": tensors}


def _plain(value: Any) -> Any:
    """JSON fallback for numpy scalars and arrays among metadata values."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} in the GGUF parse cache")


def _write_atomically(target: pathlib.Path, text: str) -> None:
    """Write ``text`` to ``target`` via a temporary file and a rename; skipped when the cache is not writable."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    except OSError:
        pass


def _field(reader: _Contents, key: str, path: str, default: Any = ...) -> Any:
    if key not in reader.fields:
        if default is ...:
            raise ValueError(f"{path}: missing GGUF metadata key {key!r}")
        return default
    return reader.fields[key]


def _config(reader: _Contents, arch: str, tensors: dict, path: str) -> dict:
    def key(name, default=...):
        return _field(reader, f"{arch}.{name}", path, default)

    model_type, hf_arch = _ARCHITECTURES[arch]
    if arch == "llama" and key("expert_count", 0):
        model_type, hf_arch = _MIXTRAL
    elif arch == "llama" and "mistral" in _field(reader, "general.name", path, "").lower():
        model_type, hf_arch = _MISTRAL  # llama.cpp stores Mistral as `llama`; so does HF's loader
    for name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        if name in tensors:
            raise ValueError(f"{path}: has a {name!r} tensor (rope frequency factors: llama3 or "
                             f"LongRoPE scaling), which this loader does not support yet")
    hidden = key("embedding_length")
    heads = key("attention.head_count")
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "vocab_size": key("vocab_size", int(tensors["token_embd.weight"].shape[-1])),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", path, None),
        "eos_token_id": _eos_token_ids(reader, path),
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
    }
    rope_type = key("rope.scaling.type", None)
    if rope_type not in (None, "none"):
        config["rope_scaling"] = {"rope_type": rope_type, "factor": key("rope.scaling.factor")}
        original = key("rope.scaling.original_context_length", None)
        if original is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = original
    window = key("attention.sliding_window", None)
    if window is not None:
        config["sliding_window"] = window
    rotary = key("rope.dimension_count", None)
    if rotary is not None and rotary != config["head_dim"]:
        config["partial_rotary_factor"] = rotary / config["head_dim"]  # Phi-4-mini rotates 3/4 of each head
    if arch == "gemma3":
        # llama.cpp's Gemma 3: the attention scale is head_dim ** -0.5 but for the 27B model (62
        # layers), whose query_pre_attn_scalar is hidden / heads; 5 local layers then a global one
        # (HF's default sliding_window_pattern), the local ones with rope base 10000 (HF's default).
        del config["hidden_act"]
        config["hidden_activation"] = "gelu_pytorch_tanh"
        config["query_pre_attn_scalar"] = hidden // heads if config["num_hidden_layers"] == 62 else config["head_dim"]
        softcap = key("final_logit_softcapping", None)
        if softcap is not None:
            config["final_logit_softcapping"] = softcap
    if model_type in _EXPERT_TENSORS:
        config["num_local_experts" if model_type == "mixtral" else "num_experts"] = key("expert_count")
        config["num_experts_per_tok"] = key("expert_used_count")
    if model_type == "qwen3_moe":
        config["moe_intermediate_size"] = key("expert_feed_forward_length")
        config["norm_topk_prob"] = True  # llama.cpp's qwen3moe graph always renormalises the top-k weights
    return config


def _eos_token_ids(reader: _Contents, path: str) -> int | list[int] | None:
    """The ids that end generation as llama.cpp reads them (eos, eot, eom): an int for one, a list for several."""
    ids = [_field(reader, f"tokenizer.ggml.{name}_token_id", path, None) for name in ("eos", "eot", "eom")]
    ids = list(dict.fromkeys(i for i in ids if i is not None))
    return ids[0] if len(ids) == 1 else ids or None


def _hf_name(name: str, arch: str, model_type: str, path: str) -> str:
    """The HF name of GGUF tensor `name`; `{j}` stands for the expert of a stacked expert tensor."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer_names = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(arch, {}), **_EXPERT_TENSORS.get(model_type, {})}
        if parts[2] in layer_names:
            return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    raise ValueError(f"{path}: unexpected tensor {name!r}; this loader does not know where it goes")


_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def _dequantized(reader: _Contents, path: str, skip: AbstractSet[str] = frozenset()) -> dict[str, np.ndarray]:
    """Every tensor but those in ``skip`` as float32 in numpy (HF) order, by GGUF name, via the dequant cache.

    Raises:
        ValueError: a tensor's type cannot be dequantized (the tensor and the file named).
    """
    import safetensors
    import safetensors.numpy

    tensors = [t for t in reader.tensors if t.name not in skip]
    quantized = [t for t in tensors if t.tensor_type not in _FLOAT_TYPES]
    floats = {t.name: _dequantize(t, path) for t in tensors if t.tensor_type in _FLOAT_TYPES}
    if not quantized:
        return floats
    cached = reader.cache_stem.with_name(f"{reader.cache_stem.name}-gguf{_gguf_version()}.safetensors")
    try:
        with safetensors.safe_open(cached, framework="numpy") as f:
            if {t.name for t in quantized} <= set(f.keys()):
                return {**floats, **{t.name: f.get_tensor(t.name) for t in quantized}}
    except (OSError, safetensors.SafetensorError):
        pass
    dequantized = {t.name: _dequantize(t, path) for t in quantized}
    limit_gb = float(os.environ.get("JAXLLM_DEQUANT_CACHE_GB", "4"))
    if sum(a.nbytes for a in dequantized.values()) <= limit_gb * 1e9:
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        try:
            safetensors.numpy.save_file(dequantized, tmp)
            os.chmod(tmp, 0o644)  # the cache may be shared, as the model file is
            os.replace(tmp, cached)
        except OSError:
            tmp.unlink(missing_ok=True)
    return {**floats, **dequantized}


@functools.cache
def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def _dequantize(tensor, path: str) -> np.ndarray:
    """Dequantize one GGUF tensor to a float32 array in numpy (row-major, HF) order."""
    try:
        return dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                         f"which gguf cannot dequantize") from exc


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation of ``w`` [n_heads*head_dim, ...] (interleaved pairs -> two halves)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_complete(tensors: dict, model_type: str, num_layers: int, path: str) -> None:
    expected = ["token_embd.weight", "output_norm.weight"]
    expected += [f"blk.{i}.{n}" for i in range(num_layers) for n in _REQUIRED_LAYER_TENSORS[model_type]]
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ValueError(f"{path}: missing tensor(s) for {model_type}: {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
