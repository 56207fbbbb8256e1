"""The C++ CPU decode kernel (``kernels_pallas.native``) against the reference, and the paths around it.

The class of inputs: any decode batch -- contexts of one token, ending mid-block or on a block boundary, filling the
block table, padding rows (``ctx_len`` 0) -- under every block size, head dim, GQA ratio and KV head count the
kernel takes, with and without a sliding window and a soft cap, on float32 and bfloat16 caches (stored as bfloat16
or as its uint16 bit patterns). Around it: how ``ragged_paged_attention_xla`` picks it, its errors, and the build
(cached per source; a failed build leaves the jnp path).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_pallas import native
from kernels_pallas.reference import paged_attention_reference, ragged_paged_attention_reference
from kernels_pallas.xla import native_decode_applies, ragged_paged_attention_xla
from tests.test_kernels_pallas import _ragged_batch

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernel cannot be built here")
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-5}
SCALE = 0.125


def _decode_case(rng, *, rows, block_size, head_dim, group, kv_heads, dtype, width):
    num_blocks = rows * width + 1
    k = jnp.asarray(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)), dtype)
    q = jnp.asarray(rng.standard_normal((rows, kv_heads * group, head_dim)), jnp.float32)
    tables = jnp.asarray(rng.permutation(num_blocks)[:rows * width].reshape(rows, width), jnp.int32)
    full = width * block_size
    choices = [0, 1, min(block_size, full), min(block_size + 1, full), full, int(rng.integers(1, full + 1))]
    lens = jnp.asarray([choices[int(i)] for i in rng.integers(0, len(choices), rows)], jnp.int32)
    return q, k, v, tables, lens


def _want(q, k, v, tables, lens, **kw):
    # The reference in float32 over the same cache values; padding rows (ctx_len 0) are zeros.
    ref = paged_attention_reference(q, k.astype(jnp.float32), v.astype(jnp.float32), tables, lens, scale=SCALE, **kw)
    return np.where(np.asarray(lens)[:, None, None] > 0, np.asarray(ref, np.float32), 0.0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), block_size=st.sampled_from([1, 4, 16, 32]), head_dim=st.sampled_from([16, 64, 128]),
       group=st.sampled_from([1, 2, 3, 4]), kv_heads=st.sampled_from([1, 2, 3]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), window=st.sampled_from([None, 1, 5, 40]),
       soft_cap=st.sampled_from([None, 5.0]), as_bits=st.booleans())
def test_native_decode_matches_reference_on_any_decode_batch(seed, block_size, head_dim, group, kv_heads, dtype,
                                                              window, soft_cap, as_bits):
    rng = np.random.default_rng(seed)
    q, k, v, tables, lens = _decode_case(rng, rows=int(rng.integers(1, 6)), block_size=block_size, head_dim=head_dim,
                                         group=group, kv_heads=kv_heads, dtype=dtype, width=int(rng.integers(1, 5)))
    want = _want(q, k, v, tables, lens, sliding_window=window, soft_cap=soft_cap)
    if as_bits and dtype == jnp.bfloat16:
        k, v = (jax.lax.bitcast_convert_type(c, jnp.uint16) for c in (k, v))
    got = native.paged_decode_cpu(q, k, v, tables, lens, scale=SCALE, sliding_window=window, soft_cap=soft_cap)
    assert got.dtype == jnp.float32 and got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got), want, atol=TOLERANCE[dtype], rtol=0)


def test_native_decode_handles_a_long_context_with_scores_far_apart():
    # 2,000 positions with scores spread over +-60 exercise the running-max rescale and the exp's range.
    rng = np.random.default_rng(3)
    q, k, v, tables, _ = _decode_case(rng, rows=2, block_size=16, head_dim=64, group=3, kv_heads=3,
                                      dtype=jnp.float32, width=125)
    q = q * 8.0
    lens = jnp.asarray([2000, 1999], jnp.int32)
    got = jax.jit(functools.partial(native.paged_decode_cpu, scale=SCALE))(q, k, v, tables, lens)
    np.testing.assert_allclose(np.asarray(got), _want(q, k, v, tables, lens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_attention_sends_decode_rows_to_the_kernel_and_prefill_rows_to_the_tiles(seed, dtype):
    # Mixed batches: decode rows take the kernel, prefill rows the jnp tiles, both against the reference.
    rng = np.random.default_rng(seed)
    q_lens = [1, int(rng.integers(2, 40)), 1, 1, int(rng.integers(2, 9))]
    seq_lens = [q + int(rng.integers(0, 50)) for q in q_lens]
    args = _ragged_batch(rng, q_lens, seq_lens, block_size=8, head_dim=64, group=3, dtype=dtype, pad_seqs=2,
                         pad_tokens=3)
    assert native_decode_applies(args[1], args[0].shape[1])
    window = [None, 9][seed % 2]
    want = ragged_paged_attention_reference(*args, scale=SCALE, sliding_window=window)
    attend = functools.partial(ragged_paged_attention_xla, scale=SCALE, sliding_window=window)
    got = jax.jit(attend)(*args)
    tiles = jax.jit(functools.partial(attend, native_decode=False))(*args)
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=0)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(tiles, np.float32), atol=tol, rtol=0)
    assert np.all(np.asarray(got)[sum(q_lens):] == 0.0)


def test_native_decode_is_not_taken_where_it_does_not_apply_and_refused_when_forced():
    rng = np.random.default_rng(0)
    q, k, v, tables, lens, qsl, n = _ragged_batch(rng, [1, 1], [5, 9], block_size=4, head_dim=16, group=2,
                                                  dtype=jnp.float32)
    scales = jnp.ones(2, jnp.float32)
    assert native_decode_applies(k, 4)
    assert not native_decode_applies(k.astype(jnp.int8), 4, scales)
    assert not native_decode_applies(k.astype(jnp.float8_e4m3fn), 4)
    assert not native_decode_applies(jnp.zeros((4, 4, 2, 512)), 4)  # head_dim past the kernel's 256
    assert not native_decode_applies(k, 3)  # query heads not a multiple of the KV heads
    with pytest.raises(ValueError, match=r"head_dim 512; the kernel takes at most 64 query heads"):
        native.paged_decode_cpu(jnp.zeros((1, 2, 512)), *(jnp.zeros((4, 4, 2, 512)),) * 2, tables[:1], lens[:1],
                                scale=SCALE)
    with pytest.raises(ValueError, match=r"native_decode=True needs .*scales True"):
        ragged_paged_attention_xla(q, k.astype(jnp.int8), v.astype(jnp.int8), tables, lens, qsl, n, scale=SCALE,
                                   k_scale=scales, v_scale=scales, native_decode=True)
    with pytest.raises(ValueError, match=r"cache dtypes int8, int8"):
        native.paged_decode_cpu(q, k.astype(jnp.int8), v.astype(jnp.int8), tables, lens, scale=SCALE)


@pytest.mark.parametrize("bad, message", [
    ("id", r"row 1 block id 99 outside \[0, \d+\)"),
    ("negative", r"row 0 block id -1 outside"),
    ("length", r"row 1 ctx_len 9 exceeds the table's 8 positions"),
])
def test_native_decode_refuses_a_table_or_length_it_would_read_past(bad, message):
    rng = np.random.default_rng(1)
    q, k, v, tables, _ = _decode_case(rng, rows=2, block_size=4, head_dim=16, group=1, kv_heads=1,
                                      dtype=jnp.float32, width=2)
    lens = jnp.asarray([5, 8], jnp.int32)
    if bad == "id":
        tables = tables.at[1, 1].set(99)
    elif bad == "negative":
        tables = tables.at[0, 0].set(-1)
    else:
        lens = jnp.asarray([5, 9], jnp.int32)
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(native.paged_decode_cpu(q, k, v, tables, lens, scale=SCALE))


def _probe(env: dict[str, str]) -> str:
    code = ("from kernels_pallas import native, xla; import jax.numpy as jnp; a = native.available(); "
            "print(a, native.unavailable_reason(), xla.native_decode_applies(jnp.zeros((1, 1, 1, 1)), 1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() + "\n" + out.stderr


def test_a_failed_build_or_the_off_switch_leaves_the_jnp_path(tmp_path):
    failed = _probe({"CXX": "false", "JAXLLM_NATIVE_CACHE": str(tmp_path)})
    assert failed.startswith("False the C++ decode kernel did not build or load") and failed.split("\n")[0].endswith(
        "False")
    assert "using the jnp decode attention" in failed
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind
    off = _probe({"JAXLLM_NATIVE_KERNELS": "0"})
    assert off.startswith("False JAXLLM_NATIVE_KERNELS=0 False")


def test_the_library_is_built_once_per_source_and_reused(tmp_path):
    first = _probe({"JAXLLM_NATIVE_CACHE": str(tmp_path)})
    built = sorted(p.name for p in tmp_path.iterdir())
    assert first.startswith("True None True") and len(built) == 1 and built[0].startswith("paged_decode_cpu-")
    stamp = (tmp_path / built[0]).stat().st_mtime_ns
    assert _probe({"JAXLLM_NATIVE_CACHE": str(tmp_path)}).startswith("True None True")
    assert (tmp_path / built[0]).stat().st_mtime_ns == stamp
