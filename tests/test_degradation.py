"""Graceful degradation under KV pressure (scheduler.degradation) and load shedding (max_waiting_requests).

Scheduler scenarios run on the fake runner of tests/_scheduler_harness.py; the engine scenario on stories260K with
a 17-block KV cache of 4-token blocks. Preemption counts are exact: with ``ignore_eos`` they depend on lengths only.
"""

from __future__ import annotations

import pytest

from jaxllm import LLM
from jaxllm.config import EngineConfig
from jaxllm.core.client import QueueFullError
from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.degradation import DegradationController, GracefulDegradation
from tests._scheduler_harness import FakeClock, FakeRunner, check_block_invariants, make_request, reference_output, step

GREEDY = dict(temperature=0, ignore_eos=True)


def _burst(degradation, num_requests: int, max_tokens: int, num_blocks: int):
    """A burst of ``num_requests`` 8-token prompts into 8 seats and ``num_blocks`` blocks of 4 tokens; returns the
    scheduler, the requests and the seat limit in force after each step."""
    config = SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                             max_model_len=128, graceful_degradation=degradation)
    sched, runner = Scheduler(config, clock=FakeClock()), FakeRunner(config)
    requests = [make_request(f"r{i}", [(7 * i + j) % 50 for j in range(8)], max_tokens=max_tokens)
                for i in range(num_requests)]
    for req in requests:
        sched.add_request(req)
    seats = []
    while sched.has_unfinished_requests():
        step(sched, runner)
        check_block_invariants(sched)
        seats.append((sched.max_num_seqs, sched.max_num_batched_tokens))
    return sched, requests, seats


@pytest.mark.parametrize("num_requests, max_tokens, num_blocks, off, on", [
    (16, 24, 25, 16, 7),
    (32, 40, 41, 58, 13),
])
def test_burst_preempts_far_less_with_degradation_same_tokens_no_leak_limits_restored(
        num_requests, max_tokens, num_blocks, off, on):
    runs = {flag: _burst(flag, num_requests, max_tokens, num_blocks) for flag in (False, True)}
    assert {flag: sched.num_preemptions for flag, (sched, _, _) in runs.items()} == {False: off, True: on}
    for sched, requests, _ in runs.values():
        for req in requests:
            assert req.output_token_ids == reference_output(req.prompt_token_ids, req.sampling_params, None, 128)
        assert sched.block_pool.num_free_blocks == num_blocks - 1
    sched, _, limits = runs[True]
    # It backed off (seats and the prefill share of the budget) during the burst, and is back at the end.
    assert min(limits) == (2, 8 + 5)
    assert limits[-1] == (8, 32) and (sched.max_num_seqs, sched.max_num_batched_tokens) == (8, 32)
    assert sched.stats.max_num_seqs == 8 and sched.stats.max_num_batched_tokens == 32
    assert all(seats == (8, 32) for seats in runs[False][2])


def test_controller_backs_off_once_per_cooldown_under_pressure_and_restores_one_step_per_calm_window():
    settings = GracefulDegradation(low_free_fraction=0.1, step_fraction=0.25, min_fraction=0.25, cooldown=2,
                                   recover_steps=3)
    c = DegradationController(settings, max_num_seqs=8, max_num_batched_tokens=40, num_usable_blocks=100)
    limits = []
    for free in [5] * 9 + [50] * 10:  # 9 steps under the low-water mark (10 blocks), then calm
        c.observe(free, num_preemptions=0, idle=False)
        limits.append((c.level, c.max_num_seqs, c.max_num_batched_tokens))
    assert [lvl for lvl, _, _ in limits] == [1, 1, 2, 2, 3, 3, 3, 3, 3] + [3, 3, 2, 2, 2, 1, 1, 1, 0, 0]
    # Seats ceil(8 f), budget 8 + ceil(32 f) for f = 1 - level / 4, floored at 1/4.
    assert sorted(set(limits), reverse=True) == [(3, 2, 16), (2, 4, 24), (1, 6, 32), (0, 8, 40)]
    assert (c.num_backoffs, c.num_restores) == (3, 3)


def test_the_low_water_mark_follows_a_resized_pool():
    settings = GracefulDegradation(low_free_fraction=0.1, cooldown=1)
    c = DegradationController(settings, max_num_seqs=8, max_num_batched_tokens=40, num_usable_blocks=100)
    c.observe(9, num_preemptions=0, idle=False)  # under 10 of 100
    assert c.level == 1
    sched = Scheduler(SchedulerConfig(num_blocks=101, block_size=4, graceful_degradation=settings))
    sched.resize_kv_cache(51)  # 50 usable: the mark is 5
    sched.degradation.observe(9, num_preemptions=0, idle=False)
    sched.degradation.observe(4, num_preemptions=0, idle=False)
    assert sched.degradation.level == 1 and sched.degradation.num_backoffs == 1


def test_controller_counts_each_preemption_once_and_an_idle_scheduler_is_restored_at_once():
    c = DegradationController(GracefulDegradation(max_preemptions=1, cooldown=1), 10, 100, num_usable_blocks=100)
    assert not c.observe(100, num_preemptions=1, idle=False) and c.level == 0  # 1 in the window is tolerated
    assert c.observe(100, num_preemptions=1, idle=False) and c.level == 1  # 2: the first back-off says so
    assert not c.observe(100, num_preemptions=0, idle=False) and c.level == 1  # counted already
    c.observe(100, num_preemptions=5, idle=False)
    assert (c.level, c.max_num_seqs, c.max_num_batched_tokens) == (2, 8, 10 + 72)
    c.observe(100, num_preemptions=0, idle=True)
    assert (c.level, c.max_num_seqs, c.max_num_batched_tokens) == (0, 10, 100)


def test_without_chunked_prefill_the_token_budget_is_never_lowered():
    c = DegradationController(GracefulDegradation(cooldown=1), 4, 64, num_usable_blocks=10, lower_token_budget=False)
    for _ in range(5):
        c.observe(0, num_preemptions=0, idle=False)
    assert c.max_num_seqs < 4 and c.max_num_batched_tokens == 64


@pytest.mark.parametrize("field, value", [
    ("low_free_fraction", 1.0), ("low_free_fraction", -0.1), ("max_preemptions", -1), ("window", 0),
    ("step_fraction", 0.0), ("min_fraction", 1.5), ("cooldown", 0), ("recover_steps", 0),
])
def test_bad_degradation_settings_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"GracefulDegradation\.{field}={value!r}"):
        GracefulDegradation(**{field: value})


def test_first_back_off_releases_pinned_prefixes_into_the_lru_cache():
    config = SchedulerConfig(num_blocks=25, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                             max_model_len=128)
    sched, runner = Scheduler(config, clock=FakeClock()), FakeRunner(config)
    system = list(range(10, 18))  # two full blocks
    sched.add_request(make_request("warm", system, max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert sched.pin_prefix(system) == 2 and sched.pin_prefix(system) == 0
    pinned = list(sched.kv_cache_manager.pinned_blocks)
    assert [b.ref_cnt for b in pinned] == [1, 1] and sched.block_pool.num_free_blocks == 24 - 2
    for i in range(16):
        sched.add_request(make_request(f"r{i}", [(7 * i + j) % 50 for j in range(8)], max_tokens=24))
    while sched.degradation.level == 0:
        assert sched.kv_cache_manager.pinned_blocks == pinned
        step(sched, runner)
        check_block_invariants(sched)
    # Unpinned at the first back-off: ordinary cached-free blocks, revivable until evicted.
    assert sched.kv_cache_manager.pinned_blocks == [] and all(b.ref_cnt == 0 or b.block_hash is None for b in pinned)
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert sched.block_pool.num_free_blocks == 24


def test_without_degradation_nothing_is_pinned():
    config = SchedulerConfig(num_blocks=9, block_size=4, graceful_degradation=False)
    sched, runner = Scheduler(config, clock=FakeClock()), FakeRunner(config)
    sched.add_request(make_request("warm", list(range(8)), max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert sched.pin_prefix(list(range(8))) == 0 and sched.block_pool.num_free_blocks == 8


def test_engine_config_rejects_a_negative_waiting_limit():
    with pytest.raises(ValueError, match="max_waiting_requests=-1"):
        EngineConfig(max_waiting_requests=-1)


# ---- the engine on stories260K ---------------------------------------------------------------------------------

ENGINE = dict(max_model_len=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, num_kv_blocks=17,
              precompile=False, token_buckets=[32])


def _prompt(i: int) -> list[int]:
    return [3 + (7 * i + 11 * j) % 400 for j in range(8)]


@pytest.mark.parametrize("async_scheduling, preemptions", [(False, (9, 3)), (True, (7, 2))])
def test_engine_burst_preemptions_on_vs_off_same_greedy_text_blocks_and_limits_restored(stories_dir, async_scheduling,
                                                                                        preemptions):
    params = SamplingParams(max_tokens=12, **GREEDY)
    prompts = [_prompt(i) for i in range(12)]
    results = {}
    for flag in (False, True):
        llm = LLM(model=stories_dir, graceful_degradation=flag, async_scheduling=async_scheduling, **ENGINE)
        engine = llm.engine
        seats, requeued = [], 0.0
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            registry = engine.metrics.registry
            seats.append(registry.get_sample_value("jaxllm:effective_max_num_seqs"))
            requeued = max(requeued, registry.get_sample_value("jaxllm:scheduler_queue_depth", {"kind": "preempted"}))
        results[flag] = [outputs[str(i)] for i in range(12)], engine.scheduler.num_preemptions, seats
        assert requeued >= 1  # preempted requests show in the queue depth
        assert engine.scheduler.block_pool.num_free_blocks == 16
        assert all(len(tokens) == 12 for tokens in results[flag][0])
    assert results[True][0] == results[False][0]
    assert (results[False][1], results[True][1]) == preemptions
    assert min(results[True][2]) < 6 and results[True][2][-1] == 6 and set(results[False][2]) == {6}


def test_engine_refuses_arrivals_past_max_waiting_requests_and_runs_the_rest(stories_dir):
    llm = LLM(model=stories_dir, max_waiting_requests=2, **ENGINE)
    engine = llm.engine
    params = SamplingParams(max_tokens=4, **GREEDY)
    for i in range(6):
        engine.add_request(f"run{i}", _prompt(i)[:5], params)
    engine.step()  # all six take a seat (30 prompt tokens of the 32-token budget)
    for i in range(2):
        engine.add_request(f"wait{i}", _prompt(i + 6), params)
    with pytest.raises(QueueFullError, match="2 requests are waiting for a batch seat, max_waiting_requests=2"):
        engine.add_request("refused", _prompt(9), params)
    assert "refused" not in engine.output_processor.requests
    assert engine.metrics.registry.get_sample_value("jaxllm:request_refused_total") == 1
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {out.request_id for out in engine.step() if out.finished}
    assert finished == {f"run{i}" for i in range(6)} | {"wait0", "wait1"}
    assert engine.scheduler.block_pool.num_free_blocks == 16
    # generate() queues its prompts at once: past 6 seats + 2 waiting it is refused whole, and nothing stays queued.
    llm.generate([_prompt(i) for i in range(8)], params, use_tqdm=False)
    with pytest.raises(QueueFullError):
        llm.generate([_prompt(i) for i in range(9)], params, use_tqdm=False)
    assert not engine.output_processor.requests and not engine.scheduler.requests


def test_fork_while_backed_off_below_the_running_count_gives_the_first_child_the_parent_seat():
    # Regression: with seats in force under the running count, the free-seat count went negative and
    # children[:negative] forked all but the last children.
    config = SchedulerConfig(num_blocks=33, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    sched, runner = Scheduler(config, clock=FakeClock()), FakeRunner(config)
    prompt = [5, 8, 13, 21, 34, 2, 7, 1, 9, 4]
    parent = make_request("parent", prompt[:-1], params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    sched.add_request(parent)
    for i in range(2):
        sched.add_request(make_request(f"o{i}", [40 + i, 41, 42], max_tokens=20))
    step(sched, runner)
    for _ in range(20):  # pressure: down to ceil(4 * 0.2) = 1 seat, with 3 running
        sched.degradation.observe(0, num_preemptions=0, idle=False)
    assert sched.max_num_seqs == 1 and len(sched.running) == 3
    children = [make_request(f"c{i}", prompt, max_tokens=4) for i in range(3)]
    copies = sched.fork_request("parent", children)
    assert [c.request_id for c in sched.running if c.request_id.startswith("c")] == ["c0"] and copies == []
    assert [r.request_id for r in sched.waiting] == ["c1", "c2"]
    check_block_invariants(sched)
    while sched.has_unfinished_requests():
        step(sched, runner)
    for c in children:
        assert c.output_token_ids == reference_output(prompt, c.sampling_params, None, 64)
    assert sched.block_pool.num_free_blocks == 32
