"""Causal attention for a mixed batch of prefill chunks and decode rows over a paged KV cache, in one Pallas
GPU launch: per-sequence query tiles with GQA heads packed into rows (vLLM's Triton "unified attention"),
FlashAttention-2's online softmax over KV chunks. Design: docs/design/kernels.md.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import _compat, _flash

# Rows (query tokens x group heads) per tile and KV tokens per inner step.
# 64 x 64 with 4 warps is the usual FlashAttention-2 Triton tile at head_dim
# 128; a smaller block_m would waste less on decode rows but re-read the KV
# more often for long prefills.
BLOCK_M = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 2


class TileSchedule(NamedTuple):
    seq: jax.Array  # int32[num_tiles]: sequence of the tile (0 for idle tiles)
    token: jax.Array  # int32[num_tiles]: first query row of the tile in q
    pos: jax.Array  # int32[num_tiles]: KV position of that first row
    rows: jax.Array  # int32[num_tiles]: query tokens in the tile, 0 = idle


def tile_schedule(seq_lens, query_start_loc, num_seqs, *, num_tiles: int, block_q: int) -> TileSchedule:
    """Cut each real sequence's query rows into ``num_tiles`` tiles of at most ``block_q`` tokens, in batch order
    (``seq_lens``, ``query_start_loc``, ``num_seqs`` as ``ragged_paged_attention``'s); tiles past the real count are
    idle (0 tokens). Shared with ``mosaic_ragged``."""
    num_seq_rows = seq_lens.shape[0]
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    q_len = jnp.where(jnp.arange(num_seq_rows) < num_seqs, q_len, 0)
    tiles_per_seq = (q_len + block_q - 1) // block_q
    tiles_end = jnp.cumsum(tiles_per_seq)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    active = tile < tiles_end[-1]
    seq = jnp.minimum(jnp.searchsorted(tiles_end, tile, side="right"), num_seq_rows - 1)
    first = (tile - (tiles_end[seq] - tiles_per_seq[seq])) * block_q
    rows = jnp.minimum(block_q, q_len[seq] - first)
    pos = seq_lens[seq] - q_len[seq] + first
    zero = jnp.zeros_like(tile)
    return TileSchedule(
        seq=jnp.where(active, seq, zero).astype(jnp.int32),
        token=jnp.where(active, query_start_loc[seq] + first, zero).astype(jnp.int32),
        pos=jnp.where(active, pos, zero).astype(jnp.int32),
        rows=jnp.where(active, rows, zero).astype(jnp.int32),
    )


def group_rows(q: jax.Array, num_kv_heads: int, *, group_p: int, block_q: int) -> jax.Array:
    """[T, Hq, D] -> [Hkv, (T + block_q) * group_p, D]: each token's query heads of one KV head (padded to
    ``group_p``) as consecutive rows, so a tile's rows are contiguous; the ``block_q`` spare tokens keep the last
    tile's slice in bounds. Shared with ``mosaic_ragged``."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, block_q), (0, 0), (0, group_p - group), (0, 0)))
    return qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, (num_tokens + block_q) * group_p, head_dim)


def ungroup_rows(out: jax.Array, q_shape: tuple[int, int, int], *, group_p: int, live_tokens: jax.Array) -> jax.Array:
    """:func:`group_rows`'s layout back to ``q_shape`` ([T, Hq, D]); tokens from ``live_tokens`` on are zeros (no
    tile writes padding tokens' rows, which hold whatever the buffer held)."""
    num_tokens, num_q_heads, head_dim = q_shape
    num_kv_heads = out.shape[0]
    out = out.reshape(num_kv_heads, -1, group_p, head_dim)[:, :num_tokens, :num_q_heads // num_kv_heads]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    valid = jnp.arange(num_tokens) < live_tokens
    return jnp.where(valid[:, None, None], out, jnp.zeros_like(out))


def _ragged_kernel(
    seq_ref, token_ref, pos_ref, rows_ref, tables_ref, k_scale_ref, v_scale_ref, q_ref, k_ref, v_ref, o_ref,
    *, group: int, block_q: int, block_k: int, block_size: int, table_width: int,
    scale: float, sliding_window: Optional[int], soft_cap: Optional[float],
):
    head, tile = pl.program_id(0), pl.program_id(1)
    k_scale = scale * k_scale_ref[head]
    seq, token, first_pos, num_rows = seq_ref[tile], token_ref[tile], pos_ref[tile], rows_ref[tile]
    block_m = block_q * group
    row_token = lax.div(lax.broadcasted_iota(jnp.int32, (block_m,), 0), group)
    row_pos = first_pos + row_token
    row_valid = row_token < num_rows
    rows = pl.ds(token * group, block_m)
    q = q_ref[rows, :]

    last_pos = first_pos + num_rows - 1
    end_chunk = jnp.where(num_rows > 0, lax.div(last_pos, block_k) + 1, 0)
    start_chunk = 0
    if sliding_window is not None:
        start_chunk = lax.div(jnp.maximum(first_pos - sliding_window + 1, 0), block_k)

    def body(chunk, carry):
        kv_pos, k, v = _flash.load_kv_chunk(
            tables_ref, seq * table_width, chunk, k_ref, v_ref, block_k=block_k, block_size=block_size
        )
        mask = (kv_pos[None, :] <= row_pos[:, None]) & row_valid[:, None]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > row_pos[:, None] - sliding_window
        return _flash.attend_chunk(carry, q, k, v, mask, scale=k_scale, soft_cap=soft_cap)

    carry = lax.fori_loop(start_chunk, end_chunk, body, _flash.init_carry(block_m, q.shape[1]))
    # Rows past the tile's sequence belong to the next sequence's tile: never write them.
    out = _flash.finish(carry) * v_scale_ref[head]
    _compat.masked_store(o_ref, (rows, slice(None)), out.astype(o_ref.dtype), row_valid[:, None])


@functools.partial(
    jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret", "block_m", "block_k")
)
def _ragged_paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, k_scale=None, v_scale=None,
    *, scale, sliding_window, soft_cap, interpret, block_m, block_k,
):
    _flash.check_attention_shapes(q, k_cache, v_cache, block_tables)
    ones = jnp.ones(k_cache.shape[2], jnp.float32)  # an unquantized cache
    k_scale, v_scale = ones if k_scale is None else k_scale, ones if v_scale is None else v_scale
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seq_rows = block_tables.shape[0]
    group = num_q_heads // num_kv_heads
    # Pad the head group to a power of two so tiles have power-of-two rows.
    group_p = _flash.next_power_of_2(group)
    block_q = max(block_m // group_p, 1)
    num_tiles = min(num_tokens, num_seq_rows + num_tokens // block_q)

    tables, table_width = _flash.pad_tables(block_tables, block_k=block_k, block_size=block_size)
    sched = tile_schedule(seq_lens, query_start_loc, num_seqs, num_tiles=num_tiles, block_q=block_q)

    qg = group_rows(q, num_kv_heads, group_p=group_p, block_q=block_q)

    num_slots = num_blocks * block_size
    flat = (num_slots, num_kv_heads, head_dim)
    head_rows_spec = pl.BlockSpec((_compat.SQUEEZED, qg.shape[1], head_dim), lambda h, t: (h, 0, 0))
    cache_spec = pl.BlockSpec((num_slots, _compat.SQUEEZED, head_dim), lambda h, t: (0, h, 0))
    kernel = functools.partial(
        _ragged_kernel, group=group_p, block_q=block_q, block_k=block_k, block_size=block_size,
        table_width=table_width, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_tiles),
        in_specs=[pl.BlockSpec()] * 7 + [head_rows_spec, cache_spec, cache_spec],
        out_specs=head_rows_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=_compat.compiler_params(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*sched, tables, k_scale, v_scale, qg, k_cache.reshape(flat), v_cache.reshape(flat))

    return ungroup_rows(out, q.shape, group_p=group_p, live_tokens=query_start_loc[num_seqs])


def ragged_paged_attention(
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
) -> jax.Array:
    """Causal attention of a ragged batch of new tokens over a paged KV cache (decode rows, prefill chunks, prompts).

    Args:
      q: [T, num_q_heads, head_dim] float32 or bfloat16, sequences concatenated in batch order, padded to T.
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] in q's dtype (or int8 / float8_e4m3fn
        with ``k_scale``, ``v_scale``), holding this step's K/V.
      block_tables: int32[S, W]; seq_lens: int32[S] KV lengths incl. new tokens; query_start_loc: int32[S + 1];
      num_seqs: int32[]: as ``reference.ragged_paged_attention_reference``.
      scale: multiplier of q·k. sliding_window: keys in ``(p - sliding_window, p]``.
      soft_cap: scores become ``soft_cap * tanh(scores / soft_cap)``.
      interpret: run the Pallas interpreter (CPU tests) instead of Triton.
      k_scale, v_scale: float32[num_kv_heads] of a quantized cache, or None.

    Returns:
      [T, num_q_heads, head_dim] in q's dtype; row i of sequence s at position ``seq_lens[s] - q_len[s] + i``;
      padding rows zeros.

    Raises:
      ValueError: mismatched shapes, num_q_heads not a multiple of num_kv_heads, or head_dim not a power of
        two >= 16.
    """
    return _ragged_paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, k_scale, v_scale,
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret,
        block_m=BLOCK_M, block_k=BLOCK_K,
    )
