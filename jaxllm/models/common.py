"""The pieces every decoder family shares: norms, rotary embeddings, the gated
MLP, the paged attention of one layer, the scan over stacked layers and the
logits.

Each family (``llama.py``, ``gemma3.py``, ...) is a :class:`Family`: how it
embeds tokens, what one layer computes from these pieces, and its final norm.
:func:`hidden_states` runs any of them over a ragged batch of new tokens
(prefill chunks and decode rows concatenated): each layer writes its K/V into
the paged cache through ``slot_mapping`` and attends over ``block_tables``
(``kernels_pallas.reference`` states the attention semantics).

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
(``kernels_pallas.reference.CompressedKV``, each array with a leading ``L``):
block-table ids ``>= num_blocks`` name its blocks (``num_blocks + slot``), and
each layer's ids are offset into the flattened pool as into the cache.

Layers run as ``lax.scan``s that carry the hidden state and the caches and
read layer ``l``'s weights by index from the stacked leaves, so a step traces,
lowers and compiles one layer per distinct kind of layer however deep the
model is (:func:`layer_plan`). Layer leaves and caches may be held as uint16
bit patterns of bfloat16, uint8 ones of float8 (:func:`loop_storage`; why in
``kernels_pallas.reference``). Inside the scan the caches are viewed as
``[L * num_blocks, block_size, num_kv_heads * head_dim]`` and layer ``l``
addresses its blocks as ``l * num_blocks + block``: the attention ops see one
ordinary paged cache (:meth:`LayerContext.attend` gives them its 4-d view)
and the block tables and slot mapping are offset per layer, so they read only
the blocks they need and write in place. The scan carries no unit KV-head
axis: with one KV head (Gemma 3 270M), XLA's CPU layout assignment would move
it and copy the whole cache on every layer.

Reading layer ``l``'s weights by index is a dynamic-slice, which XLA's CPU
backend copies on every step before its dots read the copy again. So each
layer dict inside the scan also holds, under :data:`STACKED`, the stacked
leaves, the index and the step's token count, and :func:`project` hands the float32 weights of steps
of at most :func:`native_matmul_max_rows` tokens on a one-device CPU backend (bfloat16 ones up to
:func:`native_bf16_matmul_max_rows`, by the CPU's bfloat16 instructions)
to ``kernels_pallas.native.stacked_matmul_cpu``, which reads the stacked
weight in place (``scripts/profile_step.py`` has the profile). Each call
computes only the step's tokens (the leading rows of its bucket), and
:func:`compute_logits` (``native_kernels=True``, the model step's head) runs a float32
lm_head of 4 rows or more on the native kernels too (a tied embedding the engine holds packed,
:data:`HEAD_PANELS`, from one row), for the step's sequences only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.config import ModelConfig, RopeConfig
from kernels_pallas import AttentionOps, native
from kernels_pallas.reference import BITS_STORAGE, CompressedKV, from_storage, to_storage

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

    For bfloat16 weights this is both closer to HF (whose matmuls accumulate
    in float32) and faster on XLA's CPU backend, whose bf16-in/f32-out dots
    run about twice as fast as bf16-in/bf16-out ones (issue 12's profile).
    A quantized ``w`` comes with its ``scale`` (:func:`dot_f32`).
    """
    y = dot_f32(x, w, scale)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


# The key of a scanned layer's dict that holds (the stacked layer leaves, the layer index, the step's token count).
STACKED = "_stacked"
# Steps of at most this many tokens take the native matmul: measured faster than XLA's dots plus the slice copies
# from 1 to 512 rows (30 layers of SmolLM2-135M, float32: 28 -> 8 ms at 1 row, 52 -> 35 ms at 48, 283 -> 260 ms at
# 512, an AVX-512 EPYC; 36 -> 22, 99 -> 70 and 466 -> 471 ms on an Intel Xeon with AMX); larger steps keep XLA's
# dots, unmeasured past that. Without AVX-512 (the kernel's tiles of 6 rows by 16 columns on AVX2) it keeps up to
# 192, kernel / XLA: 17 / 25 ms at 1 row, 45 / 50 at 16, 75 / 96 at 48, 176-240 / 192-229 at 128, 262-301 /
# 280-336 at 192, then 359-421 / 368-398 at 256 and 700 / 647 at 512 (scripts/bench_matmul.py, runs of one
# session, an AMD EPYC with AVX2 only, Zen 3, 2 cores: XLA's dots vary by up to 2x between runs there).
NATIVE_MATMUL_MAX_ROWS = 512
NATIVE_MATMUL_MAX_ROWS_AVX2 = 192
# The same for bfloat16 weights (as the engine stores them, uint16 bits), by what the CPU has: XLA's bfloat16 dots
# run on AMX tiles where the CPU has them, and the kernel's gain is then the slice copy it saves and the padding
# rows it skips. 30 layers of SmolLM2-135M on an Intel Xeon with AMX, kernel against XLA: 16.9 against 31.3 ms at
# 1 row, 30.0 / 26.5 at 4, 33.5 / 28.4 at 16, 72.9 / 36.9 at 48: so only the smallest bucket (4 tokens: a decode
# step of 1-4 sequences, which computes its real rows only). Without AMX (an AMD EPYC with AVX-512-BF16, 2 cores,
# scripts/bench_matmul.py, every row computed on both sides) XLA's dots and the kernel's vdpbf16ps tiles run at
# about the same rate and the kernel keeps the copy it saves up to 128 rows: 14.6 / 19.9 ms at 4 rows, 29.1 / 28.9
# at 16, 42.7 / 46.7 at 48, 46.3 / 54.5 at 64, 82.5 / 84.5 at 128, then 117.8 / 114.1 at 192, 332.8 / 311.1 at 512.
NATIVE_BF16_MATMUL_MAX_ROWS_AMX = 4
NATIVE_BF16_MATMUL_MAX_ROWS = 128


def native_matmul_max_rows() -> int:
    """The most rows (tokens) of a step whose float32 projections :func:`project` hands to the native kernel:
    :data:`NATIVE_MATMUL_MAX_ROWS`, or :data:`NATIVE_MATMUL_MAX_ROWS_AVX2` where lower and the CPU lacks AVX-512
    (``native.has_avx512``, read from ``/proc/cpuinfo`` once per process). The limits are the crossovers measured
    with ``scripts/bench_matmul.py`` (the comment above). Raises nothing: a CPU without the file counts as AVX2."""
    if native.has_avx512():
        return NATIVE_MATMUL_MAX_ROWS
    return min(NATIVE_MATMUL_MAX_ROWS, NATIVE_MATMUL_MAX_ROWS_AVX2)


def native_bf16_matmul_max_rows() -> int:
    """The most rows (tokens) of a step whose bfloat16 projections :func:`project` hands to the native kernel:
    :data:`NATIVE_BF16_MATMUL_MAX_ROWS_AMX` where the CPU has AMX (``native.has_amx_tiles``),
    :data:`NATIVE_BF16_MATMUL_MAX_ROWS` where it has AVX-512-BF16 without AMX (``native.has_bf16_pairs``), 0
    elsewhere (the kernel would convert every weight to float32 as it reads it, unmeasured against XLA's dots).
    The limits are the crossovers measured with ``scripts/bench_matmul.py`` (the comment above); the flags are
    read from ``/proc/cpuinfo`` once per process. Raises nothing: a CPU without the file counts as neither."""
    if not native.has_bf16_pairs():
        return 0
    return NATIVE_BF16_MATMUL_MAX_ROWS_AMX if native.has_amx_tiles() else NATIVE_BF16_MATMUL_MAX_ROWS


def native_matmul_applies(x: jax.Array, stacked_w: jax.Array) -> bool:
    """Whether :func:`project` computes ``x @ w`` with ``native.stacked_matmul_cpu``: on XLA's CPU backend with
    one device (a sharded weight would need the custom call partitioned), at most
    :func:`native_matmul_max_rows` rows of x, a stacked weight the kernel takes (``native.matmul_supports``), once
    the kernel is built. A bfloat16 weight (or its uint16 bits, as the engine stores them on CPU:
    :func:`loop_storage`) at most :func:`native_bf16_matmul_max_rows` rows (none without AVX-512-BF16)."""
    if stacked_w.dtype in (jnp.bfloat16, jnp.uint16) and x.shape[0] > native_bf16_matmul_max_rows():
        return False
    return (jax.default_backend() == "cpu" and jax.device_count() == 1 and x.shape[0] <= native_matmul_max_rows()
            and native.matmul_supports(stacked_w) and native.available())


def project(layer: dict[str, jax.Array], key: str, x: jax.Array, bias: Optional[str] = None) -> jax.Array:
    """``linear`` through ``layer[key]``, its ``key + "_scale"`` when quantized and the
    ``bias`` leaf when the layer has it. x: [T, in] -> [T, out] in x's dtype.

    Inside the layer scan (``layer[STACKED]`` set) an unquantized weight where :func:`native_matmul_applies` is
    read in place from the stacked leaf instead of the sliced ``layer[key]``, and only the step's tokens (the
    leading rows of x) are computed: the padding rows of its bucket come out zeros (then the bias)."""
    b = layer.get(bias) if bias else None
    scale = layer.get(key + "_scale")
    if STACKED in layer and scale is None:
        stacked, index, num_tokens = layer[STACKED]
        if native_matmul_applies(x, stacked[key]):
            y = native.stacked_matmul_cpu(x, stacked[key], index, num_tokens)
            if b is not None:
                y = y + b.astype(jnp.float32)
            return y.astype(x.dtype)
    return linear(x, layer[key], b, scale)


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
    ``kernels_pallas.reference``); :func:`hidden_states` bit-casts them back
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
                layer = jax.tree_util.tree_map(lambda a: from_storage(a[index]), layers)
                layer[STACKED] = (layers, index, num_tokens)  # slices project() does not read are dropped by XLA
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


# The lm_head takes the native kernels from this many rows: below it XLA's dot streams the embedding faster than
# the kernel's tiles (1 row: 2.2 against 3.2 ms, SmolLM2's [49152, 576] float32 embedding, 2 AVX-512 cores).
NATIVE_LM_HEAD_MIN_ROWS = 4


def native_lm_head_applies(hidden: jax.Array, weight: jax.Array, tied: bool, packed: bool = False) -> bool:
    """Whether :func:`compute_logits` (with ``native_kernels=True``) runs the lm_head on the native kernels: on
    XLA's CPU backend with one device, at least :data:`NATIVE_LM_HEAD_MIN_ROWS` rows (any number with ``packed``,
    the tied embedding's :data:`HEAD_PANELS`), a float32 weight the kernel takes (the tied embedding [V, E] through
    ``native.matmul_nt_cpu``, an lm_head [E, V] through ``native.stacked_matmul_cpu``), once the kernels are
    built."""
    # Untied: as the one layer of a stack, [1, E, V] (a shape only: nothing is computed to ask).
    # float32 only: the stacked kernel also takes bfloat16, which XLA's dots beat from 4 rows on AMX (see
    # native_bf16_matmul_max_rows), and a tied head would need a bfloat16 matmul_nt_cpu, which there is not.
    supported = weight.dtype == jnp.float32 and (
        native.matmul_nt_supports(weight) if tied
        else native.matmul_supports(jax.ShapeDtypeStruct((1, *weight.shape), weight.dtype)))
    enough_rows = packed or hidden.shape[0] >= NATIVE_LM_HEAD_MIN_ROWS
    return (jax.default_backend() == "cpu" and jax.device_count() == 1 and enough_rows and supported
            and native.available())


# The engine's copy of a tied float32 embedding [V, E] as the lm_head's kernel reads it
# (``native.pack_nt_panels``): the kernel otherwise transposes each panel of it on every step. SmolLM2's
# [49152, 576] embedding alone, 2 AMD Zen 4 cores (interleaved, best of 15): 1 row 5.7 -> 3.9 ms (XLA's dot 3.9),
# 8 rows 7.0 -> 3.8, 16 rows 9.2 -> 6.0, 48 rows 16.3 -> 14.0, 192 rows 69 -> 67.
HEAD_PANELS = "embed_panels"
# The largest embedding packed so (bytes): the copy holds it twice. gemma3-270m's [262144, 640] float32 embedding,
# 640 MiB, would gain the most (8 rows 39.1 -> 20.4 ms) but makes the model half as large again, and with it the
# test suite's worker running gemma3-270m beside its CLI in a subprocess was killed for memory on a 24 GiB machine.
HEAD_PANELS_MAX_BYTES = 256 * 2**20


def with_head_panels(params: Params, cfg: ModelConfig) -> Params:
    """``params`` with :data:`HEAD_PANELS` added where the engine's lm_head is the tied embedding and the native
    kernels take it packed: ``params["embed"]`` float32 [V, E] of at most :data:`HEAD_PANELS_MAX_BYTES`, V a
    multiple of the kernels' panel width P and E of 16 (``native.nt_panels_shape``), on one CPU device; else
    ``params`` itself (the same dict). The panels are ``native.pack_nt_panels`` of the embedding, float32
    [V / P, E, P], as much memory again; :func:`compute_logits` (``native_kernels=True``) reads them in place of the
    embedding, and a new embedding needs them packed again (the engine's ``ModelRunner.set_param`` does). Raises
    nothing."""
    embed = params.get("embed")
    # nt_panels_shape is None unless the embedding is float32 with whole panels and the kernels are built.
    applies = (cfg.tie_word_embeddings and embed is not None and "lm_head_scale" not in params
               and embed.nbytes <= HEAD_PANELS_MAX_BYTES and jax.default_backend() == "cpu"
               and jax.device_count() == 1 and native.nt_panels_shape(embed) is not None)
    return {**params, HEAD_PANELS: _pack_panels(embed)} if applies else params


_pack_panels = jax.jit(native.pack_nt_panels)


def compute_logits(params: Params, hidden: jax.Array, *, cfg: ModelConfig, num_rows: Optional[jax.Array] = None,
                   native_kernels: bool = False) -> jax.Array:
    """The lm_head (or the tied embedding): hidden ``[N, hidden_size]`` ->
    logits float32 ``[N, vocab]``, accumulated in float32, soft-capped
    (``cap * tanh(logits / cap)``) when ``cfg.final_logit_softcap`` is set.

    ``native_kernels``: the model step's head (``models.forward``, the engine's
    step) takes the C++ kernels where :func:`native_lm_head_applies`; they
    have no derivative, so the default (``dense_forward``, which ``jax.grad``
    goes through) keeps XLA's dots. ``num_rows`` (int32 [], or None for all
    N): the leading rows that are real (a step's sequences; the rest pad its
    bucket); on the kernels only those are computed and the others are
    zeros, elsewhere every row is computed.

    On the kernels a tied embedding is read from ``params[HEAD_PANELS]`` where the engine added them
    (:func:`with_head_panels`).

    The tied embedding ``[V, E]`` is contracted on its second axis directly:
    ``hidden @ embed.T`` would make XLA's CPU backend transpose the whole
    table in bfloat16 on every step (5x slower there). A quantized untied
    lm_head goes through :func:`dot_f32` with its ``lm_head_scale``.
    """
    tied = cfg.tie_word_embeddings
    weight = params["embed"] if tied else params["lm_head"]
    panels = params.get(HEAD_PANELS) if tied else None
    if native_kernels and "lm_head_scale" not in params and native_lm_head_applies(hidden, weight, tied,
                                                                                   panels is not None):
        logits = (native.matmul_nt_cpu(hidden, weight, num_rows, panels) if tied
                  else native.stacked_matmul_cpu(hidden, weight[None], 0, num_rows))
    elif tied:
        logits = jax.lax.dot_general(hidden, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    else:
        logits = dot_f32(hidden, weight, params.get("lm_head_scale"))
    if cfg.final_logit_softcap is not None:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits
