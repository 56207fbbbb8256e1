"""A config's parameter pytree leaf by leaf (``LLM(params=...)`` / ``LLM.get_params()``); paths like ``"layers/wq"``."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from jaxllm.models.config import ModelConfig
from jaxllm.worker.quantization import QUANTIZED_KEYS, SCALE_SUFFIX, quantized_dtype


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every known layer key, without the layer axis."""
    e, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv, x, fx = cfg.num_q_heads * d, cfg.num_kv_heads * d, cfg.num_experts, cfg.moe_intermediate_size
    norms = {k: (e,) for k in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "bo", "b_down")}
    return {
        **norms, "wq": (e, q), "wk": (e, kv), "wv": (e, kv), "wo": (q, e), "bq": (q,), "bk": (kv,), "bv": (kv,),
        "q_norm": (d,), "k_norm": (d,), "w_gate": (e, f), "w_up": (e, f), "w_down": (f, e), "b_gate": (f,),
        "b_up": (f,), "router": (e, x), "experts_gate": (x, e, fx), "experts_up": (x, e, fx),
        "experts_down": (x, fx, e),
    }


def leaf_layout(cfg: ModelConfig, layer_keys: set[str], dtype: Any = np.float32,
                quantization: Optional[str] = None) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Every leaf of ``cfg``'s parameter pytree: path -> (shape, dtype), in path order.

    Args:
      cfg: the model config. layer_keys: one layer's keys (``Family.layer_keys(cfg)``).
      dtype: the compute dtype of float leaves.
      quantization: None, "int8" or "fp8": dense projections quantized, each with a float32
        ``<key>_scale`` per output channel.

    Returns:
      ``{"embed": ((V, E), dtype), ..., "layers/wq": ((L, E, Hq*D), dtype), ...}`` (KV-cache scales not listed).

    Raises:
      ValueError: a layer key with no known shape (named).
    """
    e, v, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    shapes = {"embed": (v, e), "final_norm": (e,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (e, v)
    known = _layer_shapes(cfg)
    for key in sorted(layer_keys):
        if key not in known:
            raise ValueError(f"layer key {key!r} of {cfg.architecture} has no shape in jaxllm.models.layout")
        shapes[f"layers/{key}"] = (layers,) + known[key]
    out: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for path, shape in shapes.items():
        key = path.rsplit("/", 1)[-1]
        if quantization and key in QUANTIZED_KEYS:
            out[path] = (shape, quantized_dtype(quantization))
            out[path + SCALE_SUFFIX] = (shape[:-2] + shape[-1:], np.dtype(np.float32))
        else:
            out[path] = (shape, np.dtype(dtype))
    return dict(sorted(out.items()))


def layout_table(layout: dict[str, tuple[tuple[int, ...], Any]]) -> str:
    """A :func:`leaf_layout` as a Markdown table (leaf, shape, dtype)."""
    rows = [f"| `{path}` | {list(shape)} | {np.dtype(dt).name} |" for path, (shape, dt) in layout.items()]
    return "\n".join(["| leaf | shape | dtype |", "|---|---|---|"] + rows)
