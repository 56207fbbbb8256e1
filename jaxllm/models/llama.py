"""The Llama-family decoder as a pure function over a parameter pytree.

One forward pass serves Llama (incl. Llama 3 rope scaling), Mistral (sliding
window), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm) and SmolLM2, following the HF
``modeling_llama.py`` / ``modeling_qwen3.py`` computations step for step so
that float32 logits match ``transformers``.

The step takes a ragged batch of new tokens (prefill chunks and decode rows
concatenated), writes their K/V into the paged cache through ``slot_mapping``
and attends over ``block_tables``; see ``kernels_pallas.reference`` for the
attention semantics.

Parameter pytree (dense weights stored ``[in, out]`` so that ``x @ w``; every
layer leaf stacked on a leading ``L = num_layers`` axis)::

    {"embed": [V, E], "final_norm": [E], "lm_head": [E, V] (untied only),
     "layers": {"attn_norm": [L, E], "wq": [L, E, Hq*D], "wk": [L, E, Hkv*D],
                "wv": [L, E, Hkv*D], "wo": [L, Hq*D, E], "bq"/"bk"/"bv" (qkv_bias),
                "q_norm"/"k_norm": [L, D] (qk_norm), "mlp_norm": [L, E],
                "w_gate": [L, E, F], "w_up": [L, E, F], "w_down": [L, F, E]}}

KV cache: ``(k_cache, v_cache)``, each ``[L, num_blocks, block_size,
num_kv_heads, head_dim]``.

The decoder runs as a ``lax.scan`` over the layer axis (one scan per run of
layers sharing a sliding window), so a step traces, lowers and compiles one
layer however deep the model is. Layer leaves and caches may be held as
uint16 bit patterns of bfloat16 (:func:`loop_storage`; why in
``kernels_pallas.reference``). Inside the scan the caches are viewed as
``[L * num_blocks, block_size, ...]`` and layer ``l`` addresses its blocks
as ``l * num_blocks + block``: the attention ops see one ordinary paged cache
and the block tables and slot mapping are offset per layer, so they read
only the blocks they need and write in place.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig, RopeConfig
from kernels_pallas import AttentionOps
from kernels_pallas.reference import from_storage, to_storage

Params = dict[str, Any]
KVCache = tuple[jax.Array, jax.Array]


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
    convert: Callable[[Any, bool, Any], Any] | None = None, stack: Callable[[list], Any] | None = None,
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
      stack: per-layer leaves (a list, layer order) -> one leaf with a leading
        layer axis; by default ``np.stack``. A lazy loader passes one that
        stacks lazily.

    Returns:
      The pytree of numpy arrays (or ``stack``'s leaves) described in the
      module docstring.

    Raises:
      ValueError: a tensor the config requires is missing (named), or a
        tensor has the wrong shape.
    """
    convert = convert or _convert
    stack = stack or np.stack
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
    _check_shapes(cfg, top, layers)
    stacked = {}
    for key in sorted(need):
        # Drop each layer's copy as soon as it is stacked: one extra leaf in memory at a time.
        stacked[key] = stack([layer.pop(key) for layer in layers])
    return {**top, "layers": stacked}


def _convert(array: np.ndarray, transpose: bool, dtype: Any) -> np.ndarray:
    array = np.asarray(array)
    if transpose:
        array = array.T
    return np.ascontiguousarray(array.astype(dtype, copy=False))


def _check_shapes(cfg: ModelConfig, top: dict[str, Any], layers: list[dict[str, Any]]) -> None:
    e, d = cfg.hidden_size, cfg.head_dim
    want = {
        "wq": (e, cfg.num_q_heads * d),
        "wk": (e, cfg.num_kv_heads * d),
        "wv": (e, cfg.num_kv_heads * d),
        "wo": (cfg.num_q_heads * d, e),
        "w_gate": (e, cfg.intermediate_size),
        "w_down": (cfg.intermediate_size, e),
    }
    for i, layer in enumerate(layers):
        for key, shape in want.items():
            if tuple(layer[key].shape) != shape:
                raise ValueError(f"layer {i} {key} has shape {tuple(layer[key].shape)}, config implies {shape}")
    if tuple(top["embed"].shape) != (cfg.vocab_size, e):
        raise ValueError(f"embed has shape {tuple(top['embed'].shape)}, config implies {(cfg.vocab_size, e)}")


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
    """``x @ w (+ b)`` accumulated in float32, returned in x's dtype.

    For bfloat16 weights this is both closer to HF (whose matmuls accumulate
    in float32) and faster on XLA's CPU backend, whose bf16-in/f32-out dots
    run about twice as fast as bf16-in/bf16-out ones (issue 12's profile).
    """
    y = jnp.dot(x, w, preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


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


def loop_storage(params: Params) -> Params:
    """``params`` with bfloat16 layer leaves bit-cast to uint16 (other leaves as they are).

    For XLA's CPU backend, which would otherwise convert every bfloat16 weight
    the layer scan reads to float32 and back on every step (see
    ``kernels_pallas.reference``); :func:`hidden_states` bit-casts them back
    per layer. Same bytes, same sharding.
    """
    bits = jax.jit(lambda a: to_storage(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a)
    return {**params, "layers": jax.tree_util.tree_map(bits, params["layers"])}


def layer_segments(cfg: ModelConfig) -> list[tuple[int, int, int | None]]:
    """Runs of consecutive layers sharing a sliding window: ``(start, stop, window)``.

    Each run is one ``lax.scan`` (the window is static in the attention ops):
    one run for Llama or Mistral, two or more for models that mix windowed
    and full layers.
    """
    segments: list[tuple[int, int, int | None]] = []
    for i, window in enumerate(cfg.sliding_windows):
        if segments and segments[-1][2] == window:
            segments[-1] = (segments[-1][0], i + 1, window)
        else:
            segments.append((i, i + 1, window))
    return segments


def hidden_states(
    params: Params,
    kv_cache: KVCache,
    batch: dict[str, jax.Array],
    *,
    cfg: ModelConfig,
    ops: AttentionOps,
) -> tuple[jax.Array, KVCache]:
    """The decoder over a ragged batch, up to the final norm (HF's ``last_hidden_state``).

    Args:
      params: the parameter pytree (module docstring).
      kv_cache: ``(k_cache, v_cache)``, each
        ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
      batch: ``input_ids, positions, slot_mapping: int32[T]``,
        ``block_tables: int32[S, W]``, ``seq_lens: int32[S]``,
        ``query_start_loc: int32[S + 1]``, ``num_seqs: int32[]``.
      cfg: model configuration (static).
      ops: attention kernels or references (static).

    Returns:
      (hidden, kv_cache): hidden ``[T, hidden_size]`` in the params' dtype,
      normed by ``final_norm``, and the caches with this step's K/V written.
    """
    x = jnp.take(params["embed"], batch["input_ids"], axis=0, mode="clip")
    inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope))
    freqs = batch["positions"].astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    k_cache, v_cache = kv_cache
    num_blocks, block_size = k_cache.shape[1], k_cache.shape[2]
    flat = (k_cache.shape[0] * num_blocks,) + k_cache.shape[2:]

    def layer_step(window: int | None) -> Callable:
        def step(carry, layer_and_index):
            x, k_flat, v_flat = carry
            layer, index = layer_and_index
            layer = jax.tree_util.tree_map(from_storage, layer)
            first_block = index * num_blocks
            layer_batch = dict(batch, block_tables=batch["block_tables"] + first_block,
                               slot_mapping=batch["slot_mapping"] + first_block * block_size)
            attn, (k_flat, v_flat) = _attention_block(layer, x, (k_flat, v_flat), layer_batch, cos, sin, cfg,
                                                      window, ops)
            x = x + attn
            x = x + _mlp_block(layer, x, cfg)
            return (x, k_flat, v_flat), None
        return step

    carry = (x, k_cache.reshape(flat), v_cache.reshape(flat))
    for start, stop, window in layer_segments(cfg):
        layers = params["layers"]
        if (start, stop) != (0, cfg.num_layers):
            layers = jax.tree_util.tree_map(lambda a: a[start:stop], layers)
        carry, _ = jax.lax.scan(layer_step(window), carry, (layers, jnp.arange(start, stop, dtype=jnp.int32)))
    x, k_flat, v_flat = carry
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), (k_flat.reshape(k_cache.shape),
                                                                  v_flat.reshape(v_cache.shape))


def compute_logits(params: Params, hidden: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """The lm_head (or the tied embedding): hidden ``[N, hidden_size]`` ->
    logits float32 ``[N, vocab]``, accumulated in float32.

    The tied embedding ``[V, E]`` is contracted on its second axis directly:
    ``hidden @ embed.T`` would make XLA's CPU backend transpose the whole
    table in bfloat16 on every step (5x slower there).
    """
    if cfg.tie_word_embeddings:
        return jax.lax.dot_general(hidden, params["embed"], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    return jnp.dot(hidden, params["lm_head"], preferred_element_type=jnp.float32)


def forward(
    params: Params,
    kv_cache: KVCache,
    batch: dict[str, jax.Array],
    *,
    cfg: ModelConfig,
    ops: AttentionOps,
    all_logits: bool = False,
) -> tuple[jax.Array, KVCache]:
    """One model step: :func:`hidden_states`, then :func:`compute_logits` of
    the rows at ``batch["logits_indices"]: int32[S]``.

    Args:
      params, kv_cache, batch, cfg, ops: as :func:`hidden_states`.
      all_logits: return logits for every token row instead of ``logits_indices``.

    Returns:
      (logits, kv_cache): logits float32 ``[S, vocab]`` (``[T, vocab]`` with
      ``all_logits``), and the caches with this step's K/V written.
    """
    hidden, kv_cache = hidden_states(params, kv_cache, batch, cfg=cfg, ops=ops)
    if not all_logits:
        hidden = hidden[batch["logits_indices"]]
    return compute_logits(params, hidden, cfg=cfg), kv_cache
