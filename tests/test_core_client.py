"""The engine-core boundary: messages through msgpack, the data-parallel router, core processes (stories260K).

A core in another process gives the tokens the in-process core gives; two core processes on one CPU device serve
one ``LLM``; a core process exits when its parent dies.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.core_client import PrefixRouter
from jaxllm.core_messages import (
    AbortRequests,
    CoreInfo,
    CoreStats,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SampleLogprobs,
    StopSequences,
    decode_input,
    decode_message,
    encode,
)
from tests.server_process import alive

ENGINE = dict(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=8, token_buckets=(16, 64), precompile=False)


def _info(**overrides) -> CoreInfo:
    values = dict(vocab_size=512, max_model_len=128, eos_token_ids=[2], num_blocks=9, block_size=4, max_num_seqs=8,
                  async_scheduling=False, max_banned_ids=8, enable_prefix_caching=True, device_ids=[0])
    return CoreInfo(**{**values, **overrides})


def test_core_messages_survive_msgpack():
    params = SamplingParams(n=2, temperature=0.5, stop=["x"], logit_bias={3: 1.5}, bad_words=["hi"], seed=4)
    request = EngineCoreRequest("r", [1, 2, 3], params, [4, 5], [2], [[7]], 2, 12.5, priority=1, cache_salt="s")
    assert decode_input(encode(request)) == request
    assert decode_input(encode(AbortRequests(["a", "b"]))) == AbortRequests(["a", "b"])
    assert decode_input(encode(StopSequences([("a", 1)]))) == StopSequences([("a", 1)])
    stats = CoreStats(1, 2, 0.5, 3, 9, 10, 12, 5, 4, 0, 2, 1, 6, 48, 0.25, schedule_seconds=0.001,
                      num_scheduled_tokens=17, step_seconds=0.01)
    outputs = EngineCoreOutputs([EngineCoreOutput("r", 1, [9], finish_reason="stop", stop_reason=2,
                                                  new_logprobs=[SampleLogprobs(9, -0.5, 1, [9, 8], [-0.5, -1.0])],
                                                  first_scheduled_time=3.0)], stats, core_index=1)
    assert decode_message(encode(outputs)) == outputs
    assert decode_message(encode(_info())) == _info()


def test_router_prefers_the_longest_cached_prefix_then_the_lowest_load():
    router = PrefixRouter([_info(), _info()])
    shared = list(range(10, 22))  # three full blocks of 4
    router.record(1, shared + [99], None)
    assert router.cached_prefix_tokens(1, shared + [50]) == 12
    assert router.cached_prefix_tokens(0, shared + [50]) == 0
    assert router.choose(shared + [50], None, loads=[0, 5]) == 1  # busier, but it holds the prefix
    assert router.choose([1, 2, 3, 4, 5], None, loads=[3, 2]) == 1  # nothing cached: the lighter one
    assert router.choose([1, 2, 3, 4, 5], None, loads=[2, 2]) == 0
    assert router.choose(shared + [50], "other salt", loads=[0, 5]) == 0  # a salt shares nothing
    # The last prompt token is always computed, as in the scheduler.
    assert router.cached_prefix_tokens(1, shared) == 11


def test_router_forgets_the_least_recently_routed_blocks_past_the_cores_capacity():
    router = PrefixRouter([_info(num_blocks=3)])  # two usable blocks
    router.record(0, [1, 2, 3, 4, 5, 6, 7, 8, 9], None)
    router.record(0, [20, 21, 22, 23, 24], None)
    assert router.cached_prefix_tokens(0, [20, 21, 22, 23, 24]) == 4
    assert router.cached_prefix_tokens(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0  # its first block was dropped


@pytest.fixture(scope="module")
def reference(stories_dir):
    return LLM(model=stories_dir, **ENGINE)


def test_two_core_processes_serve_one_llm_with_the_in_process_tokens(stories_dir, reference):
    prompts = ["Once upon a time", "One day", "The cat", "Lily saw", [1, 403, 407], "Tom had a"]
    params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8),
              SamplingParams(temperature=0, max_tokens=20, stop=["."]), SamplingParams(temperature=0, logprobs=2),
              SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1), SamplingParams(temperature=0)]
    want = reference.generate(prompts, params, use_tqdm=False)
    llm = LLM(model=stories_dir, data_parallel_size=2, **ENGINE)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        client = llm.engine.client
        assert client.num_routed == [3, 3]
        assert [client.call_utility(d, "num_free_blocks") for d in (0, 1)] == [client.infos[0].num_blocks - 1] * 2
    finally:
        llm.engine.shutdown()
    for w, g in zip(want, got):
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in g.outputs] == \
               [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in w.outputs]
        assert [[(t, lp.rank) for t, lp in e.items()] for e in g.outputs[0].logprobs or []] == \
               [[(t, lp.rank) for t, lp in e.items()] for e in w.outputs[0].logprobs or []]
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
    assert got[1].outputs[0].text != got[1].outputs[1].text
    assert got[2].outputs[0].stop_reason == "."


def test_abort_in_a_core_process_frees_its_blocks(stories_dir):
    llm = LLM(model=stories_dir, data_parallel_size=2, **ENGINE)
    engine = llm.engine
    try:
        engine.add_request("long", "Once upon a time", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                           data_parallel_rank=1)
        while not any(engine.step()):
            pass
        engine.abort_request("long")
        assert not engine.has_unfinished_requests() and engine.step() == []
        assert engine.client.call_utility(1, "num_free_blocks") == engine.num_blocks - 1
        with pytest.raises(ValueError, match="data_parallel_rank=2"):
            engine.add_request("x", "One day", data_parallel_rank=2)
        with pytest.raises(RuntimeError, match="not a utility method"):
            engine.client.call_utility(0, "step")
    finally:
        engine.shutdown()


def test_a_core_process_exits_when_its_parent_dies(stories_dir, tmp_path):
    from jaxllm.config import EngineConfig
    import dataclasses

    config = json.dumps(dataclasses.asdict(EngineConfig(**ENGINE)))
    parent = (
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-m', 'jaxllm.core_process', '--model', {str(stories_dir)!r},"
        f" '--config', {config!r}, '--input', 'ipc://{tmp_path}/in', '--output', 'ipc://{tmp_path}/out',"
        " '--parent-pid', str(os.getpid())])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert alive(child)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)
