"""The prefix cache's host tier through the engine (stories260K, float32, greedy): a multi-turn chat on a device
pool too small for its histories gives token-for-token the same outputs with the tier as without, while the
tier serves prefixes the device lost, under both preemption modes, chunked prefill, speculative decoding and a
quantized KV cache. The run without the tier is the plain one (recompute, whole prefills, no speculation) for
each cache dtype: greedy tokens do not depend on the schedule, so each tiered configuration must give them."""

from __future__ import annotations

import functools
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineConfig
from scheduler.kv.tier import CopyKind
from tests.conftest import STORIES
from tests.helpers import assert_one_host_line

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# stories260K: 5 layers * (K + V) * 4 heads * 8 dims * 4 bytes * 16 tokens = 20480 bytes a block; 60 blocks.
TIER_GIB = 60 * 20480 / 2**30
# Two token buckets (decode steps, whole prefills): each configuration's engine builds its own step programs, and
# what is checked here does not depend on the padding; the default ladder is tests/test_compilation.py's.
BASE = dict(precompile=False, max_num_seqs=2, max_model_len=160, block_size=16, num_kv_blocks=12,
            max_num_batched_tokens=160, token_buckets=(8, 160), dtype="float32")


def chat(llm: LLM, num_conversations: int = 6, num_turns: int = 3) -> list[list[int]]:
    """Each turn resends every conversation's growing history (a shared system prompt, its own turns); returns
    every output's token ids, turn by turn. Three times as many conversations as seats: the later half's histories
    are evicted from the device while the first half runs."""
    system = [1] + [(7 * i) % 500 + 3 for i in range(20)]
    histories = [system + [400 + c, 401 + c] for c in range(num_conversations)]
    outputs = []
    for turn in range(num_turns):
        outs = llm.generate(histories, GREEDY, use_tqdm=False)
        for c, out in enumerate(outs):
            ids = list(out.outputs[0].token_ids)
            outputs.append(ids)
            histories[c] = histories[c] + ids + [(300 + 11 * turn + 7 * c + j) % 500 + 3 for j in range(10)]
    return outputs


def run(**kw):
    llm = LLM(model=str(STORIES), **{**BASE, **kw})
    outputs = chat(llm)
    return outputs, llm.engine.core.scheduler


@functools.cache
def without_tier(kv_cache_dtype: str = "auto") -> tuple[list[list[int]], int]:
    """The chat's outputs and prefix-cache hits with no tier (recompute preemption, whole prefills, no speculation):
    greedy tokens do not depend on how the steps are scheduled, so every tiered run of a cache dtype must give them."""
    outputs, sched = run(kv_cache_dtype=kv_cache_dtype)
    return outputs, sched.prefix_cache_hits


# The plain configuration (recompute, whole prefills) is the warmed-up engine of
# test_the_tier_gives_the_same_greedy_tokens_and_compiles_nothing_after_warmup, which asserts the same.
@pytest.mark.parametrize("extra", [
    {"preemption_mode": "swap", "num_host_blocks": 8},
    {"max_num_batched_tokens": 32, "long_prefill_token_threshold": 24, "token_buckets": (8, 32)},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}},
    {"kv_cache_dtype": "int8"},
], ids=["swap", "chunked", "ngram", "int8"])
def test_the_tier_serves_lost_prefixes_with_the_same_greedy_tokens(extra):
    without, hits_without = without_tier(extra.get("kv_cache_dtype", "auto"))
    with_tier, sched_on = run(kv_offloading_size=TIER_GIB, **extra)
    assert with_tier == without
    # An int8 cache's blocks take a quarter of the bytes, so the same GiB hold four times as many.
    slots = 240 if extra.get("kv_cache_dtype") == "int8" else 60
    assert sched_on.block_pool.host_tier.num_slots == slots
    assert sched_on.prefix_cache_hits_host > 0
    if set(extra) <= {"kv_cache_dtype"}:  # the same schedule as the run without the tier, plus the tier's hits
        assert sched_on.prefix_cache_hits > hits_without


def test_kv_offloading_size_sizes_the_runner_host_pool_after_the_swap_pool():
    llm = LLM(model=str(STORIES), kv_offloading_size=TIER_GIB, preemption_mode="swap", num_host_blocks=8, **BASE)
    k, v = llm.engine.runner.cache_engine.host_pool
    assert k.shape == v.shape == (5, 8 + 60, 16, 4, 8) and k.dtype == np.float32
    assert llm.engine.core.scheduler.block_pool.host_tier.base == 8


@pytest.mark.parametrize("value", [-1, "1", True])
def test_bad_kv_offloading_size_is_refused_naming_the_value(value):
    with pytest.raises(ValueError, match=f"kv_offloading_size={value!r}"):
        EngineConfig(kv_offloading_size=value)


def test_kv_offloading_size_needs_prefix_caching():
    with pytest.raises(ValueError, match="kv_offloading_size=1 needs enable_prefix_caching"):
        EngineConfig(kv_offloading_size=1, enable_prefix_caching=False)


def test_the_cli_flag_is_vllms_kv_offloading_size_in_gib():
    import argparse

    from jaxllm.entrypoints.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--kv-offloading-size", "0.5"]))["kv_offloading_size"] == 0.5


def test_metrics_and_report_count_hits_by_tier_and_bytes_each_way():
    llm = LLM(model=str(STORIES), **{**BASE, "num_kv_blocks": 6, "max_num_seqs": 1, "kv_offloading_size": TIER_GIB})
    metric = llm.engine.metrics.registry.get_sample_value
    prompt = [1] + [(5 * i) % 500 + 3 for i in range(48)]  # three full blocks and one token
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([prompt], params, use_tqdm=False)
    # Five blocks of other tokens take the whole pool: the prompt's three cached blocks go to the host tier.
    llm.generate([[1] + [(3 * i) % 500 + 7 for i in range(70)]], params, use_tqdm=False)
    assert llm.kv_cache_report()["host_tier"]["num_offloaded_blocks"] == 3
    llm.generate([prompt], params, use_tqdm=False)
    report = llm.kv_cache_report(block_map=False)["host_tier"]
    assert (report["num_blocks"], report["num_loaded_blocks"], report["hit_tokens"]) == (60, 3, 48)
    assert report["num_cached_blocks"] + report["num_free_blocks"] == 60
    assert metric("jaxllm:prefix_cache_hits_by_tier_total", {"tier": "host"}) == 48
    assert metric("jaxllm:prefix_cache_hits_by_tier_total", {"tier": "device"}) == 0
    assert metric("jaxllm:kv_offload_total_bytes_total", {"transfer_type": "CPU_to_GPU"}) == 3 * 20480
    assert metric("jaxllm:kv_offload_total_bytes_total", {"transfer_type": "GPU_to_CPU"}) == (
        report["num_offloaded_blocks"] * 20480)
    assert metric("jaxllm:kv_offload_total_time_total", {"transfer_type": "CPU_to_GPU"}) > 0
    # The offloads' host writes ran after their steps' dispatch; their time is part of the GPU_to_CPU one.
    core = llm.engine.core
    assert 0 < core.offload_write_seconds <= core.offload_seconds[0]
    assert metric("jaxllm:kv_offload_total_time_total", {"transfer_type": "GPU_to_CPU"}) == pytest.approx(
        core.offload_seconds[0])
    assert metric("jaxllm:kv_offload_usage_perc") == report["num_cached_blocks"] / 60


def test_multiturn_bench_runs_every_configuration_with_equal_answers(capsys):
    import sys

    sys.path.insert(0, str(STORIES.parents[2] / "scripts"))
    try:
        import bench_multiturn
    finally:
        sys.path.pop(0)
    # A 16-token budget (chunked prefills of the 160-token histories): each of the three engines builds every step
    # program before its timed run, and the script's default of 256 made eleven buckets of them, not three.
    payload = bench_multiturn.main(["--conversations", "4", "--turns", "3", "--max-num-seqs", "1",
                                    "--kv-offloading-size", "0.001", "--max-num-batched-tokens", "16"])
    assert assert_one_host_line(capsys.readouterr().out) == bench_multiturn.common.host_line(payload["host"])
    off, on = payload["results"]
    assert off["host_hit_tokens"] == 0 and on["host_hit_tokens"] > 0
    assert on["prefill_tokens_computed"] == off["prefill_tokens_computed"] - on["host_hit_tokens"]
    assert off["offloaded_blocks"] == off["offload_seconds_after_dispatch"] == 0 and on["offloaded_blocks"] > 0
    assert on["loaded_blocks"] > 0
    assert payload["answers_equal"]


def test_the_tier_gives_the_same_greedy_tokens_and_compiles_nothing_after_warmup():
    without, hits_without = without_tier()
    llm = LLM(model=str(STORIES), **{**BASE, "precompile": True}, kv_offloading_size=TIER_GIB)
    compiled = llm.engine.runner.compile_stats.num_compilations
    outputs = chat(llm)
    sched = llm.engine.core.scheduler
    tier = sched.block_pool.host_tier
    assert outputs == without
    assert tier.num_loaded > 0 and tier.num_slots == 60
    assert sched.prefix_cache_hits_host > 0
    # The same schedule as the run without the tier, plus the tier's hits.
    assert sched.prefix_cache_hits > hits_without
    assert llm.engine.runner.compile_stats.num_compilations == compiled


def test_a_launch_whose_offload_writes_fail_forgets_them_and_serves_the_same_tokens():
    without, _ = without_tier()
    llm = LLM(model=str(STORIES), kv_offloading_size=TIER_GIB, **BASE)
    core = llm.engine.core
    sched, tier = core.scheduler, core.scheduler.block_pool.host_tier
    step, finish, discard = core.step, core.cache_engines.finish_swap_out, sched.discard_output
    forgotten = []

    def failing_finish(pending):
        if pending and not forgotten:
            raise RuntimeError("injected: the host write failed")
        finish(pending)

    def discard_and_check(output):
        discard(output)
        slots = {slot for _, slot in output.copies(CopyKind.OFFLOAD)}
        assert slots and slots.isdisjoint(tier.slots.values())
        forgotten.append(slots)

    def step_past_the_failure():
        try:
            return step()
        except RuntimeError as e:
            assert "injected" in str(e)
            return step()

    core.cache_engines.finish_swap_out, sched.discard_output, core.step = failing_finish, discard_and_check, step_past_the_failure
    outputs = chat(llm)
    assert len(forgotten) == 1 and outputs == without and sched.prefix_cache_hits_host > 0
