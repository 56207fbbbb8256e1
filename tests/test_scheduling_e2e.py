"""The scheduler wired into the engine: preemption and prefix caching never change outputs."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from tests.helpers import assert_same_or_near_tie

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(n: int = 48) -> list[list[int]]:
    """``n`` prompts over 4 shared prefixes of 20-40 tokens, each with its own tail."""
    rng = np.random.default_rng(7)
    prefixes = [[1] + rng.integers(3, 512, size=int(rng.integers(20, 40))).tolist() for _ in range(4)]
    return [prefixes[i % 4] + rng.integers(3, 512, size=int(rng.integers(1, 12))).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def alone(stories_dir):
    llm = LLM(model=stories_dir, max_num_seqs=1, max_model_len=128, precompile=False,
              enable_prefix_caching=False)
    return llm, [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in _prompts()]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_48_requests_under_preemption_and_prefix_hits_match_alone(stories_dir, alone, preemption_mode):
    reference_llm, expected = alone
    llm = LLM(model=stories_dir, max_num_seqs=16, max_num_batched_tokens=128, max_model_len=128, block_size=8,
              num_kv_blocks=40, preemption_mode=preemption_mode, num_host_blocks=256, precompile=False)
    prompts = _prompts()
    outs = llm.generate(prompts, PARAMS)
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == llm.engine.num_blocks - 1
    for prompt, exp, out in zip(prompts, expected, outs):
        assert_same_or_near_tie(reference_llm, prompt, exp, out.outputs[0].token_ids)


def test_priority_argument_reaches_the_scheduler(stories_dir):
    llm = LLM(model=stories_dir, max_num_seqs=1, max_model_len=128, precompile=False, scheduling_policy="priority")
    prompts = [[1, 403, 407], [1, 403, 407, 261]]
    llm.engine.add_request("low", prompts[0], SamplingParams(temperature=0, max_tokens=4), priority=5)
    llm.engine.add_request("high", prompts[1], SamplingParams(temperature=0, max_tokens=4), priority=0)
    first_finished = next(o.request_id for _ in range(50) for o in llm.engine.step() if o.finished)
    assert first_finished == "high"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), priority=[3, 1])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
