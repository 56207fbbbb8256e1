"""Quantized KV caches (int8, float8_e4m3fn, and float8 held as uint8 bits on CPU) in every
attention implementation: the write quantizes, attention dequantizes after loading.

The reference defines the semantics: attention over a quantized cache equals float attention
over the dequantized cache (``cache * scale`` per head). The tiled jnp attention and the Pallas
kernels (interpret mode on CPU) fold the scales into the scores and the output instead, so they
match the reference to float32 rounding. The quantization error itself is bounded per element:
half a step (``scale / 2``) for int8, a relative 2**-4 for float8_e4m3fn's 3 mantissa bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention.pallas_decode import paged_attention
from kernels_pallas.attention.pallas_ragged import ragged_paged_attention
from kernels_pallas.attention.reference import paged_attention_reference, ragged_paged_attention_reference
from kernels_pallas.cache_write.pallas import kv_cache_write
from kernels_pallas.cache_write.reference import kv_cache_write_reference
from kernels_pallas.attention.xla import ragged_paged_attention_xla
from kernels_pallas.storage import dequantize_kv, quantize_kv, to_storage
from tests.helpers import pallas_interpret
from tests.test_kernels_pallas import NUM_KV_HEADS, _lower_for_cuda, _make_tables

INTERPRET = pallas_interpret()
# Storage dtypes of a quantized cache: int8, float8_e4m3fn, and float8 bits in uint8 (the CPU engine's).
STORAGE = [jnp.int8, jnp.float8_e4m3fn, jnp.uint8]
# Kernels vs reference on the same quantized cache: float32 rounding of a different order of products.
TOL = 2e-5


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _scales(rng):
    """Per-head scales that differ by head, as calibrated ones do."""
    return jnp.asarray(rng.uniform(0.01, 0.05, NUM_KV_HEADS), jnp.float32)


def _quantized_cache(rng, num_blocks, block_size, head_dim, storage):
    """(k_cache, v_cache, k_scale, v_scale): random values written through quantize_kv."""
    shape = (num_blocks * block_size, NUM_KV_HEADS, head_dim)
    k_scale, v_scale = _scales(rng), _scales(rng)
    k = quantize_kv(jnp.asarray(rng.standard_normal(shape), jnp.float32), k_scale, storage)
    v = quantize_kv(jnp.asarray(rng.uniform(-2, 2, shape), jnp.float32), v_scale, storage)
    cache_shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    return k.reshape(cache_shape), v.reshape(cache_shape), k_scale, v_scale


def _batch(rng, q_lens, seq_lens, *, block_size, head_dim, group, storage, pad_seqs=1, pad_tokens=3):
    width = max(-(-n // block_size) for n in seq_lens) + 1
    tables, num_blocks = _make_tables(rng, seq_lens, len(q_lens) + pad_seqs, width, block_size)
    k_cache, v_cache, k_scale, v_scale = _quantized_cache(rng, num_blocks, block_size, head_dim, storage)
    q = jnp.asarray(rng.standard_normal((sum(q_lens) + pad_tokens, NUM_KV_HEADS * group, head_dim)), jnp.float32)
    ends = np.cumsum(q_lens)
    qsl = np.concatenate([[0], ends, np.full(pad_seqs, ends[-1])]).astype(np.int32)
    lens = np.concatenate([seq_lens, np.zeros(pad_seqs)]).astype(np.int32)
    args = (q, k_cache, v_cache, tables, jnp.asarray(lens), jnp.asarray(qsl), jnp.int32(len(q_lens)))
    return args, dict(k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("storage", STORAGE, ids=lambda d: jnp.dtype(d).name)
def test_quantize_kv_error_is_half_a_step_for_int8_and_three_mantissa_bits_for_fp8(storage):
    rng = np.random.default_rng(0)
    scale = jnp.asarray([0.02, 0.5], jnp.float32)
    x = jnp.asarray(rng.standard_normal((64, 2, 32)) * np.array([1.0, 20.0])[:, None], jnp.float32)
    stored = quantize_kv(x, scale, storage)
    assert stored.dtype == storage
    back = np.asarray(dequantize_kv(stored, scale))
    err = np.abs(back - np.asarray(x))
    steps = np.asarray(scale)[:, None]
    if storage == jnp.int8:
        inside = np.abs(np.asarray(x)) <= 127 * steps
        assert np.all(err[inside] <= steps.repeat(32, 1)[None].repeat(64, 0)[inside] / 2 * (1 + 1e-6))
    else:
        normal = np.abs(np.asarray(x)) / steps >= 2.0 ** -6
        assert np.all(err[normal] <= np.abs(np.asarray(x))[normal] * 2.0 ** -4)


@pytest.mark.parametrize("storage", STORAGE, ids=lambda d: jnp.dtype(d).name)
def test_quantize_kv_clips_out_of_range_values_instead_of_overflowing(storage):
    scale = jnp.ones(1, jnp.float32)
    x = jnp.asarray([[[1e6, -1e6, 3.0, jnp.inf]]], jnp.float32)
    back = np.asarray(dequantize_kv(quantize_kv(x, scale, storage), scale))
    limit = 127.0 if storage == jnp.int8 else 448.0
    np.testing.assert_array_equal(back, [[[limit, -limit, 3.0, limit]]])


@pytest.mark.parametrize("storage", [jnp.int8, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
def test_pallas_cache_write_quantizes_exactly_as_the_reference(storage):
    rng = np.random.default_rng(1)
    shape = (6, 8, NUM_KV_HEADS, 64)
    k_cache, v_cache = jnp.zeros(shape, storage), jnp.zeros(shape, storage)
    slots = jnp.asarray([8, 9, 15, 16, 40, 23, 0, 1], jnp.int32)
    k = jnp.asarray(rng.standard_normal((8, NUM_KV_HEADS, 64)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((8, NUM_KV_HEADS, 64)), jnp.float32)
    scales = dict(k_scale=_scales(rng), v_scale=_scales(rng))
    got = kv_cache_write(k_cache, v_cache, k, v, slots, interpret=INTERPRET, **scales)
    want = kv_cache_write_reference(k_cache, v_cache, k, v, slots, **scales)
    for g, w in zip(got, want):
        assert g.dtype == storage
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(got[0].reshape(48, NUM_KV_HEADS, 64)[8].astype(jnp.float32)),
                                  np.asarray(quantize_kv(k[0:1], scales["k_scale"], storage)[0].astype(jnp.float32)))


# Decode rows, a chunk over a cached prefix and a whole prompt, with one padded row.
Q_LENS, SEQ_LENS = (1, 7, 12, 1), (9, 23, 12, 16)


def test_reference_attention_over_a_quantized_cache_is_float_attention_over_its_dequantized_values():
    rng = np.random.default_rng(2)
    args, scales = _batch(rng, Q_LENS, SEQ_LENS, block_size=8, head_dim=32, group=2, storage=jnp.int8)
    q, k_cache, v_cache = args[:3]
    deq = [dequantize_kv(c, s) for c, s in ((k_cache, scales["k_scale"]), (v_cache, scales["v_scale"]))]
    attend = jax.jit(functools.partial(ragged_paged_attention_reference, scale=0.125))
    want = attend(q, *deq, *args[3:])
    got = attend(*args, **scales)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


# float8 as the CPU engine holds it (uint8 bits); the Pallas kernels below take float8_e4m3fn itself.
@pytest.mark.parametrize("storage, window, soft_cap", [(jnp.int8, None, None), (jnp.uint8, 11, 20.0)],
                         ids=["int8", "uint8"])
def test_xla_attention_over_a_quantized_cache_matches_the_reference(storage, window, soft_cap):
    rng = np.random.default_rng(3)
    args, scales = _batch(rng, Q_LENS, SEQ_LENS, block_size=8, head_dim=32, group=2, storage=storage)
    kw = dict(scale=0.125, sliding_window=window, soft_cap=soft_cap, **scales)
    want = jax.jit(functools.partial(ragged_paged_attention_reference, **kw))(*args)
    got = jax.jit(functools.partial(ragged_paged_attention_xla, prefill_tile=4, **kw))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=0)


# One interpret-mode case (slow): float8 K/V converted in the kernel; int8's conversion is the same
# code, and both pass the Triton lowering below.
def test_pallas_kernels_over_a_float8_cache_match_the_reference():
    rng = np.random.default_rng(4)
    args, scales = _batch(rng, Q_LENS, SEQ_LENS, block_size=8, head_dim=16, group=4, storage=jnp.float8_e4m3fn)
    kw = dict(scale=0.125, sliding_window=5, soft_cap=None, **scales)
    got = ragged_paged_attention(*args, interpret=INTERPRET, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ragged_paged_attention_reference(*args, **kw)),
                               atol=TOL, rtol=0)
    # Decode: the last query of each sequence, at its last position.
    q, k_cache, v_cache, tables, seq_lens, qsl, _ = args
    rows = jnp.asarray(np.minimum(np.asarray(qsl[1:]) - 1, q.shape[0] - 1))
    decode_args = (q[rows], k_cache, v_cache, tables, seq_lens)
    got = paged_attention(*decode_args, interpret=INTERPRET, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(paged_attention_reference(*decode_args, **kw)),
                               atol=TOL, rtol=0)


def test_to_storage_of_uint8_holds_float8_bits():
    x = jnp.asarray([0.5, -3.0, 448.0], jnp.float32)
    bits = to_storage(x, jnp.uint8)
    assert bits.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(x.astype(jnp.float8_e4m3fn)).view(np.uint8))


@pytest.mark.parametrize("storage", [jnp.int8, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
def test_kernels_with_a_quantized_cache_pass_the_triton_lowering(storage):
    sds = jax.ShapeDtypeStruct
    cache = sds((257, 16, NUM_KV_HEADS, 128), storage)
    tables, lens = sds((8, 32), jnp.int32), sds((8,), jnp.int32)
    heads = sds((NUM_KV_HEADS,), jnp.float32)
    kw = dict(scale=0.1, sliding_window=100, soft_cap=None)
    _lower_for_cuda(lambda *a: ragged_paged_attention(*a[:7], k_scale=a[7], v_scale=a[8], **kw),
                    sds((64, NUM_KV_HEADS * 4, 128), jnp.bfloat16), cache, cache, tables, lens,
                    sds((9,), jnp.int32), sds((), jnp.int32), heads, heads)
    _lower_for_cuda(lambda *a: paged_attention(*a[:5], k_scale=a[5], v_scale=a[6], **kw),
                    sds((8, NUM_KV_HEADS * 4, 128), jnp.bfloat16), cache, cache, tables, lens, heads, heads)
    token_kv = sds((64, NUM_KV_HEADS, 128), jnp.bfloat16)
    _lower_for_cuda(kv_cache_write, cache, cache, token_kv, token_kv, sds((64,), jnp.int32), heads, heads)
