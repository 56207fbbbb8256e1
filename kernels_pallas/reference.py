"""Plain ``jnp`` references for the paged-attention kernels.

Each function here has the exact signature of its Pallas kernel (the
``interpret`` flag is accepted and ignored) so that callers can swap one for
the other. They are the numerical ground truth for the kernel tests and the
attention path the engine uses on CPU.

Cache layout (one layer): ``k_cache, v_cache: [num_blocks, block_size,
num_kv_heads, head_dim]``. Token slot ``s`` lives at block ``s // block_size``,
offset ``s % block_size``. Block 0 is the null block that padded slots write
into; nothing reads it through a valid block-table entry.

GQA follows Hugging Face's ``repeat_kv``: query head ``h`` reads KV head
``h // (num_q_heads // num_kv_heads)``.

Storage. The jnp ops (here and in ``xla.py``) also accept caches that hold
bfloat16 values as their uint16 bit patterns (:func:`to_storage`,
:func:`from_storage`). XLA's CPU backend converts a bfloat16 array that a
loop reads (the model's scan over layers, the KV-chunk loop) to float32 as a
whole before the loop and back inside it: a full copy of the cache (and of
the weights) every step. Integer arrays are left alone, so on CPU the engine
keeps bfloat16 caches and layer weights as uint16 and bit-casts them back
where they are read. float8_e4m3fn caches (and weights) are held as uint8
bit patterns for the same reason.

Quantized caches. A cache of int8 or float8_e4m3fn holds ``x / scale`` of
each key and value, with one float32 scale per KV head and layer
(``k_scale``, ``v_scale: [num_kv_heads]``; per-tensor scales in vLLM's
fp8 KV cache, per head here): :func:`quantize_kv` rounds (int8) and clips to
the type's range on the write, and the attention ops multiply back after
loading (the kernels fold the K scale into the scores and the V scale into
the output, which is the same product). Without scales a cache holds the
values themselves, cast to its dtype.

Compressed blocks (``LLM(kv_cache_compression="int8" | "fp8")``). Beside the
cache, a second pool of one-byte blocks (:class:`CompressedKV`) holds blocks
re-encoded from it with one float32 scale per block and KV head, the block's
largest ``|x|`` mapped to the type's largest value (:func:`quantize_blocks`).
A block-table id ``b >= num_blocks`` (``num_blocks``: the cache's first axis)
names block ``b - num_blocks`` of that pool; the attention ops read each block
in its own dtype (:func:`gather_blocks`). Writes never touch the pool: only
full blocks of computed tokens are compressed.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


# Float types held as bit patterns on XLA's CPU backend -> the unsigned type holding them, and back.
BITS_STORAGE = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16), jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8)}
_BITS_OF = {bits: number for number, bits in BITS_STORAGE.items()}
# Largest magnitude a quantized cache stores (int8 symmetric; float8_e4m3fn's finite maximum).
KV_QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def number_dtype(storage_dtype) -> jnp.dtype:
    """The dtype of the numbers an array of ``storage_dtype`` holds (uint16: bfloat16, uint8: float8_e4m3fn)."""
    dtype = jnp.dtype(storage_dtype)
    return _BITS_OF.get(dtype, dtype)


def from_storage(x: jax.Array) -> jax.Array:
    """A stored array as numbers: uint16 is bfloat16 bit patterns, uint8 float8_e4m3fn ones, anything else is as is."""
    dtype = jnp.dtype(x.dtype)
    return jax.lax.bitcast_convert_type(x, _BITS_OF[dtype]) if dtype in _BITS_OF else x


def to_storage(x: jax.Array, storage_dtype) -> jax.Array:
    """``x`` as stored in an array of ``storage_dtype``: cast, then bit-cast for a uint16 or uint8 store."""
    number = number_dtype(storage_dtype)
    if number != jnp.dtype(storage_dtype):
        return jax.lax.bitcast_convert_type(x.astype(number), storage_dtype)
    return x.astype(storage_dtype)


def quantize_kv(x: jax.Array, scale: jax.Array, storage_dtype) -> jax.Array:
    """Keys or values as a quantized cache stores them.

    Args:
      x: [T, num_kv_heads, head_dim] float.
      scale: float32[num_kv_heads], the heads' scales.
      storage_dtype: int8, float8_e4m3fn or uint8 (float8_e4m3fn bits).

    Returns:
      ``x / scale`` rounded to the nearest integer for int8, clipped to
      ``KV_QUANT_MAX`` of the type (float8_e4m3fn has no infinity: an
      unclipped overflow would be NaN), in ``storage_dtype``.
    """
    number = number_dtype(storage_dtype)
    y = x.astype(jnp.float32) / scale[:, None]
    if number == jnp.int8:
        y = jnp.round(y)
    limit = KV_QUANT_MAX[number]
    return to_storage(jnp.clip(y, -limit, limit), storage_dtype)


def dequantize_kv(x: jax.Array, scale: Optional[jax.Array]) -> jax.Array:
    """A stored cache slice ``[..., num_kv_heads, head_dim]`` as float32 numbers, times ``scale``
    (float32[num_kv_heads]) when the cache is quantized."""
    x = from_storage(x).astype(jnp.float32)
    return x if scale is None else x * scale[:, None]


class CompressedKV(NamedTuple):
    """The pool of compressed KV blocks (module docstring), a pytree.

    k, v: [num_compressed, block_size, num_kv_heads, head_dim] int8, or uint8 holding float8_e4m3fn bits
      (or float8_e4m3fn itself).
    k_scale, v_scale: float32[num_compressed, num_kv_heads], each block's per-head scale.
    """

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array


def quantize_blocks(x: jax.Array, storage_dtype) -> tuple[jax.Array, jax.Array]:
    """Blocks re-encoded with one scale per block and head.

    Args:
      x: [..., block_size, num_kv_heads, head_dim] float (any stored float: see :func:`from_storage`).
      storage_dtype: int8, float8_e4m3fn or uint8 (float8_e4m3fn bits).

    Returns:
      (q, scale): q of ``x``'s shape in ``storage_dtype``, ``x / scale`` (rounded for int8, within
      ``KV_QUANT_MAX`` of the type); scale float32 ``[..., num_kv_heads]``, the block's largest ``|x|`` of
      that head over the type's largest value (1 for an all-zero head, so nothing divides by 0).
    """
    x = from_storage(x).astype(jnp.float32)
    limit = KV_QUANT_MAX[number_dtype(storage_dtype)]
    peak = jnp.max(jnp.abs(x), axis=(-3, -1))
    scale = jnp.where(peak > 0, peak / limit, 1.0)
    y = x / scale[..., None, :, None]
    if number_dtype(storage_dtype) == jnp.int8:
        y = jnp.round(y)
    return to_storage(jnp.clip(y, -limit, limit), storage_dtype), scale


def gather_blocks(cache: jax.Array, ids: jax.Array, scale: Optional[jax.Array] = None,
                  pool: Optional[jax.Array] = None, pool_scale: Optional[jax.Array] = None) -> jax.Array:
    """Blocks ``ids`` as float32 numbers, each from the cache or the compressed pool its id names.

    Args:
      cache: [num_blocks, block_size, Hkv, D], stored (``from_storage``).
      ids: int32[...] block ids; ``>= num_blocks`` names block ``id - num_blocks`` of ``pool``.
      scale: float32[Hkv] of a quantized cache, or None.
      pool: the compressed pool's K or V, [C, block_size, Hkv, D]; None: every id is the cache's.
      pool_scale: float32[C, Hkv], with ``pool``.

    Returns:
      float32 ``[..., block_size, Hkv, D]``.
    """
    num_blocks = cache.shape[0]
    x = dequantize_kv(cache[jnp.minimum(ids, num_blocks - 1)], scale)
    if pool is None:
        return x
    compressed = ids >= num_blocks
    slot = jnp.where(compressed, ids - num_blocks, 0)
    y = from_storage(pool[slot]).astype(jnp.float32) * pool_scale[slot][..., None, :, None]
    return jnp.where(compressed[..., None, None, None], y, x)


def check_pool_scales(k_scale: Optional[jax.Array], compressed: Optional[CompressedKV]) -> None:
    """Raise ValueError for a quantized cache with a compressed pool: a one-byte cache has nothing to compress."""
    if k_scale is not None and compressed is not None:
        raise ValueError("compressed KV blocks need a cache of plain values: k_scale (a quantized cache) and "
                         "compressed were both given")


def _soft_cap(scores: jax.Array, soft_cap: Optional[float]) -> jax.Array:
    if soft_cap is None:
        return scores
    return soft_cap * jnp.tanh(scores / soft_cap)


def _masked_softmax_pv(scores: jax.Array, mask: jax.Array, v: jax.Array) -> jax.Array:
    """softmax over the last axis of ``scores`` under ``mask``, then @ v.

    scores: [N, Hkv, G, L] float32, mask: [N, 1, 1, L] bool, v: [N, L, Hkv, D] float32.
    Rows with no valid key give zeros (never NaN).
    """
    scores = jnp.where(mask, scores, _NEG_INF)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    return jnp.einsum("nhgl,nlhd->nhgd", p, v)


def ragged_paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    scale: float,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    interpret: bool = False,
    k_scale: Optional[jax.Array] = None,
    v_scale: Optional[jax.Array] = None,
    compressed: Optional[CompressedKV] = None,
) -> jax.Array:
    """Causal attention of a ragged batch of new tokens over a paged KV cache.

    Args:
      q: [T, num_q_heads, head_dim] — the step's new tokens, sequences
        concatenated in batch order, padded to T.
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim],
        already holding this step's keys and values.
      block_tables: int32[S, W] — block ids of each sequence, in order.
      seq_lens: int32[S] — KV length of each sequence including new tokens.
      query_start_loc: int32[S + 1] — sequence s owns query rows
        ``query_start_loc[s]:query_start_loc[s + 1]``.
      num_seqs: int32 scalar — rows ``>= num_seqs`` of the sequence arrays,
        and query rows ``>= query_start_loc[num_seqs]``, are padding.
      scale: multiplier of q·k (usually head_dim ** -0.5).
      sliding_window: if set, a query at position p sees keys in
        ``(p - sliding_window, p]`` (Mistral's convention).
      soft_cap: if set, scores become ``soft_cap * tanh(scores / soft_cap)``.
      interpret: accepted for signature parity with the Pallas kernel.
      k_scale, v_scale: float32[num_kv_heads], the scales of a quantized
        cache (int8 or float8_e4m3fn, module docstring); None for a cache of
        plain values.

    Returns:
      [T, num_q_heads, head_dim] in q's dtype; padding rows are zeros.
      Query row i of sequence s sits at position
      ``seq_lens[s] - q_len[s] + i`` and attends to positions up to it.

    Memory: gathers each token's context, O(T * W * block_size * num_kv_heads
    * head_dim) — a reference, not a kernel.
    """
    del interpret
    check_pool_scales(k_scale, compressed)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    ctx_len = block_tables.shape[1] * block_size

    token_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of_token = jnp.searchsorted(query_start_loc[1:], token_idx, side="right").astype(jnp.int32)
    seq_of_token = jnp.minimum(seq_of_token, block_tables.shape[0] - 1)
    valid_token = token_idx < query_start_loc[num_seqs]
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    pos = seq_lens[seq_of_token] - q_len[seq_of_token] + (token_idx - query_start_loc[seq_of_token])

    tables = block_tables[seq_of_token]  # [T, W]
    pools = (None, None, None, None) if compressed is None else compressed
    k = gather_blocks(k_cache, tables, k_scale, pools[0], pools[2]).reshape(num_tokens, ctx_len, num_kv_heads,
                                                                            head_dim)
    v = gather_blocks(v_cache, tables, v_scale, pools[1], pools[3]).reshape(num_tokens, ctx_len, num_kv_heads,
                                                                            head_dim)

    kv_pos = jnp.arange(ctx_len, dtype=jnp.int32)[None, :]
    mask = (kv_pos <= pos[:, None]) & valid_token[:, None]
    if sliding_window is not None:
        mask &= kv_pos > pos[:, None] - sliding_window

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("nhgd,nlhd->nhgl", qg, k) * scale
    scores = _soft_cap(scores, soft_cap)
    out = _masked_softmax_pv(scores, mask[:, None, None, :], v)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    interpret: bool = False,
    k_scale: Optional[jax.Array] = None,
    v_scale: Optional[jax.Array] = None,
) -> jax.Array:
    """Decode attention: one new query per sequence over its paged context.

    Args:
      q: [S, num_q_heads, head_dim] — the query of the last token of each
        sequence (position ``seq_lens[s] - 1``).
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
      block_tables: int32[S, W]; seq_lens: int32[S] (0 marks a padding row).
      scale, sliding_window, soft_cap, interpret, k_scale, v_scale: as in
        :func:`ragged_paged_attention_reference`.

    Returns:
      [S, num_q_heads, head_dim] in q's dtype; rows with seq_lens 0 are zeros.
    """
    num_seqs = q.shape[0]
    query_start_loc = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    out = ragged_paged_attention_reference(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, jnp.int32(num_seqs),
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
    )
    return jnp.where((seq_lens > 0)[:, None, None], out, jnp.zeros_like(out))


def kv_cache_write_reference(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    k_scale: Optional[jax.Array] = None,
    v_scale: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's keys and values into the paged cache.

    Args:
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
      k, v: [T, num_kv_heads, head_dim], cast to the cache dtype (bit-cast
        from bfloat16 for a uint16 cache, see :func:`to_storage`), or
        quantized by :func:`quantize_kv` when scales are given.
      slot_mapping: int32[T] — flat slot ``block * block_size + offset`` of
        each token; padded tokens point into block 0.
      k_scale, v_scale: float32[num_kv_heads] of a quantized cache, or None.

    Returns:
      (k_cache, v_cache) with the slots written; in place when the caller
      donates the caches to the enclosing jit.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat = (num_blocks * block_size, num_kv_heads, head_dim)
    k, v = (to_storage(x, c.dtype) if s is None else quantize_kv(x, s, c.dtype)
            for x, s, c in ((k, k_scale, k_cache), (v, v_scale, v_cache)))
    k_cache = k_cache.reshape(flat).at[slot_mapping].set(k).reshape(k_cache.shape)
    v_cache = v_cache.reshape(flat).at[slot_mapping].set(v).reshape(v_cache.shape)
    return k_cache, v_cache
