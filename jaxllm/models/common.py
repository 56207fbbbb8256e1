"""The pieces every decoder family shares: norms, rotary embeddings, the gated
MLP, the paged attention of one layer, the scan over stacked layers and the
logits.

Each family (``llama.py``, ``gemma3.py``, ...) is a :class:`Family`: how it
embeds tokens, what one layer computes from these pieces, and its final norm.
:func:`hidden_states` runs any of them over a ragged batch of new tokens
(prefill chunks and decode rows concatenated): each layer writes its K/V into
the paged cache through ``slot_mapping`` and attends over ``block_tables``
(``kernels_pallas.attention.reference`` states the attention semantics).

Parameter pytree (dense weights stored ``[in, out]`` so that ``x @ w``; every
layer leaf stacked on a leading ``L = num_layers`` axis; which layer keys a
family has is ``jaxllm.loader.params.expected_layer_keys``)::

    {"embed": [V, E], "final_norm": [E], "lm_head": [E, V] (untied only),
     "layers": {"attn_norm": [L, E], "wq": [L, E, Hq*D], "wk": [L, E, Hkv*D],
                "wv": [L, E, Hkv*D], "wo": [L, Hq*D, E], "mlp_norm": [L, E],
                "w_gate": [L, E, F], "w_up": [L, E, F], "w_down": [L, F, E], ...}}

Quantized weights (``jaxllm.worker.quantization``) are int8 or float8_e4m3fn leaves
with a float32 ``"<key>_scale"`` sibling (``[L, out]`` per output channel, or
``[L, G, out]`` per group of input rows); :func:`dot_f32` takes either. A
quantized KV cache has ``"k_scale"``, ``"v_scale": [L, cache heads]`` layer
leaves (the heads the cache holds, ``ModelSharding.num_cache_heads``), handed
to the attention ops.

KV cache: ``(k_cache, v_cache)``, each ``[L, num_blocks, block_size,
num_kv_heads, head_dim]``. Beside it, optionally, the pool of compressed blocks
(``kernels_pallas.storage.CompressedKV``, each array with a leading ``L``):
block-table ids ``>= num_blocks`` name its blocks (``num_blocks + slot``), and
each layer's ids are offset into the flattened pool as into the cache.

Layers run as ``lax.scan``s that carry the hidden state and the caches and
read layer ``l``'s weights by index from the stacked leaves, so a step traces,
lowers and compiles one layer per distinct kind of layer however deep the
model is (:func:`layer_plan`). Layer leaves and caches may be held as uint16
bit patterns of bfloat16, uint8 ones of float8 (:func:`loop_storage`; why in
``kernels_pallas.storage``). Inside the scan the caches are viewed as
``[L * num_blocks, block_size, num_kv_heads * head_dim]`` and layer ``l``
addresses its blocks as ``l * num_blocks + block``: the attention ops see one
ordinary paged cache (:meth:`LayerContext.attend` gives them its 4-d view)
and the block tables and slot mapping are offset per layer, so they read only
the blocks they need and write in place. The scan carries no unit KV-head
axis: with one KV head (Gemma 3 270M), XLA's CPU layout assignment would move
it and copy the whole cache on every layer.

Every kernel is reached through the ops table (``kernels_pallas.ops``), which picks its backend: a layer's
projections (:func:`project`) may read their weights in place from the stacked leaves on the CPU, and the model
step's logits (:func:`compute_logits`) may run on the CPU kernel, for the step's real rows only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.config import ModelConfig, RopeConfig
from kernels_pallas.ops import (BITS_STORAGE, AttentionOps, CompressedKV, from_storage, layer_matmul, lm_head,
                                lm_head_panels, to_storage, with_lm_head_panels, with_stacked_weights)

if TYPE_CHECKING:
    from jaxllm.worker.step_batch import StepBatch

Params = dict[str, Any]
KVCache = tuple[jax.Array, jax.Array]
# (start, stop, sliding window) of a run of consecutive layers of one kind.
Segment = tuple[int, int, Optional[int]]


def dot_f32(x: jax.Array, w: jax.Array, scale: Optional[jax.Array] = None) -> jax.Array:
    """``x @ w`` in float32, for a float or a quantized weight.

    x: [T, in]; w: [in, out], float or (with ``scale``) int8 / float8_e4m3fn.
    scale: None; float32 ``[out]`` per output channel: ``(x @ w.astype(x.dtype)) * scale``;
    or ``[G, out]`` per group of ``in / G`` input rows: the weight is dequantized group by
    group (``w * scale`` in float32, then x's dtype) before the matmul (GGUF Q8_0 blocks).
    Returns float32 [T, out].

    Per channel, the scale multiplies the ``[T, out]`` output rather than the ``[in, out]``
    weight; ``scripts/bench_quant_matmul.py`` times both and the alternatives on a backend.
    """
    if scale is None:
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    if scale.ndim == w.ndim - 1:
        return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32) * scale
    groups, (rows, cols) = scale.shape[-2], w.shape
    grouped = w.reshape(groups, rows // groups, cols).astype(jnp.float32) * scale[:, None, :]
    return jnp.dot(x, grouped.reshape(rows, cols).astype(x.dtype), preferred_element_type=jnp.float32)


def linear(x: jax.Array, w: jax.Array, b: Optional[jax.Array] = None,
           scale: Optional[jax.Array] = None) -> jax.Array:
    """``x @ w (+ b)`` accumulated in float32, returned in x's dtype.

    For bfloat16 weights this is both closer to HF (whose matmuls accumulate in float32) and faster on XLA's CPU
    backend, whose bf16-in/f32-out dots run faster than bf16-in/bf16-out ones. A quantized ``w`` comes with its
    ``scale`` (:func:`dot_f32`).
    """
    y = dot_f32(x, w, scale)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def project(layer: dict[str, jax.Array], key: str, x: jax.Array, bias: Optional[str] = None) -> jax.Array:
    """``linear`` through ``layer[key]``, its ``key + "_scale"`` when quantized and the
    ``bias`` leaf when the layer has it. x: [T, in] -> [T, out] in x's dtype.

    An unquantized weight goes through the ops table's ``layer_matmul``, which inside the layer scan may read it
    in place from the stacked leaf and compute only the step's tokens (the padding rows of its bucket come out
    zeros, then the bias)."""
    b = layer.get(bias) if bias else None
    scale = layer.get(key + "_scale")
    y = layer_matmul(layer, key, x) if scale is None else dot_f32(x, layer[key], scale)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF ``LlamaRMSNorm``: normalise in float32, scale in x's dtype.

    x: [..., N]; weight: [N]."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def gated_mlp(layer: dict[str, jax.Array], h: jax.Array, act: str) -> jax.Array:
    """``down(act(gate(h)) * up(h))``: SwiGLU (``act="silu"``) or GeGLU
    (``"gelu_pytorch_tanh"``), with the optional ``b_*`` biases.

    h: [T, E] -> [T, E], through ``w_gate``, ``w_up``: [E, F] and ``w_down``: [F, E].
    """
    gate = project(layer, "w_gate", h, "b_gate")
    up = project(layer, "w_up", h, "b_up")
    return project(layer, "w_down", _ACTIVATIONS[act](gate) * up, "b_down")


# ------------------------------------------------------------------ rotary embeddings

def rope_inv_freq(head_dim: int, rope: RopeConfig, long: bool = False) -> np.ndarray:
    """Inverse frequencies ``[rotary_dim // 2]`` float32, as HF's rope init
    functions compute them (default, linear, llama3, longrope); ``rotary_dim``
    is ``head_dim * rope.partial_rotary_factor``. ``long`` picks LongRoPE's
    ``long_factor`` instead of its ``short_factor``."""
    dim = int(head_dim * rope.partial_rotary_factor)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    if rope.rope_type == "longrope":
        factors = np.asarray(rope.long_factor if long else rope.short_factor, np.float32)
        return (1.0 / (factors * rope.theta ** exponents)).astype(np.float32)
    inv_freq = 1.0 / (rope.theta ** exponents)
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


def rope_cos_sin(rope: RopeConfig, head_dim: int, batch: StepBatch) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[T, rotary_dim // 2]`` float32 of each token's position.

    LongRoPE picks its long factors for the tokens of a sequence longer than
    ``original_max_position_embeddings`` (``seq_lens`` of the token's row), as
    HF does for one sequence (it decides on the longest position of the
    forward call), and scales cos and sin by ``attention_factor``.
    """
    positions = batch.positions.astype(jnp.float32)[:, None]
    inv_freq = jnp.asarray(rope_inv_freq(head_dim, rope))
    if rope.rope_type == "longrope":
        num_rows = batch.seq_lens.shape[0]
        row = jnp.searchsorted(batch.query_start_loc[1:], jnp.arange(positions.shape[0]), side="right")
        long = batch.seq_lens[jnp.minimum(row, num_rows - 1)] > rope.original_max_position_embeddings
        inv_freq = jnp.where(long[:, None], jnp.asarray(rope_inv_freq(head_dim, rope, long=True)), inv_freq)
    freqs = positions * inv_freq
    return jnp.cos(freqs) * rope.attention_factor, jnp.sin(freqs) * rope.attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF ``rotate_half`` rotary embedding of the first ``2 * cos.shape[-1]``
    dimensions of each head (all of them unless the rope is partial).

    x: [T, H, D]; cos, sin: [T, R // 2] float32. Returns x's dtype.
    """
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)


# ------------------------------------------------------------------ one layer's attention

class LayerContext(NamedTuple):
    """What one layer's computation needs besides its weights and the caches.

    batch: the step's batch with ``block_tables`` and ``slot_mapping`` offset to
      this layer's blocks of the flattened caches.
    window: the layer's sliding window (static), None for full attention.
    cos, sin: [T, R // 2] float32 of this layer's rope.
    num_tokens: int32[] the batch's real (unpadded) tokens.
    kv_scales: a quantized cache's float32 ``(k_scale, v_scale)``, each
      ``[cache heads]`` of this layer; None for a cache of plain values.
    compressed: the pool of compressed blocks, every layer's, flattened to
      ``[L * C, ...]`` (this layer's block tables are offset into it), or None.
    """

    cfg: ModelConfig
    ops: AttentionOps
    batch: StepBatch
    window: Optional[int]
    cos: jax.Array
    sin: jax.Array
    num_tokens: jax.Array
    kv_scales: Optional[tuple[jax.Array, jax.Array]] = None
    compressed: Optional[CompressedKV] = None

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, kv: KVCache) -> tuple[jax.Array, KVCache]:
        """Rope q and k, write k and v into the paged cache, attend.

        q: [T, Hq, D]; k, v: [T, Hkv, D]; kv: this step's flattened caches,
        each ``[L * num_blocks, block_size, heads * D]`` (``heads``: the
        cache's, more than Hkv where tensor parallelism replicates them).
        Returns (attention output [T, Hq * D], the caches with k and v written).
        The scale is ``cfg.attention_scale``, the window the layer's ``window``.
        """
        cfg, t = self.cfg, q.shape[0]
        q = apply_rope(q, self.cos, self.sin)
        k = apply_rope(k, self.cos, self.sin)
        blocks = kv[0].shape[:2] + (-1, cfg.head_dim)
        scales = dict(zip(("k_scale", "v_scale"), self.kv_scales)) if self.kv_scales else {}
        k_cache, v_cache = self.ops.kv_cache_write(kv[0].reshape(blocks), kv[1].reshape(blocks), k, v,
                                                   self.batch.slot_mapping, **scales)
        pool = {} if self.compressed is None else {"compressed": self.compressed}
        out = self.ops.ragged_paged_attention(
            q, k_cache, v_cache, self.batch.block_tables, self.batch.seq_lens, self.batch.query_start_loc,
            self.batch.num_seqs, scale=cfg.attention_scale, sliding_window=self.window, **scales, **pool,
        )
        return out.reshape(t, cfg.num_q_heads * cfg.head_dim), (k_cache.reshape(kv[0].shape),
                                                                v_cache.reshape(kv[1].shape))


def attention_block(layer: dict[str, jax.Array], h: jax.Array, kv: KVCache, ctx: LayerContext,
                    norm: Callable[[jax.Array, jax.Array, float], jax.Array] = rms_norm) -> tuple[jax.Array, KVCache]:
    """q/k/v projections (``wq``, ``wk``, ``wv``, optional ``b*`` biases),
    optional per-head ``q_norm``/``k_norm`` with ``norm``, paged attention and
    the ``wo`` projection, as HF's Llama/Qwen3/Gemma3 attention modules.

    h: [T, E] (already normed) -> ([T, E], the caches with this layer's K/V).
    """
    cfg, t = ctx.cfg, h.shape[0]
    q = project(layer, "wq", h, "bq").reshape(t, cfg.num_q_heads, cfg.head_dim)
    k = project(layer, "wk", h, "bk").reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = project(layer, "wv", h, "bv").reshape(t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = norm(q, layer["q_norm"], cfg.rms_norm_eps)
        k = norm(k, layer["k_norm"], cfg.rms_norm_eps)
    attn, kv = ctx.attend(q, k, v, kv)
    return project(layer, "wo", attn, "bo"), kv


# ------------------------------------------------------------------ families and the layer scan

def embed_tokens(params: Params, input_ids: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rows of ``embed`` [V, E] for ``input_ids`` int32[T] (out of range ids clip)."""
    return jnp.take(params["embed"], input_ids, axis=0, mode="clip")


def final_rms_norm(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """:func:`rms_norm` of x [T, E] by the ``final_norm`` leaf [E] (Llama's ``model.norm``)."""
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


# HF names of the top-level tensors (outside the layers) of every built-in family -> (pytree key, transpose).
HF_TOP_NAMES = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family: its checkpoint names and what it computes (``jaxllm.models.register_model``
    states the protocol a family from outside jaxllm follows).

    hf_layer_names: HF tensor name inside ``{hf_layer_prefix}{i}.`` -> (pytree
      key, transpose from HF's ``[out, in]``). Expert tensors are named with
      ``*`` for the expert index (``mlp.experts.*.gate_proj.weight``); their
      leaves stack the experts: ``[L, num_experts, ...]``.
    layer_keys: ``cfg -> set`` of the layer keys a model of the family has.
    layer: ``(layer weights, x [T, E], kv, LayerContext) -> (x, kv)``: one
      decoder layer, residuals included.
    unfuse: ``(hf layer name, array, cfg) -> [(hf layer name, array)]`` that
      splits fused HF tensors into the names of ``hf_layer_names`` (Phi-3's
      ``qkv_proj``); arrays in HF orientation, sliced on their first axis.
    embed: ``(params, input_ids, cfg) -> x [T, E]``.
    final_norm: ``(params, x [T, E], cfg) -> x``, before the logits.
    hf_top_names: HF name -> (pytree key, transpose) of the tensors outside
      the layers; every key is required but ``lm_head`` under tied embeddings.
    hf_layer_prefix: what precedes a layer's index in its tensors' HF names.
    hf_config: ``config.json dict -> dict`` with the names ``ModelConfig.from_hf_config``
      reads (``hidden_size``, ...), for a checkpoint that names them otherwise; None: as it is.
    param_axes: logical axes (``jaxllm.worker.sharding.PARAM_AXES``'s names) of the family's
      own leaves, layer leaves without their ``L`` axis; a leaf that neither table names is
      replicated on every device.
    leaf_shapes: ``cfg -> {key: shape}`` of the family's own layer leaves (without ``L``),
      checked when the weights load (the shared keys ``wq``, ``w_up``, ... are checked anyway).
    """

    hf_layer_names: dict[str, tuple[str, bool]]
    layer_keys: Callable[[ModelConfig], set[str]]
    layer: Callable[[dict[str, jax.Array], jax.Array, KVCache, LayerContext], tuple[jax.Array, KVCache]]
    unfuse: Optional[Callable[[str, Any, ModelConfig], list[tuple[str, Any]]]] = None
    embed: Callable[[Params, jax.Array, ModelConfig], jax.Array] = embed_tokens
    final_norm: Callable[[Params, jax.Array, ModelConfig], jax.Array] = final_rms_norm
    hf_top_names: dict[str, tuple[str, bool]] = dataclasses.field(default_factory=lambda: dict(HF_TOP_NAMES))
    hf_layer_prefix: str = "model.layers."
    hf_config: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None
    param_axes: dict[str, tuple[Optional[str], ...]] = dataclasses.field(default_factory=dict)
    leaf_shapes: Optional[Callable[[ModelConfig], dict[str, tuple[int, ...]]]] = None


def loop_storage(params: Params) -> Params:
    """``params`` with bfloat16 layer leaves bit-cast to uint16 and float8_e4m3fn ones
    (quantized weights) to uint8 (other leaves as they are).

    For XLA's CPU backend, which would otherwise convert every bfloat16 (or
    float8) weight the layer scan reads to float32 and back on every step (see
    ``kernels_pallas.storage``); :func:`hidden_states` bit-casts them back
    per layer. Same bytes, same sharding.
    """
    bits = jax.jit(lambda a: to_storage(a, BITS_STORAGE[a.dtype]))
    return {**params, "layers": jax.tree_util.tree_map(lambda a: bits(a) if a.dtype in BITS_STORAGE else a,
                                                       params["layers"])}


def layer_segments(windows: tuple[Optional[int], ...], offset: int = 0) -> list[Segment]:
    """Runs of consecutive layers sharing a sliding window: ``(start, stop, window)``,
    layer indices shifted by ``offset``."""
    segments: list[Segment] = []
    for i, window in enumerate(windows, start=offset):
        if segments and segments[-1][2] == window:
            segments[-1] = (segments[-1][0], i + 1, window)
        else:
            segments.append((i, i + 1, window))
    return segments


def layer_plan(cfg: ModelConfig) -> tuple[list[Segment], int, list[Segment]]:
    """How the layers are scanned: ``(period, repeats, rest)``.

    The window is static in the attention ops, so each kind of layer is its
    own scan body. A model whose layer kinds repeat with a period of several
    kinds (Gemma 3: 5 sliding-window layers, then a global one) runs an outer
    scan over ``repeats`` periods, each scanning the runs of ``period``
    (layer indices within the period); the ``rest`` runs follow (absolute
    indices; a partial last period, or every layer of a model without such a
    period). Gemma 3 270M (18 layers) compiles 2 layer bodies this way, not
    the 6 of one scan per run; Llama, one window throughout, is one run.
    """
    windows = cfg.sliding_windows or (None,) * cfg.num_layers
    n = len(windows)
    period = next(p for p in range(1, n + 1) if all(windows[i] == windows[i % p] for i in range(n)))
    repeats = n // period
    if period == 1 or repeats < 2:
        return [], 0, layer_segments(windows)
    return layer_segments(windows[:period]), repeats, layer_segments(windows[repeats * period:], repeats * period)


def hidden_states(
    params: Params,
    kv_cache: KVCache,
    batch: StepBatch,
    *,
    cfg: ModelConfig,
    ops: AttentionOps,
    family: Family,
    compressed: Optional[CompressedKV] = None,
) -> tuple[jax.Array, KVCache]:
    """The decoder over a ragged batch, up to the final norm (HF's ``last_hidden_state``).

    Args:
      params: the parameter pytree (module docstring).
      kv_cache: ``(k_cache, v_cache)``, each
        ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
      batch: the step's batch; the decoder reads ``input_ids, positions,
        slot_mapping: int32[T]``, ``block_tables: int32[S, W]``,
        ``seq_lens: int32[S]``, ``query_start_loc: int32[S + 1]`` and
        ``num_seqs: int32[]``.
      cfg: model configuration (static).
      ops: attention kernels or references (static).
      family: the decoder family (static).
      compressed: the pool of compressed blocks, ``k, v: [num_layers, C, block_size, cache heads, head_dim]``,
        ``k_scale, v_scale: float32[num_layers, C, cache heads]``, read where a block table holds an id
        ``>= num_blocks``; None: no such id.

    Returns:
      (hidden, kv_cache): hidden ``[T, hidden_size]`` in the params' dtype,
      normed by ``final_norm``, and the caches with this step's K/V written.
    """
    x = family.embed(params, batch.input_ids, cfg)
    ropes = {None: rope_cos_sin(cfg.rope, cfg.head_dim, batch)}
    if cfg.local_rope is not None:
        ropes["local"] = rope_cos_sin(cfg.local_rope, cfg.head_dim, batch)
    num_tokens = batch.query_start_loc[batch.num_seqs]
    k_cache, v_cache = kv_cache
    num_blocks, block_size = k_cache.shape[1], k_cache.shape[2]
    num_layers = k_cache.shape[0]
    flat = (num_layers * num_blocks, block_size, -1)
    layers = params["layers"]
    pool = None
    if compressed is not None:
        num_compressed = compressed.k.shape[1]
        pool = CompressedKV(*(a.reshape((num_layers * num_compressed,) + a.shape[2:]) for a in compressed))
        in_pool = batch.block_tables >= num_blocks

    def run(carry, segments, base):
        for start, stop, window in segments:
            cos, sin = ropes["local" if window is not None and cfg.local_rope is not None else None]

            def step(carry, index, window=window, cos=cos, sin=sin):
                x, k_flat, v_flat = carry
                layer = with_stacked_weights(jax.tree_util.tree_map(lambda a: from_storage(a[index]), layers),
                                             layers, index, num_tokens)
                first_block = index * num_blocks
                tables = batch.block_tables + first_block
                if pool is not None:
                    # Past the flattened cache's L * num_blocks ids: this layer's slots of the flattened pool.
                    tables = jnp.where(in_pool, batch.block_tables + (num_layers - 1) * num_blocks
                                       + index * num_compressed, tables)
                layer_batch = dataclasses.replace(batch, block_tables=tables,
                                                  slot_mapping=batch.slot_mapping + first_block * block_size)
                ctx = LayerContext(cfg, ops, layer_batch, window, cos, sin, num_tokens,
                                   (layer["k_scale"], layer["v_scale"]) if "k_scale" in layer else None, pool)
                x, (k_flat, v_flat) = family.layer(layer, x, (k_flat, v_flat), ctx)
                return (x, k_flat, v_flat), None

            carry, _ = jax.lax.scan(step, carry, base + jnp.arange(start, stop, dtype=jnp.int32))
        return carry

    period, repeats, rest = layer_plan(cfg)
    carry = (x, k_cache.reshape(flat), v_cache.reshape(flat))
    if repeats:
        size = period[-1][1]
        carry, _ = jax.lax.scan(lambda c, g: (run(c, period, g * size), None), carry,
                                jnp.arange(repeats, dtype=jnp.int32))
    x, k_flat, v_flat = run(carry, rest, 0)
    x = family.final_norm(params, x, cfg)
    return x, (k_flat.reshape(k_cache.shape), v_flat.reshape(v_cache.shape))


def with_head_panels(params: Params, cfg: ModelConfig) -> Params:
    """``params`` prepared for the engine's lm_head: where it is the tied embedding (unquantized), the ops table's
    ``with_lm_head_panels`` adds the embedding packed for the CPU kernel where that kernel takes it; else
    ``params`` itself (the same dict). A new embedding needs them packed again (the engine's
    ``WeightStore.set_param`` does). Raises nothing."""
    embed = params.get("embed")
    if not cfg.tie_word_embeddings or embed is None or "lm_head_scale" in params:
        return params
    return with_lm_head_panels(params, embed)


def compute_logits(params: Params, hidden: jax.Array, *, cfg: ModelConfig, num_rows: Optional[jax.Array] = None,
                   native_kernels: bool = False) -> jax.Array:
    """The lm_head (or the tied embedding): hidden ``[N, hidden_size]`` ->
    logits float32 ``[N, vocab]``, accumulated in float32, soft-capped
    (``cap * tanh(logits / cap)``) when ``cfg.final_logit_softcap`` is set.

    ``native_kernels``: the model step's head (``models.forward``, the engine's
    step) lets the ops table's ``lm_head`` pick the C++ kernel; it has no
    derivative, so the default (``dense_forward``, which ``jax.grad`` goes
    through) keeps XLA's dots. ``num_rows`` (int32 [], or None for all
    N): the leading rows that are real (a step's sequences; the rest pad its
    bucket); on the kernel only those are computed and the others are
    zeros, elsewhere every row is computed. A tied embedding packed by
    :func:`with_head_panels` is read in place of the embedding. A quantized
    untied lm_head goes through :func:`dot_f32` with its ``lm_head_scale``.
    """
    tied = cfg.tie_word_embeddings
    if not tied and "lm_head_scale" in params:
        logits = dot_f32(hidden, params["lm_head"], params["lm_head_scale"])
    else:
        weight = params["embed"] if tied else params["lm_head"]
        logits = lm_head(hidden, weight, tied=tied, rows=num_rows, panels=lm_head_panels(params) if tied else None,
                         kernels=native_kernels and "lm_head_scale" not in params)
    if cfg.final_logit_softcap is not None:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits
