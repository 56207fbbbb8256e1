"""Plain ``jnp`` references for paged attention: the ground truth of every attention backend.

Each has its Pallas kernel's exact signature (``interpret`` accepted and ignored).

Cache layout (one layer): ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s`` is
block ``s // block_size``, offset ``s % block_size``. Block 0 is the null block padded slots write into. Caches may
be bit patterns, quantized, or beside a pool of scaled one-byte blocks (``kernels_pallas.storage.ScaledKV``).
GQA as HF's ``repeat_kv``: query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from kernels_pallas.storage import ScaledKV, check_pool_scales, gather_blocks

_NEG_INF = -1e30


def _soft_cap(scores: jax.Array, soft_cap: Optional[float]) -> jax.Array:
    if soft_cap is None:
        return scores
    return soft_cap * jnp.tanh(scores / soft_cap)


def _masked_softmax_pv(scores: jax.Array, mask: jax.Array, v: jax.Array) -> jax.Array:
    """Masked softmax over the last axis, then @ v; rows with no valid key give zeros.

    scores: [N, Hkv, G, L] float32; mask: [N, 1, 1, L] bool; v: [N, L, Hkv, D] float32.
    """
    scores = jnp.where(mask, scores, _NEG_INF)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    return jnp.einsum("nhgl,nlhd->nhgd", p, v)


# One compiled program per shape and static options; op by op, each new shape would compile every op.
@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret"))
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
    scaled_pool: Optional[ScaledKV] = None,
) -> jax.Array:
    """Causal attention of a ragged batch of new tokens over a paged KV cache.

    Args:
      q: [T, num_q_heads, head_dim], sequences concatenated in batch order, padded to T.
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], holding this step's K/V.
      block_tables: int32[S, W] each sequence's block ids.
      seq_lens: int32[S] KV length including new tokens.
      query_start_loc: int32[S + 1]; sequence s owns rows ``query_start_loc[s]:query_start_loc[s + 1]``.
      num_seqs: int32[]; sequence rows ``>= num_seqs`` and query rows ``>= query_start_loc[num_seqs]`` are padding.
      scale: multiplier of q·k. sliding_window: keys in ``(p - sliding_window, p]`` (Mistral's convention).
      soft_cap: scores become ``soft_cap * tanh(scores / soft_cap)``. interpret: ignored.
      k_scale, v_scale: float32[num_kv_heads] of a quantized cache, or None.
      scaled_pool: the pool (``storage.ScaledKV``) table ids ``>= num_blocks`` name, or None (not with scales).

    Returns:
      [T, num_q_heads, head_dim] in q's dtype, zeros on padding rows. Row i of sequence s is at position
      ``seq_lens[s] - q_len[s] + i`` and attends up to it. Memory O(T * W * block_size * Hkv * D).
    """
    del interpret
    check_pool_scales(k_scale, scaled_pool)
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
    pools = (None, None, None, None) if scaled_pool is None else scaled_pool
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


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret"))
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
    """Decode attention: one query per sequence (position ``seq_lens[s] - 1``) over its paged context.

    q: [S, num_q_heads, head_dim]; caches as the ragged reference; block_tables: int32[S, W]; seq_lens:
    int32[S] (0: padding row). Other args as :func:`ragged_paged_attention_reference`.
    Returns [S, num_q_heads, head_dim] in q's dtype; zeros where seq_lens is 0.
    """
    num_seqs = q.shape[0]
    query_start_loc = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    out = ragged_paged_attention_reference(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, jnp.int32(num_seqs),
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
    )
    return jnp.where((seq_lens > 0)[:, None, None], out, jnp.zeros_like(out))
