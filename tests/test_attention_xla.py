"""The tiled jnp attention (``kernels_pallas.attention.xla``) and the decode fast path against the reference.

The class of inputs: any ragged batch -- decode rows and prefill chunks in any
order, chunks shorter or longer than a tile and not a multiple of it,
contexts that end mid-block or on a block boundary, padded sequence rows and
padded token rows -- under every GQA ratio, block size, sliding window and
soft-cap, and the tuning knobs (tile length, KV blocks per loop step for prefill and
for decode tiles, decode dots batched over KV heads or over every head pair).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention.pallas_decode import paged_attention
from kernels_pallas.attention.reference import ragged_paged_attention_reference
from kernels_pallas.attention.xla import ragged_paged_attention_xla
from kernels_pallas.ops import decode_step_attention
from tests.test_kernels_pallas import TOLERANCE, _ragged_batch

SCALE = 0.125


def _random_rows(rng, num_seqs, block_size, decode_share):
    q_lens, seq_lens = [], []
    for _ in range(num_seqs):
        q_len = 1 if rng.random() < decode_share else int(rng.integers(2, 5 * block_size))
        context = int(rng.choice([0, block_size, int(rng.integers(0, 6 * block_size))]))
        q_lens.append(q_len)
        seq_lens.append(q_len + context)
    return q_lens, seq_lens


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_attention_matches_reference_on_random_ragged_batches(seed, dtype):
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([4, 8, 16]))
    q_lens, seq_lens = _random_rows(rng, int(rng.integers(1, 7)), block_size, decode_share=0.5)
    args = _ragged_batch(rng, q_lens, seq_lens, block_size=block_size, head_dim=int(rng.choice([16, 64])),
                         group=int(rng.choice([1, 2, 4])), dtype=dtype, pad_seqs=int(rng.integers(0, 3)),
                         pad_tokens=int(rng.integers(0, 6)))
    window = [None, int(rng.integers(1, 3 * block_size))][seed % 2]
    soft_cap = [None, 5.0][(seed // 2) % 2]
    tuning = dict(prefill_tile=int(rng.choice([1, 4, 16])), kv_chunk_blocks=int(rng.choice([1, 2, 3])),
                  decode_kv_chunk_blocks=int(rng.choice([1, 3, 4])), cross_head_decode=bool(seed % 3))
    want = ragged_paged_attention_reference(*args, scale=SCALE, sliding_window=window, soft_cap=soft_cap)
    got = jax.jit(functools.partial(ragged_paged_attention_xla, scale=SCALE, sliding_window=window,
                                    soft_cap=soft_cap, **tuning))(*args)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=TOLERANCE[dtype],
                               rtol=0)


@pytest.mark.parametrize("q_lens, seq_lens", [
    ([1, 1, 1], [1, 16, 17]),             # decode only, at and past a block boundary
    ([33], [33]),                          # one prefill, two full tiles and a partial one
    ([16, 1, 5], [48, 9, 5]),              # a whole-tile chunk on a cached prefix, decode, short prompt
    ([2] * 8, [2, 3, 4, 5, 6, 7, 8, 9]),   # many short prefill rows: the most tiles a step can need
])
def test_xla_attention_matches_reference_on_edge_layouts(q_lens, seq_lens):
    rng = np.random.default_rng(0)
    args = _ragged_batch(rng, q_lens, seq_lens, block_size=8, head_dim=32, group=2, dtype=jnp.float32)
    want = ragged_paged_attention_reference(*args, scale=SCALE)
    got = jax.jit(functools.partial(ragged_paged_attention_xla, scale=SCALE, prefill_tile=16))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_xla_attention_padding_rows_are_zero():
    rng = np.random.default_rng(1)
    args = _ragged_batch(rng, [3, 1], [7, 12], block_size=4, head_dim=16, group=2, dtype=jnp.float32,
                         pad_seqs=2, pad_tokens=5)
    got = np.asarray(ragged_paged_attention_xla(*args, scale=SCALE))
    assert got.shape[0] == 4 + 5
    assert np.all(got[4:] == 0.0)


@pytest.mark.parametrize("seq_lens", [[5, 16, 17, 40], [9, 20, 3]])
def test_decode_step_attention_matches_reference(seq_lens):
    # Decode-only steps' attention: the decode kernel (interpret mode) behind the ragged signature.
    rng = np.random.default_rng(2)
    args = _ragged_batch(rng, [1] * len(seq_lens), seq_lens, block_size=8, head_dim=64, group=2, dtype=jnp.float32,
                         pad_seqs=1, pad_tokens=2)
    attend = decode_step_attention(functools.partial(paged_attention, interpret=True))
    want = ragged_paged_attention_reference(*args, scale=SCALE)
    got = jax.jit(functools.partial(attend, scale=SCALE))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize("q_lens, seq_lens", [([1, 1, 1], [5, 16, 40]), ([1, 4, 1], [9, 20, 3]), ([5, 3], [9, 20])])
def test_xla_decode_only_variant_matches_on_decode_steps_and_mixed_runs_both(q_lens, seq_lens):
    # decode_only=True is exact on decode-only batches; the mixed variant (no branch on the batch) on any.
    rng = np.random.default_rng(3)
    args = _ragged_batch(rng, q_lens, seq_lens, block_size=4, head_dim=16, group=2, dtype=jnp.float32,
                         pad_seqs=1, pad_tokens=3)
    want = np.asarray(ragged_paged_attention_reference(*args, scale=SCALE))
    kw = dict(scale=SCALE, prefill_tile=4)
    got = jax.jit(functools.partial(ragged_paged_attention_xla, **kw))(*args)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
    if all(n == 1 for n in q_lens):
        got = jax.jit(functools.partial(ragged_paged_attention_xla, decode_only=True, **kw))(*args)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
