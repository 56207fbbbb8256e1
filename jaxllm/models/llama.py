"""The Llama-family decoder as a pure function over a parameter pytree.

One forward pass serves Llama (incl. Llama 3 rope scaling), Mistral (sliding
window), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm) and SmolLM2, following the HF
``modeling_llama.py`` / ``modeling_qwen3.py`` computations step for step so
that float32 logits match ``transformers``.

The step takes a ragged batch of new tokens (prefill chunks and decode rows
concatenated), writes their K/V into the paged cache through ``slot_mapping``
and attends over ``block_tables``; see ``kernels_pallas.reference`` for the
attention semantics.

Parameter pytree (dense weights stored ``[in, out]`` so that ``x @ w``)::

    {"embed": [V, E], "final_norm": [E], "lm_head": [E, V] (untied only),
     "layers": [{"attn_norm": [E], "wq": [E, Hq*D], "wk": [E, Hkv*D],
                 "wv": [E, Hkv*D], "wo": [Hq*D, E], "bq"/"bk"/"bv" (qkv_bias),
                 "q_norm"/"k_norm": [D] (qk_norm), "mlp_norm": [E],
                 "w_gate": [E, F], "w_up": [E, F], "w_down": [F, E]}, ...]}
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig, RopeConfig

Params = dict[str, Any]
KVCache = list[tuple[jax.Array, jax.Array]]


class AttentionOps(NamedTuple):
    """The two attention entry points a step needs (kernel or reference);
    signatures as in ``kernels_pallas.reference``."""

    ragged_paged_attention: Callable[..., jax.Array]
    kv_cache_write: Callable[..., tuple[jax.Array, jax.Array]]


_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.bias": ("bo", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "mlp.gate_proj.bias": ("b_gate", False),
    "mlp.up_proj.bias": ("b_up", False),
    "mlp.down_proj.bias": ("b_down", False),
}
_TOP_NAMES = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}


def expected_layer_keys(cfg: ModelConfig) -> set[str]:
    """Pytree keys each layer must have under ``cfg``'s flags."""
    keys = {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"}
    if cfg.qkv_bias:
        keys |= {"bq", "bk", "bv"}
    if cfg.o_bias:
        keys.add("bo")
    if cfg.mlp_bias:
        keys |= {"b_gate", "b_up", "b_down"}
    if cfg.qk_norm:
        keys |= {"q_norm", "k_norm"}
    return keys


def params_from_hf(
    cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], dtype: Any, source: str = "checkpoint",
    convert: Callable[[Any, bool, Any], Any] | None = None,
) -> Params:
    """Map HF-named tensors to the jaxllm parameter pytree (numpy, host).

    Args:
      cfg: the model configuration.
      tensors: ``(hf_name, array)`` pairs in HF orientation (``[out, in]``).
      dtype: numpy/ml_dtypes dtype of the result.
      source: named in error messages (the file or folder).
      convert: ``(array, transpose, dtype) -> leaf``; by default a contiguous
        numpy array of ``dtype``. A loader that places weights slice by slice
        passes one that keeps tensors lazy (anything with ``.shape``).

    Returns:
      The pytree of numpy arrays (or ``convert``'s leaves) described in the
      module docstring.

    Raises:
      ValueError: a tensor the config requires is missing (named), or a
        tensor has the wrong shape.
    """
    convert = convert or _convert
    layers: list[dict[str, np.ndarray]] = [{} for _ in range(cfg.num_layers)]
    top: dict[str, np.ndarray] = {}
    for name, array in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name.startswith("model.layers."):
            idx_str, _, rest = name[len("model.layers."):].partition(".")
            idx = int(idx_str)
            if rest not in _LAYER_NAMES or idx >= cfg.num_layers:
                continue
            key, transpose = _LAYER_NAMES[rest]
            layers[idx][key] = convert(array, transpose, dtype)
        elif name in _TOP_NAMES:
            key, transpose = _TOP_NAMES[name]
            top[key] = convert(array, transpose, dtype)
    required_top = {"embed", "final_norm"} | (set() if cfg.tie_word_embeddings else {"lm_head"})
    hf_top = {key: name for name, (key, _) in _TOP_NAMES.items()}
    hf_layer = {key: name for name, (key, _) in _LAYER_NAMES.items()}
    missing = [hf_top[k] for k in sorted(required_top - top.keys())]
    need = expected_layer_keys(cfg)
    for i, layer in enumerate(layers):
        missing += [f"model.layers.{i}.{hf_layer[k]}" for k in sorted(need - layer.keys())]
    if missing:
        raise ValueError(f"{source} is missing tensors required by {cfg.architecture}: {missing[:8]}")
    if cfg.tie_word_embeddings:
        top.pop("lm_head", None)
    params: Params = {**top, "layers": layers}
    _check_shapes(cfg, params)
    return params


def _convert(array: np.ndarray, transpose: bool, dtype: Any) -> np.ndarray:
    array = np.asarray(array)
    if transpose:
        array = array.T
    return np.ascontiguousarray(array.astype(dtype, copy=False))


def _check_shapes(cfg: ModelConfig, params: Params) -> None:
    e, d = cfg.hidden_size, cfg.head_dim
    want = {
        "wq": (e, cfg.num_q_heads * d),
        "wk": (e, cfg.num_kv_heads * d),
        "wv": (e, cfg.num_kv_heads * d),
        "wo": (cfg.num_q_heads * d, e),
        "w_gate": (e, cfg.intermediate_size),
        "w_down": (cfg.intermediate_size, e),
    }
    for i, layer in enumerate(params["layers"]):
        for key, shape in want.items():
            if layer[key].shape != shape:
                raise ValueError(f"layer {i} {key} has shape {layer[key].shape}, config implies {shape}")
    if params["embed"].shape != (cfg.vocab_size, e):
        raise ValueError(f"embed has shape {params['embed'].shape}, config implies {(cfg.vocab_size, e)}")


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` float32, as HF's rope init
    functions compute them (default, linear, llama3)."""
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    if rope.rope_type == "linear":
        return (inv_freq / rope.factor).astype(np.float32)
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF ``rotate_half`` rotary embedding.

    x: [T, H, D]; cos, sin: [T, D // 2] float32. Returns x's dtype.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF ``LlamaRMSNorm``: normalise in float32, scale in x's dtype.

    x: [..., N]; weight: [N]."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    y = x @ w
    return y if b is None else y + b


def _attention_block(
    layer: dict[str, jax.Array],
    x: jax.Array,
    kv: tuple[jax.Array, jax.Array],
    batch: dict[str, jax.Array],
    cos: jax.Array,
    sin: jax.Array,
    cfg: ModelConfig,
    window: int | None,
    ops: AttentionOps,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    t = x.shape[0]
    h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    q = _linear(h, layer["wq"], layer.get("bq")).reshape(t, cfg.num_q_heads, cfg.head_dim)
    k = _linear(h, layer["wk"], layer.get("bk")).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = _linear(h, layer["wv"], layer.get("bv")).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    k_cache, v_cache = ops.kv_cache_write(kv[0], kv[1], k, v, batch["slot_mapping"])
    attn = ops.ragged_paged_attention(
        q, k_cache, v_cache, batch["block_tables"], batch["seq_lens"], batch["query_start_loc"],
        batch["num_seqs"], scale=cfg.head_dim ** -0.5, sliding_window=window,
    )
    out = _linear(attn.reshape(t, cfg.num_q_heads * cfg.head_dim), layer["wo"], layer.get("bo"))
    return out, (k_cache, v_cache)


def _mlp_block(layer: dict[str, jax.Array], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    gate = _linear(h, layer["w_gate"], layer.get("b_gate"))
    up = _linear(h, layer["w_up"], layer.get("b_up"))
    return _linear(jax.nn.silu(gate) * up, layer["w_down"], layer.get("b_down"))


def hidden_states(
    params: Params,
    kv_caches: KVCache,
    batch: dict[str, jax.Array],
    *,
    cfg: ModelConfig,
    ops: AttentionOps,
) -> tuple[jax.Array, KVCache]:
    """The decoder over a ragged batch, up to the final norm (HF's ``last_hidden_state``).

    Args:
      params: the parameter pytree (module docstring).
      kv_caches: per layer ``(k_cache, v_cache)``, each
        ``[num_blocks, block_size, num_kv_heads, head_dim]``.
      batch: ``input_ids, positions, slot_mapping: int32[T]``,
        ``block_tables: int32[S, W]``, ``seq_lens: int32[S]``,
        ``query_start_loc: int32[S + 1]``, ``num_seqs: int32[]``.
      cfg: model configuration (static).
      ops: attention kernels or references (static).

    Returns:
      (hidden, kv_caches): hidden ``[T, hidden_size]`` in the params' dtype,
      normed by ``final_norm``, and the caches with this step's K/V written.
    """
    x = params["embed"][batch["input_ids"]]
    inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope))
    freqs = batch["positions"].astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    new_caches: KVCache = []
    for i, layer in enumerate(params["layers"]):
        attn, kv = _attention_block(layer, x, kv_caches[i], batch, cos, sin, cfg, cfg.sliding_windows[i], ops)
        x = x + attn
        x = x + _mlp_block(layer, x, cfg)
        new_caches.append(kv)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), new_caches


def compute_logits(params: Params, hidden: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """The lm_head (or the tied embedding): hidden ``[N, hidden_size]`` ->
    logits float32 ``[N, vocab]``, accumulated in float32."""
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(hidden, head, preferred_element_type=jnp.float32)


def forward(
    params: Params,
    kv_caches: KVCache,
    batch: dict[str, jax.Array],
    *,
    cfg: ModelConfig,
    ops: AttentionOps,
    all_logits: bool = False,
) -> tuple[jax.Array, KVCache]:
    """One model step: :func:`hidden_states`, then :func:`compute_logits` of
    the rows at ``batch["logits_indices"]: int32[S]``.

    Args:
      params, kv_caches, batch, cfg, ops: as :func:`hidden_states`.
      all_logits: return logits for every token row instead of ``logits_indices``.

    Returns:
      (logits, kv_caches): logits float32 ``[S, vocab]`` (``[T, vocab]`` with
      ``all_logits``), and the caches with this step's K/V written.
    """
    hidden, kv_caches = hidden_states(params, kv_caches, batch, cfg=cfg, ops=ops)
    if not all_logits:
        hidden = hidden[batch["logits_indices"]]
    return compute_logits(params, hidden, cfg=cfg), kv_caches
