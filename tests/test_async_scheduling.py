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


def test_async_n_greater_than_one_matches_sync(stories_dir):
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=12)
    outs = {}
    for async_scheduling in (False, True):
        llm = LLM(model=stories_dir, precompile=False, async_scheduling=async_scheduling)
        out = llm.generate(["Once upon a time", "One day"], params, use_tqdm=False)
        outs[async_scheduling] = [[c.token_ids for c in o.outputs] for o in out]
        assert llm.engine.scheduler.stats.num_free_blocks == llm.engine.num_blocks - 1
    assert outs[True] == outs[False]
    assert all(len(o) == 3 for o in outs[True])


def test_aborting_then_reusing_a_request_id_under_async_scheduling(stories_dir):
    engine = LLM(model=stories_dir, precompile=False, async_scheduling=True).engine
    engine.add_request("r", "Once upon a time", SamplingParams(temperature=0, max_tokens=20, logprobs=2))
    engine.step()
    engine.step()
    engine.abort_request("r")
    engine.add_request("r", "One day", SamplingParams(temperature=0, max_tokens=4, logprobs=2))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == "r":
                final = out
    assert final is not None and final.prompt == "One day"
    assert len(final.outputs[0].token_ids) == 4 and len(final.outputs[0].logprobs) == 4


@pytest.mark.parametrize("prompt", ["Once upon a time", "One day"])
def test_multi_token_bad_words_under_async_scheduling_match_sync(stories_dir, prompt):
    """A row with multi-token bad words waits for the token in flight (its bans match the last tokens); the
    words are banned and the outputs equal those without async scheduling, with a plain request alongside."""
    params = [SamplingParams(temperature=0, max_tokens=40, bad_words=["was a", "a big"]),
              SamplingParams(temperature=0, max_tokens=40)]
    outs = {}
    for async_scheduling in (False, True):
        llm = LLM(model=stories_dir, precompile=False, async_scheduling=async_scheduling)
        res = llm.generate([prompt, prompt], params, use_tqdm=False)
        outs[async_scheduling] = [o.outputs[0].text for o in res]
        assert llm.engine.scheduler.stats.num_free_blocks == llm.engine.num_blocks - 1
    assert outs[True] == outs[False]
    banned, plain = outs[True]
    assert "a big" in plain  # the words would come without the ban
    assert "was a" not in banned and "a big" not in banned and banned != plain


def test_async_scheduling_is_on_by_default_unless_speculating():
    from jaxllm.config import EngineConfig

    assert EngineConfig().async_scheduling is True
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).async_scheduling is False
    assert EngineConfig(async_scheduling=False).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling='yes'"):
        EngineConfig(async_scheduling="yes")


@pytest.mark.parametrize("budget", [64, 8], ids=["whole-prompt", "chunked"])
@pytest.mark.parametrize("prompt_len", [8, 12, 15, 16])
def test_a_tight_kv_pool_preempts_no_more_under_async_than_sync(stories_dir, prompt_len, budget):
    """Two requests that cannot both finish in 3 usable blocks: under async scheduling the one admitted beside
    a running request takes the slot of its first decode token, and once preempted comes back only when its
    remaining prompt and that slot fit, so it is not preempted again before its sample lands and readmitted to
    recompute, step after step; with the prompt whole or in chunks of 8. Regression: a 16-token prompt (a whole
    block) gave 8 preemptions under async against 1 without it (4 against 1 in chunks)."""
    prompts = [[3 + (i * 7) % 400 for i in range(prompt_len)], [50 + (i * 7) % 400 for i in range(prompt_len)]]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(model=stories_dir, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=budget, num_kv_blocks=4,
                  precompile=False, async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[async_scheduling] = ([o.outputs[0].token_ids for o in outs], llm.engine.scheduler.num_preemptions)
        assert llm.engine.scheduler.stats.num_free_blocks == llm.engine.num_blocks - 1
    assert runs[True][0] == runs[False][0]
    assert all(len(tokens) == 20 for tokens in runs[True][0])
    assert runs[False][1] >= 1  # the pool is tight: sync scheduling preempts too
    assert runs[True][1] <= runs[False][1]


@pytest.mark.parametrize("prompt_len", [16, 17, 18])
def test_n_greater_than_one_beside_a_running_request_matches_sync(stories_dir, prompt_len):
    """A prefill parent admitted beside a running request: under async scheduling it reserves no decode slot
    (it never decodes), and forked children share only blocks holding computed tokens. Regression: with a
    17-token prompt (the parent computes 16 tokens, two whole blocks of 8) the three children shared a reserved
    block and two of them differed from sync."""
    prompt = [1] + [(i * 37) % 400 + 3 for i in range(prompt_len - 1)]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)]
    outs = {}
    for async_scheduling in (False, True):
        llm = LLM(model=stories_dir, precompile=False, block_size=8, async_scheduling=async_scheduling)
        res = llm.generate([[1, 5, 6, 7], prompt], params, use_tqdm=False)
        outs[async_scheduling] = [[c.token_ids for c in o.outputs] for o in res]
        assert llm.engine.scheduler.stats.num_free_blocks == llm.engine.num_blocks - 1
    assert outs[True] == outs[False]
    assert len({tuple(t) for t in outs[True][1]}) == 3


def test_serve_flags_turn_async_scheduling_on_and_off():
    import argparse

    from jaxllm.entrypoints.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert [engine_kwargs(parser.parse_args(flags))["async_scheduling"]
            for flags in ([], ["--async-scheduling"], ["--no-async-scheduling"])] == [None, True, False]
