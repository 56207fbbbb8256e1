"""Async scheduling (step N+1 scheduled while step N runs) changes no output."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams


def _workload():
    rng = np.random.default_rng(11)
    prompts = [[1] + rng.integers(3, 512, size=int(rng.integers(1, 60))).tolist() for _ in range(32)]
    params = []
    for i in range(32):
        max_tokens = int(rng.integers(1, 40))
        if i % 4 == 3:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=max_tokens))
        elif i % 4 == 2:
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[13]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens))
    return prompts, params


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_async_scheduling_gives_the_same_outputs_on_32_mixed_requests(stories_dir, preemption_mode):
    prompts, params = _workload()
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(model=stories_dir, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=8,
                  num_kv_blocks=30, preemption_mode=preemption_mode, num_host_blocks=128, precompile=False,
                  async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params)
        results[async_scheduling] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        assert llm.engine.scheduler.stats.num_preemptions > 0
        assert llm.engine.scheduler.stats.num_free_blocks == llm.engine.num_blocks - 1
    assert results[True] == results[False]
    assert any(reason == "stop" for _, reason in results[True])


def test_async_engine_returns_outputs_one_step_behind(stories_dir):
    llm = LLM(model=stories_dir, precompile=False, async_scheduling=True)
    llm.engine.add_request("a", "Once upon a time", SamplingParams(temperature=0, max_tokens=3))
    assert llm.engine.step() == []
    steps = 1
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps += 1
    assert steps == 4
