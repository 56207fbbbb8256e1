"""Tensor parallelism on 8 CPU devices: same tokens at every degree, every weight where its rule puts it."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxllm import LLM
from jaxllm.loader import load_model
from jaxllm.worker.sharding import PARAM_AXES
from tests.multidevice.conftest import ENGINE, GREEDY, prompts


# Cached: a model's TP 1 reference is built once (the Pallas test compares with the first test's).
@functools.cache
def _greedy_tokens(folder, tp, **kwargs):
    llm = LLM(model=folder, tensor_parallel_size=tp, **ENGINE, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(6), GREEDY)]


def test_tp_1_2_4_give_identical_greedy_tokens_with_4_kv_heads(kv4_dir):
    one = _greedy_tokens(kv4_dir, 1)
    assert _greedy_tokens(kv4_dir, 2) == one
    assert _greedy_tokens(kv4_dir, 4) == one


def test_tp_4_with_2_kv_heads_replicates_them_and_gives_tp_1_tokens(kv2_dir):
    assert _greedy_tokens(kv2_dir, 4) == _greedy_tokens(kv2_dir, 1)


def test_moe_experts_split_over_their_ffn_dim_give_tp_1_tokens(moe_dir):
    llm = LLM(model=moe_dir, tensor_parallel_size=4, **ENGINE)
    gate = llm.engine.runner.weights.params["layers"]["experts_gate"]  # [L, experts, hidden, moe ffn]
    assert {s.data.shape for s in gate.addressable_shards} == {gate.shape[:3] + (gate.shape[3] // 4,)}
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(6), GREEDY)] == _greedy_tokens(moe_dir, 1)


def test_pallas_kernels_under_shard_map_give_reference_tokens(kv4_dir):
    assert _greedy_tokens(kv4_dir, 2, attention_backend="pallas", interpret=True) == _greedy_tokens(kv4_dir, 1)


def _expected_spec(key, shape, tp, kv_replicated, stacked):
    rules = {"vocab": "model", "heads": "model", "mlp": "model", "kv_heads": None if kv_replicated else "model"}
    axes = ((None,) if stacked else ()) + PARAM_AXES[key]  # layer leaves lead with the layer axis
    return P(*[rules.get(axis) if rules.get(axis) and size % tp == 0 else None
               for axis, size in zip(axes, shape)])


@pytest.mark.parametrize("model, kv_replicated", [("kv4", False), ("kv2", True)])
def test_each_weight_follows_its_rule_and_each_device_holds_only_its_slice(request, model, kv_replicated):
    folder = request.getfixturevalue(f"{model}_dir")
    tp = 4
    llm = LLM(model=folder, tensor_parallel_size=tp, **ENGINE)
    _, host, _ = load_model(folder, np.float32)
    device = llm.engine.runner.weights.params
    flat_host = jax.tree_util.tree_leaves_with_path(host)
    flat_device = jax.tree_util.tree_leaves(device)
    assert len(flat_host) == len(flat_device)
    for (path, want), array in zip(flat_host, flat_device):
        key = path[-1].key
        spec = _expected_spec(key, want.shape, tp, kv_replicated, stacked=path[0].key == "layers")
        assert array.sharding.spec == spec, (key, array.sharding.spec, spec)
        assert len(array.addressable_shards) == tp
        split = [d for d, axis in enumerate(spec) if axis is not None]
        for shard in array.addressable_shards:
            expect_shape = tuple(n // tp if d in split else n for d, n in enumerate(want.shape))
            assert shard.data.shape == expect_shape, (key, shard.data.shape)
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


@pytest.mark.parametrize("model, kv_heads", [("kv4", 4), ("kv2", 2)])
def test_kv_cache_gives_each_device_the_kv_heads_its_q_heads_read(request, model, kv_heads):
    folder = request.getfixturevalue(f"{model}_dir")
    tp = 4
    engine = LLM(model=folder, tensor_parallel_size=tp, **ENGINE).engine
    k_cache = engine.runner.cache_engine.kv_cache[0]
    assert k_cache.shape[3] == max(kv_heads, tp)
    assert k_cache.sharding.spec == P(None, None, None, "model", None)
    assert {s.data.shape[3] for s in k_cache.addressable_shards} == {max(kv_heads, tp) // tp}


def test_quantized_weights_and_kv_cache_split_their_scales_and_give_tp_1_tokens(kv2_dir):
    # Weight scales split with their output channels; the KV scales with the cache heads, here with
    # 2 KV heads replicated over 4 devices (one cache head per device). The rule table for every
    # scale is tests/test_quantization.py's; this runs it.
    folder = kv2_dir
    quant = dict(quantization="int8", kv_cache_dtype="fp8_e4m3")
    llm = LLM(model=folder, tensor_parallel_size=4, **ENGINE, **quant)
    layers = llm.engine.runner.weights.params["layers"]
    expected = {"wq_scale": P(None, "model"), "wk_scale": P(None, None), "wo_scale": P(None, None),
                "w_up_scale": P(None, "model"), "w_down_scale": P(None, None), "k_scale": P(None, "model"),
                "v_scale": P(None, "model")}
    for key, spec in expected.items():
        assert layers[key].sharding.spec == spec, (key, layers[key].sharding.spec)
    assert layers["k_scale"].shape[1] == 4 and {s.data.shape[1] for s in layers["k_scale"].addressable_shards} == {1}
    assert layers["wq"].dtype == np.int8 and layers["wq"].sharding.spec == P(None, None, "model")
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts(6), GREEDY)]
    assert tokens == _greedy_tokens(folder, 1, **quant)
