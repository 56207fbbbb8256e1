"""The Pallas kernels against the jnp references: in interpret mode on CPU,
compiled through Triton when JAX has a GPU (``JAXLLM_PALLAS_INTERPRET``
overrides: see tests/helpers.py).

Sizes are tiny and the parametrizations are chosen to cover (block_size,
head_dim, GQA ratio, dtype, sliding window, soft-cap) without a Cartesian
product: interpret mode compiles once per case.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.attention.pallas_decode import paged_attention
from kernels_pallas.attention.pallas_ragged import ragged_paged_attention
from kernels_pallas.attention.reference import paged_attention_reference, ragged_paged_attention_reference
from kernels_pallas.cache_write.pallas import kv_cache_write
from kernels_pallas.cache_write.reference import kv_cache_write_reference
from kernels_pallas.ops import default_attention_backend, get_attention_ops
from kernels_pallas.attention.pallas_decode import _paged_attention
from kernels_pallas.attention.pallas_ragged import _ragged_paged_attention
from tests.helpers import pallas_interpret

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
NUM_KV_HEADS = 2
INTERPRET = pallas_interpret()


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    # On GPU, XLA may run the reference's float32 einsums in TF32, far from 1e-5.
    with jax.default_matmul_precision("highest"):
        yield


def _make_cache(rng, num_blocks, block_size, head_dim, dtype):
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k = rng.standard_normal(shape)
    # Values in [-1, 1] keep bf16 rounding of the output below the tolerance.
    v = rng.uniform(-1.0, 1.0, shape)
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def _make_tables(rng, seq_lens, num_seq_rows, width, block_size):
    """Distinct random blocks per sequence, never block 0; padding entries are 0."""
    needed = [-(-n // block_size) for n in seq_lens]
    blocks = rng.permutation(np.arange(1, sum(needed) + 1))
    tables = np.zeros((num_seq_rows, width), np.int32)
    start = 0
    for row, n in enumerate(needed):
        tables[row, :n] = blocks[start:start + n]
        start += n
    return jnp.asarray(tables), sum(needed) + 1


def _ragged_batch(rng, q_lens, seq_lens, *, block_size, head_dim, group, dtype, pad_seqs=1, pad_tokens=3):
    """A ragged batch with ``pad_seqs`` padded sequence rows and ``pad_tokens`` padded query rows."""
    num_seqs = len(q_lens)
    num_seq_rows = num_seqs + pad_seqs
    width = max(-(-n // block_size) for n in seq_lens) + 1
    tables, num_blocks = _make_tables(rng, seq_lens, num_seq_rows, width, block_size)
    k_cache, v_cache = _make_cache(rng, num_blocks, block_size, head_dim, dtype)
    num_tokens = sum(q_lens) + pad_tokens
    q = jnp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS * group, head_dim)), dtype)
    ends = np.cumsum(q_lens)
    query_start_loc = np.concatenate([[0], ends, np.full(pad_seqs, ends[-1])]).astype(np.int32)
    lens = np.concatenate([seq_lens, np.zeros(pad_seqs)]).astype(np.int32)
    return (q, k_cache, v_cache, tables, jnp.asarray(lens), jnp.asarray(query_start_loc), jnp.int32(num_seqs))


def _mixed_lengths(block_size):
    """(q_len, seq_len) pairs: decode rows at partial and block-boundary lengths,
    a prefill chunk over a cached prefix, and whole prompts."""
    return [
        (1, 1),
        (1, block_size),
        (1, 3 * block_size + 5),
        (7, 2 * block_size + 3),  # chunk continuing a cached prefix
        (2 * block_size, 2 * block_size),  # whole prompt, ends on a block boundary
        (block_size + 3, block_size + 3),  # whole prompt, partial last block
    ]


def _assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype
    assert not np.isnan(np.asarray(actual, np.float32)).any()
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), atol=TOLERANCE[dtype], rtol=0
    )


# (block_size, head_dim, group, dtype, sliding_window, soft_cap)
ATTENTION_CASES = [
    (8, 64, 1, jnp.float32, None, None),
    (16, 128, 2, jnp.bfloat16, None, None),
    (8, 128, 4, jnp.float32, 13, None),
    (16, 64, 8, jnp.float32, None, 30.0),
    (16, 64, 4, jnp.bfloat16, 20, 5.0),
    (8, 64, 8, jnp.bfloat16, None, None),
    (16, 128, 1, jnp.float32, 5, 50.0),
    (8, 64, 3, jnp.float32, None, None),  # group padded to a power of two
]


@pytest.mark.parametrize("block_size,head_dim,group,dtype,sliding_window,soft_cap", ATTENTION_CASES)
def test_ragged_matches_reference_on_mixed_prefill_and_decode_batch(
    block_size, head_dim, group, dtype, sliding_window, soft_cap
):
    rng = np.random.default_rng(block_size * head_dim + group)
    q_lens, seq_lens = zip(*_mixed_lengths(block_size))
    batch = _ragged_batch(rng, q_lens, seq_lens, block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)
    kw = dict(scale=head_dim ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    out = ragged_paged_attention(*batch, interpret=INTERPRET, **kw)
    _assert_close(out, ragged_paged_attention_reference(*batch, **kw), dtype)


@pytest.mark.parametrize("group,sliding_window", [(1, None), (4, 9), (8, None)])
def test_ragged_tiles_cut_inside_sequences_and_kv_chunks_match_reference(group, sliding_window):
    # 16-row tiles and 16-token KV chunks split every prompt over several tiles
    # and every context over several chunks, some of them skipped by the window.
    rng = np.random.default_rng(group)
    q_lens, seq_lens = zip(*_mixed_lengths(8))
    batch = _ragged_batch(rng, q_lens, seq_lens, block_size=8, head_dim=64, group=group, dtype=jnp.float32)
    kw = dict(scale=0.125, sliding_window=sliding_window, soft_cap=None)
    out = _ragged_paged_attention(*batch, interpret=INTERPRET, block_m=16, block_k=16, **kw)
    _assert_close(out, ragged_paged_attention_reference(*batch, **kw), jnp.float32)


def test_ragged_padded_sequences_and_tokens_give_zero_rows():
    rng = np.random.default_rng(1)
    q, k_cache, v_cache, tables, seq_lens, qsl, _ = _ragged_batch(
        rng, [1, 4, 2], [5, 4, 10], block_size=8, head_dim=64, group=2, dtype=jnp.float32, pad_seqs=2, pad_tokens=5
    )
    num_seqs = jnp.int32(2)  # the third sequence is padding too
    out = ragged_paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, num_seqs, scale=0.125, interpret=INTERPRET)
    ref = ragged_paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, qsl, num_seqs, scale=0.125)
    _assert_close(out, ref, jnp.float32)
    assert not np.asarray(out[5:]).any()


def test_ragged_batch_of_only_padding_is_all_zeros():
    rng = np.random.default_rng(2)
    batch = list(_ragged_batch(rng, [3], [3], block_size=8, head_dim=64, group=1, dtype=jnp.float32))
    batch[-1] = jnp.int32(0)
    out = ragged_paged_attention(*batch, scale=0.125, interpret=INTERPRET)
    assert not np.asarray(out).any()


@pytest.mark.parametrize("block_size,head_dim,group,dtype,sliding_window,soft_cap", ATTENTION_CASES)
def test_paged_attention_matches_reference_on_decode_batch(block_size, head_dim, group, dtype, sliding_window, soft_cap):
    rng = np.random.default_rng(block_size + head_dim + group)
    # 0 is a padding row; 150 spans several 64-token chunks, hence several splits.
    seq_lens = [1, block_size, block_size + 1, 150, 0, 37]
    width = -(-150 // block_size) + 1
    tables, num_blocks = _make_tables(rng, [max(n, 1) for n in seq_lens], len(seq_lens), width, block_size)
    k_cache, v_cache = _make_cache(rng, num_blocks, block_size, head_dim, dtype)
    q = jnp.asarray(rng.standard_normal((len(seq_lens), NUM_KV_HEADS * group, head_dim)), dtype)
    args = (q, k_cache, v_cache, tables, jnp.asarray(seq_lens, jnp.int32))
    kw = dict(scale=head_dim ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    out = paged_attention(*args, interpret=INTERPRET, **kw)
    _assert_close(out, paged_attention_reference(*args, **kw), dtype)
    assert not np.asarray(out[4]).any()


@pytest.mark.parametrize("num_splits,sliding_window", [(1, None), (3, None), (4, 40)])
def test_paged_attention_result_does_not_depend_on_split_count(num_splits, sliding_window):
    rng = np.random.default_rng(num_splits)
    seq_lens = [130, 17, 0, 64]
    tables, num_blocks = _make_tables(rng, [max(n, 1) for n in seq_lens], len(seq_lens), 9, 16)
    k_cache, v_cache = _make_cache(rng, num_blocks, 16, 64, jnp.float32)
    q = jnp.asarray(rng.standard_normal((len(seq_lens), NUM_KV_HEADS * 4, 64)), jnp.float32)
    args = (q, k_cache, v_cache, tables, jnp.asarray(seq_lens, jnp.int32))
    kw = dict(scale=0.125, sliding_window=sliding_window, soft_cap=None)
    out = _paged_attention(*args, interpret=INTERPRET, block_k=16, num_splits=num_splits, **kw)
    _assert_close(out, paged_attention_reference(*args, **kw), jnp.float32)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
def test_kv_cache_write_writes_exactly_the_addressed_slots(cache_dtype):
    rng = np.random.default_rng(3)
    num_blocks, block_size, head_dim = 6, 8, 64
    k_cache, v_cache = _make_cache(rng, num_blocks, block_size, head_dim, cache_dtype)
    # Real tokens at partial, boundary and scattered slots; two padded tokens into block 0.
    slots = jnp.asarray([8, 9, 15, 16, 40, 23, 0, 1], jnp.int32)
    k = jnp.asarray(rng.standard_normal((8, NUM_KV_HEADS, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((8, NUM_KV_HEADS, head_dim)), jnp.float32)

    new_k, new_v = kv_cache_write(k_cache, v_cache, k, v, slots, interpret=INTERPRET)
    ref_k, ref_v = kv_cache_write_reference(k_cache, v_cache, k, v, slots)

    for new, ref, old in ((new_k, ref_k, k_cache), (new_v, ref_v, v_cache)):
        assert new.dtype == cache_dtype
        np.testing.assert_array_equal(np.asarray(new, np.float32), np.asarray(ref, np.float32))
        flat_new = np.asarray(new, np.float32).reshape(num_blocks * block_size, -1)
        flat_old = np.asarray(old, np.float32).reshape(num_blocks * block_size, -1)
        untouched = np.setdiff1d(np.arange(num_blocks * block_size), np.asarray(slots))
        np.testing.assert_array_equal(flat_new[untouched], flat_old[untouched])


def test_kv_cache_write_under_donation_matches_reference():
    rng = np.random.default_rng(4)
    k_cache, v_cache = _make_cache(rng, 4, 16, 64, jnp.float32)
    expected = kv_cache_write_reference(k_cache, v_cache, k_cache[1, :3], v_cache[2, :3], jnp.asarray([50, 51, 3]))
    write = jax.jit(lambda kc, vc, k, v, s: kv_cache_write(kc, vc, k, v, s, interpret=INTERPRET), donate_argnums=(0, 1))
    new_k, new_v = write(k_cache.copy(), v_cache.copy(), k_cache[1, :3], v_cache[2, :3], jnp.asarray([50, 51, 3]))
    np.testing.assert_array_equal(new_k, expected[0])
    np.testing.assert_array_equal(new_v, expected[1])


def test_head_dim_that_is_not_a_power_of_two_is_rejected():
    rng = np.random.default_rng(5)
    batch = _ragged_batch(rng, [1], [4], block_size=8, head_dim=48, group=1, dtype=jnp.float32)
    with pytest.raises(ValueError, match="head_dim"):
        ragged_paged_attention(*batch, scale=1.0, interpret=INTERPRET)


def test_get_attention_ops_pallas_matches_reference():
    rng = np.random.default_rng(6)
    batch = _ragged_batch(rng, [1, 5], [9, 5], block_size=8, head_dim=64, group=2, dtype=jnp.float32)
    ops = get_attention_ops("pallas", interpret=INTERPRET)
    expected = get_attention_ops("reference").ragged_paged_attention(*batch, scale=0.125)
    _assert_close(ops.ragged_paged_attention(*batch, scale=0.125), expected, jnp.float32)


def test_get_attention_ops_reference_returns_the_references():
    ops = get_attention_ops("reference")
    assert ops.ragged_paged_attention is ragged_paged_attention_reference
    assert ops.kv_cache_write is kv_cache_write_reference


def test_get_attention_ops_rejects_unknown_backend_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="pallas.*reference"):
        get_attention_ops("triton")


def test_default_attention_backend_follows_the_jax_backend():
    expected = "pallas" if jax.default_backend() == "gpu" else "xla"
    assert default_attention_backend() == expected


def _lower_for_cuda(fn, *arg_shapes):
    """Run the Pallas Triton lowering (to Triton IR) without a GPU, via jax.export."""
    target = getattr(plgpu, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
    triton_call = export.DisabledSafetyCheck.custom_call(target)
    return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton_call])(*arg_shapes)


@pytest.mark.parametrize(
    "dtype,group,block_size,head_dim", [(jnp.bfloat16, 4, 16, 128), (jnp.float32, 1, 8, 64), (jnp.bfloat16, 3, 8, 256)]
)
def test_kernels_pass_the_triton_lowering(dtype, group, block_size, head_dim):
    # Catches what interpret mode cannot: non-power-of-two tensors, primitives
    # without a Triton lowering rule, unsupported indexing. PTX compilation
    # still needs a GPU.
    num_seq_rows, num_tokens, width, num_blocks = 8, 64, 32, 257
    sds = jax.ShapeDtypeStruct
    cache = sds((num_blocks, block_size, NUM_KV_HEADS, head_dim), dtype)
    tables, lens = sds((num_seq_rows, width), jnp.int32), sds((num_seq_rows,), jnp.int32)
    kw = dict(scale=0.1, sliding_window=100, soft_cap=30.0)
    _lower_for_cuda(
        functools.partial(ragged_paged_attention, **kw),
        sds((num_tokens, NUM_KV_HEADS * group, head_dim), dtype), cache, cache, tables, lens,
        sds((num_seq_rows + 1,), jnp.int32), sds((), jnp.int32),
    )
    _lower_for_cuda(
        functools.partial(paged_attention, **kw),
        sds((num_seq_rows, NUM_KV_HEADS * group, head_dim), dtype), cache, cache, tables, lens,
    )
    token_kv = sds((num_tokens, NUM_KV_HEADS, head_dim), jnp.float32)
    _lower_for_cuda(kv_cache_write, cache, cache, token_kv, token_kv, sds((num_tokens,), jnp.int32))
