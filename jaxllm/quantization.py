"""Weight-only quantization (int8, fp8) of the dense projections, and the scales of quantized KV caches.

Weights (``LLM(quantization="int8" | "fp8")``). Every dense projection --
``wq, wk, wv, wo, w_gate, w_up, w_down``, the experts' ``experts_*`` and an
untied ``lm_head`` -- is held as int8 (symmetric, round to nearest) or
float8_e4m3fn with a float32 scale per output channel: ``w ~= q * scale``,
``scale = max |w[:, j]| / 127`` (int8) or ``/ 448`` (float8_e4m3fn's
largest finite value). The scale is a sibling leaf ``"<key>_scale"`` of shape
``[..., out]`` (the weight's shape without its input axis), so the parameter
pytree stays a dict of arrays: scanned, sharded (a scale splits with its
weight's output channels, ``jaxllm.sharding``) and checkpointed like any other
leaf. The matmul is ``(x @ q.astype(x.dtype)) * scale``
(``jaxllm.models.common.dot_f32``). The embedding, norms, biases and the MoE
router stay in the compute dtype; a tied lm_head is the embedding and stays too.

A scale may instead be ``[..., G, out]``: one per group of ``in / G``
consecutive input rows of each output channel. That is how a GGUF file's Q8_0
tensors are kept (32-value blocks, each with its own scale, ``G = in / 32``):
exactly llama.cpp's numbers, dequantized per group before the matmul.

This is the scheme of vLLM's weight-only int8 / fp8 (per-channel scales) and
of qwix's weight-only PTQ; qwix itself targets flax modules (its dependency),
whereas the model here is plain functions over a dict of arrays.

KV caches (``LLM(kv_cache_dtype="int8" | "fp8_e4m3")``). One float32 scale
per layer and KV head, for K and for V (``kernels_pallas.reference`` states
how the write and attention use them). They are calibrated when the engine
starts, by :func:`calibrate_kv_scales`: one forward pass over
:data:`CALIBRATION_TEXT` with a float32 cache gives each head's largest
``|k|`` and ``|v|``, and the scale maps that, times :data:`KV_SCALE_MARGIN`,
to the type's largest value (per-tensor static scales are vLLM's fp8 KV
cache, which TensorRT-LLM calibrates the same way for int8).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxllm.config import KV_CACHE_DTYPES, WEIGHT_QUANTIZATIONS, ModelConfig
from jaxllm.models.common import Params

SCALE_SUFFIX = "_scale"
# Parameter keys quantized by ``quantization``: the dense projections and an untied lm_head.
QUANTIZED_KEYS = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head",
                            "experts_gate", "experts_up", "experts_down"})
# Weight quantization -> (stored dtype, largest stored magnitude).
_WEIGHT_TYPES = {"int8": (np.dtype(np.int8), 127.0), "fp8": (np.dtype(ml_dtypes.float8_e4m3fn), 448.0)}
_QUANTIZED_DTYPES = frozenset(dtype for dtype, _ in _WEIGHT_TYPES.values())
KV_QUANT_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
                   "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn)}
# Calibrated |k|, |v| maxima are mapped to the type's largest value divided by this: room for
# keys and values larger than the calibration text's (clipped beyond), at the cost of
# log2(margin) bits of int8 resolution. Chosen from the perplexity of the default model
# (README, "Quantization").
KV_SCALE_MARGIN = 2.0

# Fixed English text of the KV calibration pass (written for this purpose).
CALIBRATION_TEXT = (
    "The harbour town woke slowly. Fishing boats knocked against the wooden pier while gulls argued over "
    "the morning catch, and the baker on Quay Street pulled the first loaves from her oven. Children ran "
    "past the lighthouse on their way to school, counting the steps as they always did: one hundred and "
    "twelve, never more, never fewer. At the town hall, the mayor read a letter twice before folding it "
    "into her coat. The railway company wanted to build a station on the hill above the bay, and the "
    "council would vote on Thursday. Some said the trains would bring visitors, money and work for the "
    "young; others feared the noise, the smoke and the end of a quiet life. In the library, an old "
    "sailor explained to anyone who would listen how the tides are pulled by the moon, why the water "
    "rises twice a day, and how his grandfather had once sailed to Lisbon with nothing but a compass, a "
    "clock and a map drawn by hand. \"Numbers never lie,\" he said, \"but people who read them often do.\""
)


def quantized_dtype(quantization: str) -> np.dtype:
    """The stored dtype of ``quantization``'s weights (int8 or float8_e4m3fn)."""
    return _WEIGHT_TYPES[quantization][0]


def check_quantization(quantization: Optional[str]) -> None:
    """Raise ValueError unless ``quantization`` is None or one of :data:`WEIGHT_QUANTIZATIONS`."""
    if quantization is not None and quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} must be None or one of {WEIGHT_QUANTIZATIONS}")


def kv_number_dtype(kv_cache_dtype: str, dtype: Any) -> np.dtype:
    """The dtype of the numbers a KV cache holds: ``dtype`` (the compute dtype) for "auto",
    int8 for "int8", float8_e4m3fn for "fp8" / "fp8_e4m3" (vLLM's names).

    Raises:
      ValueError: an unknown ``kv_cache_dtype`` (named with the allowed ones).
    """
    if kv_cache_dtype == "auto":
        return np.dtype(dtype)
    if kv_cache_dtype not in KV_QUANT_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
    return KV_QUANT_DTYPES[kv_cache_dtype]


def is_quantized_dtype(dtype: Any) -> bool:
    """True for the stored dtypes of quantized weights (int8, float8_e4m3fn)."""
    return np.dtype(dtype) in _QUANTIZED_DTYPES


def leaf_dtype(key: str, stored: Any, dtype: Any) -> np.dtype:
    """The dtype parameter leaf ``key`` is held in on the device: scales float32, quantized
    weights as stored (int8, float8_e4m3fn), everything else ``dtype`` (the compute dtype)."""
    if key.endswith(SCALE_SUFFIX):
        return np.dtype(np.float32)
    if is_quantized_dtype(stored):
        return np.dtype(stored)
    return np.dtype(dtype)


def quantize_weight(w: np.ndarray, quantization: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel symmetric quantization of a ``[..., in, out]`` weight (host numpy).

    Args:
      w: float array ``[..., in, out]`` (stacked layers and experts lead).
      quantization: "int8" or "fp8".

    Returns:
      (q, scale): q ``[..., in, out]`` int8 (rounded to nearest) or float8_e4m3fn,
      scale float32 ``[..., out]`` with ``w ~= q * scale``; an all-zero channel gets scale 1.
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
    """float32 ``q * scale`` of a per-channel (``scale [..., out]``) or per-group
    (``scale [..., G, out]``) quantized ``[..., in, out]`` weight."""
    q = np.asarray(q).astype(np.float32)
    scale = np.asarray(scale, np.float32)
    if scale.ndim == q.ndim - 1:
        return q * scale[..., None, :]
    groups = scale.shape[-2]
    grouped = q.reshape(q.shape[:-2] + (groups, q.shape[-2] // groups, q.shape[-1]))
    return (grouped * scale[..., :, None, :]).reshape(q.shape)


def quantize_params(params: Params, quantization: Optional[str], dtype: Any) -> Params:
    """``params`` (host numpy) with the :data:`QUANTIZED_KEYS` leaves quantized per output channel.

    Leaves already quantized (with a ``_scale`` sibling) are kept. Other float leaves are cast
    to ``dtype``. With ``quantization`` None, only that cast.
    """
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
    """Bytes of the parameter pytree (whole arrays, whatever their sharding).

    Returns:
      ``{"total": all leaves, "quantized": the quantized weights and their scales,
      "quantized_as_float32": what those weights take as float32}``.
    """
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


def calibration_ids(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """Token ids of :data:`CALIBRATION_TEXT` (int32), or, for a model without a tokenizer,
    a fixed pseudo-random sequence of as many ids (seed 0)."""
    if tokenizer is not None:
        return np.asarray(tokenizer.encode(CALIBRATION_TEXT), np.int32)
    return np.random.default_rng(0).integers(0, vocab_size, size=256).astype(np.int32)


def calibrate_kv_scales(cfg: ModelConfig, params: Params, token_ids: np.ndarray, *, ops: Any, sharding: Any,
                        kv_dtype: Any, block_size: int = 16,
                        margin: float = KV_SCALE_MARGIN) -> tuple[jax.Array, jax.Array]:
    """Per-layer, per-head K and V scales of a quantized KV cache, from one forward pass.

    Runs the decoder (``jaxllm.models.hidden_states``, the engine's attention ops) over
    ``token_ids`` as one sequence with a float32 cache, and takes each cache head's largest
    ``|k|`` (after rope) and ``|v|`` over the sequence.

    Args:
      cfg: the model configuration.
      params: the parameter pytree on ``sharding``'s devices (quantized weights or not).
      token_ids: int32[N] the calibration tokens (:func:`calibration_ids`).
      ops: the engine's attention ops (``ModelSharding.attention_ops`` of a backend).
      sharding: the replica's ``ModelSharding``.
      kv_dtype: int8 or float8_e4m3fn, the cache's numbers.
      margin: the maximum maps to the type's largest value divided by this.

    Returns:
      (k_scale, v_scale): float32 ``[num_layers, sharding.num_cache_heads]`` on the devices,
      split over the cache heads as the cache is; ``max * margin / type max`` (1 for a head
      that saw only zeros).
    """
    from jaxllm.kv_cache import allocate_kv_cache
    from jaxllm.models import hidden_states
    from kernels_pallas.reference import KV_QUANT_MAX

    n = len(token_ids)
    num_blocks = -(-n // block_size) + 1
    kv = allocate_kv_cache(num_blocks, block_size, jnp.float32, sharding)
    positions = np.arange(n, dtype=np.int32)
    batch = dict(input_ids=token_ids.astype(np.int32), positions=positions, slot_mapping=positions + block_size,
                 block_tables=np.arange(1, num_blocks, dtype=np.int32)[None], seq_lens=np.asarray([n], np.int32),
                 query_start_loc=np.asarray([0, n], np.int32), num_seqs=np.int32(1))
    batch = jax.device_put(batch, sharding.replicated)
    limit = KV_QUANT_MAX[jnp.dtype(kv_dtype)]

    @functools.partial(jax.jit, out_shardings=sharding.kv_scale_sharding)
    def scales(params, kv, batch):
        _, (k_cache, v_cache) = hidden_states(params, kv, batch, cfg=cfg, ops=ops)
        return tuple(jnp.where(m > 0, m * margin / limit, 1.0)
                     for m in (jnp.max(jnp.abs(c), axis=(1, 2, 4)) for c in (k_cache, v_cache)))

    return scales(params, kv, batch)
