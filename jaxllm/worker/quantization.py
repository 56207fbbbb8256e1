"""Weight-only quantization (int8, fp8) of the dense projections (``LLM(quantization="int8" | "fp8")``), the scheme
of vLLM's weight-only int8 / fp8 and qwix's weight-only PTQ.

:data:`QUANTIZED_KEYS` leaves are held as int8 (symmetric, round to nearest) or float8_e4m3fn with a float32 sibling
leaf ``"<key>_scale"``: ``[..., out]`` per output channel (``w ~= q * scale``, ``scale = max|w[:, j]| / 127`` or
``/ 448``), or ``[..., G, out]`` per group of ``in / G`` input rows (GGUF Q8_0). Embedding, norms, biases, the
router and a tied lm_head stay in the compute dtype. docs/design/worker.md has the details.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import jax
import ml_dtypes
import numpy as np

from jaxllm.config import WEIGHT_QUANTIZATIONS

if TYPE_CHECKING:
    from jaxllm.models.common import Params

SCALE_SUFFIX = "_scale"
# Parameter keys quantized by ``quantization``: the dense projections and an untied lm_head.
QUANTIZED_KEYS = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head",
                            "experts_gate", "experts_up", "experts_down"})
# Weight quantization -> (stored dtype, largest stored magnitude).
_WEIGHT_TYPES = {"int8": (np.dtype(np.int8), 127.0), "fp8": (np.dtype(ml_dtypes.float8_e4m3fn), 448.0)}
_QUANTIZED_DTYPES = frozenset(dtype for dtype, _ in _WEIGHT_TYPES.values())



def quantized_dtype(quantization: str) -> np.dtype:
    """The stored dtype of ``quantization``'s weights (int8 or float8_e4m3fn)."""
    return _WEIGHT_TYPES[quantization][0]


def check_quantization(quantization: Optional[str]) -> None:
    """Raise ValueError unless ``quantization`` is None or one of :data:`WEIGHT_QUANTIZATIONS`."""
    if quantization is not None and quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} must be None or one of {WEIGHT_QUANTIZATIONS}")


def is_quantized_dtype(dtype: Any) -> bool:
    """True for the stored dtypes of quantized weights (int8, float8_e4m3fn)."""
    return np.dtype(dtype) in _QUANTIZED_DTYPES


def leaf_dtype(key: str, stored: Any, dtype: Any) -> np.dtype:
    """The device dtype of leaf ``key``: scales float32, quantized weights as stored, else ``dtype``."""
    if key.endswith(SCALE_SUFFIX):
        return np.dtype(np.float32)
    if is_quantized_dtype(stored):
        return np.dtype(stored)
    return np.dtype(dtype)


def quantize_weight(w: np.ndarray, quantization: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel symmetric quantization of a host ``[..., in, out]`` float weight.

    Args:
      quantization: "int8" or "fp8".

    Returns:
      ``(q, scale)``: q ``[..., in, out]`` int8 (rounded) or float8_e4m3fn, scale float32 ``[..., out]``,
      ``w ~= q * scale``; an all-zero channel gets scale 1.
    """
    stored, limit = _WEIGHT_TYPES[quantization]
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=-2)
    scale = np.where(amax > 0, amax / limit, 1.0).astype(np.float32)
    q = np.clip(w / scale[..., None, :], -limit, limit)
    if stored == np.int8:
        q = np.round(q)
    return q.astype(stored), scale


def dequantize_weight(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 ``q * scale`` of a ``[..., in, out]`` weight with ``scale [..., out]`` or ``[..., G, out]``."""
    q = np.asarray(q).astype(np.float32)
    scale = np.asarray(scale, np.float32)
    if scale.ndim == q.ndim - 1:
        return q * scale[..., None, :]
    groups = scale.shape[-2]
    grouped = q.reshape(q.shape[:-2] + (groups, q.shape[-2] // groups, q.shape[-1]))
    return (grouped * scale[..., :, None, :]).reshape(q.shape)


def quantize_params(params: Params, quantization: Optional[str], dtype: Any) -> Params:
    """Host ``params`` with :data:`QUANTIZED_KEYS` leaves quantized (those with a ``_scale`` kept) and other
    float leaves cast to ``dtype``; with ``quantization`` None, only the cast."""
    def one(tree: dict) -> dict:
        out = {}
        for key, leaf in tree.items():
            if key == "layers":
                out[key] = one(leaf)
            elif quantization and key in QUANTIZED_KEYS and key + SCALE_SUFFIX not in tree:
                out[key], out[key + SCALE_SUFFIX] = quantize_weight(leaf, quantization)
            else:
                out[key] = np.asarray(leaf).astype(leaf_dtype(key, np.asarray(leaf).dtype, dtype), copy=False)
        return out

    return one(params)


def weight_quantization(params: Params) -> Optional[str]:
    """"int8" or "fp8" when ``params`` holds quantized weights (by their dtype), else None."""
    for leaf in jax.tree_util.tree_leaves(params):
        for name, (stored, _) in _WEIGHT_TYPES.items():
            if np.dtype(leaf.dtype) == stored:
                return name
    return None


def param_bytes(params: Params) -> dict[str, int]:
    """Bytes of the parameter pytree (whole arrays): ``{"total", "quantized" (weights and scales),
    "quantized_as_float32" (those weights as float32)}``."""
    total = quantized = as_f32 = 0
    flat = {tuple(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    for path, leaf in flat.items():
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        total += nbytes
        if path[:-1] + (path[-1] + SCALE_SUFFIX,) in flat:
            quantized += nbytes
            as_f32 += int(np.prod(leaf.shape)) * 4
        elif path[-1].endswith(SCALE_SUFFIX) and path[:-1] + (path[-1][: -len(SCALE_SUFFIX)],) in flat:
            quantized += nbytes
    return {"total": total, "quantized": quantized, "quantized_as_float32": as_f32}
