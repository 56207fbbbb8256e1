"""Ragged paged attention in plain ``jnp``, shaped for XLA's CPU backend.

Same signature and semantics as ``reference.py`` (cache layout, padding, GQA, uint16 storage of
bfloat16, int8 / float8_e4m3fn scales, the scaled_pool pool), at the cost of what the sequences
need: per-sequence query tiles over KV chunks with a flash-decoding log-sum-exp merge, no
``[T, W * block_size]`` buffer. (The ops table sends the rows to the C++ kernel instead where it applies:
``kernels_pallas.ops.xla_attention``.) Scores and softmax are float32; the output is q's dtype.
Design and costs: docs/design/kernels.md.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from kernels_pallas.storage import ScaledKV, check_pool_scales, from_storage

# Finite stand-in for -inf: masked scores and the initial running max. exp of
# (masked - max) underflows to exactly 0, and no NaN arises from -inf - -inf.
_MASKED = -1e30
PREFILL_TILE = 16
KV_CHUNK_BLOCKS = 2
DECODE_KV_CHUNK_BLOCKS = 4
PAIRS_PER_STEP = 32
# Up to this many KV heads (per device), decode tiles take the cross-head dots:
# Hkv times the multiply-adds of the decode dots, none of the layout copies.
CROSS_HEAD_MAX_KV_HEADS = 4


def _head_batched_dots(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """Scores and the weights -> outputs function, as dots batched over KV heads.

    q: float32 [B, Q, Hkv, G, D]; k, v: float32 [B, L, Hkv, D].
    Returns (scores float32 [B, Hkv, Q, G, L], [B, Hkv, Q, G, L] -> float32 [B, Hkv, Q, G, D]).
    """
    return (jnp.einsum("bqhgd,blhd->bhqgl", q, k),
            lambda p: jnp.einsum("bhqgl,blhd->bhqgd", p, v))


def _cross_head_dots(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """:func:`_head_batched_dots` over every (query head, KV head) pair, the matching ones kept (no layout copies)."""
    batch, tile_len, num_kv_heads, group, head_dim = q.shape
    chunk_len = k.shape[1]
    rows = q.reshape(batch, tile_len * num_kv_heads * group, head_dim)
    cross = jnp.einsum("bmd,bnd->bmn", k.reshape(batch, chunk_len * num_kv_heads, head_dim), rows)
    cross = cross.reshape(batch, chunk_len, num_kv_heads, tile_len, num_kv_heads, group)
    scores = jnp.diagonal(cross, axis1=2, axis2=4).transpose(0, 4, 2, 3, 1)  # [B, Hkv, Q, G, L]

    def values(p: jax.Array) -> jax.Array:
        weights = p.reshape(batch, num_kv_heads * tile_len * group, chunk_len)
        out = jnp.einsum("bnl,blm->bnm", weights, v.reshape(batch, chunk_len, num_kv_heads * head_dim))
        out = out.reshape(batch, num_kv_heads, tile_len, group, num_kv_heads, head_dim)
        return jnp.diagonal(out, axis1=1, axis2=4).transpose(0, 4, 1, 2, 3)  # [B, Hkv, Q, G, D]

    return scores, values


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
    pairs_per_step: int,
    k_scale: Optional[jax.Array] = None,
    v_scale: Optional[jax.Array] = None,
    cross_heads: bool = False,
    scaled_pool: Optional[ScaledKV] = None,
) -> jax.Array:
    """Attention of query tiles over their own sequence's paged KV (tile/chunk pairs, log-sum-exp merge).

    q_tiles: [N, Q, Hq, D], one sequence per tile; q_pos: int32[N, Q] positions, -1 padding; tables: int32[N, W];
    k_cache, v_cache: [num_blocks, block_size, Hkv, D]; chunk_blocks: KV blocks per chunk; pairs_per_step: pairs per
    loop step; k_scale, v_scale: float32[Hkv] or None; cross_heads: use :func:`_cross_head_dots`; scaled_pool: the
    pool table ids ``>= num_blocks`` name, or None. Returns float32 [N, Q, Hq, D], zeros for padding queries.
    """
    num_tiles, tile_len, num_q_heads, head_dim = q_tiles.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    width = tables.shape[1]
    chunk_len = chunk_blocks * block_size
    # Pad the tables to whole chunks with the null block (masked out below).
    tables = jnp.pad(tables, ((0, 0), (0, -(-width // chunk_blocks) * chunk_blocks - width)))
    qg = (q_tiles.astype(jnp.float32) * scale).reshape(num_tiles, tile_len, num_kv_heads, group, head_dim)
    if k_scale is not None:
        qg = qg * k_scale[:, None, None]

    valid_q = q_pos >= 0
    last_pos = jnp.max(q_pos, axis=1)
    first_chunk = jnp.zeros(num_tiles, jnp.int32)
    if sliding_window is not None:
        lowest = jnp.min(jnp.where(valid_q, q_pos, jnp.iinfo(jnp.int32).max), axis=1)
        first_chunk = jnp.maximum(lowest - sliding_window + 1, 0) // chunk_len
    num_chunks = jnp.where(last_pos >= 0, last_pos // chunk_len + 1 - first_chunk, 0)
    pair_end = jnp.cumsum(num_chunks)
    num_pairs = pair_end[-1]
    batch = pairs_per_step
    stats = (num_tiles, num_kv_heads, tile_len, group)
    # Gather whole blocks as rows: with one KV head, a gather of [block_size, 1, head_dim]
    # slices lets XLA's CPU layout assignment move the unit axis, and the layer scan then
    # copies the whole cache on every layer.
    num_blocks = k_cache.shape[0]
    k_blocks = k_cache.reshape(num_blocks, -1)
    v_blocks = v_cache.reshape(num_blocks, -1)
    pool = None if scaled_pool is None else (scaled_pool.k.reshape(scaled_pool.k.shape[0], -1),
                                            scaled_pool.v.reshape(scaled_pool.v.shape[0], -1))

    def load(blocks: jax.Array, ids: jax.Array, which: int) -> jax.Array:
        """float32 [B, chunk_len, Hkv, D] of blocks ``ids`` (int32[B, chunk_blocks]), K (0) or V (1)."""
        x = from_storage(jnp.take(blocks, ids, axis=0, mode="clip")).astype(jnp.float32)
        shape = (batch, chunk_blocks, block_size, num_kv_heads, head_dim)
        if pool is not None:
            in_pool = ids >= num_blocks
            slot = jnp.where(in_pool, ids - num_blocks, 0)
            y = from_storage(jnp.take(pool[which], slot, axis=0)).astype(jnp.float32).reshape(shape)
            y = y * jnp.take(scaled_pool[2 + which], slot, axis=0)[:, :, None, :, None]
            x = jnp.where(in_pool[:, :, None, None, None], y, x.reshape(shape))
        return x.reshape(batch, chunk_len, num_kv_heads, head_dim)

    def body(step, carry):
        run_max, run_sum, acc = carry
        pair = step * batch + jnp.arange(batch, dtype=jnp.int32)
        live = pair < num_pairs
        tile = jnp.minimum(jnp.searchsorted(pair_end, pair, side="right"), num_tiles - 1).astype(jnp.int32)
        chunk = first_chunk[tile] + pair - (pair_end[tile] - num_chunks[tile])
        ids = jnp.take_along_axis(tables[tile], chunk[:, None] * chunk_blocks + jnp.arange(chunk_blocks)[None, :],
                                  axis=1)
        k, v = load(k_blocks, ids, 0), load(v_blocks, ids, 1)
        dots = _cross_head_dots if cross_heads else _head_batched_dots
        scores, values = dots(qg[tile], k, v)
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        kv_pos = chunk[:, None] * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)[None, :]  # [B, L]
        pos = q_pos[tile]  # [B, Q]
        visible = (kv_pos[:, None, :] <= pos[:, :, None]) & (pos[:, :, None] >= 0) & live[:, None, None]
        if sliding_window is not None:
            visible &= kv_pos[:, None, :] > pos[:, :, None] - sliding_window
        visible = visible[:, None, :, None, :]  # [B, 1, Q, 1, L]
        scores = jnp.where(visible, scores, _MASKED)
        pair_max = jnp.max(scores, axis=-1)
        p = jnp.where(visible, jnp.exp(scores - pair_max[..., None]), 0.0)
        pair_out = values(p)
        # Fold the pairs into their tiles; a dead pair points past the end and is dropped.
        target = jnp.where(live, tile, num_tiles)
        new_max = run_max.at[target].max(pair_max, mode="drop")
        weight = jnp.exp(pair_max - new_max[tile])
        rescale = jnp.exp(run_max - new_max)
        run_sum = (run_sum * rescale).at[target].add(jnp.sum(p, axis=-1) * weight, mode="drop")
        acc = (acc * rescale[..., None]).at[target].add(pair_out * weight[..., None], mode="drop")
        return new_max, run_sum, acc

    init = (jnp.full(stats, _MASKED, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros(stats + (head_dim,), jnp.float32))
    _, run_sum, acc = jax.lax.fori_loop(0, (num_pairs + batch - 1) // batch, body, init)
    out = acc / jnp.where(run_sum == 0.0, 1.0, run_sum)[..., None]
    if v_scale is not None:
        out = out * v_scale[:, None, None, None]
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
    decode_kv_chunk_blocks: int = DECODE_KV_CHUNK_BLOCKS,
    pairs_per_step: int = PAIRS_PER_STEP,
    k_scale: Optional[jax.Array] = None,
    v_scale: Optional[jax.Array] = None,
    cross_head_decode: Optional[bool] = None,
    scaled_pool: Optional[ScaledKV] = None,
) -> jax.Array:
    """Causal attention of a ragged batch over a paged KV cache, tiled per sequence.

    Arguments, result and semantics as ``reference.ragged_paged_attention_reference``: q ``[T, Hq, D]``;
    caches ``[num_blocks, block_size, Hkv, D]``; ``block_tables: int32[S, W]``; ``seq_lens: int32[S]``;
    ``query_start_loc: int32[S + 1]``; ``num_seqs: int32[]``; ``k_scale, v_scale: float32[Hkv]`` or None;
    ``scaled_pool`` pool or None. Returns ``[T, Hq, D]`` in q's dtype, zeros on padding rows.
    ``interpret`` is accepted for signature parity.

    Args:
      prefill_tile: queries per prefill tile.
      kv_chunk_blocks, decode_kv_chunk_blocks: KV blocks per chunk of prefill / decode tiles.
      pairs_per_step: (tile, chunk) pairs per loop iteration (capped at the number of tiles).
      cross_head_decode: decode dots over all KV-head pairs; None: when ``Hkv <= CROSS_HEAD_MAX_KV_HEADS``.

    Raises:
      ValueError: ``k_scale`` together with ``scaled_pool`` (``storage.check_pool_scales``).
    """
    del interpret
    check_pool_scales(k_scale, scaled_pool)
    if cross_head_decode is None:
        cross_head_decode = k_cache.shape[2] <= CROSS_HEAD_MAX_KV_HEADS
    num_tokens = q.shape[0]
    num_rows = block_tables.shape[0]
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    q_len = ends - starts
    live = jnp.arange(num_rows) < num_seqs
    is_decode = live & (q_len == 1)
    is_prefill = live & (q_len > 1)
    first_pos = seq_lens - q_len  # position of each row's first new token
    attend = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
                  scaled_pool=scaled_pool)
    pairs = functools.partial(min, pairs_per_step)
    zeros = jnp.zeros(q.shape, jnp.float32)

    def decode(out: jax.Array) -> jax.Array:
        token = jnp.minimum(starts, num_tokens - 1)
        pos = jnp.where(is_decode, seq_lens - 1, -1)[:, None]
        res = _attend_tiles(q[token][:, None], pos, block_tables, k_cache, v_cache, pairs_per_step=pairs(num_rows),
                            cross_heads=cross_head_decode, chunk_blocks=decode_kv_chunk_blocks, **attend)
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
                            pairs_per_step=pairs(max_tiles), chunk_blocks=kv_chunk_blocks, **attend)
        return out.at[jnp.where(valid, token, num_tokens)].set(res, mode="drop")

    out = jax.lax.cond(jnp.any(is_decode), decode, lambda o: o, zeros)
    out = jax.lax.cond(jnp.any(is_prefill), prefill, lambda o: o, out)
    return out.astype(q.dtype)
