"""The C++ CPU matmul (``kernels_pallas.native.stacked_matmul_cpu``) against numpy, and how the layer scan uses it.

The class of inputs: any ``x [M, K] @ w[layer]`` of a stacked ``w [L, K, N]`` -- row counts that fill whole
register tiles of rows and leave every remainder, inner dims of one element and more, column counts of one to
four vectors per panel and several panels, any layer of the stack. Around it: its errors, and the model step,
which reads every float32 projection through it (no per-layer slice of the weights) up to
``NATIVE_MATMUL_MAX_ROWS`` tokens, with the same logits, while bfloat16 weights and larger steps keep XLA's dots.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import native

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernel cannot be built here")


def test_stacked_matmul_matches_numpy_on_every_tile_shape():
    # Rows 1-13, 48 and 64 cover whole tiles of 6 (AVX-512) and 3 (AVX2) rows and every remainder; N = 16 .. 208
    # gives panels of 1-4 vectors of 8 or 16 columns and more than one panel; K = 1 and 7 leave no vector of K.
    rng = np.random.default_rng(0)
    for k_dim, n in [(1, 16), (7, 48), (64, 80), (576, 192), (33, 208)]:
        stack = rng.standard_normal((3, k_dim, n)).astype(np.float32)
        w = jnp.asarray(stack)
        for m in [*range(1, 14), 48, 64, 97]:
            x = rng.standard_normal((m, k_dim)).astype(np.float32)
            layer = m % 3
            got = np.asarray(native.stacked_matmul_cpu(jnp.asarray(x), w, jnp.int32(layer)))
            want = x.astype(np.float64) @ stack[layer].astype(np.float64)
            assert got.dtype == np.float32 and got.shape == (m, n)
            # float32 sums of K products of unit normals: error ~ sqrt(K) * 2^-24 * |terms|.
            np.testing.assert_allclose(got, want, atol=2e-6 * k_dim, rtol=0, err_msg=f"M={m} K={k_dim} N={n}")


def test_stacked_matmul_refuses_weights_it_does_not_take_and_a_layer_past_the_stack():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"w float32 \(2, 8, 40\); expected .* N a multiple of 16"):
        native.stacked_matmul_cpu(x, jnp.ones((2, 8, 40), jnp.float32), 0)
    with pytest.raises(ValueError, match=r"x \(2, 8\), w float32 \(2, 9, 16\)"):
        native.stacked_matmul_cpu(x, jnp.ones((2, 9, 16), jnp.float32), 0)
    for dtype in (jnp.bfloat16, jnp.int8):
        with pytest.raises(ValueError, match=rf"w {jnp.dtype(dtype).name} \(2, 8, 16\); expected .* float32 w"):
            native.stacked_matmul_cpu(x, jnp.ones((2, 8, 16), dtype), 0)
    with pytest.raises(Exception, match=r"matmul_cpu: layer 2 outside \[0, 2\)"):
        jax.block_until_ready(native.stacked_matmul_cpu(x, jnp.ones((2, 8, 16), jnp.float32), jnp.int32(2)))
    with pytest.raises(Exception, match=r"matmul_cpu: layer -1 outside \[0, 2\)"):
        jax.block_until_ready(native.stacked_matmul_cpu(x, jnp.ones((2, 8, 16), jnp.float32), jnp.int32(-1)))


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
    from kernels_pallas import get_attention_ops

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
            patch.setattr(common, "NATIVE_MATMUL_MAX_ROWS", 0)  # every projection through XLA's dots
            xla_logits, hlo = _logits(*step)
        assert "jaxllm_matmul_cpu" not in hlo
        # Both float32, summed in different orders: within the 1e-4 the project holds float32 logits to against HF.
        np.testing.assert_allclose(native_logits, xla_logits, atol=1e-4, rtol=0, err_msg=f"{num_tokens} tokens")


def test_bfloat16_weights_and_steps_past_the_row_limit_keep_xlas_dots(tmp_path):
    from jaxllm.models import common

    _, hlo = _logits(*_step(tmp_path, jnp.bfloat16, 5))
    assert "jaxllm_matmul_cpu" not in hlo
    wq = _step(tmp_path, np.float32, 5)[0]["layers"]["wq"]
    limit = common.NATIVE_MATMUL_MAX_ROWS
    assert common.native_matmul_applies(jnp.zeros((limit, 64)), wq)
    assert not common.native_matmul_applies(jnp.zeros((limit + 1, 64)), wq)
    assert not common.native_matmul_applies(jnp.zeros((4, 64)), jnp.zeros((3, 64, 40)))  # N not a multiple of 16
    assert not common.native_matmul_applies(jnp.zeros((4, 64)), wq.astype(jnp.bfloat16))
