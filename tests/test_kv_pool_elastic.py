"""An elastic KV pool (issue 30, item 3) on stories260K in float32: ``LLM.kv_cache_compact()`` and
``LLM.kv_cache_resize()`` in the middle of decoding keep every block and every greedy token, compile nothing
(compaction) or only the programs a new cache shape needs, once (resize), and refuse what does not fit.
"""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from tests.conftest import STORIES, STORIES_SENTENCE

# One step program (16 tokens) and the block-copy program, built at warm-up: the count of programs is fixed then.
ENGINE = dict(max_model_len=128, num_kv_blocks=48, block_size=8, max_num_seqs=4, max_num_batched_tokens=16,
              token_buckets=(16,), precompile=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
# The short one finishes first and leaves a hole below the third one's blocks.
PROMPTS = [STORIES_SENTENCE, "The little dog", "Once upon a time there was a girl"]
PARAMS = [GREEDY, SamplingParams(temperature=0.0, max_tokens=2), GREEDY]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(STORIES, **ENGINE)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _start(llm):
    """The three requests added and stepped until the short one has finished (its blocks freed, the others'
    still decoding); their tokens so far."""
    engine = llm.engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(str(i), prompt, params)
    tokens = {str(i): [] for i in range(len(PROMPTS))}
    while "1" not in _collect(engine.step(), tokens):
        pass
    return tokens


def _collect(outputs, tokens):
    """Add the outputs' tokens to ``tokens``; returns the ids of the requests that finished."""
    finished = set()
    for out in outputs:
        tokens[out.request_id] += out.outputs[0].delta_token_ids
        if out.finished:
            finished.add(out.request_id)
    return finished


def _finish(llm, tokens):
    engine = llm.engine
    while engine.has_unfinished_requests():
        _collect(engine.step(), tokens)
    return [tokens[str(i)] for i in range(len(PROMPTS))]


def _live_ids(llm):
    return [i for i, b in enumerate(llm.kv_cache_report()["blocks"]) if b["state"] in ("used", "cached_free")]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_compaction_in_the_middle_of_decoding_keeps_every_token_and_compiles_nothing(reference, async_scheduling):
    llm = LLM(STORIES, async_scheduling=async_scheduling, **ENGINE)
    tokens = _start(llm)
    runner = llm.engine.runner
    compiled, live = runner.compile_stats.num_compilations, _live_ids(llm)
    assert live != list(range(1, len(live) + 1))  # a hole below a live block
    (report,) = llm.kv_cache_compact()
    assert report["num_moved_blocks"] > 0 and report["num_blocks"] == 48
    assert _live_ids(llm) == list(range(1, len(live) + 1))
    assert _finish(llm, tokens) == reference
    assert runner.compile_stats.num_compilations == compiled
    assert llm.engine.core.num_free_blocks() == 47


def test_shrink_and_grow_in_the_middle_of_decoding_keep_every_token_and_compile_once(reference):
    llm = LLM(STORIES, **ENGINE)
    tokens = _start(llm)
    runner = llm.engine.runner
    before, full = runner.compile_stats.num_compilations, llm.kv_cache_compact()[0]["kv_cache_bytes"]
    (report,) = llm.kv_cache_resize(24)
    assert report["kv_cache_bytes"] * 2 == full  # half the blocks: half the device memory
    # The resize copy, the block copy program and the one step program built so far.
    assert report["num_compilations"] == 3 == runner.compile_stats.num_compilations - before
    assert runner.cache_engine.kv_cache[0].shape[1] == 24 and llm.engine.num_blocks == 24
    assert llm.kv_cache_report()["num_blocks"] == 24 and max(_live_ids(llm)) < 24
    _collect(llm.engine.step(), tokens)
    (report,) = llm.kv_cache_resize(64)
    assert report["num_moved_blocks"] == 0 and runner.cache_engine.kv_cache[1].shape[1] == 64
    compiled = runner.compile_stats.num_compilations
    assert _finish(llm, tokens) == reference
    assert runner.compile_stats.num_compilations == compiled
    assert llm.engine.core.num_free_blocks() == 63


def test_a_shrink_below_the_blocks_in_use_is_refused_naming_both_and_requests_go_on(reference):
    llm = LLM(STORIES, **ENGINE)
    tokens = _start(llm)
    used = llm.kv_cache_report(block_map=False)["num_used_blocks"]
    with pytest.raises(ValueError, match=f"num_blocks=3 is below the {used} blocks in use"):
        llm.kv_cache_resize(3)
    with pytest.raises(ValueError, match="num_blocks=1 must be an int >= 2"):
        llm.kv_cache_resize(1)
    assert llm.engine.runner.cache_engine.kv_cache[0].shape[1] == 48 and llm.engine.num_blocks == 48
    assert _finish(llm, tokens) == reference
    assert llm.engine.core.num_free_blocks() == 47


def test_the_draft_models_cache_is_resized_and_compacted_with_the_targets(reference):
    spec = dict(method="draft_model", model=str(STORIES), num_speculative_tokens=2)
    llm = LLM(STORIES, speculative_config=spec, async_scheduling=False, **ENGINE)
    tokens = _start(llm)
    core = llm.engine.core
    assert llm.kv_cache_compact()[0]["num_moved_blocks"] > 0
    (report,) = llm.kv_cache_resize(20)
    assert core.drafter.cache_engine.kv_cache[0].shape[1] == core.runner.cache_engine.kv_cache[0].shape[1] == 20
    assert report["num_compilations"] == 6  # per runner: the resize copy, the block copy, the step program
    compiled = core.runner.compile_stats.num_compilations + core.drafter.compile_stats.num_compilations
    assert _finish(llm, tokens) == reference
    assert core.runner.compile_stats.num_compilations + core.drafter.compile_stats.num_compilations == compiled
    assert core.stats().spec_num_accepted_tokens > 0


def test_compaction_and_resize_are_refused_while_the_kv_cache_sleeps():
    llm = LLM(STORIES, enable_sleep_mode=True, **ENGINE)
    llm.sleep(1)
    for call in (llm.kv_cache_compact, lambda: llm.kv_cache_resize(32)):
        with pytest.raises(RuntimeError, match="the KV cache sleeps; wake_up"):
            call()
    llm.wake_up()
    assert llm.kv_cache_resize(32)[0]["num_blocks"] == 32


def test_device_block_moves_with_chains_cycles_and_fan_out_act_as_if_every_source_were_read_first():
    """``CacheEngine.move_blocks`` over the warm 16-block copy program: a 20-block cycle (broken through block 0),
    a chain, a block read twice and 11 disjoint moves; each one-copy chunk is padded with its copy repeated, so
    the copy into block 0 is not raced by a (0, 0) pad."""
    import jax
    import numpy as np

    runner = LLM(STORIES, **ENGINE).engine.runner
    compiled = runner.compile_stats.num_compilations
    shape = runner.cache_engine.kv_cache[0].shape
    values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    runner.cache_engine.kv_cache = tuple(jax.device_put(values * (i + 1), c.sharding) for i, c in enumerate(runner.cache_engine.kv_cache))
    cycle = [(i, i % 20 + 1) for i in range(1, 21)]
    chain = [(21, 22), (22, 23), (23, 24), (21, 25)]
    disjoint = [(26 + i, 47 - i) for i in range(0, 11)]
    pairs = cycle + chain + disjoint
    runner.cache_engine.move_blocks(pairs)
    want = values.copy()
    for src, dst in pairs:
        want[:, dst] = values[:, src]
    for i, c in enumerate(runner.cache_engine.kv_cache):
        np.testing.assert_array_equal(np.asarray(c)[:, 1:], want[:, 1:] * (i + 1))
    assert runner.compile_stats.num_compilations == compiled


def test_a_shrink_to_one_block_more_than_in_use_swaps_requests_out_and_in_with_the_rebuilt_programs(reference):
    llm = LLM(STORIES, preemption_mode="swap", num_host_blocks=16, **ENGINE)
    tokens = _start(llm)
    runner = llm.engine.runner
    (report,) = llm.kv_cache_resize(llm.kv_cache_report(block_map=False)["num_used_blocks"] + 1)
    assert report["num_compilations"] == 5  # the resize copy, block copy, swap out (gather), swap in (scatter), step
    compiled = runner.compile_stats.num_compilations
    assert _finish(llm, tokens) == reference
    assert llm.engine.core.stats().num_preemptions > 0 and runner.compile_stats.num_compilations == compiled
