"""The Mosaic GPU decode and ragged kernels against the jnp references: in JAX's Mosaic GPU interpreter on CPU
(TMA copies, barriers and the two-stage ring simulated; the tensor-core products as ``jnp.dot``), compiled on Hopper
(``JAXLLM_PALLAS_INTERPRET`` as in tests/test_kernels_pallas.py), and through the Mosaic GPU lowering for CUDA
without a GPU, which checks register layouts, shared-memory tiling and swizzles, TMA sizes and the products'
operand shapes (PTX compilation still needs the GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import _mosaic
from kernels_pallas.attention import mosaic_decode, mosaic_ragged
from kernels_pallas.attention.mosaic_decode import paged_attention
from kernels_pallas.attention.reference import paged_attention_reference, ragged_paged_attention_reference
from tests.helpers import pallas_interpret
from kernels_pallas.ops import get_attention_ops
from tests.test_kernels_pallas import NUM_KV_HEADS, _make_cache, _make_tables, _mixed_lengths, _ragged_batch

INTERPRET = pallas_interpret()
# bf16 products: P is rounded to bf16 before P @ V, as in the Triton kernel.
TOLERANCE = 2e-2


def _on_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "").startswith("9")


pytestmark = pytest.mark.skipif(not INTERPRET and not _on_hopper(), reason="Mosaic GPU kernels compile for Hopper")


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    # On GPU, XLA may run the reference's float32 einsums in TF32.
    with jax.default_matmul_precision("highest"):
        yield


def _decode_batch(rng, seq_lens, *, block_size, head_dim, group, dtype=jnp.bfloat16):
    width = -(-max(seq_lens) // block_size) + 1
    tables, num_blocks = _make_tables(rng, [max(n, 1) for n in seq_lens], len(seq_lens), width, block_size)
    k_cache, v_cache = _make_cache(rng, num_blocks, block_size, head_dim, dtype)
    q = jnp.asarray(rng.standard_normal((len(seq_lens), NUM_KV_HEADS * group, head_dim)), dtype)
    return q, k_cache, v_cache, tables, jnp.asarray(seq_lens, jnp.int32)


def _as_float32(args, dtype):
    return tuple(a.astype(jnp.float32) if a.dtype == dtype else a for a in args)


# (block_size, head_dim, group, dtype, sliding_window, soft_cap): pages smaller than, equal to and larger than the
# 64-token chunk; groups below, at and above the 16 padded columns; both tensor-core dtypes.
CASES = [
    (16, 128, 2, jnp.bfloat16, None, None),
    (8, 64, 1, jnp.float16, None, None),
    (64, 64, 8, jnp.bfloat16, 20, None),
    (128, 128, 4, jnp.bfloat16, None, 30.0),
    (32, 64, 24, jnp.bfloat16, None, None),
]


@pytest.mark.parametrize("block_size,head_dim,group,dtype,sliding_window,soft_cap", CASES)
def test_decode_kernel_matches_reference(block_size, head_dim, group, dtype, sliding_window, soft_cap):
    rng = np.random.default_rng(block_size + head_dim + group)
    # 0 is a padding row; 150 spans three 64-token chunks; block_size and 64 end exactly on a boundary.
    seq_lens = [1, block_size, 64, 150, 0, 37]
    args = _decode_batch(rng, seq_lens, block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)
    kw = dict(scale=head_dim ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    out = paged_attention(*args, interpret=INTERPRET, **kw)
    expected = paged_attention_reference(*_as_float32(args, dtype), **kw)
    assert out.dtype == dtype and out.shape == args[0].shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), atol=TOLERANCE, rtol=0)
    assert not np.asarray(out[4], np.float32).any()


@pytest.mark.parametrize("block_size,head_dim,group,dtype,sliding_window,soft_cap",
                         CASES + [(16, 256, 40, jnp.bfloat16, None, None)])  # 64 padded heads: a token per tile
def test_ragged_kernel_matches_reference_on_mixed_prefill_and_decode_batch(
        block_size, head_dim, group, dtype, sliding_window, soft_cap):
    rng = np.random.default_rng(block_size * head_dim + group)
    q_lens, seq_lens = zip(*_mixed_lengths(block_size))
    batch = _ragged_batch(rng, list(q_lens), list(seq_lens), block_size=block_size, head_dim=head_dim, group=group,
                          dtype=dtype)
    kw = dict(scale=head_dim ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    out = mosaic_ragged.ragged_paged_attention(*batch, interpret=INTERPRET, **kw)
    expected = ragged_paged_attention_reference(*_as_float32(batch, dtype), **kw)
    assert out.dtype == dtype and out.shape == batch[0].shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), atol=TOLERANCE, rtol=0)
    # The three padding tokens are zeros.
    assert not np.asarray(out[sum(q_lens):], np.float32).any()


@pytest.mark.parametrize("num_splits", [2, 5])
def test_decode_kernel_result_does_not_depend_on_split_count(num_splits):
    rng = np.random.default_rng(num_splits)
    args = _decode_batch(rng, [300, 17, 0, 64], block_size=16, head_dim=64, group=4)
    kw = dict(scale=0.125, sliding_window=None, soft_cap=None)
    out = mosaic_decode._paged_attention(*args, interpret=INTERPRET, num_splits=num_splits, **kw)
    one = mosaic_decode._paged_attention(*args, interpret=INTERPRET, num_splits=1, **kw)
    expected = paged_attention_reference(*_as_float32(args, jnp.bfloat16), **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), atol=TOLERANCE, rtol=0)
    # The merge reorders float32 sums only; each split's bf16 tile products are the same.
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(one, np.float32), atol=1e-2, rtol=0)


@pytest.mark.parametrize("module", [mosaic_decode, mosaic_ragged])
@pytest.mark.parametrize("q_dtype,cache_dtype,head_dim,block_size,quantized,fragment", [
    (jnp.float32, jnp.float32, 64, 16, False, "float32"),
    (jnp.bfloat16, jnp.float16, 64, 16, False, "cache float16"),
    (jnp.bfloat16, jnp.bfloat16, 96, 16, False, "head_dim 96"),
    (jnp.bfloat16, jnp.bfloat16, 320, 16, False, "head_dim 320"),
    (jnp.bfloat16, jnp.bfloat16, 64, 24, False, "block_size 24"),
    (jnp.bfloat16, jnp.bfloat16, 64, 4, False, "block_size 4"),
    (jnp.bfloat16, jnp.bfloat16, 64, 16, True, "quantized"),
])
def test_unsupported_inputs_are_named(module, q_dtype, cache_dtype, head_dim, block_size, quantized, fragment):
    assert fragment in module.unsupported_reason(q_dtype, cache_dtype, head_dim, block_size, 2, quantized,
                                                 table_width=8)


@pytest.mark.parametrize("module,most", [(mosaic_decode, 32), (mosaic_ragged, 64)])
def test_groups_up_to_the_kernels_columns_or_rows_are_taken(module, most):
    assert module.unsupported_reason(jnp.bfloat16, jnp.bfloat16, 128, 16, most, table_width=8) is None
    reason = module.unsupported_reason(jnp.bfloat16, jnp.bfloat16, 128, 16, most + 1, table_width=8)
    assert f"{most + 1} query heads per KV head (at most {most})" in reason


def _widest_table(module, head_dim: int, group: int, block_size: int) -> int:
    ok = lambda w: module.unsupported_reason(jnp.bfloat16, jnp.bfloat16, head_dim, block_size, group,
                                             table_width=w) is None
    return max(w for w in range(8, 40_000, 8) if ok(w))


@pytest.mark.parametrize("module,head_dim,group", [(mosaic_decode, 256, 32), (mosaic_decode, 128, 2),
                                                   (mosaic_ragged, 256, 8)])
def test_the_widest_block_table_taken_fits_in_shared_memory_and_the_next_is_refused(module, head_dim, group):
    # A program copies its block ids to shared memory beside its tiles; the lowering for CUDA runs Mosaic GPU's
    # own shared-memory check, so the widest table the kernel takes must lower and the next one be refused.
    widest = _widest_table(module, head_dim, group, 16)
    reason = module.unsupported_reason(jnp.bfloat16, jnp.bfloat16, head_dim, 16, group, table_width=widest + 8)
    assert f"block tables of {widest + 8} entries" in reason and str(_mosaic.SMEM_BYTES) in reason
    assert "mosaic_gpu" in _lower(module, 16, head_dim, group, None, None, widest)


def test_an_unsupported_call_raises():
    args = _decode_batch(np.random.default_rng(0), [5], block_size=16, head_dim=64, group=1, dtype=jnp.float32)
    with pytest.raises(ValueError, match="float32"):
        paged_attention(*args, scale=1.0, interpret=True)


@pytest.mark.parametrize("dtype,tolerance", [(jnp.bfloat16, TOLERANCE), (jnp.float32, 1e-5)])
@pytest.mark.parametrize("decode_steps", [True, False])
def test_pallas_ops_on_mosaic_match_reference_falling_back_to_triton_for_float32(
        dtype, tolerance, decode_steps, monkeypatch):
    # Decode-only steps' programs take the decode kernel, the others the ragged one: a decode-only batch (one
    # padded row, three padded tokens) through each, Mosaic's kernels called only where they take the inputs.
    batch = _ragged_batch(np.random.default_rng(7), [1, 1, 1], [70, 1, 16], block_size=16, head_dim=64, group=2,
                          dtype=dtype)
    module, name = (mosaic_decode, "paged_attention") if decode_steps else (mosaic_ragged, "ragged_paged_attention")
    calls, kernel = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or kernel(*a, **k))
    ops = get_attention_ops("pallas", interpret=INTERPRET, lowering="mosaic")
    attend = ops.for_decode_steps() if decode_steps else ops
    out = attend.ragged_paged_attention(*batch, scale=0.125)
    assert len(calls) == (dtype == jnp.bfloat16)
    expected = get_attention_ops("reference").ragged_paged_attention(*_as_float32(batch, dtype), scale=0.125)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), atol=tolerance, rtol=0)


def test_lowering_names_are_checked_and_the_environment_picks_one(monkeypatch):
    with pytest.raises(ValueError, match="'cutlass' \\(from lowering='cutlass'\\).*triton.*mosaic"):
        get_attention_ops("pallas", interpret=True, lowering="cutlass")
    monkeypatch.setenv("JAXLLM_PALLAS_LOWERING", "flash")
    with pytest.raises(ValueError, match="'flash'.*JAXLLM_PALLAS_LOWERING"):
        get_attention_ops("pallas", interpret=True)
    monkeypatch.setenv("JAXLLM_PALLAS_LOWERING", "mosaic")
    calls = []
    monkeypatch.setattr(mosaic_ragged, "ragged_paged_attention", lambda *a, **k: calls.append(1) or a[0])
    batch = _ragged_batch(np.random.default_rng(8), [3], [5], block_size=16, head_dim=64, group=1,
                          dtype=jnp.bfloat16)
    get_attention_ops("pallas", interpret=True).ragged_paged_attention(*batch, scale=1.0)
    assert calls == [1]
    if not _on_hopper():
        with pytest.raises(ValueError, match="Hopper"):
            get_attention_ops("pallas", interpret=False)


@pytest.mark.skipif(not INTERPRET, reason="the race detector is the interpreter's")
@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_the_two_stage_ring_has_no_data_race(kernel):
    # The interpreter's happens-before race detector over the TMA copies, barriers and tile reads: a slot refilled
    # while still read, P^T rewritten before its product, or a copy read before its barrier, is a race.
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    params = _mosaic.interpret_params(detect_races=True)
    kw = dict(scale=0.125, sliding_window=None, soft_cap=None, interpret=params)
    if kernel == "decode":
        args = _decode_batch(np.random.default_rng(3), [200, 64, 0], block_size=16, head_dim=64, group=2)
        out = mosaic_decode._paged_attention(*args, num_splits=1, **kw)
    else:
        batch = _ragged_batch(np.random.default_rng(3), [40, 1], [200, 64], block_size=16, head_dim=64, group=2,
                              dtype=jnp.bfloat16)
        out = mosaic_ragged._ragged_paged_attention(*batch, **kw)
    jax.block_until_ready(out)
    assert not get_races().races_found


def _lower(module, block_size, head_dim, group, sliding_window, soft_cap, width) -> str:
    """The kernel of ``module`` lowered for CUDA (Mosaic GPU's checks run; PTX is not made), as text."""
    sds = jax.ShapeDtypeStruct
    rows, num_tokens, num_blocks = 8, 64, 257
    cache = sds((num_blocks, block_size, NUM_KV_HEADS, head_dim), jnp.bfloat16)
    tables, lens = sds((rows, width), jnp.int32), sds((rows,), jnp.int32)
    kw = dict(scale=0.1, sliding_window=sliding_window, soft_cap=soft_cap)
    if module is mosaic_decode:
        fn, args = paged_attention, (sds((rows, NUM_KV_HEADS * group, head_dim), jnp.bfloat16), cache, cache,
                                     tables, lens)
    else:
        fn, args = mosaic_ragged.ragged_paged_attention, (
            sds((num_tokens, NUM_KV_HEADS * group, head_dim), jnp.bfloat16), cache, cache, tables, lens,
            sds((rows + 1,), jnp.int32), sds((), jnp.int32))
    return jax.jit(functools.partial(fn, **kw)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("module", [mosaic_decode, mosaic_ragged])
@pytest.mark.parametrize("block_size,head_dim,group,sliding_window,soft_cap,width", [
    (16, 128, 2, None, None, 2048),  # the Qwen3-0.6B shape gpu_check serves, at 32k tokens of context
    (8, 64, 1, 100, 30.0, 32),
    (128, 256, 32, None, None, 256),
])
def test_kernels_pass_the_mosaic_gpu_lowering(module, block_size, head_dim, group, sliding_window, soft_cap, width):
    assert "mosaic_gpu" in _lower(module, block_size, head_dim, group, sliding_window, soft_cap, width)
