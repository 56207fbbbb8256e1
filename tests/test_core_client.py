"""The engine-core boundary: messages through msgpack, the data-parallel router, utility calls, and a core process
exiting when its parent dies (stories260K).

A core in another process is exercised end to end by tests/test_openai_server.py (one core behind the server, its
tokens, logprobs, n > 1 and aborts against ``LLM`` in this process) and tests/multidevice/test_data_parallel.py
(two core processes behind one ``LLM``: tokens, routing, aborts).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import pytest

from jaxllm import SamplingParams
from jaxllm.config import EngineConfig
from jaxllm.core.router import PrefixRouter
from jaxllm.core.messages import (
    AbortRequests,
    CoreInfo,
    CoreStats,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SampleLogprobs,
    StopSequences,
    UtilityCall,
    UtilityResult,
    decode_input,
    decode_message,
    encode,
)
from jaxllm.core.process import _call
from tests.server_process import ENGINE, alive


def _info(**overrides) -> CoreInfo:
    values = dict(vocab_size=512, max_model_len=128, eos_token_ids=[2], num_blocks=9, block_size=4, max_num_seqs=8,
                  max_banned_ids=8, enable_prefix_caching=True, device_ids=[0])
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


def test_router_follows_a_pool_resize_dropping_the_least_recently_routed_blocks():
    router = PrefixRouter([_info(), _info()])
    router.record(0, [1, 2, 3, 4, 5, 6, 7, 8, 9], None)
    router.record(0, [20, 21, 22, 23, 24], None)
    router.resize(3)  # two usable blocks: the first prompt's first block goes
    assert router.cached_prefix_tokens(0, [20, 21, 22, 23, 24]) == 4
    assert router.cached_prefix_tokens(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    router.record(1, [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42], None)
    assert router.cached_prefix_tokens(1, [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42]) == 0


def test_a_utility_call_runs_only_utility_methods_and_answers_errors_as_values():
    class Core:
        UTILITY_METHODS = frozenset({"num_free_blocks", "cached_prefix_tokens"})

        def num_free_blocks(self):
            return 7

        def cached_prefix_tokens(self, token_ids):
            raise ValueError(f"bad ids {token_ids}")

        def step(self):
            raise AssertionError("step is not a utility method")

    assert _call(Core(), UtilityCall(1, "num_free_blocks", [])) == UtilityResult(1, 7)
    failed = _call(Core(), UtilityCall(2, "cached_prefix_tokens", [[5]]))
    assert failed == UtilityResult(2, error="ValueError: bad ids [5]", error_type="ValueError")
    refused = _call(Core(), UtilityCall(3, "step", []))
    assert refused.result is None and "'step' is not a utility method" in refused.error
    assert decode_message(encode(refused)) == refused


def test_a_core_process_exits_when_its_parent_dies(stories_dir, tmp_path):
    config = json.dumps(dataclasses.asdict(EngineConfig(**ENGINE)))
    parent = (
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-m', 'jaxllm.core.process', '--model', {str(stories_dir)!r},"
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

