"""The C++ CPU matmuls (``kernels_pallas.matmul.cpu.stacked_matmul_cpu``, ``kernels_pallas.lm_head.cpu.matmul_nt_cpu``)
against numpy, and how the model step uses them.

The class of inputs: any ``x [M, K] @ w[layer]`` of a stacked ``w [L, K, N]`` -- row counts that fill whole register
tiles of rows and leave every remainder, inner dims of one element to several chunks of K, column counts of one to
four vectors per panel and several panels, any layer of the stack; any ``x [M, K] @ w.T`` of a ``w [N, K]`` with K a
multiple of 16 -- row counts on both sides of the transposed-panel threshold, column counts that fill whole panels,
leave a narrower last one or fall short of one dot tile; for both, any count of leading rows to compute (the rest
zeros), clamped to [0, M]. Around them: their errors, and the model step, which reads every float32 projection
through the first (no per-layer slice of the weights) up to the ops table's ``projection_max_rows`` tokens (by the
CPU's vector width) and the lm_head of 4 rows or more through either, with the same logits, and every bfloat16
projection through the first where the CPU has AVX-512-BF16, as close to the float32 logits as XLA's bfloat16 dots;
other bfloat16 weights and larger steps keep XLA's dots.
"""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import cpu_features, ops
from kernels_pallas.lm_head import cpu as lm_head_cpu
from kernels_pallas.matmul import cpu as matmul_cpu
from kernels_pallas.storage import to_storage

# The ops table's row limits with the C++ matmul taking no step: every projection through XLA's dots.
NO_MATMUL_ROWS = {"float32": ((frozenset(), 0),), "bfloat16": ((frozenset(), 0),)}

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernel cannot be built here")


@pytest.fixture(autouse=True, scope="module")
def _kernels_loaded():
    # The ops table loads the library and registers the kernels' FFI targets; the tests call the kernels directly.
    assert ops.native_kernels(), ops.native_unavailable_reason()


def test_stacked_matmul_matches_numpy_on_every_tile_shape():
    # Rows 1-13, 48 and 64 cover whole tiles of 6 rows and every remainder, and AVX2's tiles of 3 rows by 4
    # vectors up to 6 rows (1-3 in place, 4-6 over chunks); N = 16 .. 208 gives panels of 1-4 vectors of 16
    # columns (AVX-512), of 2 or 4 vectors of 8 (AVX2), and more than one panel; K = 1 and 7 leave no vector of K.
    # N = 16 and 32 with K = 300: a weight exactly one AVX2 panel wide, which tiles of more than one tile of rows
    # read in place (nothing to copy) in one pass down all of K.
    rng = np.random.default_rng(0)
    # K = 257: odd, over three chunks of 128 rows read in place (AVX-512: units of up to 48 rows) or copied (AVX2:
    # 4-23 rows), or copied whole (units of 49 rows or more on AVX-512, of 24 or more on AVX2); N = 96, 160: panels
    # of two vectors of 16 (AVX-512). N = 1024: rows 4 KiB apart, copied from two tiles of rows on either CPU
    # (whole from 24 rows).
    for k_dim, n in [(1, 16), (7, 48), (64, 80), (576, 192), (33, 208), (257, 96), (40, 160), (300, 16), (300, 32),
                     (257, 1024)]:
        stack = rng.standard_normal((3, k_dim, n)).astype(np.float32)
        w = jnp.asarray(stack)
        for m in [*range(1, 14), 48, 64, 97]:
            x = rng.standard_normal((m, k_dim)).astype(np.float32)
            layer = m % 3
            got = np.asarray(matmul_cpu.stacked_matmul_cpu(jnp.asarray(x), w, jnp.int32(layer)))
            want = x.astype(np.float64) @ stack[layer].astype(np.float64)
            assert got.dtype == np.float32 and got.shape == (m, n)
            # float32 sums of K products of unit normals: error ~ sqrt(K) * 2^-24 * |terms|.
            np.testing.assert_allclose(got, want, atol=2e-6 * k_dim, rtol=0, err_msg=f"M={m} K={k_dim} N={n}")


def _bf16(a: np.ndarray) -> np.ndarray:
    """a rounded to bfloat16 (as float64: the exact values the kernel multiplies)."""
    return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)


def test_bfloat16_stacked_matmul_matches_numpy_on_every_tile_shape():
    # As the float32 test, with K even (pairs of rows): K = 2 is one pair, 258 is two chunks of 128 rows and one
    # pair, 576 four chunks and a half one; N = 96 and 160 take the pairs tile of two vectors (AVX-512-BF16); N =
    # 2048: rows 4 KiB apart (copied: in chunks below 24 rows, whole from 24). x is given in float32 for half the
    # cases: the kernel multiplies it rounded to bfloat16.
    rng = np.random.default_rng(4)
    for k_dim, n in [(2, 16), (8, 48), (64, 80), (576, 192), (34, 208), (258, 96), (40, 160), (258, 2048)]:
        stack = jnp.asarray(rng.standard_normal((3, k_dim, n)), jnp.bfloat16)
        for m in [*range(1, 14), 48, 64, 97]:
            x = rng.standard_normal((m, k_dim)).astype(np.float32)
            layer = m % 3
            given = jnp.asarray(x, jnp.bfloat16) if m % 2 else jnp.asarray(x)
            # The engine's stored layer weights are uint16 bits of bfloat16 (models.loop_storage): the same call.
            stored = stack if m % 4 < 2 else jax.lax.bitcast_convert_type(stack, jnp.uint16)
            got = np.asarray(matmul_cpu.stacked_matmul_cpu(given, stored, jnp.int32(layer)))
            want = _bf16(x) @ np.asarray(stack[layer], np.float64)
            assert got.dtype == np.float32 and got.shape == (m, n)
            # Exact bfloat16 products summed in float32, as in the float32 test.
            np.testing.assert_allclose(got, want, atol=2e-6 * k_dim, rtol=0, err_msg=f"M={m} K={k_dim} N={n}")


# Panels of 64 columns (AVX-512; AVX2's are 16) enough that none but the last is cut into pieces for the pool's
# threads (at most one per CPU): a unit then has all of x's rows.
_MANY_PANELS = 128 * (os.cpu_count() or 1) + 16


@pytest.mark.parametrize("dtype, k_dim, n", [
    # Longer than one pass (384 KiB of a panel: 1536 float32 rows of 64 columns, 3072 bfloat16 ones; 6144 float32
    # and 12288 bfloat16 rows of AVX2's 16 columns), copied from 49 rows (AVX-512) or 24 (AVX2) and read in passes
    # that add to y: K = 1600 and 3100 on AVX-512, 6200 and 12400 on AVX2 too; N = 16 is one panel read where it
    # is, in two passes on either CPU.
    ("float32", 1600, _MANY_PANELS), ("float32", 6200, _MANY_PANELS), ("float32", 6200, 16),
    ("bfloat16", 3100, _MANY_PANELS), ("bfloat16", 12400, _MANY_PANELS),
    # 2 and 3 panels of 64 columns (AVX-512) for the pool's threads: with a unit reserved ahead, every panel is cut
    # into pieces of rows, so that no thread holds two whole panels while another waits.
    ("float32", 576, 128), ("float32", 576, 192), ("bfloat16", 576, 192)])
def test_long_contractions_go_in_passes_and_few_panels_in_pieces(dtype, k_dim, n):
    rng = np.random.default_rng(5)
    stack = jnp.asarray(rng.standard_normal((2, k_dim, n)) * 0.1, dtype)
    for m in (7, 24, 49, 97):
        x = (rng.standard_normal((m, k_dim)) * 0.1).astype(np.float32)
        got = np.asarray(matmul_cpu.stacked_matmul_cpu(jnp.asarray(x, dtype), stack, jnp.int32(1)))
        want = _bf16(x) @ np.asarray(stack[1], np.float64) if dtype == "bfloat16" else (
            x.astype(np.float64) @ np.asarray(stack[1], np.float64))
        # K products of about 0.01 summed in float32: rounding error about 4e-10 * K; a row of K lost, or a pass
        # that overwrote y instead of adding to it, is off by 0.01 or more.
        np.testing.assert_allclose(got, want, atol=2e-8 * k_dim, rtol=0, err_msg=f"M={m} K={k_dim} N={n}")


def test_matmul_nt_takes_a_long_contraction_in_passes():
    # The lm_head's packed panel (64 rows of w transposed; AVX2: 16) is read in passes of 1536 rows of K (AVX2:
    # 6144): K = 6208 is five (two).
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((200, 6208)) * 0.1).astype(np.float32)
    for m in (8, 24, 97):
        x = (rng.standard_normal((m, 6208)) * 0.1).astype(np.float32)
        got = np.asarray(lm_head_cpu.matmul_nt_cpu(jnp.asarray(x), jnp.asarray(w)))
        np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), atol=2e-8 * 6208, rtol=0,
                                   err_msg=f"M={m}")


def test_stacked_matmul_refuses_weights_it_does_not_take_and_a_layer_past_the_stack():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"w float32 \(2, 8, 40\); expected .* N a multiple of 16"):
        matmul_cpu.stacked_matmul_cpu(x, jnp.ones((2, 8, 40), jnp.float32), 0)
    with pytest.raises(ValueError, match=r"x \(2, 8\), w float32 \(2, 9, 16\)"):
        matmul_cpu.stacked_matmul_cpu(x, jnp.ones((2, 9, 16), jnp.float32), 0)
    for dtype, k_dim in ((jnp.int8, 8), (jnp.float16, 8), (jnp.bfloat16, 7)):  # bfloat16 takes an even K only
        w = jnp.ones((2, k_dim, 16), dtype)
        assert not matmul_cpu.matmul_supports(w)
        with pytest.raises(ValueError, match=rf"w {jnp.dtype(dtype).name} \(2, {k_dim}, 16\); expected .* float32 "
                                             r"or bfloat16 w .* \(K even for bfloat16\)"):
            matmul_cpu.stacked_matmul_cpu(jnp.ones((2, k_dim), jnp.float32), w, 0)
    with pytest.raises(Exception, match=r"matmul_bf16_cpu: layer 2 outside \[0, 2\)"):
        jax.block_until_ready(matmul_cpu.stacked_matmul_cpu(x, jnp.ones((2, 8, 16), jnp.bfloat16), jnp.int32(2)))
    with pytest.raises(Exception, match=r"matmul_cpu: layer 2 outside \[0, 2\)"):
        jax.block_until_ready(matmul_cpu.stacked_matmul_cpu(x, jnp.ones((2, 8, 16), jnp.float32), jnp.int32(2)))
    with pytest.raises(Exception, match=r"matmul_cpu: layer -1 outside \[0, 2\)"):
        jax.block_until_ready(matmul_cpu.stacked_matmul_cpu(x, jnp.ones((2, 8, 16), jnp.float32), jnp.int32(-1)))


def test_matmul_nt_matches_numpy_on_every_tile_shape():
    # Rows 1-13, 48 and 97: below and above the transposed-panel threshold (8), whole and partial tiles of x rows
    # (dot tiles of 4 or 2 rows, packed tiles of 6); N = 1 and 3 are less than one dot tile, 64 one panel,
    # 129, 200 and 257 whole panels and a narrower last one; K = 16 .. 576 whole vectors of 8 or 16.
    rng = np.random.default_rng(1)
    for k_dim, n in [(16, 1), (16, 3), (32, 64), (48, 129), (576, 200), (64, 257)]:
        w = rng.standard_normal((n, k_dim)).astype(np.float32)
        for m in [*range(1, 14), 48, 97]:
            x = rng.standard_normal((m, k_dim)).astype(np.float32)
            got = np.asarray(lm_head_cpu.matmul_nt_cpu(jnp.asarray(x), jnp.asarray(w)))
            want = x.astype(np.float64) @ w.T.astype(np.float64)
            assert got.dtype == np.float32 and got.shape == (m, n)
            np.testing.assert_allclose(got, want, atol=2e-6 * k_dim, rtol=0, err_msg=f"M={m} K={k_dim} N={n}")


def test_packed_panels_hold_the_weight_transposed_and_multiply_as_numpy_on_every_tile_shape():
    # The class: any w [N, K] with N a whole number of panels (P columns: 64 with AVX-512, 16 with AVX2) and K a
    # multiple of 16, times x of 1-13, 48 or 97 rows (few-row tiles, whole and partial tiles of 6 rows, pieces of a
    # panel's columns or rows when there are fewer panels than threads to share them), any leading rows computed.
    p = ops.lm_head_panel_columns()
    assert p in (16, 64)
    rng = np.random.default_rng(4)
    for k_dim, n in [(16, p), (48, 3 * p), (576, 4 * p), (64, 9 * p)]:
        w = rng.standard_normal((n, k_dim)).astype(np.float32)
        panels = ops.pack_lm_head_panels(jnp.asarray(w))
        assert panels.shape == lm_head_cpu.nt_panels_shape(w, p) == (n // p, k_dim, p)
        np.testing.assert_array_equal(np.asarray(panels), w.reshape(n // p, p, k_dim).transpose(0, 2, 1))
        for m in [*range(1, 14), 48, 97]:
            x = rng.standard_normal((m, k_dim)).astype(np.float32)
            padded = x.copy()
            padded[m - 1] = np.nan  # past the leading rows computed: never read
            for rows, x_in in ((m, x), (m - 1, padded)):
                got = np.asarray(lm_head_cpu.matmul_nt_cpu(jnp.asarray(x_in), jnp.asarray(w), jnp.int32(rows), panels))
                want = x[:rows].astype(np.float64) @ w.T.astype(np.float64)
                assert got.dtype == np.float32 and got.shape == (m, n)
                np.testing.assert_allclose(got[:rows], want, atol=2e-6 * k_dim, rtol=0,
                                           err_msg=f"M={m} rows={rows} K={k_dim} N={n}")
                assert (got[rows:] == 0).all()


def test_packed_panels_are_refused_for_a_weight_they_do_not_fit():
    p = ops.lm_head_panel_columns()
    w = jnp.ones((3 * p + 1, 32), jnp.float32)  # a vocabulary that is not whole panels
    assert lm_head_cpu.nt_panels_shape(w, p) is None
    with pytest.raises(ValueError, match=rf"pack_nt_panels: w float32 \({3 * p + 1}, 32\); expected .* panel"):
        ops.pack_lm_head_panels(w)
    w = jnp.ones((2 * p, 32), jnp.float32)
    x = jnp.ones((4, 32), jnp.float32)
    for bad in (jnp.ones((2, 32, p), jnp.bfloat16), jnp.ones((2, p, 32), jnp.float32), jnp.ones((1, 32, p))):
        with pytest.raises(ValueError, match=rf"matmul_nt_cpu: panels .*; expected float32 \[N / P, K, P\] of w "
                                             rf"\({2 * p}, 32\)"):
            lm_head_cpu.matmul_nt_cpu(x, w, panels=bad)


@pytest.mark.parametrize("m", [5, 12, 20])  # the NT kernel packs panels from 8 computed rows (rows 12 and 10 of 20)
def test_the_matmuls_compute_the_leading_rows_and_zero_the_rest(m):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((m, 64)).astype(np.float32)
    x[m // 2:] = np.nan  # a padding row's contents never reach the result
    stack = rng.standard_normal((2, 64, 80)).astype(np.float32)
    w_nt = rng.standard_normal((130, 64)).astype(np.float32)
    for rows in (-3, 0, 1, m // 2, m - 1, m + 5):
        valid = min(max(rows, 0), m)
        if valid > m // 2:
            x_rows = np.where(np.isnan(x), 1.0, x).astype(np.float32)  # every computed row finite
        else:
            x_rows = x
        stack_bf16 = jnp.asarray(stack, jnp.bfloat16)
        for got, x_used, w in (
                (matmul_cpu.stacked_matmul_cpu(jnp.asarray(x_rows), jnp.asarray(stack), 1, jnp.int32(rows)), x_rows,
                 stack[1]),
                (matmul_cpu.stacked_matmul_cpu(jnp.asarray(x_rows), stack_bf16, 1, jnp.int32(rows)), _bf16(x_rows),
                 np.asarray(stack_bf16[1], np.float64)),
                (lm_head_cpu.matmul_nt_cpu(jnp.asarray(x_rows), jnp.asarray(w_nt), jnp.int32(rows)), x_rows, w_nt.T)):
            got = np.asarray(got)
            want = x_used[:valid].astype(np.float64) @ w.astype(np.float64)
            np.testing.assert_allclose(got[:valid], want, atol=2e-6 * 64, rtol=0, err_msg=f"rows={rows}")
            assert (got[valid:] == 0).all(), f"rows={rows}: the rows past {valid} must be zeros"


def test_matmul_nt_refuses_weights_it_does_not_take():
    x = jnp.ones((2, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"x \(2, 40\), w float32 \(8, 40\); expected .* K a multiple of 16"):
        lm_head_cpu.matmul_nt_cpu(jnp.ones((2, 40), jnp.float32), jnp.ones((8, 40), jnp.float32))
    with pytest.raises(ValueError, match=r"x \(2, 32\), w float32 \(8, 48\)"):
        lm_head_cpu.matmul_nt_cpu(x, jnp.ones((8, 48), jnp.float32))
    for w in (jnp.ones((8, 32), jnp.bfloat16), jnp.ones((1, 8, 32), jnp.float32), jnp.ones((0, 32), jnp.float32)):
        assert not lm_head_cpu.matmul_nt_supports(w)
        with pytest.raises(ValueError, match=r"matmul_nt_cpu: .* expected x \[M, K\] and float32 w \[N, K\]"):
            lm_head_cpu.matmul_nt_cpu(x, w)


@pytest.mark.parametrize("tied", [True, False])
def test_the_lm_head_of_four_rows_or_more_or_packed_takes_the_kernels_with_xlas_logits(tmp_path, tied):
    from jaxllm.loader import load_model
    from jaxllm.models import common
    from tests.hf_models import make_tiny_hf_model

    make_tiny_hf_model("llama", tmp_path, tie_word_embeddings=tied)
    cfg, params, _ = load_model(tmp_path, np.float32)
    target = "jaxllm_matmul_nt_cpu" if tied else "jaxllm_matmul_cpu"
    hidden = jnp.asarray(np.random.default_rng(3).standard_normal((6, cfg.hidden_size)), jnp.float32)
    head = jax.jit(lambda h, n: common.compute_logits(params, h, cfg=cfg, num_rows=n, native_kernels=True))
    assert f'custom_call_target="{target}"' in head.lower(hidden, jnp.int32(6)).compile().as_text()
    weight = params["embed"].T if tied else params["lm_head"]
    want = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64)
    np.testing.assert_allclose(np.asarray(head(hidden, jnp.int32(6))), want, atol=1e-5, rtol=0)
    padded = np.asarray(head(hidden, jnp.int32(4)))  # a step of 4 sequences in a bucket of 6 rows
    np.testing.assert_allclose(padded[:4], want[:4], atol=1e-5, rtol=0)
    assert (padded[4:] == 0).all()
    # A bfloat16 head keeps XLA's dot (the bfloat16 stacked kernel is for the layers' 4-token bucket only).
    head16 = jax.jit(lambda h, n: common.compute_logits(jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16),
                                                                              params),
                                                        h.astype(jnp.bfloat16), cfg=cfg, num_rows=n,
                                                        native_kernels=True))
    assert "jaxllm_matmul" not in head16.lower(hidden, jnp.int32(6)).compile().as_text()
    # Fewer rows than LM_HEAD_MIN_ROWS: XLA's dot, every row computed.
    few = hidden[:ops.LM_HEAD_MIN_ROWS - 1]
    assert target not in head.lower(few, jnp.int32(1)).compile().as_text()
    np.testing.assert_allclose(np.asarray(head(few, jnp.int32(1))), want[:len(few)], atol=1e-5, rtol=0)
    # The engine's tied embedding packed (with_head_panels): the packed kernel from one row on, same logits.
    engine_params = common.with_head_panels(params, cfg)
    assert (ops.HEAD_PANELS in engine_params) == tied
    # An embedding past HEAD_PANELS_MAX_BYTES is not copied: the head transposes its panels per call instead.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "HEAD_PANELS_MAX_BYTES", params["embed"].nbytes - 1)
        assert ops.HEAD_PANELS not in common.with_head_panels(params, cfg)
    if tied:
        packed = jax.jit(lambda h, n: common.compute_logits(engine_params, h, cfg=cfg, num_rows=n,
                                                            native_kernels=True))
        for rows in (1, 6):
            hlo = packed.lower(hidden[:rows], jnp.int32(rows)).compile().as_text()
            assert 'custom_call_target="jaxllm_matmul_nt_packed_cpu"' in hlo and "dot(" not in hlo
            np.testing.assert_allclose(np.asarray(packed(hidden[:rows], jnp.int32(rows))), want[:rows], atol=1e-5,
                                       rtol=0)


def test_dense_forward_keeps_xlas_dots_so_jax_grad_goes_through(tmp_path):
    """The kernels have no derivative: ``dense_forward`` (the differentiable forward, 2 x 6 rows of a float32 tied
    model, past LM_HEAD_MIN_ROWS) keeps XLA's dots, and its gradient is the finite difference's."""
    from jaxllm.loader import load_model
    from jaxllm.models.dense import dense_forward
    from tests.hf_models import make_tiny_hf_model

    make_tiny_hf_model("llama", tmp_path, tie_word_embeddings=True)
    cfg, params, _ = load_model(tmp_path, np.float32)
    ids = jnp.asarray(np.arange(12).reshape(2, 6) * 7 % cfg.vocab_size, jnp.int32)

    def loss(embed):
        return jnp.sum(jax.nn.log_softmax(dense_forward({**params, "embed": embed}, ids, cfg=cfg))[..., 5])

    assert "jaxllm_" not in jax.jit(loss).lower(params["embed"]).compile().as_text()
    grad = np.asarray(jax.grad(loss)(params["embed"]))
    step = np.zeros(params["embed"].shape, np.float32)
    step[7, 3] = 1e-2
    numeric = (loss(params["embed"] + step) - loss(params["embed"] - step)) / 2e-2
    np.testing.assert_allclose(grad[7, 3], numeric, rtol=2e-2, atol=1e-3)


def _step(tmp_path, dtype, num_tokens):
    """A tiny llama's forward over one row of ``num_tokens`` new tokens: (params, kv cache, batch, cfg)."""
    from jaxllm.loader import load_model
    from jaxllm.worker.step_batch import StepBatch
    from tests.hf_models import make_tiny_hf_model

    if not (tmp_path / "config.json").exists():
        make_tiny_hf_model("llama", tmp_path, num_hidden_layers=3)
    cfg, params, _ = load_model(tmp_path, dtype)
    blocks = -(-num_tokens // 4)
    cache = jnp.zeros((cfg.num_layers, blocks + 2, 4, cfg.num_kv_heads, cfg.head_dim), dtype)
    t = num_tokens
    batch = StepBatch(input_ids=jnp.arange(3, 3 + t) % cfg.vocab_size, positions=jnp.arange(t),
                      slot_mapping=jnp.arange(4, 4 + t), block_tables=jnp.arange(1, blocks + 1)[None],
                      seq_lens=jnp.asarray([t]), query_start_loc=jnp.asarray([0, t]),
                      logits_indices=jnp.asarray([t - 1]), prev_token_index=jnp.full(t, -1),
                      prompt_target_ids=jnp.full(t, -1), num_spec_tokens=jnp.zeros(1, jnp.int32),
                      num_seqs=jnp.int32(1))
    return params, (cache, cache), batch, cfg


def _logits(params, kv, batch, cfg):
    from jaxllm.models import forward
    from kernels_pallas.ops import get_attention_ops

    jax.clear_caches()  # forward's trace from before a patch would be reused
    run = jax.jit(forward, static_argnames=("cfg", "ops", "all_logits"))
    ops = get_attention_ops("xla")
    hlo = run.lower(params, kv, batch, cfg=cfg, ops=ops).compile().as_text()
    return np.asarray(run(params, kv, batch, cfg=cfg, ops=ops)[0], np.float32), hlo


def test_decode_steps_read_the_stacked_weights_in_place_with_the_same_logits(tmp_path, monkeypatch):
    from jaxllm.models import common

    for num_tokens in (5, 80):  # a decode-sized step and a prefill-sized one
        step = _step(tmp_path, np.float32, num_tokens)
        native_logits, hlo = _logits(*step)
        # The layer loop's body calls it once per projection (q, k, v, o, gate, up, down) of the one layer traced.
        assert hlo.count('custom_call_target="jaxllm_matmul_cpu"') == 7
        with monkeypatch.context() as patch:
            patch.setattr(ops, "PROJECTION_MAX_ROWS", NO_MATMUL_ROWS)  # every projection through XLA's dots
            xla_logits, hlo = _logits(*step)
        assert "jaxllm_matmul_cpu" not in hlo
        # Both float32, summed in different orders: within the 1e-4 the project holds float32 logits to against HF.
        np.testing.assert_allclose(native_logits, xla_logits, atol=1e-4, rtol=0, err_msg=f"{num_tokens} tokens")


@pytest.mark.skipif("avx512_bf16" not in cpu_features.cpu_flags(),
                    reason="the bfloat16 kernel is used only with AVX-512-BF16")
def test_bfloat16_steps_read_the_stacked_weights_in_place_as_close_to_float32_as_xlas_dots(tmp_path, monkeypatch):
    from jaxllm.models import common

    # A decode step, and a prefill of several tiles of rows (the row limit lifted for it, with AMX or without).
    monkeypatch.setitem(ops.PROJECTION_MAX_ROWS, "bfloat16", ((frozenset(), 40),))
    for num_tokens in (3, 40):
        exact, _ = _logits(*_step(tmp_path, np.float32, num_tokens))
        step = _step(tmp_path, jnp.bfloat16, num_tokens)
        native_logits, hlo = _logits(*step)
        assert hlo.count('custom_call_target="jaxllm_matmul_bf16_cpu"') == 7
        # The engine's layer weights as uint16 bits (loop_storage): the same calls, the same logits.
        stored_logits, hlo = _logits(common.loop_storage(step[0]), *step[1:])
        assert hlo.count('custom_call_target="jaxllm_matmul_bf16_cpu"') == 7
        np.testing.assert_array_equal(stored_logits, native_logits)
        with monkeypatch.context() as patch:
            patch.setattr(ops, "PROJECTION_MAX_ROWS", NO_MATMUL_ROWS)
            xla_logits, hlo = _logits(*step)
        assert "jaxllm_matmul_bf16_cpu" not in hlo
        # Both round every projection's output to bfloat16 (sums in different orders): the kernel's distance to the
        # float32 logits is within a quarter more than XLA's own, plus one bfloat16 step of a logit.
        native_err, xla_err = (float(np.abs(got - exact).max()) for got in (native_logits, xla_logits))
        scale = float(np.abs(exact).max())
        assert native_err <= 1.25 * xla_err + scale * 2 ** -8, (num_tokens, native_err, xla_err, scale)


def test_the_vector_flags_are_read_from_the_first_cpu(tmp_path):
    # The flags of an AMD EPYC (AVX-512-BF16, no AMX), an Intel Xeon (both) and an AVX2 CPU whose near-miss names
    # are no flags: a flag's name is matched whole.
    amd, intel, neither = (tmp_path / name for name in ("amd", "intel", "neither"))
    amd.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    intel.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    neither.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512fx avx512_bf16x amx_bf16x\n")
    flags = [cpu_features.cpu_flags(p) for p in (amd, intel, neither)]
    assert ["avx512_bf16" in f for f in flags] == [True, True, False]
    assert ["amx_bf16" in f for f in flags] == [False, True, False]
    assert ["avx512f" in f for f in flags] == [True, True, False]
    assert cpu_features.cpu_flags(tmp_path / "missing") == frozenset()


def test_bfloat16_weights_without_avx512_bf16_and_steps_past_the_row_limit_keep_xlas_dots(tmp_path, monkeypatch):
    def cpu_with(*names):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(names))
        return frozenset(names)

    assert ops.projection_max_rows(jnp.bfloat16, cpu_with("avx2", "avx512f")) == 0
    _, hlo = _logits(*_step(tmp_path, jnp.bfloat16, 5))
    assert "jaxllm_matmul" not in hlo.replace("jaxllm_matmul_nt_cpu", "")
    wq = _step(tmp_path, np.float32, 5)[0]["layers"]["wq"]
    for stored in (wq.astype(jnp.bfloat16), to_storage(wq.astype(jnp.bfloat16), jnp.uint16)):
        assert ops.matmul_backend(jnp.zeros((1, 64)), stored) == "xla"
    # AVX-512-BF16: 4 rows where XLA's dots have AMX tiles, 128 without (the table's measurements).
    for amx, bf16_limit in ((True, 4), (False, 128)):
        flags = cpu_with("avx2", "avx512f", "avx512_bf16", *(("amx_bf16",) if amx else ()))
        assert ops.projection_max_rows(jnp.bfloat16, flags) == bf16_limit
        for stored in (wq.astype(jnp.bfloat16), to_storage(wq.astype(jnp.bfloat16), jnp.uint16)):
            assert ops.matmul_backend(jnp.zeros((bf16_limit, 64)), stored) == "cpu"
            assert ops.matmul_backend(jnp.zeros((bf16_limit + 1, 64)), stored) == "xla"
    # float32: 512 rows with AVX-512, 192 on AVX2 (the table's measurements).
    for avx512, limit in ((True, 512), (False, 192)):
        flags = cpu_with("avx2", *(("avx512f",) if avx512 else ()))
        assert ops.projection_max_rows(jnp.float32, flags) == limit
        assert ops.matmul_backend(jnp.zeros((limit, 64)), wq) == "cpu"
        assert ops.matmul_backend(jnp.zeros((limit + 1, 64)), wq) == "xla"
    assert ops.matmul_backend(jnp.zeros((4, 64)), jnp.zeros((3, 64, 40))) == "xla"  # N not a multiple of 16
