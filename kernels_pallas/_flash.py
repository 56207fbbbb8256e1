"""Pieces shared by the Pallas attention kernels: KV gathering through a block table and one online-softmax
step (FlashAttention-2, Algorithm 1), on values already loaded from refs; power-of-two shapes for Triton.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

# Finite rather than -inf so that fully masked rows never compute inf - inf.
MASK_VALUE = -1e30


class Carry(NamedTuple):
    """Running state of one query tile: unnormalised output, row max, row sum."""

    acc: jax.Array  # [M, head_dim] float32
    row_max: jax.Array  # [M] float32
    row_sum: jax.Array  # [M] float32


def init_carry(num_rows: int, head_dim: int) -> Carry:
    return Carry(
        acc=jnp.zeros((num_rows, head_dim), jnp.float32),
        row_max=jnp.full((num_rows,), MASK_VALUE, jnp.float32),
        row_sum=jnp.zeros((num_rows,), jnp.float32),
    )


def load_kv_chunk(tables_ref, table_offset, chunk, k_ref, v_ref, *, block_k: int, block_size: int):
    """Gather KV positions ``[chunk * block_k, (chunk + 1) * block_k)`` of one sequence, token by token.

    tables_ref: flattened int32[S * W], the sequence's row at ``table_offset``; k_ref, v_ref: [num_slots, head_dim]
    of one KV head. Returns (kv_pos int32[block_k], k [block_k, head_dim], v [block_k, head_dim]).
    """
    kv_pos = chunk * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    blocks = tables_ref[table_offset + lax.div(kv_pos, block_size)]
    slots = blocks * block_size + lax.rem(kv_pos, block_size)
    return kv_pos, k_ref[slots, :], v_ref[slots, :]


def _dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    # HIGHEST keeps float32 inputs out of TF32 on GPU; bf16 inputs are unaffected.
    return lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())),
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )


def attend_chunk(
    carry: Carry,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float,
    soft_cap: Optional[float],
) -> Carry:
    """Fold one KV chunk into a query tile's running softmax.

    q: [M, head_dim]; k, v: [block_k, head_dim] as stored (converted to q's dtype; a quantized cache's K scale
    belongs in ``scale``, its V scale is applied after); mask: bool[M, block_k]. Masked keys get zero weight;
    a row seeing no key keeps ``row_sum == 0`` (zeros from :func:`finish`).
    """
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    scores = _dot(q, k, contract_b=1) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask, scores, MASK_VALUE)
    row_max = jnp.maximum(carry.row_max, jnp.max(scores, axis=1))
    probs = jnp.where(mask, jnp.exp(scores - row_max[:, None]), 0.0)
    correction = jnp.exp(carry.row_max - row_max)
    row_sum = carry.row_sum * correction + jnp.sum(probs, axis=1)
    acc = carry.acc * correction[:, None] + _dot(probs.astype(v.dtype), v, contract_b=0)
    return Carry(acc, row_max, row_sum)


def finish(carry: Carry) -> jax.Array:
    """Normalised output [M, head_dim] float32; rows that saw no key are zeros."""
    row_sum = jnp.where(carry.row_sum == 0.0, 1.0, carry.row_sum)
    return carry.acc / row_sum[:, None]


def merge_splits(acc: jax.Array, row_max: jax.Array, row_sum: jax.Array) -> jax.Array:
    """Split-K partial results merged by log-sum-exp: acc [..., splits, H, D] (unnormalised), row_max, row_sum
    [..., splits, H] (float32) -> [..., H, D] float32; rows no split saw are zeros."""
    global_max = jnp.max(row_max, axis=-2, keepdims=True)
    # Empty splits have row_sum 0 and acc 0, so their weight does not matter.
    weight = jnp.exp(row_max - global_max)
    total = jnp.sum(row_sum * weight, axis=-2)
    out = jnp.sum(acc * weight[..., None], axis=-3)
    return out / jnp.where(total == 0.0, 1.0, total)[..., None]


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_attention_shapes(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                           *, triton: bool = True) -> None:
    """Raise ValueError for inputs the paged attention kernels cannot take (``triton``: with Triton's dot limits)."""
    _, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if triton and (head_dim < 16 or head_dim & (head_dim - 1)):
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 16 (Triton dot constraint)")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [S, W], got {block_tables.shape}")


def pad_tables(block_tables: jax.Array, *, block_k: int, block_size: int) -> tuple[jax.Array, int]:
    """Block tables flattened to int32[S * W'], W' covering whole ``block_k`` chunks (padding -> block 0, masked)."""
    _, width = block_tables.shape
    chunks = -(-width * block_size // block_k)
    padded_width = -(-chunks * block_k // block_size)
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    return tables.reshape(-1), padded_width
