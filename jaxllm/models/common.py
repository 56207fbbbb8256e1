"""The pieces every decoder family shares: norms, rotary embeddings, the gated
MLP, one layer's paged attention, the scan over stacked layers and the logits.

:func:`hidden_states` runs a :class:`Family` over a ragged batch of new tokens
(prefill chunks and decode rows concatenated); each layer writes its K/V through
``slot_mapping`` and attends over ``block_tables`` (semantics:
``kernels_pallas.attention.reference``).

Parameter pytree (dense weights ``[in, out]``; layer leaves stacked on a leading
``L = num_layers`` axis; layer keys per family: ``jaxllm.loader.params.expected_layer_keys``)::

    {"embed": [V, E], "final_norm": [E], "lm_head": [E, V] (untied only),
     "layers": {"attn_norm": [L, E], "wq": [L, E, Hq*D], "wk": [L, E, Hkv*D],
                "wv": [L, E, Hkv*D], "wo": [L, Hq*D, E], "mlp_norm": [L, E],
                "w_gate": [L, E, F], "w_up": [L, E, F], "w_down": [L, F, E], ...}}

With LoRA, the step's params also hold adapter slots ``"<key>_lora_a": [L, N, in, R]``, ``"<key>_lora_b": [L, N, R,
out]`` (``jaxllm.worker.lora``), read by :func:`project` for the tokens of each row's ``batch.lora_slots``.

Quantized weights are int8 / float8_e4m3fn with a float32 ``"<key>_scale"`` sibling
(``[L, out]`` per channel or ``[L, G, out]`` per input-row group). A quantized KV cache
adds ``"k_scale"``, ``"v_scale": [L, cache heads]`` layer leaves.

KV cache: ``(k_cache, v_cache)``, each ``[L, num_blocks, block_size, num_kv_heads, head_dim]``;
optionally a scaled block pool (``kernels_pallas.storage.ScaledKV``, leading ``L``) whose
blocks are named by block-table ids ``num_blocks + slot``. Layer leaves and caches may be
held as uint16 / uint8 bit patterns (:func:`loop_storage`). Design: docs/design/models.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.config import ModelConfig, RopeConfig
from kernels_pallas.ops import (BITS_STORAGE, AttentionOps, ScaledKV, from_storage, layer_matmul, lm_head,
                                lm_head_panels, to_storage, with_lm_head_panels, with_stacked_weights)

if TYPE_CHECKING:
    from jaxllm.worker.step_batch import StepBatch

Params = dict[str, Any]
KVCache = tuple[jax.Array, jax.Array]
# (start, stop, sliding window) of a run of consecutive layers of one kind.
Segment = tuple[int, int, Optional[int]]


def dot_f32(x: jax.Array, w: jax.Array, scale: Optional[jax.Array] = None) -> jax.Array:
    """``x @ w`` in float32 for a float or quantized weight.

    x: [T, in]; w: [in, out], float or (with ``scale``) int8 / float8_e4m3fn.
    scale: None; float32 ``[out]`` per output channel; or ``[G, out]`` per group of
    ``in / G`` input rows (GGUF Q8_0), dequantized before the matmul.
    Returns float32 [T, out].
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
    """``x @ w (+ b)`` accumulated in float32, in x's dtype; a quantized ``w`` with its ``scale`` (:func:`dot_f32`)."""
    y = dot_f32(x, w, scale)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


# LoRA slot leaves of a projection ``key``: ``key + LORA_A`` [L, N, in, R] and ``key + LORA_B`` [L, N, R, out]
# (``jaxllm.worker.lora``), read in place per layer (``LoRARows.layer``); LORA_ROWS: the step's :class:`LoRARows`.
LORA_A, LORA_B, LORA_ROWS = "_lora_a", "_lora_b", "lora_rows"


class LoRARows(NamedTuple):
    """Which LoRA slot each token of a step runs under, as :func:`lora_delta` reads it (:func:`lora_rows`).

    Attributes:
      slots: int32[T] each token's slot, -1 none (base model, padding).
      used: int32[N] the slots some token runs under first (ascending), then the others.
      count: int32[] how many slots some token runs under (a Python int where it is fixed, as in ``dense_forward``).
      layer: int32[] the layer, where the slot leaves keep their leading ``[L]`` axis; None where they are the
        layer's.
    """

    slots: jax.Array
    used: jax.Array
    count: Any
    layer: Optional[jax.Array] = None


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, rows: LoRARows) -> jax.Array:
    """Each token's adapter term ``(x A_slot) B_slot`` in float32 (PEFT's ``lora_B(lora_A(x)) * scaling``, the
    scaling folded into B). A loop over the ``rows.count`` slots the step's tokens use (punica's per-adapter
    shrink and expand): the work follows the adapters the rows use, not ``N``; slots no token uses are not read;
    the shapes never depend on the mix. Tokens of no slot get exact zeros.

    x: [T, in]; a: [N, in, R]; b: [N, R, out] (``[L, N, ...]`` with ``rows.layer``). Returns float32 [T, out].
    """
    def one(i, acc):
        slot = rows.used[i]
        a_slot, b_slot = (a[slot], b[slot]) if rows.layer is None else (a[rows.layer, slot], b[rows.layer, slot])
        xa = jnp.dot(x, a_slot, preferred_element_type=jnp.float32)
        xa = jnp.where((rows.slots == slot)[:, None], xa, 0.0)
        return acc + jnp.dot(xa.astype(x.dtype), b_slot, preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(0, rows.count, one, jnp.zeros((x.shape[0], b.shape[-1]), jnp.float32))


def lora_rows(slots: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array, num_tokens: int,
              num_slots: int) -> LoRARows:
    """Each token's LoRA slot and the slots used (:class:`LoRARows`): row ``s``'s tokens take ``slots[s]``
    (int32[S], -1: none); padding tokens none."""
    row = jnp.searchsorted(query_start_loc[1:], jnp.arange(num_tokens), side="right")
    slot = jnp.where(row < num_seqs, slots[jnp.minimum(row, slots.shape[0] - 1)], -1).astype(jnp.int32)
    present = jnp.zeros(num_slots, bool).at[jnp.where(slot < 0, num_slots, slot)].set(True, mode="drop")
    used = jnp.argsort(~present, stable=True).astype(jnp.int32)
    return LoRARows(slot, used, jnp.sum(present, dtype=jnp.int32))


def project(layer: dict[str, jax.Array], key: str, x: jax.Array, bias: Optional[str] = None) -> jax.Array:
    """``linear`` through ``layer[key]`` (with ``key + "_scale"`` when quantized, ``bias`` leaf when present),
    plus each token's LoRA term when the layer holds adapter slots for ``key`` (:func:`lora_delta`).

    x: [T, in] -> [T, out] in x's dtype. Unquantized weights go through the ops table's
    ``layer_matmul`` (padding rows of the bucket may come out zeros, then the bias).
    """
    b = layer.get(bias) if bias else None
    scale = layer.get(key + "_scale")
    y = layer_matmul(layer, key, x) if scale is None else dot_f32(x, layer[key], scale)
    if key + LORA_A in layer and LORA_ROWS in layer:
        y = y + lora_delta(x, layer[key + LORA_A], layer[key + LORA_B], layer[LORA_ROWS])
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF ``LlamaRMSNorm``: normalise in float32, scale in x's dtype. x: [..., N]; weight: [N]."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def gated_mlp(layer: dict[str, jax.Array], h: jax.Array, act: str) -> jax.Array:
    """``down(act(gate(h)) * up(h))``: SwiGLU (``"silu"``) or GeGLU (``"gelu_pytorch_tanh"``), optional ``b_*`` biases.

    h: [T, E] -> [T, E]; ``w_gate``, ``w_up``: [E, F]; ``w_down``: [F, E].
    """
    gate = project(layer, "w_gate", h, "b_gate")
    up = project(layer, "w_up", h, "b_up")
    return project(layer, "w_down", _ACTIVATIONS[act](gate) * up, "b_down")


# ------------------------------------------------------------------ rotary embeddings

def rope_inv_freq(head_dim: int, rope: RopeConfig, long: bool = False) -> np.ndarray:
    """Inverse frequencies float32 ``[rotary_dim // 2]`` as HF's rope inits (default, linear, llama3, longrope).

    ``rotary_dim = head_dim * rope.partial_rotary_factor``; ``long`` picks LongRoPE's ``long_factor``.
    """
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
    """cos and sin float32 ``[T, rotary_dim // 2]`` of each token's position.

    LongRoPE uses its long factors for tokens of rows whose ``seq_lens`` exceeds
    ``original_max_position_embeddings`` and scales by ``attention_factor`` (as HF).
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
    """HF ``rotate_half`` rope of the first ``2 * cos.shape[-1]`` dims of each head.

    x: [T, H, D]; cos, sin: [T, R // 2] float32. Returns x's dtype.
    """
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)


# ------------------------------------------------------------------ one layer's attention

class LayerContext(NamedTuple):
    """What one layer needs besides its weights and the caches.

    batch: the step's batch, ``block_tables``/``slot_mapping`` offset to this layer's blocks.
    window: the layer's sliding window (static) or None. cos, sin: [T, R // 2] float32.
    num_tokens: int32[] real tokens. kv_scales: float32 ``(k_scale, v_scale)``, each
    ``[cache heads]``, or None. scaled_pool: the pool flattened to ``[L * C, ...]``, or None.
    """

    cfg: ModelConfig
    ops: AttentionOps
    batch: StepBatch
    window: Optional[int]
    cos: jax.Array
    sin: jax.Array
    num_tokens: jax.Array
    kv_scales: Optional[tuple[jax.Array, jax.Array]] = None
    scaled_pool: Optional[ScaledKV] = None

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, kv: KVCache) -> tuple[jax.Array, KVCache]:
        """Rope q and k, write k and v into the paged cache, attend.

        q: [T, Hq, D]; k, v: [T, Hkv, D]; kv: flattened caches, each
        ``[L * num_blocks, block_size, cache heads * D]``. Scale ``cfg.attention_scale``.
        Returns (output [T, Hq * D], the caches with k and v written).
        """
        cfg, t = self.cfg, q.shape[0]
        q = apply_rope(q, self.cos, self.sin)
        k = apply_rope(k, self.cos, self.sin)
        blocks = kv[0].shape[:2] + (-1, cfg.head_dim)
        scales = dict(zip(("k_scale", "v_scale"), self.kv_scales)) if self.kv_scales else {}
        k_cache, v_cache = self.ops.kv_cache_write(kv[0].reshape(blocks), kv[1].reshape(blocks), k, v,
                                                   self.batch.slot_mapping, **scales)
        pool = {} if self.scaled_pool is None else {"scaled_pool": self.scaled_pool}
        out = self.ops.ragged_paged_attention(
            q, k_cache, v_cache, self.batch.block_tables, self.batch.seq_lens, self.batch.query_start_loc,
            self.batch.num_seqs, scale=cfg.attention_scale, sliding_window=self.window, **scales, **pool,
        )
        return out.reshape(t, cfg.num_q_heads * cfg.head_dim), (k_cache.reshape(kv[0].shape),
                                                                v_cache.reshape(kv[1].shape))


def attention_block(layer: dict[str, jax.Array], h: jax.Array, kv: KVCache, ctx: LayerContext,
                    norm: Callable[[jax.Array, jax.Array, float], jax.Array] = rms_norm) -> tuple[jax.Array, KVCache]:
    """q/k/v projections (optional ``b*`` biases, ``q_norm``/``k_norm``), paged attention, ``wo`` (HF Llama/Gemma3).

    h: [T, E] (normed) -> ([T, E], the caches with this layer's K/V).
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
    """Rows of ``embed`` [V, E] for ``input_ids`` int32[T] (out-of-range ids clip)."""
    return jnp.take(params["embed"], input_ids, axis=0, mode="clip")


def final_rms_norm(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """:func:`rms_norm` of x [T, E] by ``final_norm`` [E]."""
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


# HF names of the top-level tensors (outside the layers) of every built-in family -> (pytree key, transpose).
HF_TOP_NAMES = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family (protocol: ``jaxllm.models.register_model``).

    hf_layer_names: HF name inside ``{hf_layer_prefix}{i}.`` -> (pytree key, transpose from
      ``[out, in]``); experts named with ``*``, leaves ``[L, num_experts, ...]``.
    layer_keys: ``cfg -> set`` of layer keys.
    layer: ``(layer weights, x [T, E], kv, LayerContext) -> (x, kv)``, residuals included.
    unfuse: ``(hf name, array, cfg) -> [(hf name, array)]`` splitting fused tensors (HF
      orientation, sliced on axis 0).
    embed: ``(params, input_ids, cfg) -> x [T, E]``. final_norm: ``(params, x, cfg) -> x``.
    hf_top_names: HF name -> (key, transpose) outside the layers; all required but tied ``lm_head``.
    hf_layer_prefix: what precedes a layer's index in HF names.
    hf_config: ``config.json dict -> dict`` renamed for ``ModelConfig.from_hf_config``; None: as is.
    param_axes: logical axes of the family's own leaves (without ``L``); unnamed leaves replicate.
    leaf_shapes: ``cfg -> {key: shape}`` of the family's own layer leaves, checked at load.
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
    """``params`` with bfloat16 layer leaves bit-cast to uint16 and float8_e4m3fn ones to uint8.

    :func:`hidden_states` casts them back per layer (reason: ``kernels_pallas.storage``).
    """
    bits = jax.jit(lambda a: to_storage(a, BITS_STORAGE[a.dtype]))
    return {**params, "layers": jax.tree_util.tree_map(lambda a: bits(a) if a.dtype in BITS_STORAGE else a,
                                                       params["layers"])}


def layer_segments(windows: tuple[Optional[int], ...], offset: int = 0) -> list[Segment]:
    """Runs of consecutive layers sharing a window: ``(start, stop, window)``, indices + ``offset``."""
    segments: list[Segment] = []
    for i, window in enumerate(windows, start=offset):
        if segments and segments[-1][2] == window:
            segments[-1] = (segments[-1][0], i + 1, window)
        else:
            segments.append((i, i + 1, window))
    return segments


def layer_plan(cfg: ModelConfig) -> tuple[list[Segment], int, list[Segment]]:
    """How the layers are scanned: ``(period, repeats, rest)``.

    Each distinct window is its own scan body. With a repeating period of several
    kinds (Gemma 3), an outer scan runs ``repeats`` periods over ``period``'s runs
    (indices within the period); ``rest`` runs follow with absolute indices.
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
    scaled_pool: Optional[ScaledKV] = None,
) -> tuple[jax.Array, KVCache]:
    """The decoder over a ragged batch, up to the final norm (HF's ``last_hidden_state``).

    Args:
      params: the parameter pytree (module docstring).
      kv_cache: ``(k_cache, v_cache)``, each ``[L, num_blocks, block_size, num_kv_heads, head_dim]``.
      batch: reads ``input_ids, positions, slot_mapping: int32[T]``, ``block_tables: int32[S, W]``,
        ``seq_lens: int32[S]``, ``query_start_loc: int32[S + 1]``, ``num_seqs: int32[]``; ``lora_slots:
        int32[S]`` where params hold LoRA slots.
      cfg, ops, family: static.
      scaled_pool: ``k, v: [L, C, block_size, cache heads, head_dim]``, ``k_scale, v_scale:
        float32[L, C, cache heads]``, read for table ids ``>= num_blocks``; or None.

    Returns:
      (hidden ``[T, hidden_size]`` in the params' dtype after ``final_norm``, the caches with this step's K/V).
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
    adapters = next((a for k, a in layers.items() if k.endswith(LORA_A)), None)
    # The adapter slots stay stacked: lora_delta reads a used slot of the layer in place, never copying the layer's
    # other slots.
    adapter_leaves = {k: a for k, a in layers.items() if k.endswith((LORA_A, LORA_B))}
    dense = {k: a for k, a in layers.items() if k not in adapter_leaves}
    rows = None
    if adapters is not None and getattr(batch, "lora_slots", None) is not None:
        rows = lora_rows(batch.lora_slots, batch.query_start_loc, batch.num_seqs, x.shape[0], adapters.shape[1])
    pool = None
    if scaled_pool is not None:
        num_pooled = scaled_pool.k.shape[1]
        pool = ScaledKV(*(a.reshape((num_layers * num_pooled,) + a.shape[2:]) for a in scaled_pool))
        in_pool = batch.block_tables >= num_blocks

    def run(carry, segments, base):
        for start, stop, window in segments:
            cos, sin = ropes["local" if window is not None and cfg.local_rope is not None else None]

            def step(carry, index, window=window, cos=cos, sin=sin):
                x, k_flat, v_flat = carry
                layer = with_stacked_weights(jax.tree_util.tree_map(lambda a: from_storage(a[index]), dense),
                                             layers, index, num_tokens)
                if rows is not None:
                    layer.update(adapter_leaves)
                    layer[LORA_ROWS] = rows._replace(layer=index)
                first_block = index * num_blocks
                tables = batch.block_tables + first_block
                if pool is not None:
                    # Past the flattened cache's L * num_blocks ids: this layer's slots of the flattened pool.
                    tables = jnp.where(in_pool, batch.block_tables + (num_layers - 1) * num_blocks
                                       + index * num_pooled, tables)
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
    """``params`` plus the tied unquantized embedding packed for the CPU lm_head kernel where used; else ``params``.

    A new embedding must be packed again (``WeightStore.set_param`` does). Raises nothing.
    """
    embed = params.get("embed")
    if not cfg.tie_word_embeddings or embed is None or "lm_head_scale" in params:
        return params
    return with_lm_head_panels(params, embed)


def compute_logits(params: Params, hidden: jax.Array, *, cfg: ModelConfig, num_rows: Optional[jax.Array] = None,
                   native_kernels: bool = False) -> jax.Array:
    """lm_head (or tied embedding): hidden ``[N, hidden_size]`` -> float32 logits ``[N, vocab]``.

    Soft-capped (``cap * tanh(logits / cap)``) when ``cfg.final_logit_softcap`` is set.
    ``native_kernels``: let the ops table pick the C++ kernel (no derivative; default keeps XLA).
    ``num_rows``: int32[] leading real rows (None: all); on the kernel the rest are zeros.
    A quantized untied lm_head uses :func:`dot_f32` with ``lm_head_scale``.
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
