"""The JAX research API under tensor parallelism (8 CPU devices): weights given in memory and updates are placed
by the partition rules, into the shardings the programs were compiled for."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxllm import LLM
from jaxllm.core.messages import flatten
from jaxllm.loader import load_model
from tests.conftest import STORIES
from tests.multidevice.conftest import ENGINE, GREEDY, prompts


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(prompts(4), GREEDY, use_tqdm=False)]


def _scaled(host):
    return {**host, "layers": {**host["layers"], "w_down": host["layers"]["w_down"] * 8.0}}


def test_params_and_updates_are_placed_by_the_partition_rules_with_no_compilation():
    host = load_model(STORIES)[1]
    from_folder = LLM(STORIES, tensor_parallel_size=4, **ENGINE)
    llm = LLM(STORIES, params=_scaled(host), tensor_parallel_size=4, enable_sleep_mode=True, **ENGINE)
    want = {path: a.sharding for path, a in flatten(from_folder.get_params()).items()}
    assert {path: a.sharding for path, a in flatten(llm.get_params()).items()} == want
    assert want["layers/wq"].spec == P(None, None, "model") and len(want["layers/wq"].device_set) == 4
    scaled = _tokens(llm)
    compiled = llm.engine.runner.compile_stats.num_compilations
    llm.update_weights(host)
    assert {path: a.sharding for path, a in flatten(llm.get_params()).items()} == want
    for path, leaf in flatten(llm.get_params()).items():
        np.testing.assert_array_equal(jax.device_get(leaf), flatten(host)[path], err_msg=path)
    assert _tokens(llm) == _tokens(from_folder) != scaled
    llm.sleep(level=2)
    llm.update_weights(_scaled(host))
    llm.wake_up()
    assert _tokens(llm) == scaled
    assert llm.engine.runner.compile_stats.num_compilations == compiled
