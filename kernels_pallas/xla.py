"""Ragged paged attention in plain ``jnp``, shaped for XLA's CPU backend.

The reference (``reference.py``) gathers every query token's whole context,
``[T, W * block_size, Hkv, D]``: simple, but its memory traffic grows with
tokens times the table width. This version has the same signature and
semantics and costs what the sequences need:

* Queries are grouped into *tiles* that each belong to one sequence. A
  decode row (one new token) is a tile of one query; the new tokens of a
  prefill chunk are cut into tiles of ``prefill_tile`` consecutive queries.
  The KV blocks of a tile are gathered once for all its queries, so the
  gather traffic follows tiles (about ``num_seqs + T / prefill_tile``), not
  tokens.
* Keys and values are visited in chunks of ``kv_chunk_blocks`` blocks by a
  ``fori_loop`` whose trip count is the longest context in the step (not the
  table width), folding each chunk into a running (max, sum, output) as in
  FlashAttention (Dao et al. 2022). Nothing of size ``W * block_size`` is ever
  materialised, so a wide block table costs nothing until a sequence is long.
* Decode tiles and prefill tiles are two fixed-shape passes, each skipped by
  ``lax.cond`` when the step has no row of its kind.

Scores and the softmax are float32 whatever the cache dtype; the output is
q's dtype. Cache layout, padding rules, GQA mapping and the uint16 storage of
bfloat16 caches as in ``reference.py``.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kernels_pallas.reference import from_storage

# Finite stand-in for -inf: masked scores and the initial running max. exp of
# (masked - max) underflows to exactly 0, and no NaN arises from -inf - -inf.
_MASKED = -1e30
PREFILL_TILE = 16
KV_CHUNK_BLOCKS = 2


def _attend_tiles(
    q_tiles: jax.Array,
    q_pos: jax.Array,
    tables: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    scale: float,
    sliding_window: Optional[int],
    soft_cap: Optional[float],
    chunk_blocks: int,
) -> jax.Array:
    """Attention of query tiles over their own sequence's paged KV.

    Args:
      q_tiles: [N, Q, Hq, D] queries, tile n belonging to one sequence.
      q_pos: int32[N, Q] position of each query; -1 marks a padding query.
      tables: int32[N, W] the block table of each tile's sequence.
      k_cache, v_cache: [num_blocks, block_size, Hkv, D].
      chunk_blocks: KV blocks folded per loop iteration.

    Returns:
      float32 [N, Q, Hq, D]; padding queries give zeros.
    """
    num_tiles, tile_len, num_q_heads, head_dim = q_tiles.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    width = tables.shape[1]
    chunk_len = chunk_blocks * block_size
    # Pad the tables to whole chunks with the null block (masked out below).
    num_chunks = -(-width // chunk_blocks)
    tables = jnp.pad(tables, ((0, 0), (0, num_chunks * chunk_blocks - width)))

    qg = (q_tiles.astype(jnp.float32) * scale).reshape(num_tiles, tile_len, num_kv_heads, group, head_dim)
    valid_q = q_pos >= 0
    kv_end = jnp.max(jnp.where(valid_q, q_pos + 1, 0))
    first = jnp.int32(0)
    if sliding_window is not None:
        lowest = jnp.min(jnp.where(valid_q, q_pos - sliding_window + 1, jnp.iinfo(jnp.int32).max))
        first = jnp.maximum(lowest, 0) // chunk_len
    last = (kv_end + chunk_len - 1) // chunk_len

    def body(chunk, carry):
        run_max, run_sum, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(tables, chunk * chunk_blocks, chunk_blocks, axis=1)
        k = jnp.take(k_cache, ids, axis=0, mode="clip").reshape(num_tiles, chunk_len, num_kv_heads, head_dim)
        v = jnp.take(v_cache, ids, axis=0, mode="clip").reshape(num_tiles, chunk_len, num_kv_heads, head_dim)
        scores = jnp.einsum("nqhgd,nlhd->nhqgl", qg, from_storage(k).astype(jnp.float32))
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        kv_pos = chunk * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)
        visible = (kv_pos[None, None, :] <= q_pos[:, :, None]) & valid_q[:, :, None]
        if sliding_window is not None:
            visible &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        visible = visible[:, None, :, None, :]  # [N, 1, Q, 1, L]
        scores = jnp.where(visible, scores, _MASKED)
        new_max = jnp.maximum(run_max, jnp.max(scores, axis=-1))
        p = jnp.where(visible, jnp.exp(scores - new_max[..., None]), 0.0)
        rescale = jnp.exp(run_max - new_max)
        run_sum = run_sum * rescale + jnp.sum(p, axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum("nhqgl,nlhd->nhqgd", p, from_storage(v).astype(jnp.float32))
        return new_max, run_sum, acc

    stats_shape = (num_tiles, num_kv_heads, tile_len, group)
    init = (jnp.full(stats_shape, _MASKED, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (head_dim,), jnp.float32))
    _, run_sum, acc = jax.lax.fori_loop(first, last, body, init)
    out = acc / jnp.where(run_sum == 0.0, 1.0, run_sum)[..., None]
    return out.transpose(0, 2, 1, 3, 4).reshape(num_tiles, tile_len, num_q_heads, head_dim)


def ragged_paged_attention_xla(
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
    prefill_tile: int = PREFILL_TILE,
    kv_chunk_blocks: int = KV_CHUNK_BLOCKS,
) -> jax.Array:
    """Causal attention of a ragged batch over a paged KV cache, tiled per sequence.

    Arguments, result and semantics are those of
    ``reference.ragged_paged_attention_reference`` (q ``[T, Hq, D]``, caches
    ``[num_blocks, block_size, Hkv, D]``, ``block_tables: int32[S, W]``,
    ``seq_lens: int32[S]``, ``query_start_loc: int32[S + 1]``,
    ``num_seqs: int32[]``; returns ``[T, Hq, D]`` in q's dtype with zeros on
    padding rows). ``interpret`` is accepted for signature parity.

    Args:
      prefill_tile: queries per prefill tile (a sequence with more than one
        new token). Smaller tiles waste less on a chunk's last partial tile;
        larger ones gather each KV block for more queries at once.
      kv_chunk_blocks: KV blocks folded per loop iteration.

    Cost: KV gathers of about ``(S + T / prefill_tile) * L * Hkv * D``
    elements, where ``L`` is the longest context in the step rounded up to
    ``kv_chunk_blocks * block_size``; no ``[T, W * block_size]`` buffer.
    """
    del interpret
    num_tokens = q.shape[0]
    num_rows = block_tables.shape[0]
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    q_len = ends - starts
    live = jnp.arange(num_rows) < num_seqs
    is_decode = live & (q_len == 1)
    is_prefill = live & (q_len > 1)
    first_pos = seq_lens - q_len  # position of each row's first new token
    attend = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, chunk_blocks=kv_chunk_blocks)
    zeros = jnp.zeros(q.shape, jnp.float32)

    def decode(out: jax.Array) -> jax.Array:
        token = jnp.minimum(starts, num_tokens - 1)
        pos = jnp.where(is_decode, seq_lens - 1, -1)[:, None]
        res = _attend_tiles(q[token][:, None], pos, block_tables, k_cache, v_cache, **attend)
        return out.at[jnp.where(is_decode, starts, num_tokens)].set(res[:, 0], mode="drop")

    # Every prefill row adds at most one partial tile, and there are at most
    # min(S, T // 2) of them, so this many tiles always hold the step.
    tile = min(prefill_tile, num_tokens)
    max_tiles = -(-num_tokens // tile) + min(num_rows, num_tokens // 2)

    def prefill(out: jax.Array) -> jax.Array:
        tiles_per_row = jnp.where(is_prefill, (q_len + tile - 1) // tile, 0)
        tile_end = jnp.cumsum(tiles_per_row)
        idx = jnp.arange(max_tiles, dtype=jnp.int32)
        row = jnp.minimum(jnp.searchsorted(tile_end, idx, side="right"), num_rows - 1).astype(jnp.int32)
        used = idx < tile_end[-1]
        token = starts[row][:, None] + (idx - (tile_end[row] - tiles_per_row[row]))[:, None] * tile \
            + jnp.arange(tile, dtype=jnp.int32)[None, :]
        valid = used[:, None] & (token < ends[row][:, None])
        pos = jnp.where(valid, first_pos[row][:, None] + token - starts[row][:, None], -1)
        res = _attend_tiles(q[jnp.minimum(token, num_tokens - 1)], pos, block_tables[row], k_cache, v_cache,
                            **attend)
        return out.at[jnp.where(valid, token, num_tokens)].set(res, mode="drop")

    out = jax.lax.cond(jnp.any(is_decode), decode, lambda o: o, zeros)
    out = jax.lax.cond(jnp.any(is_prefill), prefill, lambda o: o, out)
    return out.astype(q.dtype)
