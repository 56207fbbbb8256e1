"""Attention over a mix of cache blocks and compressed blocks (``reference.ScaledKV``).

The class of inputs: random ragged batches (decode rows and prefill chunks, padding rows) whose tables point some
blocks into the compressed pool, under both one-byte types. Two properties: the tiled XLA op equals the reference
on the same mixed tables (float32 rounding only), and both equal the reference over the dequantized blocks written
back into the cache (what compression means); against the original blocks the error is the quantization's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas.attention.reference import ragged_paged_attention_reference
from kernels_pallas.attention.xla import ragged_paged_attention_xla
from kernels_pallas.storage import KV_QUANT_MAX, ScaledKV, from_storage, gather_blocks, quantize_blocks
from tests.test_attention_xla import _random_rows
from tests.test_kernels_pallas import _ragged_batch

SCALE = 0.125
STORAGE = {"int8": np.dtype(np.int8), "fp8": np.dtype(np.uint8)}


def _compress_some(rng, k_cache, v_cache, tables, storage, share=0.5):
    """Move a random ``share`` of the tables' non-null blocks into a compressed pool (slot 0 unused, as the
    engine's null slot). Returns (mixed tables, pool, caches with those blocks replaced by their dequantized
    values)."""
    num_blocks = k_cache.shape[0]
    ids = np.unique(np.asarray(tables))
    ids = ids[ids > 0]
    chosen = ids[rng.random(len(ids)) < share]
    pool_size = len(chosen) + 1
    qk, sk = quantize_blocks(k_cache[chosen], storage)
    qv, sv = quantize_blocks(v_cache[chosen], storage)
    shape = (pool_size,) + k_cache.shape[1:]
    heads = k_cache.shape[2]
    pool = ScaledKV(jnp.zeros(shape, storage).at[1:].set(qk), jnp.zeros(shape, storage).at[1:].set(qv),
                        jnp.ones((pool_size, heads), jnp.float32).at[1:].set(sk),
                        jnp.ones((pool_size, heads), jnp.float32).at[1:].set(sv))
    remap = np.arange(num_blocks, dtype=np.int32)
    remap[chosen] = num_blocks + 1 + np.arange(len(chosen), dtype=np.int32)
    mixed = jnp.asarray(remap[np.asarray(tables)])
    slots = jnp.arange(1, pool_size)
    dq_k = from_storage(pool.k[slots]).astype(jnp.float32) * pool.k_scale[slots][:, None, :, None]
    dq_v = from_storage(pool.v[slots]).astype(jnp.float32) * pool.v_scale[slots][:, None, :, None]
    return mixed, pool, (k_cache.at[chosen].set(dq_k.astype(k_cache.dtype)),
                         v_cache.at[chosen].set(dq_v.astype(v_cache.dtype)))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_xla_attention_over_mixed_blocks_matches_reference(seed, kind):
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([4, 8, 16]))
    q_lens, seq_lens = _random_rows(rng, int(rng.integers(1, 7)), block_size, decode_share=0.5)
    q, k_cache, v_cache, tables, lens, starts, num_seqs = _ragged_batch(
        rng, q_lens, seq_lens, block_size=block_size, head_dim=int(rng.choice([16, 64])),
        group=int(rng.choice([1, 2, 4])), dtype=jnp.float32, pad_seqs=int(rng.integers(0, 3)),
        pad_tokens=int(rng.integers(0, 6)))
    mixed, pool, (dq_k, dq_v) = _compress_some(rng, k_cache, v_cache, tables, STORAGE[kind])
    window = [None, int(rng.integers(1, 3 * block_size))][seed % 2]
    static = dict(scale=SCALE, sliding_window=window)
    want = ragged_paged_attention_reference(q, dq_k, dq_v, tables, lens, starts, num_seqs, **static)
    ref = ragged_paged_attention_reference(q, k_cache, v_cache, mixed, lens, starts, num_seqs, scaled_pool=pool,
                                           **static)
    got = jax.jit(functools.partial(ragged_paged_attention_xla, kv_chunk_blocks=int(rng.choice([1, 2, 3])),
                                    **static))(q, k_cache, v_cache, mixed, lens, starts, num_seqs, scaled_pool=pool)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(want), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    # Against the blocks before compression: the quantization error (values ~N(0, 1), outputs averages of them).
    exact = ragged_paged_attention_reference(q, k_cache, v_cache, tables, lens, starts, num_seqs, **static)
    np.testing.assert_allclose(np.asarray(got), np.asarray(exact), atol={"int8": 0.05, "fp8": 0.25}[kind], rtol=0)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantize_blocks_scales_each_block_and_head_by_its_peak(kind):
    storage = STORAGE[kind]
    x = np.random.default_rng(0).standard_normal((3, 4, 2, 8)).astype(np.float32)
    x[1, :, 1] = 0.0  # an all-zero head: scale 1, zeros stored
    q, scale = quantize_blocks(jnp.asarray(x), storage)
    peak = np.abs(x).max(axis=(1, 3))
    number = np.int8 if kind == "int8" else ml_dtypes.float8_e4m3fn
    limit = KV_QUANT_MAX[jnp.dtype(number)]
    np.testing.assert_allclose(np.asarray(scale), np.where(peak > 0, peak / limit, 1.0), rtol=1e-6)
    # A cache of one block: ids 2, 3, 4 are slots 1, 2, 3 of a pool whose slot 0 is the null slot.
    pool = jnp.concatenate([jnp.zeros_like(q[:1]), q])
    pool_scale = jnp.concatenate([jnp.ones((1, 2)), scale])
    back = np.asarray(gather_blocks(jnp.zeros((1, 4, 2, 8)), jnp.asarray([2, 3, 4]), pool=pool, pool_scale=pool_scale))
    assert np.all(back[1, :, 1] == 0.0)
    # int8 rounds to the nearest step (half a step of error); e4m3 keeps 3 mantissa bits (1/16 relative).
    bound = peak[:, None, :, None] * (0.5 / 127 if kind == "int8" else 1 / 16) + 1e-7
    assert np.all(np.abs(back - x) <= bound)


def test_compressed_pool_with_a_quantized_cache_is_refused():
    rng = np.random.default_rng(0)
    args = _ragged_batch(rng, [1], [9], block_size=4, head_dim=16, group=1, dtype=jnp.float32)
    pool = ScaledKV(jnp.zeros((2, 4, 2, 16), jnp.int8), jnp.zeros((2, 4, 2, 16), jnp.int8),
                        jnp.ones((2, 2)), jnp.ones((2, 2)))
    for op in (ragged_paged_attention_reference, ragged_paged_attention_xla):
        with pytest.raises(ValueError, match="k_scale .* and scaled_pool were both given"):
            op(*args, scale=SCALE, k_scale=jnp.ones(2), v_scale=jnp.ones(2), scaled_pool=pool)
