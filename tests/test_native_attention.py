"""The C++ CPU attention kernel (``kernels_pallas.attention.cpu``) against the reference, and the paths around it.

The class of inputs: any ragged batch -- decode rows and prefill chunks, contexts of one token, ending
mid-block or on a block boundary, filling the block table, padding rows and padding tokens -- under every
block size, head dim, GQA ratio and KV head count (one included: its unit axis must not make XLA copy the
cache), with and without a sliding window and a soft cap, on float32 and bfloat16 caches (stored as bfloat16
or as its uint16 bit patterns). Around it: how ``ragged_paged_attention_xla`` sends every row to it, its
errors, and the build (cached per source; a failed build leaves the jnp path). Runs of several query
tokens take the kernel's GEMM-shaped path, decode rows its per-token one, decode rows over a shared prefix both (a
cascade); all three are swept here.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_pallas import cpu_build, cpu_features, ops
from kernels_pallas.attention import cpu
from kernels_pallas.attention.cpu import token_rows_and_positions
from kernels_pallas.attention.reference import ragged_paged_attention_reference
from kernels_pallas.attention.xla import ragged_paged_attention_xla
from kernels_pallas.ops import attention_native_applies as native_applies
from tests.test_kernels_pallas import _ragged_batch

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernel cannot be built here")
SCALE = 0.125


@pytest.fixture(autouse=True, scope="module")
def _kernels_loaded():
    # The ops table loads the library and registers the kernels' FFI targets; the tests call the kernels directly.
    assert ops.native_kernels(), ops.native_unavailable_reason()


def _case(rng, *, block_size, head_dim, group, kv_heads, dtype, width, pad_rows=1, pad_tokens=2):
    """A ragged batch in the reference's layout: rows of 1 (decode) to 40 new tokens after a context, the
    table's positions at most ``width * block_size``; plus padding rows and padding tokens."""
    full = width * block_size
    rows = int(rng.integers(1, 5))
    seq_lens = [int(rng.choice([1, min(block_size, full), min(block_size + 1, full), full,
                                int(rng.integers(1, full + 1))])) for _ in range(rows)]
    q_lens = [1 if rng.random() < 0.5 else int(rng.integers(1, min(n, 40) + 1)) for n in seq_lens]
    num_blocks = (rows + pad_rows) * width + 1
    k = jnp.asarray(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)), dtype)
    tables = jnp.asarray(rng.permutation(num_blocks)[:(rows + pad_rows) * width].reshape(-1, width), jnp.int32)
    ends = np.cumsum(q_lens)
    qsl = jnp.asarray(np.concatenate([[0], ends, np.full(pad_rows, ends[-1])]), jnp.int32)
    lens = jnp.asarray(seq_lens + [0] * pad_rows, jnp.int32)
    q = jnp.asarray(rng.standard_normal((int(ends[-1]) + pad_tokens, kv_heads * group, head_dim)), jnp.float32)
    return q, k, v, tables, lens, qsl, jnp.int32(rows)


def _rows(rng, q_lens, seq_lens, *, block_size, head_dim, group, kv_heads, dtype):
    """Rows of the given new-token and sequence lengths, a padding row and two padding tokens, each row's
    blocks anywhere in the cache."""
    width = max(-(-n // block_size) for n in seq_lens) + 1
    num_blocks = (len(q_lens) + 1) * width + 1
    k, v = (jnp.asarray(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)), dtype) for _ in range(2))
    tables = jnp.asarray(rng.permutation(num_blocks)[:(len(q_lens) + 1) * width].reshape(-1, width), jnp.int32)
    ends = np.cumsum(q_lens)
    qsl = jnp.asarray(np.concatenate([[0], ends, [ends[-1]]]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((int(ends[-1]) + 2, kv_heads * group, head_dim)), jnp.float32)
    return q, k, v, tables, jnp.asarray(list(seq_lens) + [0], jnp.int32), qsl, jnp.int32(len(q_lens))


# Both sides jitted: one program per case's shapes, where op-by-op dispatch would compile each op for every new
# shape.
@functools.partial(jax.jit, static_argnames=("sliding_window", "soft_cap"))
def _native(q, k, v, tables, lens, qsl, num_seqs, **kw):
    row, pos = token_rows_and_positions(qsl, lens, num_seqs, q.shape[0])
    return cpu.ragged_paged_attention_cpu(q, k, v, tables, row, pos, scale=SCALE, **kw)


@functools.partial(jax.jit, static_argnames=("sliding_window", "soft_cap"))
def _reference(q, k, v, tables, lens, qsl, num_seqs, **kw):
    return ragged_paged_attention_reference(q, k.astype(jnp.float32), v.astype(jnp.float32), tables, lens, qsl,
                                            num_seqs, scale=SCALE, **kw)


def _want(*args, **kw):
    # The reference in float32 over the same cache values; padding tokens are zeros.
    return np.asarray(_reference(*args, **kw), np.float32)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), block_size=st.sampled_from([1, 4, 16, 32]), head_dim=st.sampled_from([8, 64, 128]),
       group=st.sampled_from([1, 2, 3, 4]), kv_heads=st.sampled_from([1, 2, 3]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), window=st.sampled_from([None, 1, 5, 40]),
       soft_cap=st.sampled_from([None, 5.0]), as_bits=st.booleans())
def test_native_attention_matches_reference_on_any_ragged_batch(seed, block_size, head_dim, group, kv_heads, dtype,
                                                                 window, soft_cap, as_bits):
    rng = np.random.default_rng(seed)
    args = _case(rng, block_size=block_size, head_dim=head_dim, group=group, kv_heads=kv_heads, dtype=dtype,
                 width=int(rng.integers(1, 5)))
    want = _want(*args, sliding_window=window, soft_cap=soft_cap)
    q, k, v, *rest = args
    if as_bits and dtype == jnp.bfloat16:
        k, v = (jax.lax.bitcast_convert_type(c, jnp.uint16) for c in (k, v))
    got = _native(q, k, v, *rest, sliding_window=window, soft_cap=soft_cap)
    assert got.dtype == jnp.float32 and got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("head_dim, group, kv_heads, dtype, window, soft_cap", [
    (64, 3, 3, jnp.float32, None, None),    # SmolLM2-135M's heads
    (16, 1, 1, jnp.float32, 7, None),
    (128, 2, 2, jnp.bfloat16, None, 5.0),
    (256, 4, 1, jnp.bfloat16, 20, None),    # Gemma 3 270M's heads
    (32, 2, 3, jnp.float32, 16, 3.0),
    (80, 2, 2, jnp.float32, None, None),    # four-vector runs of the values' sum, then single vectors
])
def test_native_attention_vector_path_of_16_token_blocks_matches_reference(head_dim, group, kv_heads, dtype, window,
                                                                           soft_cap):
    # block_size 16 with whole 16-lane head dims takes the kernel's vector path (scores of a block's 16 tokens
    # summed across lanes together): every seed mixes partial blocks, windows that start mid-block and prefill runs.
    for seed in range(3):
        rng = np.random.default_rng(seed)
        args = _case(rng, block_size=16, head_dim=head_dim, group=group, kv_heads=kv_heads, dtype=dtype, width=5)
        got = _native(*args, sliding_window=window, soft_cap=soft_cap)
        np.testing.assert_allclose(np.asarray(got), _want(*args, sliding_window=window, soft_cap=soft_cap), atol=1e-5,
                                   rtol=0)


@pytest.mark.parametrize("group, kv_heads, block_size, head_dim, dtype, window, soft_cap", [
    # Chunks of query heads with AVX-512 (3 at most), then with AVX2 (2 at most), smaller chunks first.
    (3, 3, 16, 64, jnp.float32, None, None),  # SmolLM2-135M: 3; AVX2 1, 2
    (5, 2, 16, 48, jnp.float32, 21, None),    # 2, 3; AVX2 1, 2, 2; 48 dims: single vectors of values
    (7, 1, 32, 64, jnp.bfloat16, None, 4.0),  # 2, 2, 3; AVX2 1, 2, 2, 2; two vectors of keys per block
    (8, 2, 16, 128, jnp.float32, 5, None),    # 2, 3, 3; AVX2 2, 2, 2, 2; 128 dims: two runs of four vectors
    (4, 1, 16, 256, jnp.bfloat16, 20, None),  # Gemma 3 270M's heads: 2, 2
    (6, 1, 16, 64, jnp.float32, 9, 3.0),      # 3, 3; AVX2 2, 2, 2
    (2, 3, 32, 32, jnp.float32, None, None),  # 2
    (1, 4, 16, 64, jnp.float32, 3, None),     # 1: no grouping
    (5, 1, 4, 40, jnp.float32, 6, 2.0),       # 2, 3 off the vector path (block and head dim not whole vectors)
    (3, 2, 16, 40, jnp.bfloat16, None, None),  # 3 off the vector path (head dim)
])
def test_native_attention_decode_rows_take_a_kv_heads_query_heads_together(group, kv_heads, block_size, head_dim,
                                                                           dtype, window, soft_cap):
    # Decode rows (on the vector path but for the last two cases): the query heads of a KV head share each load of
    # its keys and values, in chunks as even as the registers allow, whatever the GQA group; contexts end anywhere
    # in a block and windows start anywhere in a vector of keys (the lanes outside a row's keys must weigh nothing).
    rng = np.random.default_rng(group * 100 + head_dim)
    seq_lens = [1, 2, block_size - 1, block_size, block_size + 7, 3 * block_size + 1, int(rng.integers(4, 200))]
    args = _rows(rng, [1] * len(seq_lens), seq_lens, block_size=block_size, head_dim=head_dim, group=group,
                 kv_heads=kv_heads, dtype=dtype)
    got = _native(*args, sliding_window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(got), _want(*args, sliding_window=window, soft_cap=soft_cap), atol=1e-5,
                               rtol=0)


def _shared_prefix_rows(rng, *, rows, shared, block_size, head_dim, group, kv_heads, dtype, short_row=True):
    """Decode rows whose block tables begin with the same ``shared`` blocks (as prefix caching leaves a system
    prompt), their contexts past them; with ``short_row``, row 1 of them ends inside the shared blocks (the rows can
    share only what it sees whole), half the time; after them a row of other blocks, a prefill run over the shared
    blocks, a padding row and two padding tokens; the other blocks anywhere in the cache."""
    lens = [int(rng.integers(shared * block_size + 1, shared * block_size + 3 * block_size + 1))
            for _ in range(rows)]
    q_lens = [1] * rows
    if short_row and shared > 1 and rows > 3 and rng.random() < 0.5:
        lens[1] = int(rng.integers(1, shared * block_size))
    lens.append(int(rng.integers(1, 4 * block_size)))  # other blocks
    q_lens.append(1)
    lens.append(shared * block_size + 9)  # a prefill run of 9 tokens after the shared blocks
    q_lens.append(9)
    width = max(-(-n // block_size) for n in lens) + 1
    num_blocks = shared + (len(lens) + 1) * width
    k, v = (jnp.asarray(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)), dtype) for _ in range(2))
    ids = rng.permutation(num_blocks)
    own = ids[shared:shared + (len(lens) + 1) * width].reshape(-1, width)
    tables = own.copy()
    for i in list(range(rows)) + [len(lens) - 1]:
        tables[i, :shared] = ids[:shared]
    ends = np.cumsum(q_lens)
    qsl = jnp.asarray(np.concatenate([[0], ends, [ends[-1]]]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((int(ends[-1]) + 2, kv_heads * group, head_dim)), jnp.float32)
    return (q, k, v, jnp.asarray(tables, jnp.int32), jnp.asarray(lens + [0], jnp.int32), qsl,
            jnp.int32(len(lens)))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(2, 40), shared=st.integers(0, 5),
       block_size=st.sampled_from([8, 16, 32]), head_dim=st.sampled_from([8, 40, 64]), group=st.integers(1, 5),
       kv_heads=st.sampled_from([1, 3]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       window=st.sampled_from([None, None, 20]), soft_cap=st.sampled_from([None, 4.0]))
def test_native_attention_decode_rows_over_a_shared_prefix_match_reference(seed, rows, shared, block_size, head_dim,
                                                                           group, kv_heads, dtype, window, soft_cap):
    # Decode rows that share their first blocks attend over them together (a cascade unit: the shared blocks once
    # for up to 16 rows' queries, then each row's own blocks from where that left off), in pieces of any size
    # from 2 to 16 rows; a window turns it off. Every token must still match the reference.
    rng = np.random.default_rng(seed)
    args = _shared_prefix_rows(rng, rows=rows, shared=shared, block_size=block_size, head_dim=head_dim, group=group,
                               kv_heads=kv_heads, dtype=dtype)
    got = _native(*args, sliding_window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(got), _want(*args, sliding_window=window, soft_cap=soft_cap), atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_attention_32_rows_over_a_384_token_system_prompt_match_reference(dtype):
    # The shared-prefix benchmark's decode step on SmolLM2-135M's heads: 32 rows after the same 24 blocks, in
    # cascade units (two of 16 rows on two threads).
    rng = np.random.default_rng(384)
    args = _shared_prefix_rows(rng, rows=32, shared=24, block_size=16, head_dim=64, group=3, kv_heads=3, dtype=dtype,
                               short_row=False)
    got = _native(*args)
    np.testing.assert_allclose(np.asarray(got), _want(*args), atol=1e-5, rtol=0)


def _prefix_rows(rng, rows, *, block_size, head_dim, group, kv_heads, dtype):
    """Decode rows given as (prefix, blocks in common with it, context length): each row's table begins with that
    many of its prefix's blocks (prefixes of 8 blocks each, by name; None: none), the rest of its blocks its own,
    anywhere in the cache; then a padding row."""
    names = sorted({name for name, _, _ in rows if name is not None})
    width = max(-(-n // block_size) for _, _, n in rows) + 1
    num_blocks = 8 * len(names) + (len(rows) + 1) * width
    k, v = (jnp.asarray(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)), dtype) for _ in range(2))
    ids = rng.permutation(num_blocks)
    prefix = {name: ids[8 * i:8 * i + 8] for i, name in enumerate(names)}
    tables = ids[8 * len(names):].reshape(-1, width).copy()
    for i, (name, common, _) in enumerate(rows):
        if name is not None:
            tables[i, :common] = prefix[name][:common]
    lens = [n for _, _, n in rows] + [0]
    qsl = jnp.asarray(list(range(len(rows) + 1)) + [len(rows)], jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(rows) + 2, kv_heads * group, head_dim)), jnp.float32)
    return q, k, v, jnp.asarray(tables, jnp.int32), jnp.asarray(lens, jnp.int32), qsl, jnp.int32(len(rows))


_BS = 16  # block size of the cascade cases below


@pytest.mark.parametrize("name, rows, window, cascades", [
    # Two system prompts of 4 and 3 blocks, ten rows each.
    ("two groups", [("a", 4, 4 * _BS + 5 + i) for i in range(10)] + [("b", 3, 3 * _BS + 2 * i + 1) for i in range(10)],
     None, 4),
    # A row that shares only the first block must not keep the others from sharing their four.
    ("one row shares block 0", [("a", 4, 5 * _BS + i) for i in range(15)] + [("a", 1, 6 * _BS)], None, 2),
    # Rows that see the prefix only in part: one ending exactly on its third block, one inside it, one in block 0.
    ("rows inside the prefix", [("a", 6, 7 * _BS + i) for i in range(12)] + [("a", 6, 3 * _BS), ("a", 6, 2 * _BS + 7),
                                                                            ("a", 6, 9)], None, 2),
    # A sliding window turns cascades off; so do two rows on two threads (pieces of one row).
    ("window", [("a", 4, 5 * _BS + i) for i in range(12)], 40, 0),
    ("two rows", [("a", 4, 5 * _BS), ("a", 4, 5 * _BS + 3)], None, 0),
])
def test_native_attention_cascades_form_where_rows_share_blocks(name, rows, window, cascades):
    # Decode rows over shared blocks go in cascade units (the shared blocks once for several rows' queries through
    # the GEMM-shaped tiles, then each row's own blocks): as many units as the shapes call for on this machine's
    # threads (at least the number given, on two or more), and every token as the reference has it.
    rng = np.random.default_rng(len(name))
    args = _prefix_rows(rng, rows, block_size=_BS, head_dim=64, group=3, kv_heads=3, dtype=jnp.float32)
    before = ops.cascade_units_formed()
    got = _native(*args, sliding_window=window)
    formed = ops.cascade_units_formed() - before
    np.testing.assert_allclose(np.asarray(got), _want(*args, sliding_window=window), atol=1e-5, rtol=0)
    if cascades == 0 or (os.cpu_count() or 1) >= 2:
        assert (formed >= cascades) if cascades else (formed == 0), (name, formed)


@pytest.mark.parametrize("block_size, head_dim, dtype, window, soft_cap", [
    (16, 64, jnp.float32, None, None),   # SmolLM2-135M's blocks and heads
    (8, 8, jnp.float32, 11, None),
    (32, 128, jnp.bfloat16, None, 5.0),
    (16, 256, jnp.bfloat16, 20, None),   # Gemma 3 270M's heads, a window starting mid-block
    (64, 16, jnp.float32, 3, 3.0),
])
def test_native_attention_gemm_path_of_prefill_runs_matches_reference(block_size, head_dim, dtype, window, soft_cap):
    # Runs of 2 to 40 query tokens of one row take the kernel's GEMM-shaped path (blocks and head dims multiples
    # of 8): per KV head a unit's (token, head) pairs are 16-wide vectors of lanes, so every run length times every
    # GQA group below fills 1 to 8 vectors, whole or with spare lanes, in tiles of 3 vectors and the remainder;
    # contexts start at 0 (causal within the block) or after a cached prefix ending mid-block.
    rng = np.random.default_rng(block_size + head_dim)
    for group, run in [(1, 2), (3, 16), (2, 9), (8, 16), (4, 23), (3, 40), (5, 7)]:
        kv_heads = 1 + run % 3
        context = int(rng.choice([0, block_size // 2 + 1, 3 * block_size]))
        q_lens, seq_lens = [run, 1, run], [run + context, context + 5, run]
        args = _rows(rng, q_lens, seq_lens, block_size=block_size, head_dim=head_dim, group=group, kv_heads=kv_heads,
                     dtype=dtype)
        got = _native(*args, sliding_window=window, soft_cap=soft_cap)
        np.testing.assert_allclose(np.asarray(got), _want(*args, sliding_window=window, soft_cap=soft_cap), atol=1e-5,
                                   rtol=0, err_msg=f"group {group}, run {run}, context {context}")


def test_native_attention_handles_long_contexts_with_scores_far_apart():
    # A decode row at 2,000 positions and a 40-token chunk ending there, scores spread over +-60: the running-max
    # rescale and the exp's range; the chunk spans three units of 16 queries.
    rng = np.random.default_rng(3)
    q, k, v, tables, _, _, _ = _case(rng, block_size=16, head_dim=64, group=3, kv_heads=3, dtype=jnp.float32,
                                     width=125)
    q = jnp.concatenate([q, q, q] * 9)[:41] * 8.0
    lens = jnp.asarray([2000, 1999], jnp.int32)
    qsl = jnp.asarray([0, 1, 41], jnp.int32)
    args = (q, k, v, tables[:2], lens, qsl, jnp.int32(2))
    got = _native(*args)
    np.testing.assert_allclose(np.asarray(got), _want(*args), atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_attention_sends_every_row_to_the_kernel_and_agrees_with_the_tiles(seed, dtype):
    # Mixed batches of decode and prefill rows through the kernel, against the reference and the jnp tiles.
    rng = np.random.default_rng(seed)
    q_lens = [1, int(rng.integers(2, 40)), 1, 1, int(rng.integers(2, 9))]
    seq_lens = [q + int(rng.integers(0, 50)) for q in q_lens]
    args = _ragged_batch(rng, q_lens, seq_lens, block_size=8, head_dim=64, group=3, dtype=dtype, pad_seqs=2,
                         pad_tokens=3)
    assert native_applies(args[1], args[0].shape[1])
    window = [None, 9][seed % 2]
    want = ragged_paged_attention_reference(*args, scale=SCALE, sliding_window=window)
    got = jax.jit(functools.partial(ops.xla_attention, scale=SCALE, sliding_window=window))(*args)
    tiles = jax.jit(functools.partial(ragged_paged_attention_xla, scale=SCALE, sliding_window=window))(*args)
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=0)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(tiles, np.float32), atol=tol, rtol=0)
    assert np.all(np.asarray(got)[sum(q_lens):] == 0.0)


def test_native_attention_is_not_taken_where_it_does_not_apply_and_refused_when_forced():
    rng = np.random.default_rng(0)
    q, k, v, tables, lens, qsl, n = _ragged_batch(rng, [1, 1], [5, 9], block_size=4, head_dim=16, group=2,
                                                  dtype=jnp.float32)
    scales = jnp.ones(2, jnp.float32)
    assert native_applies(k, 4)
    assert not native_applies(k.astype(jnp.int8), 4, scales)
    assert not native_applies(k.astype(jnp.float8_e4m3fn), 4)
    assert not native_applies(jnp.zeros((4, 512, 2, 16)), 4)  # blocks past the kernel's 256 tokens
    assert not native_applies(k, 3)  # query heads not a multiple of the KV heads
    row, pos = token_rows_and_positions(qsl, lens, n, q.shape[0])
    with pytest.raises(ValueError, match=r"3 query heads, 2 KV heads, block_size 4; the kernel takes"):
        cpu.ragged_paged_attention_cpu(q[:, :3], k, v, tables, row, pos, scale=SCALE)
    with pytest.raises(ValueError, match=r"use_native=True needs .*scales True"):
        ops.xla_attention(q, k.astype(jnp.int8), v.astype(jnp.int8), tables, lens, qsl, n, scale=SCALE,
                          k_scale=scales, v_scale=scales, use_native=True)
    with pytest.raises(ValueError, match=r"cache dtypes int8, int8"):
        cpu.ragged_paged_attention_cpu(q, k.astype(jnp.int8), v.astype(jnp.int8), tables, row, pos, scale=SCALE)


@pytest.mark.parametrize("bad, message", [
    ("id", r"token 1 \(row 1\) block id 99 outside \[0, 5\)"),
    ("negative", r"token 0 \(row 0\) block id -1 outside"),
    ("position", r"token 1 position 8 outside the table's 8 positions"),
    ("row", r"token 1 row 2 outside \[0, 2\)"),
])
def test_native_attention_refuses_a_table_row_or_position_it_would_read_past(bad, message):
    rng = np.random.default_rng(1)
    k, v = (jnp.asarray(rng.standard_normal((5, 4, 1, 16)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((2, 1, 16)), jnp.float32)
    tables = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    row, pos = jnp.asarray([0, 1], jnp.int32), jnp.asarray([4, 7], jnp.int32)
    if bad == "id":
        tables = tables.at[1, 1].set(99)
    elif bad == "negative":
        tables = tables.at[0, 0].set(-1)
    elif bad == "position":
        pos = pos.at[1].set(8)
    else:
        row = row.at[1].set(2)
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(cpu.ragged_paged_attention_cpu(q, k, v, tables, row, pos, scale=SCALE))


def _probe(env: dict[str, str]) -> str:
    code = ("from kernels_pallas import ops; import jax.numpy as jnp; a = ops.native_kernels(); "
            "print(a, ops.native_unavailable_reason(), ops.attention_native_applies(jnp.zeros((1, 1, 1, 1)), 1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() + "\n" + out.stderr


def test_a_failed_build_or_the_off_switch_leaves_the_jnp_path(tmp_path):
    failed = _probe({"CXX": "false", "JAXLLM_NATIVE_CACHE": str(tmp_path)})
    assert failed.startswith("False the C++ CPU kernels did not build or load") and failed.split("\n")[0].endswith(
        "False")
    assert "using the jnp attention and XLA's dots" in failed
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind
    off = _probe({"JAXLLM_NATIVE_KERNELS": "0"})
    assert off.startswith("False JAXLLM_NATIVE_KERNELS=0 False")


def test_a_cache_holding_the_library_is_reused_without_a_build(tmp_path):
    # The module fixture built (or found) this process's library under its cache key; a process whose cache holds
    # that file loads it as it is: no build, no other file. (A cold cache builds it: the first kernel test of a run.)
    ours = Path(cpu_build._lib._name)
    assert ours.parent == cpu_build._cache_dir() and ours.name.startswith("jaxllm_cpu-")
    shutil.copy2(ours, tmp_path / ours.name)
    stamp = (tmp_path / ours.name).stat().st_mtime_ns
    assert _probe({"JAXLLM_NATIVE_CACHE": str(tmp_path)}).startswith("True None True")
    assert sorted(p.name for p in tmp_path.iterdir()) == [ours.name]
    assert (tmp_path / ours.name).stat().st_mtime_ns == stamp


def test_the_library_is_cached_where_the_environment_reference_says(tmp_path, monkeypatch):
    """docs/reference/environment.md: ``$JAXLLM_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/jaxllm/native``, else
    ``~/.cache/jaxllm/native``, whatever ``$JAXLLM_CACHE`` says (a new user expected it under ``$JAXLLM_CACHE``:
    the reference now says it is not)."""
    monkeypatch.delenv("JAXLLM_NATIVE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cpu_build._cache_dir() == tmp_path / "home" / ".cache" / "jaxllm" / "native"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_build._cache_dir() == tmp_path / "xdg" / "jaxllm" / "native"
    monkeypatch.setenv("JAXLLM_NATIVE_CACHE", str(tmp_path / "own"))
    assert cpu_build._cache_dir() == tmp_path / "own"


def test_the_library_cache_key_names_the_cpu(tmp_path, monkeypatch):
    # -march=native code built where AVX-512 exists would die of an illegal instruction where it does not: a shared
    # cache directory must never hand one CPU's library to another.
    monkeypatch.setenv("JAXLLM_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_features, "flags_line", lambda: "flags\t: fpu avx2 avx512f")
    avx512 = cpu_build.library_path("c++")
    monkeypatch.setattr(cpu_features, "flags_line", lambda: "flags\t: fpu avx2")
    avx2 = cpu_build.library_path("c++")
    assert avx512 != avx2 and avx512.parent == avx2.parent == tmp_path
    assert cpu_build.library_path("c++") == avx2 and cpu_build.library_path("clang++") != avx2
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2\n")
    monkeypatch.undo()
    assert cpu_features.flags_line(cpuinfo) == "flags\t\t: fpu avx2"
    assert cpu_features.flags_line(tmp_path / "none") == ""
