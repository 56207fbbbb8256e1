"""HF-named tensors to the parameter pytree of ``jaxllm.models``, for every family.

Names come from the family (``hf_layer_names``, ``hf_top_names``, ``unfuse``); an int8 tensor arrives with
``<name>_scale`` (``[out]`` or ``[out, G]``), which becomes the leaf's ``_scale`` sibling.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import numpy as np

from jaxllm.models import family
from jaxllm.models.common import Family, Params
from jaxllm.models.config import ModelConfig
from jaxllm.worker.quantization import QUANTIZED_KEYS, SCALE_SUFFIX, dequantize_weight, quantize_weight

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def expected_layer_keys(cfg: ModelConfig) -> set[str]:
    """Pytree keys each layer of ``cfg``'s family must have under its flags."""
    return family(cfg).layer_keys(cfg)


def params_from_hf(
    cfg: ModelConfig, tensors: Iterable[tuple[str, Any]], dtype: Any, source: str = "checkpoint",
    convert: Callable[[Any, bool, Any], Any] | None = None, stack: Callable[[list], Any] | None = None,
    quantization: str | None = None,
) -> Params:
    """Map HF-named tensors to the jaxllm parameter pytree (numpy, host).

    Args:
      cfg: the model configuration. tensors: ``(hf_name, array)`` in HF orientation ``[out, in]``.
      dtype: the result's dtype. source: named in error messages.
      convert: ``(array, transpose, dtype) -> leaf`` (default: contiguous numpy); lazy loaders keep tensors lazy.
      stack: per-layer leaves -> one leaf with a leading axis (default ``np.stack``).
      quantization: None, "int8" or "fp8": ``QUANTIZED_KEYS`` quantized per output channel once stacked.

    Returns:
      The pytree of ``jaxllm.models.common`` (experts ``[L, num_experts, ...]``, ``_scale`` siblings).

    Raises:
      ValueError: a required tensor is missing (named) or has the wrong shape.
    """
    convert = convert or _convert
    stack = stack or np.stack
    fam = family(cfg)
    layers: list[dict[str, Any]] = [{} for _ in range(cfg.num_layers)]
    top: dict[str, Any] = {}
    prefix = fam.hf_layer_prefix
    for name, array in tensors:
        if name.startswith(prefix):
            idx_str, _, rest = name[len(prefix):].partition(".")
            if int(idx_str) >= cfg.num_layers:
                continue
            for part, tensor in fam.unfuse(rest, array, cfg) if fam.unfuse else [(rest, array)]:
                _place(layers[int(idx_str)], part, tensor, fam.hf_layer_names, convert, dtype, quantization)
        else:
            _place(top, name, array, fam.hf_top_names, convert, dtype, quantization)
    hf_top = {key: name for name, (key, _) in fam.hf_top_names.items()}
    required_top = set(hf_top) - ({"lm_head"} if cfg.tie_word_embeddings else set())
    missing = [hf_top[k] for k in sorted(required_top - top.keys())]
    need = fam.layer_keys(cfg)
    for i, layer in enumerate(layers):
        missing += [f"{prefix}{i}.{_hf_name(fam.hf_layer_names, k, layer.get(k), cfg)}"
                    for k in sorted(need) if _incomplete(layer.get(k), cfg)]
    if missing:
        raise ValueError(f"{source} is missing tensors required by {cfg.architecture}: {missing[:8]}")
    if cfg.tie_word_embeddings:
        top.pop("lm_head", None)
        top.pop("lm_head" + SCALE_SUFFIX, None)
    _check_shapes(cfg, fam, top, layers)
    if "lm_head" in top:
        _set_leaf(top, "lm_head", top.pop("lm_head"), top.pop("lm_head" + SCALE_SUFFIX, None), quantization)
    stacked: dict[str, Any] = {}
    for key in sorted(need):
        # Drop each layer's copy as soon as it is stacked: one extra leaf in memory at a time.
        per_layer = [layer.pop(key) for layer in layers]
        scales = [layer.pop(key + SCALE_SUFFIX, None) for layer in layers]
        if isinstance(per_layer[0], dict):  # experts: stack them first
            per_layer = [stack([experts[j] for j in range(cfg.num_experts)]) for experts in per_layer]
        if any(s is not None for s in scales) and (any(s is None for s in scales)
                                                    or len({np.shape(s) for s in scales}) > 1):
            # Quantized in some layers only (or with other groups): back to float32, per channel below.
            per_layer = [w if s is None else dequantize_weight(w, s) for w, s in zip(per_layer, scales)]
            scales = [None] * len(scales)
        _set_leaf(stacked, key, stack(per_layer), None if scales[0] is None else stack(scales), quantization)
    return {**top, "layers": stacked}


def _set_leaf(tree: dict[str, Any], key: str, leaf: Any, scale: Any, quantization: str | None) -> None:
    """``tree[key] = leaf``, quantized per channel when asked and not already quantized, with its scale beside it."""
    if scale is not None:
        tree[key], tree[key + SCALE_SUFFIX] = leaf, scale
    elif quantization and key in QUANTIZED_KEYS:
        tree[key], tree[key + SCALE_SUFFIX] = quantize_weight(leaf, quantization)
    else:
        tree[key] = leaf


def _place(layer: dict[str, Any], name: str, tensor: Any, names: dict[str, tuple[str, bool]],
           convert: Callable, dtype: Any, quantization: str | None) -> None:
    scale = name.endswith(SCALE_SUFFIX)
    name = name[: -len(SCALE_SUFFIX)] if scale else name
    expert = _EXPERT.search(name)
    pattern = _EXPERT.sub(".experts.*.", name, count=1) if expert else name
    if pattern not in names:
        return  # rotary inv_freq buffers, tensors of layers a flag turns off
    key, transpose = names[pattern]
    stored = getattr(tensor, "dtype", None)
    if scale:
        key, target = key + SCALE_SUFFIX, np.float32
    elif stored is not None and np.dtype(stored) == np.int8:
        target = np.int8
    else:
        # Quantized leaves are read in full precision, and quantized once stacked.
        target = np.float32 if quantization and key in QUANTIZED_KEYS else dtype
    if expert:
        layer.setdefault(key, {})[int(expert.group(1))] = convert(tensor, transpose, target)
    else:
        layer[key] = convert(tensor, transpose, target)


def _incomplete(leaf: Any, cfg: ModelConfig) -> bool:
    return leaf is None or (isinstance(leaf, dict) and len([j for j in leaf if j < cfg.num_experts]) < cfg.num_experts)


def _hf_name(names: dict[str, tuple[str, bool]], key: str, experts: Any, cfg: ModelConfig) -> str:
    name = next(n for n, (k, _) in names.items() if k == key)
    if "*" in name:
        missing = next(j for j in range(cfg.num_experts) if j not in (experts or {}))
        name = name.replace("*", str(missing))
    return name


def _convert(array: np.ndarray, transpose: bool, dtype: Any) -> np.ndarray:
    array = np.asarray(array)
    if transpose:
        array = array.T
    return np.ascontiguousarray(array.astype(dtype, copy=False))


def _expected_shapes(cfg: ModelConfig, fam: Family) -> dict[str, tuple[int, ...]]:
    """Each layer leaf's shape without the layer axis, for the keys whose shape the config fixes."""
    e, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv, x, fx = cfg.num_q_heads * d, cfg.num_kv_heads * d, cfg.num_experts, cfg.moe_intermediate_size
    return {
        "wq": (e, q), "wk": (e, kv), "wv": (e, kv), "wo": (q, e), "bq": (q,), "bk": (kv,), "bv": (kv,),
        "q_norm": (d,), "k_norm": (d,), "w_gate": (e, f), "w_up": (e, f), "w_down": (f, e),
        "router": (e, x), "experts_gate": (x, e, fx), "experts_up": (x, e, fx), "experts_down": (x, fx, e),
        **(fam.leaf_shapes(cfg) if fam.leaf_shapes else {}),
    }


def _check_shapes(cfg: ModelConfig, fam: Family, top: dict[str, Any], layers: list[dict[str, Any]]) -> None:
    want = _expected_shapes(cfg, fam)
    for i, layer in enumerate(layers):
        for key, leaf in layer.items():
            if key not in want:
                continue
            experts = leaf.items() if isinstance(leaf, dict) else [(None, leaf)]
            shape = want[key][1:] if isinstance(leaf, dict) else want[key]
            for j, tensor in experts:
                if tuple(tensor.shape) != shape:
                    where = f"layer {i} {key}" + ("" if j is None else f" expert {j}")
                    raise ValueError(f"{where} has shape {tuple(tensor.shape)}, config implies {shape}")
    if tuple(top["embed"].shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"embed has shape {tuple(top['embed'].shape)}, config implies "
                         f"{(cfg.vocab_size, cfg.hidden_size)}")
