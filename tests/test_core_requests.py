"""The engine core's per-request records: once every request has ended, whatever way it ended, nothing of it is
left in the core (no record, no sampling slot, no grammar, no sequence object kept alive)."""

from __future__ import annotations

import gc
import time

import pytest

from jaxllm import LLM, SamplingParams, StructuredOutputsParams
from jaxllm.core.messages import EngineCoreRequest
from jaxllm.core.requests import CoreSequence

MAX_NUM_SEQS = 4


@pytest.fixture(params=[True, False], ids=["async", "sync"])
def engine(stories_dir, request):
    # A small pool: 11 blocks of 8 tokens for 4 seats (no back-off), so the long requests preempt one another.
    return LLM(model=stories_dir, precompile=False, max_num_seqs=MAX_NUM_SEQS, block_size=8, num_kv_blocks=12,
               max_model_len=80, max_num_batched_tokens=64, graceful_degradation=False,
               async_scheduling=request.param).engine


def _live_sequences() -> list[CoreSequence]:
    return [o for o in gc.get_objects() if isinstance(o, CoreSequence)]


def test_every_way_a_request_ends_leaves_nothing_of_it_in_the_core(engine):
    core = engine.core
    gc.collect()
    gc.disable()  # what is left must be freed by reference counting alone
    try:
        engine.add_request("fork", "Once upon a time", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=24,
                                                                     logprobs=1, prompt_logprobs=1))
        engine.add_request("stop", "One day", SamplingParams(temperature=0, max_tokens=60, stop=["."]))
        engine.add_request("bad-words", "Lily", SamplingParams(temperature=0, max_tokens=30,
                                                              bad_words=["was a", "a big"]))
        engine.add_request("long", "The cat", SamplingParams(temperature=0, max_tokens=70, ignore_eos=True))
        engine.add_request("choice", "Is the sky blue?", SamplingParams(
            max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
        engine.add_request("aborted", "Once upon", SamplingParams(temperature=0, max_tokens=70, ignore_eos=True))
        # Past the front end's checks, a grammar that fails to compile in the core (it is aborted there).
        core.add_request(EngineCoreRequest("bad-grammar", [5, 6, 7], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="[a-")), [0], [2], [], 2, 0.0))
        for _ in range(3):
            engine.step()
        engine.abort_request("aborted")  # with a step in flight under async scheduling
        deadline = time.monotonic() + 120
        while engine.has_unfinished_requests() or core.requests:
            engine.step()
            assert time.monotonic() < deadline
        assert core.scheduler.stats.num_preemptions > 0
        assert core.requests == {}
        assert core._num_unscheduled == 0 and core._num_prompt_trackers == 0
        assert len(core.slots._free) == MAX_NUM_SEQS and core.slots._num_multi_word == 0
        assert core.structured.num_sequences == 0
        assert core.scheduler.block_pool.num_free_blocks == core.num_blocks - 1
        assert _live_sequences() == []
    finally:
        gc.enable()
