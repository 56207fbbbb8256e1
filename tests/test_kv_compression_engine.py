"""KV compression in the engine (``kv_cache_compression``), on the stories260K fixture.

Four greedy requests outgrow a small cache mid-decode (with and without async scheduling): the scheduler compresses
full blocks instead of preempting. The request that opted out and the one of high priority must generate exactly
the tokens of an engine with a cache large enough for everything (their KV is never compressed, and a row's output
does not depend on the rest of the batch); compression must have fired with no preemption and no compile after
warm-up; all blocks of both pools come back. The compressed requests' quality cost is measured by ``scripts/bench_kv_compression.py``, not asserted here.
"""

from __future__ import annotations

import pytest

from jaxllm import SamplingParams
from jaxllm.config import EngineConfig
from jaxllm.entrypoints.diag import summarize
from jaxllm.frontend.llm_engine import LLMEngine

MAX_MODEL_LEN = 96
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN, block_size=8,
              token_buckets=[8, 64], precompile=True, async_scheduling=False, scheduling_policy="priority")
PROMPTS = {"opted-out": list(range(5, 21)), "high-priority": list(range(40, 56)), "a": list(range(80, 96)),
           "b": list(range(120, 136))}
# The protected requests are short (4 blocks of KV each), the others long (11 each, 22 blocks: more than the 19 usable
# blocks of a cache of the whole budget).
MAX_TOKENS = {"opted-out": 16, "high-priority": 16, "a": 72, "b": 72}


def _serve(engine: LLMEngine) -> dict[str, list[int]]:
    for rid, prompt in PROMPTS.items():
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[rid], ignore_eos=True,
                                allow_kv_compression=rid != "opted-out")
        engine.add_request(rid, prompt, params, priority=-1 if rid == "high-priority" else 0)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens


@pytest.fixture(scope="module")
def uncompressed(stories_dir):
    return _serve(LLMEngine(stories_dir, num_kv_blocks=64, **ENGINE))


@pytest.mark.parametrize("kind, async_scheduling", [("int8", False), ("fp8", False), ("int8", True)])
def test_compression_replaces_preemption_and_leaves_protected_requests_exact(stories_dir, uncompressed, kind,
                                                                             async_scheduling):
    # A budget of 20 float32 blocks of 10240 bytes: two thirds make 13 device blocks (12 usable), one third 25
    # compressed blocks of 2720 bytes (one byte a number, and 5 layers x 4 heads x 2 float32 scales).
    engine = LLMEngine(stories_dir, num_kv_blocks=20, kv_cache_compression=kind,
                       kv_cache_compression_fraction=1 / 3, **{**ENGINE, "async_scheduling": async_scheduling})
    pool = engine.runner.cache_engine.scaled_pool
    assert (engine.num_blocks, pool.k.shape[1]) == (13, 25)
    assert pool.k.dtype.itemsize == 1 and pool.k_scale.shape == (5, 25, 4)
    # The steps, block copy, slot fill and slot rows, and the compress program.
    compiled = engine.runner.compile_stats.num_compilations
    assert compiled == len(engine.buckets) + 4
    tokens = _serve(engine)
    stats = engine.scheduler.stats
    assert (stats.num_preemptions, stats.num_blocks_pooled) == (0, 10)
    assert tokens["opted-out"] == uncompressed["opted-out"]
    assert tokens["high-priority"] == uncompressed["high-priority"]
    assert all(len(tokens[rid]) == MAX_TOKENS[rid] for rid in PROMPTS)
    assert engine.runner.compile_stats.num_compilations == compiled
    assert stats.num_free_blocks == engine.num_blocks - 1 and stats.num_pool_in_use == 0
    metric = engine.metrics.registry.get_sample_value
    assert metric("jaxllm:kv_blocks_pooled_total") == 10
    assert metric("jaxllm:kv_pool_usage_perc") == 0.0
    report = engine.kv_cache_report(block_map=False)
    assert report["scaled_pool"] == {
        "num_blocks": 24, "num_used_blocks": 0, "num_free_blocks": 24, "num_blocks_pooled": 10}
    assert "scaled pool: 24 blocks: 0 used, 24 free; 10 taken so far" in summarize(report)


def test_sleep_frees_the_compressed_pool_and_wake_up_brings_it_back(stories_dir, uncompressed):
    import jax

    engine = LLMEngine(stories_dir, num_kv_blocks=20, kv_cache_compression="int8", kv_cache_compression_fraction=1 / 3,
                       enable_sleep_mode=True, **ENGINE)
    runner = engine.runner
    pool_bytes = sum(a.nbytes for a in runner.cache_engine.scaled_pool)
    kv_bytes = sum(c.nbytes for c in runner.cache_engine.kv_cache)
    assert pool_bytes == 2 * 5 * 25 * 8 * 4 * 8 + 2 * 5 * 25 * 4 * 4  # int8 K, V and float32 scales
    compiled = runner.compile_stats.num_compilations
    _serve(engine)
    report = engine.sleep(level=1)[0]
    assert report["freed_bytes"] >= kv_bytes + pool_bytes
    assert not isinstance(runner.cache_engine.scaled_pool.k, jax.Array)
    engine.wake_up()
    assert isinstance(runner.cache_engine.scaled_pool.k, jax.Array)
    tokens = _serve(engine)
    assert tokens["opted-out"] == uncompressed["opted-out"] and tokens["high-priority"] == uncompressed["high-priority"]
    assert engine.scheduler.stats.num_blocks_pooled == 20  # 10 in each of the two runs
    assert runner.compile_stats.num_compilations == compiled


def test_the_same_budget_without_compression_preempts(stories_dir, uncompressed):
    engine = LLMEngine(stories_dir, num_kv_blocks=20, **ENGINE)
    tokens = _serve(engine)
    assert engine.scheduler.stats.num_preemptions > 0
    assert tokens == uncompressed


@pytest.mark.parametrize("settings, message", [
    (dict(kv_cache_compression="int4"), r"kv_cache_compression='int4' must be None or one of \('int8', 'fp8'\)"),
    (dict(kv_cache_compression="int8", kv_cache_compression_fraction=1.0),
     "kv_cache_compression_fraction=1.0 must be a number in"),
    (dict(kv_cache_compression="int8", kv_cache_dtype="fp8"), "kv_cache_compression='int8' cannot be used with "
                                                              "kv_cache_dtype='fp8'"),
    (dict(kv_cache_compression="fp8", speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "cannot be used with speculative_config"),
    (dict(kv_cache_compression="int8", preemption_mode="swap", num_host_blocks=4), "preemption_mode='swap'"),
    (dict(kv_cache_compression="int8", kv_offloading_size=0.01), "kv_offloading_size=0.01"),
    (dict(kv_cache_compression="int8", tensor_parallel_size=2), "tensor_parallel_size=2"),
    (dict(kv_cache_compression="int8", batching="static"), "batching='static'"),
    (dict(kv_cache_compression="int8", attention_backend="pallas"), "attention_backend='pallas'"),
])
def test_combinations_compression_does_not_support_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_a_fraction_too_small_for_two_compressed_blocks_is_refused(stories_dir):
    with pytest.raises(ValueError, match="kv_cache_compression_fraction=0.01 of a .* holds 0 compressed blocks"):
        LLMEngine(stories_dir, num_kv_blocks=20, kv_cache_compression="int8", kv_cache_compression_fraction=0.01,
                  **ENGINE)


def test_cli_flags_reach_the_config():
    import argparse

    from jaxllm.entrypoints.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-cache-compression", "fp8", "--kv-cache-compression-fraction", "0.25"])
    config = EngineConfig(**engine_kwargs(args))
    assert (config.kv_cache_compression, config.kv_cache_compression_fraction) == ("fp8", 0.25)
