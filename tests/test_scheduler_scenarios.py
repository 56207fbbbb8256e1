"""Scheduler behaviour, one scenario per test, driven by a fake runner with a simulated KV cache."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler import RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from scheduler.kv.tier import CopyKind
from scheduler.kv_events import BlockRemoved
from tests._scheduler_harness import (
    VOCAB,
    FakeClock,
    FakeRunner,
    check_block_invariants,
    make_request,
    reference_output,
    run_async_until_done,
    run_until_done,
    step,
)


def setup(clock=None, **overrides):
    cfg = dict(num_blocks=33, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64)
    cfg.update(overrides)
    config = SchedulerConfig(**cfg)
    sched = Scheduler(config, clock=clock or FakeClock())
    return sched, FakeRunner(config)


def expected(req, max_model_len=64):
    return reference_output(req.prompt_token_ids, req.sampling_params, req.eos_token_id, max_model_len)


def test_same_prompt_twice_hits_the_cache_and_generates_the_same_tokens():
    sched, runner = setup()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]  # exactly 2 blocks
    first = make_request("first", prompt)
    sched.add_request(first)
    run_until_done(sched, runner)
    second = make_request("second", prompt)
    sched.add_request(second)
    out, _ = step(sched, runner)
    # Both blocks hit; only the last token is computed, into a copy of the
    # cached last block.
    assert (out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens) == (7, 1)
    run_until_done(sched, runner)
    assert second.output_token_ids == first.output_token_ids == expected(first)
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (16, 7)


def test_request_skipping_prefix_cache_reads_computes_its_cached_prompt_and_is_not_counted():
    sched, runner = setup()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    first = make_request("first", prompt)
    sched.add_request(first)
    run_until_done(sched, runner)
    second = make_request("second", prompt, skip_reading_prefix_cache=True)
    sched.add_request(second)
    out, _ = step(sched, runner)
    assert (out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens) == (0, 8)
    run_until_done(sched, runner)
    assert second.output_token_ids == first.output_token_ids
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (8, 0)


def _cached_prompt_and_its_twin():
    sched, runner = setup()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    first = make_request("first", prompt)
    sched.add_request(first)
    run_until_done(sched, runner)  # first held blocks [1, 2, 3, 4]; 4 was partial, so it is freed first
    second = make_request("second", prompt)
    sched.add_request(second)
    return sched, runner, first, second


def test_fully_cached_prompt_copies_its_last_cached_block_into_a_fresh_block():
    sched, runner, first, second = _cached_prompt_and_its_twin()
    out = sched.schedule()
    assert out.copies(CopyKind.COPY) == [(2, 4)]
    assert out.scheduled[0].block_ids == [1, 4]
    # The source is pinned until update_from_output, so nothing can reuse it first.
    assert sched.block_pool.blocks[2].ref_cnt == 1
    sched.update_from_output(out, runner(out))
    batch = runner.last_batch
    assert batch.slot_mapping[0] == 4 * 4 + 3
    pool = sched.block_pool
    assert pool.get_cached_block(first.block_hashes[1]) is pool.blocks[2]
    assert (pool.blocks[2].ref_cnt, pool.blocks[4].block_hash) == (0, None)
    assert second.output_token_ids == first.output_token_ids[:1]


def test_skipping_the_copy_changes_the_generated_tokens():
    sched, runner, first, second = _cached_prompt_and_its_twin()
    out = sched.schedule()
    out.block_copies = [c for c in out.block_copies if c.kind is not CopyKind.COPY]
    sched.update_from_output(out, runner(out))
    run_until_done(sched, runner)
    assert second.output_token_ids != first.output_token_ids


def test_recompute_preempted_request_whose_tokens_are_all_cached_recomputes_only_its_last_token():
    clock = FakeClock()
    sched, runner = setup(clock, scheduling_policy="priority", max_num_seqs=1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    first = make_request("first", prompt, priority=5, arrival_time=0.0)
    sched.add_request(first)
    run_until_done(sched, runner)  # registers 3 full blocks: the prompt and 4 outputs
    second = make_request("second", prompt, priority=5, arrival_time=1.0)
    sched.add_request(second)
    for _ in range(4):
        step(sched, runner)
    assert second.num_tokens == 12
    sched.add_request(make_request("urgent", [9, 9, 9], max_tokens=1, priority=0, arrival_time=2.0))
    preempting, _ = step(sched, runner)
    assert preempting.preempted == [second]
    resumed, _ = step(sched, runner)
    assert [(r.request, r.num_computed_tokens, r.num_new_tokens) for r in resumed.scheduled] == [(second, 11, 1)]
    assert [src for src, _ in resumed.copies(CopyKind.COPY)] == [sched.block_pool.get_cached_block(first.block_hashes[2]).block_id]
    run_until_done(sched, runner)
    assert second.output_token_ids == first.output_token_ids == expected(first)


def test_prompt_one_token_past_cached_blocks_hits_all_of_them():
    sched, runner = setup()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    sched.add_request(make_request("first", prompt))
    run_until_done(sched, runner)
    sched.add_request(make_request("second", prompt + [7]))
    out, _ = step(sched, runner)
    assert (out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens) == (8, 1)


def test_issue11_fully_cached_block_aligned_prompt_needing_the_whole_cache_does_not_stall_the_queue():
    # The reported input: 2 usable blocks of 16; a 32-token prompt with max_tokens=1 fills them exactly.
    sched, runner = setup(num_blocks=3, block_size=16, max_model_len=64)
    prompt = list(range(1, 33))
    first = make_request("first", prompt, max_tokens=1)
    sched.add_request(first)
    run_until_done(sched, runner)
    again, small = make_request("again", prompt, max_tokens=1), make_request("small", [5, 6, 7], max_tokens=4)
    sched.add_request(again)
    sched.add_request(small)
    out, _ = step(sched, runner)
    # Copying the cached last block would take a third block: the first block hits, the second is recomputed.
    assert [(r.request, r.num_computed_tokens, r.num_new_tokens) for r in out.scheduled] == [(again, 16, 16)]
    assert out.copies(CopyKind.COPY) == []
    # "again" finishes with this step's sample; then "small" prefills and decodes 3 more.
    assert run_until_done(sched, runner, max_steps=10) == 4
    assert again.output_token_ids == first.output_token_ids == expected(first)
    assert small.output_token_ids == expected(small)
    assert sched.block_pool.num_free_blocks == 2


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("chunk_budget", [None, 3])
@pytest.mark.parametrize("block_size,usable", [(2, 1), (2, 3), (4, 1), (4, 2), (4, 5), (16, 2)])
def test_fully_cached_prompt_that_needs_the_whole_cache_is_served_alone_and_so_is_the_queue_behind_it(
    block_size, usable, chunk_budget, async_scheduling
):
    """The kind of issue 11 item 4: a request that fits the whole cache alone is admitted when alone.

    A block-aligned prompt of every usable block with max_tokens=1 needs the
    whole cache; sent again, its copy on write would need one block more.
    """
    budget = chunk_budget or 64
    sched, runner = setup(
        num_blocks=usable + 1, block_size=block_size, max_num_batched_tokens=budget,
        max_num_seqs=min(8, budget), async_scheduling=async_scheduling,
    )
    run = run_async_until_done if async_scheduling else run_until_done
    prompt = [1 + (i * 7) % 40 for i in range(usable * block_size)]
    first = make_request("first", prompt, max_tokens=1)
    sched.add_request(first)
    run(sched, runner, max_steps=100)
    # The small request behind it fits one block.
    again, small = make_request("again", prompt, max_tokens=1), make_request("small", [5], max_tokens=block_size)
    sched.add_request(again)
    sched.add_request(small)
    run(sched, runner, max_steps=100, check=check_block_invariants)
    assert again.output_token_ids == first.output_token_ids == expected(first)
    assert small.output_token_ids == expected(small)
    assert sched.stats.prefix_cache_hits == (usable - 1) * block_size
    assert sched.block_pool.num_free_blocks == usable


def test_async_request_alone_waits_a_step_for_a_pinned_copy_source_instead_of_being_capped():
    # 3 usable blocks: the 8-token prompt's two cached blocks, its copy, and nothing more. Under async
    # scheduling the copy source stays pinned while the next step is scheduled, when the request needs
    # its third block; it must wait for the pin, not be length-capped as if it alone filled the cache.
    sched, runner = setup(num_blocks=4, async_scheduling=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    first = make_request("first", prompt, max_tokens=3)
    sched.add_request(first)
    run_async_until_done(sched, runner, max_steps=20)
    again = make_request("again", prompt, max_tokens=3)
    sched.add_request(again)
    copying = sched.schedule()
    assert copying.copies(CopyKind.COPY) and sched.block_pool.num_free_blocks == 0
    waiting = sched.schedule()
    assert (waiting.scheduled, again.status) == ([], RequestStatus.RUNNING)
    sched.update_from_output(copying, runner(copying))
    sched.update_from_output(waiting, [])
    run_async_until_done(sched, runner, max_steps=20)
    assert again.output_token_ids == first.output_token_ids == expected(first)


def test_evicted_block_is_never_served_as_a_hit_for_its_old_hash():
    sched, runner = setup(num_blocks=5)
    old = make_request("old", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=1)
    sched.add_request(old)
    run_until_done(sched, runner)
    old_hash = old.block_hashes[0]
    sched.add_request(make_request("other", list(range(20, 33)), max_tokens=1))  # needs all 4 blocks
    run_until_done(sched, runner)
    assert sched.block_pool.get_cached_block(old_hash) is None
    again = make_request("again", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=3)
    sched.add_request(again)
    out, _ = step(sched, runner)
    assert out.scheduled[0].num_computed_tokens == 0
    run_until_done(sched, runner)
    assert again.output_token_ids == expected(again)


def test_request_larger_than_the_whole_cache_is_ignored_while_eight_others_complete():
    sched, runner = setup(num_blocks=9)  # 8 usable blocks = 32 token slots
    big = make_request("big", list(range(30)), max_tokens=8)
    sched.add_request(big)
    small = [make_request(f"s{i}", [i + 1] * 6, max_tokens=4) for i in range(8)]
    for req in small:
        sched.add_request(req)
    assert big.status == RequestStatus.FINISHED_IGNORED
    assert big.ignored_reason == "prompt (30 tokens) + max_tokens (8) needs 10 KV blocks of 4 tokens; the whole cache has 8"
    out, updated = step(sched, runner)
    assert out.finished == [big]
    assert updated[0] is big
    run_until_done(sched, runner, check=check_block_invariants)
    assert [r.output_token_ids for r in small] == [expected(r) for r in small]
    assert big.finish_reason == "length"


def test_prompt_longer_than_max_model_len_is_ignored():
    sched, _ = setup(max_model_len=16)
    req = make_request("long", list(range(17)))
    sched.add_request(req)
    assert req.status == RequestStatus.FINISHED_IGNORED
    assert req.ignored_reason == "prompt has 17 tokens, more than max_model_len=16"


def test_long_chunked_prefill_under_memory_pressure_completes():
    sched, runner = setup(num_blocks=13, max_num_batched_tokens=8, max_num_seqs=4)
    long = make_request("long", list(range(40)), max_tokens=4, arrival_time=0.0)
    shorts = [make_request(f"s{i}", [i + 1] * 8, max_tokens=12, arrival_time=1.0 + i) for i in range(3)]
    for req in [long] + shorts:
        sched.add_request(req)
    run_until_done(sched, runner, max_steps=300, check=check_block_invariants)
    assert sched.stats.num_preemptions > 0
    assert [r.output_token_ids for r in [long] + shorts] == [expected(r) for r in [long] + shorts]
    assert sched.block_pool.num_free_blocks == 12


def test_chunked_prefill_shares_a_step_with_decodes():
    sched, runner = setup(max_num_batched_tokens=8)
    sched.add_request(make_request("decoder", [1, 2, 3], arrival_time=0.0))
    step(sched, runner)
    sched.add_request(make_request("prompt", list(range(20)), arrival_time=1.0))
    out, _ = step(sched, runner)
    assert [(r.request.request_id, r.num_new_tokens, r.samples) for r in out.scheduled] == [
        ("decoder", 1, True),
        ("prompt", 7, False),
    ]


def test_long_prefill_threshold_caps_one_request_chunk():
    sched, runner = setup(long_prefill_token_threshold=5)
    sched.add_request(make_request("p", list(range(12))))
    chunks = [step(sched, runner)[0].scheduled[0].num_new_tokens for _ in range(4)]
    assert chunks == [5, 5, 2, 1]


def test_without_chunked_prefill_a_prompt_over_the_remaining_budget_waits():
    sched, runner = setup(enable_chunked_prefill=False, max_num_batched_tokens=64)
    sched.add_request(make_request("a", list(range(40)), arrival_time=0.0))
    sched.add_request(make_request("b", list(range(100, 130)), arrival_time=1.0))
    first, _ = step(sched, runner)
    second, _ = step(sched, runner)
    assert [(r.request.request_id, r.num_new_tokens) for r in first.scheduled] == [("a", 40)]
    assert [(r.request.request_id, r.num_new_tokens) for r in second.scheduled] == [("a", 1), ("b", 30)]


def test_partial_prefill_discards_its_sample():
    sched, runner = setup(max_num_batched_tokens=8)
    req = make_request("p", list(range(12)))
    sched.add_request(req)
    out = sched.schedule()
    updated = sched.update_from_output(out, [7])
    assert (req.num_computed_tokens, req.output_token_ids, updated) == (8, [], [])


def test_priority_most_urgent_arrival_runs_within_two_steps_of_a_full_batch():
    clock = FakeClock()
    sched, runner = setup(clock, scheduling_policy="priority", max_num_seqs=2)
    for i in range(2):
        sched.add_request(make_request(f"bulk{i}", [i + 1] * 8, max_tokens=40, priority=5, arrival_time=0.0))
    step(sched, runner)
    urgent = make_request("urgent", [9] * 8, max_tokens=4, priority=0, arrival_time=1.0)
    sched.add_request(urgent)
    first, _ = step(sched, runner)
    assert urgent.status == RequestStatus.RUNNING
    assert [r.request.request_id for r in first.scheduled] == ["bulk0", "urgent"]
    assert [r.request_id for r in first.preempted] == ["bulk1"]


def test_urgent_request_preempting_a_prefill_cut_by_the_budget_gets_exactly_its_tokens():
    # The running prefill is cut at the 10-token budget; preempting it gives those 10 tokens back.
    sched, runner = setup(FakeClock(), scheduling_policy="priority", max_num_batched_tokens=10)
    sched.add_request(make_request("long", list(range(1, 33)), max_tokens=1, priority=5, arrival_time=0.0))
    step(sched, runner)
    sched.add_request(make_request("urgent", list(range(40, 72)), max_tokens=1, priority=0, arrival_time=1.0))
    out, _ = step(sched, runner)
    assert [(r.request.request_id, r.num_new_tokens) for r in out.scheduled] == [("urgent", 10)]
    assert [r.request_id for r in out.preempted] == ["long"]


def test_fcfs_does_not_preempt_for_a_later_arrival():
    sched, runner = setup(max_num_seqs=2)
    for i in range(2):
        sched.add_request(make_request(f"bulk{i}", [i + 1] * 8, max_tokens=40, arrival_time=0.0))
    step(sched, runner)
    late = make_request("late", [9] * 8, max_tokens=4, priority=-100, arrival_time=1.0)
    sched.add_request(late)
    out, _ = step(sched, runner)
    assert (late.status, out.preempted) == (RequestStatus.WAITING, [])


def _steady_urgent_stream(policy, steps):
    clock = FakeClock()
    sched, runner = setup(clock, scheduling_policy=policy, max_num_seqs=1, aging_rate=1.0)
    low = make_request("low", [7] * 4, max_tokens=2, priority=10, arrival_time=0.0)
    sched.add_request(low)
    for t in range(steps):
        clock.advance(1.0)
        sched.add_request(make_request(f"u{t}", [t % 40 + 1] * 4, max_tokens=3, priority=0, arrival_time=clock.t))
        step(sched, runner)
    return low


def test_aging_lets_a_least_urgent_request_finish_under_a_steady_urgent_stream():
    low = _steady_urgent_stream("aging", steps=60)
    assert low.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_priority_without_aging_starves_it_under_the_same_stream():
    low = _steady_urgent_stream("priority", steps=60)
    assert low.status == RequestStatus.WAITING


def test_sjf_admits_the_shortest_job_first():
    sched, runner = setup(scheduling_policy="sjf", max_num_seqs=1)
    sched.add_request(make_request("long", [1] * 10, max_tokens=20, arrival_time=0.0))
    sched.add_request(make_request("short", [2] * 10, max_tokens=2, arrival_time=1.0))
    out, _ = step(sched, runner)
    assert [r.request.request_id for r in out.scheduled] == ["short"]


def test_request_waiting_for_its_grammar_is_passed_over_until_ready_then_runs_like_any_other():
    sched, runner = setup(max_num_seqs=2)
    ready = [False]
    constrained = make_request("constrained", [5, 6, 7, 8, 9], grammar_ready=lambda: ready[0])
    later = [make_request(f"later{i}", [i + 1, 2, 3]) for i in range(2)]
    for req in [constrained] + later:
        sched.add_request(req)
    assert constrained.status is RequestStatus.WAITING_FOR_FSM
    assert sched.stats.num_waiting_for_fsm == 1
    out, _ = step(sched, runner)
    # Both seats go to the requests behind it; it keeps its place at the head of the queue.
    assert [r.request_id for r in out.requests] == ["later0", "later1"]
    assert sched.waiting == [constrained] and constrained.status is RequestStatus.WAITING_FOR_FSM
    ready[0] = True
    run_until_done(sched, runner, check=check_block_invariants)
    assert constrained.output_token_ids == expected(constrained)
    assert all(r.output_token_ids == expected(r) for r in later)
    assert sched.stats.num_waiting_for_fsm == 0
    assert sched.block_pool.num_free_blocks == sched.config.num_blocks - 1


def test_request_whose_grammar_is_ready_at_arrival_never_waits_for_it():
    sched, runner = setup()
    req = make_request("r", [1, 2, 3], grammar_ready=lambda: True)
    sched.add_request(req)
    assert req.status is RequestStatus.WAITING
    out, _ = step(sched, runner)
    assert out.requests == [req]


def test_aborting_a_request_waiting_for_its_grammar_removes_it_from_the_queue():
    sched, runner = setup()
    req = make_request("r", [1, 2, 3], grammar_ready=lambda: False)
    sched.add_request(req)
    sched.abort_request("r")
    assert sched.waiting == [] and req.status is RequestStatus.FINISHED_ABORTED
    assert not sched.requests


def test_aborting_a_running_request_returns_all_its_blocks_at_once():
    sched, runner = setup()
    req = make_request("r", list(range(10)), max_tokens=20)
    sched.add_request(req)
    for _ in range(3):
        step(sched, runner)
    assert sched.block_pool.num_free_blocks == 32 - 3
    sched.abort_request("r")
    assert sched.block_pool.num_free_blocks == 32
    assert (req.status, req.finish_reason, sched.has_unfinished_requests()) == (
        RequestStatus.FINISHED_ABORTED, "abort", True,
    )
    out, updated = step(sched, runner)
    assert (out.finished, updated, sched.has_unfinished_requests()) == ([req], [req], False)


def test_aborting_a_waiting_request_removes_it_from_the_queue():
    sched, runner = setup(max_num_seqs=1)
    sched.add_request(make_request("a", [1, 2, 3], arrival_time=0.0))
    sched.add_request(make_request("b", [1, 2, 3], arrival_time=1.0))
    step(sched, runner)
    sched.abort_request("b")
    sched.abort_request("no-such-id")
    assert (sched.stats.num_waiting, sched.num_unfinished_requests) == (0, 1)


# A 3-block system prompt, then: 2 tokens, 1 token, 5 tokens, nothing (the prompt is the prefix itself, so its
# hits would cover every token and copy the last block, which the same step writes: it recomputes that block).
_PREFIX = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
_SUFFIXES = [[7, 7], [8], [9, 9, 9, 9, 1], []]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_admitted_in_one_step_read_the_prefix_the_first_of_them_computes(async_scheduling):
    """vLLM v1 registers an admission's full blocks as it is scheduled: those admitted after it in the same step
    hit them (the step writes every row's K/V before any row attends), so the prefix is computed once."""
    sched, runner = setup(async_scheduling=async_scheduling)
    reqs = [make_request(f"r{i}", _PREFIX + suffix) for i, suffix in enumerate(_SUFFIXES)]
    for req in reqs:
        sched.add_request(req)
    out = sched.schedule()
    assert [(r.num_computed_tokens, r.num_new_tokens) for r in out.scheduled] == [(0, 14), (12, 1), (12, 5), (8, 4)]
    assert out.copies(CopyKind.COPY) == []
    tables = [sched.kv_cache_manager.get_block_ids(r.request_id) for r in reqs]
    assert tables[1][:3] == tables[2][:3] == tables[0][:3] and tables[3][:2] == tables[0][:2]
    assert tables[3][2] != tables[0][2]
    sched.update_from_output(out, runner(out))
    (run_async_until_done if async_scheduling else run_until_done)(sched, runner, check=check_block_invariants)
    assert [r.output_token_ids for r in reqs] == [expected(r) for r in reqs]
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (14 + 13 + 17 + 12, 12 + 12 + 8)
    assert sched.block_pool.num_free_blocks == 32


def test_blocks_registered_by_a_schedule_are_copy_sources_once_it_returns():
    """Regression (a pinned prefix came back one block short): only inside the schedule that registers a block is
    it kept from being copied on write; after it, lookups between steps (``pin_prefix``) and later schedules see
    every hit, since the runner does a step's copies after the steps before it."""
    sched, runner = setup()
    sched.add_request(make_request("first", _PREFIX))
    out = sched.schedule()
    assert sched.kv_cache_manager.get_computed_blocks(make_request("probe", _PREFIX))[1] == 11
    sched.update_from_output(out, runner(out))
    assert sched.pin_prefix(_PREFIX) == 3


def test_a_discarded_output_forgets_the_blocks_its_admissions_registered():
    """The step never ran, so the prefix it was to compute is not in the cache: nothing hits it afterwards, no
    block is lost, and the requests computed again from scratch generate the right tokens."""
    sched, runner = setup(enable_kv_cache_events=True)
    reqs = [make_request(f"r{i}", _PREFIX + suffix) for i, suffix in enumerate(_SUFFIXES[:2])]
    for req in reqs:
        sched.add_request(req)
    out = sched.schedule()
    assert [(r.num_computed_tokens, r.num_new_tokens) for r in out.scheduled] == [(0, 14), (12, 1)]
    stored = sched.take_kv_events()
    assert [type(e).__name__ for e in stored] == ["BlockStored"] and len(stored[0].block_hashes) == 3
    sched.discard_output(out)
    assert sched.block_pool.cached == {} and sched.block_pool.num_free_blocks == 32
    assert sched.take_kv_events() == [BlockRemoved(stored[0].block_hashes)]
    out = sched.schedule()
    assert [(r.num_computed_tokens, r.num_new_tokens) for r in out.scheduled] == [(0, 14), (12, 1)]
    sched.update_from_output(out, runner(out))
    run_until_done(sched, runner, check=check_block_invariants)
    assert [r.output_token_ids for r in reqs] == [expected(r) for r in reqs]


@given(prompts=st.lists(st.tuples(st.integers(0, len(_PREFIX)), st.lists(st.integers(0, VOCAB - 1), max_size=6)),
                        min_size=1, max_size=8),
       async_scheduling=st.booleans(), budget=st.sampled_from([8, 9, 32]), num_blocks=st.integers(12, 33),
       discard_at=st.integers(-1, 3))
def test_requests_sharing_prefixes_generate_the_reference_whatever_is_admitted_together(
        prompts, async_scheduling, budget, num_blocks, discard_at):
    """The class: prompts of any prefix of one system prompt plus their own tokens, arriving together, admitted
    together or step by step as the token budget and a small cache allow (chunks, preemptions), sync or async,
    with the output of step ``discard_at`` discarded unrun: each request generates what a scheduler-free
    reference does (the fake runner reads back the KV through the block tables), and no block is lost."""
    sched, runner = setup(async_scheduling=async_scheduling, max_num_batched_tokens=budget, num_blocks=num_blocks)
    reqs = [make_request(f"r{i}", _PREFIX[:k] + suffix or [1]) for i, (k, suffix) in enumerate(prompts)]
    for req in reqs:
        sched.add_request(req)
    in_flight = None
    for n in range(1000):
        if not sched.has_unfinished_requests() and in_flight is None:
            break
        out = sched.schedule()
        if n == discard_at and out.num_seqs:
            sched.discard_output(out)
            continue
        launched = (out, runner(out))
        if not async_scheduling or not out.num_seqs:
            done, in_flight = [d for d in (in_flight, launched) if d is not None], None
        else:
            done, in_flight = [in_flight] if in_flight is not None else [], launched
        for o, sampled in done:
            sched.update_from_output(o, sampled)
        check_block_invariants(sched)
    assert [r.output_token_ids for r in reqs] == [expected(r) for r in reqs]
    assert sched.block_pool.num_free_blocks == num_blocks - 1


def test_a_request_a_discard_restarts_under_async_scheduling_ignores_its_row_in_the_step_before():
    """Regression (found by the test above): step 1 is discarded while step 0 is in flight; the request waits,
    runs again in step 2, and only then is step 0 applied. Its step-0 row (a sample of the old start, on its old
    batch row) must not count as the restarted request's: it generated its first token twice."""
    sched, runner = setup(async_scheduling=True)
    req = make_request("r0", [1])
    sched.add_request(req)
    step0 = sched.schedule()
    sampled0 = runner(step0)
    sched.discard_output(sched.schedule())
    step2 = sched.schedule()
    assert [(r.num_computed_tokens, r.num_new_tokens) for r in step2.scheduled] == [(0, 1)]
    sampled2 = runner(step2)
    assert sched.update_from_output(step0, sampled0) == [] and req.output_token_ids == []
    sched.update_from_output(step2, sampled2)
    run_async_until_done(sched, runner, check=check_block_invariants)
    assert req.output_token_ids == expected(req)


def test_recompute_preemption_keeps_hashes_so_the_resumed_prefill_hits_its_own_prefix():
    sched, runner = setup(num_blocks=7, max_num_seqs=2, max_num_batched_tokens=16)
    a = make_request("a", [1] * 9, max_tokens=12, arrival_time=0.0)
    b = make_request("b", [2] * 9, max_tokens=12, arrival_time=1.0)
    sched.add_request(a)
    sched.add_request(b)
    first_block = resumed = None
    for _ in range(60):
        first_block = first_block or sched.kv_cache_manager.get_block_ids("b")[:1]
        out, _ = step(sched, runner)
        resumed = resumed or next((r for r in out.scheduled if r.request is b and b.num_preemptions), None)
        if not sched.has_unfinished_requests():
            break
    assert b.num_preemptions == 1
    # a's growth evicted b's later blocks (freed tail first); its first block survived.
    assert (resumed.num_computed_tokens, resumed.block_ids[:1]) == (4, first_block)
    assert (a.output_token_ids, b.output_token_ids) == (expected(a), expected(b))


def test_swap_preemption_resumes_with_identical_tokens_and_reports_the_copies():
    sched, runner = setup(num_blocks=7, max_num_seqs=2, preemption_mode="swap", num_host_blocks=8)
    a = make_request("a", [1] * 9, max_tokens=12, arrival_time=0.0)
    b = make_request("b", [2] * 9, max_tokens=12, arrival_time=1.0)
    sched.add_request(a)
    sched.add_request(b)
    swap_out = swap_in = None
    for _ in range(60):
        table_before = list(sched.kv_cache_manager.get_block_ids("b"))
        computed_before = b.num_computed_tokens
        out, _ = step(sched, runner)
        if out.copies(CopyKind.SWAP_OUT) and swap_out is None:
            swap_out = (out.copies(CopyKind.SWAP_OUT), table_before, computed_before)
        if out.copies(CopyKind.SWAP_IN) and swap_in is None:
            row = next(r for r in out.scheduled if r.request is b)
            swap_in = (out.copies(CopyKind.SWAP_IN), row)
        if not sched.has_unfinished_requests():
            break
    pairs, table, computed = swap_out
    assert [d for d, _ in pairs] == table[: -(-computed // 4)]
    in_pairs, row = swap_in
    assert [h for h, _ in in_pairs] == [h for _, h in pairs]
    assert [d for _, d in in_pairs] == row.block_ids[: len(in_pairs)]
    assert row.num_computed_tokens == computed
    assert (a.output_token_ids, b.output_token_ids) == (expected(a), expected(b))
    assert sched.kv_cache_manager.swap.host_pool.num_free_blocks == 8


def test_swap_mode_without_host_blocks_falls_back_to_recompute():
    sched, runner = setup(num_blocks=7, max_num_seqs=2, preemption_mode="swap", num_host_blocks=0)
    a = make_request("a", [1] * 9, max_tokens=12, arrival_time=0.0)
    b = make_request("b", [2] * 9, max_tokens=12, arrival_time=1.0)
    sched.add_request(a)
    sched.add_request(b)
    outs = []
    while sched.has_unfinished_requests():
        outs.append(step(sched, runner)[0])
    assert sum(len(o.preempted) for o in outs) >= 1
    assert all(not o.copies(CopyKind.SWAP_OUT) for o in outs)
    assert (a.output_token_ids, b.output_token_ids) == (expected(a), expected(b))


def test_eos_stops_the_request_unless_ignore_eos():
    prompt = [4, 4, 4]
    eos = reference_output(prompt, SamplingParams(max_tokens=1), None, 64)[0]
    sched, runner = setup()
    stopped = make_request("stopped", prompt, max_tokens=5, eos_token_id=eos)
    ignoring = make_request("ignoring", prompt, eos_token_id=eos, params=SamplingParams(max_tokens=5, ignore_eos=True))
    sched.add_request(stopped)
    sched.add_request(ignoring)
    run_until_done(sched, runner)
    assert (stopped.output_token_ids, stopped.status, stopped.stop_reason) == ([eos], RequestStatus.FINISHED_STOPPED, None)
    assert (len(ignoring.output_token_ids), ignoring.status) == (5, RequestStatus.FINISHED_LENGTH_CAPPED)


def test_stop_token_id_stops_and_becomes_the_stop_reason():
    prompt = [4, 4, 4]
    out = reference_output(prompt, SamplingParams(max_tokens=3), None, 64)
    sched, runner = setup()
    req = make_request("r", prompt, params=SamplingParams(max_tokens=5, stop_token_ids=[out[1]]))
    sched.add_request(req)
    run_until_done(sched, runner)
    assert (req.output_token_ids, req.stop_reason, req.finish_reason) == (out[:2], out[1], "stop")


def test_min_tokens_suppresses_an_earlier_stop():
    prompt = [4, 4, 4]
    first = reference_output(prompt, SamplingParams(max_tokens=1), None, 64)[0]
    sched, runner = setup()
    req = make_request("r", prompt, eos_token_id=first, params=SamplingParams(max_tokens=3, min_tokens=2))
    sched.add_request(req)
    run_until_done(sched, runner)
    assert req.output_token_ids[0] == first
    assert len(req.output_token_ids) >= 2


def test_max_model_len_caps_the_length():
    sched, runner = setup(max_model_len=12)
    req = make_request("r", list(range(10)), max_tokens=None)
    sched.add_request(req)
    run_until_done(sched, runner)
    assert (req.num_tokens, req.status) == (12, RequestStatus.FINISHED_LENGTH_CAPPED)


def test_chunked_prompt_of_exactly_max_model_len_finishes_its_prefill_and_is_length_capped():
    sched, runner = setup(max_model_len=12, max_num_batched_tokens=8)
    req = make_request("r", list(range(12)))
    sched.add_request(req)
    run_until_done(sched, runner, max_steps=10)
    assert (req.num_tokens, req.status, req.output_token_ids) == (13, RequestStatus.FINISHED_LENGTH_CAPPED, expected(req, 12))


def test_request_without_max_tokens_that_alone_fills_the_cache_is_length_capped():
    sched, runner = setup(num_blocks=4, max_model_len=64)
    req = make_request("r", list(range(10)), max_tokens=None)
    sched.add_request(req)
    run_until_done(sched, runner, max_steps=50)
    assert (req.num_tokens, req.status, sched.stats.num_preemptions) == (13, RequestStatus.FINISHED_LENGTH_CAPPED, 0)


def test_engine_stop_string_finish_frees_blocks_without_a_report():
    sched, runner = setup()
    req = make_request("r", list(range(6)), max_tokens=10)
    sched.add_request(req)
    step(sched, runner)
    sched.finish_requests(["r"], RequestStatus.FINISHED_STOPPED)
    out, updated = step(sched, runner)
    assert (sched.block_pool.num_free_blocks, out.finished, updated) == (32, [], [])


def test_finish_requests_rejects_a_non_final_status():
    sched, _ = setup()
    with pytest.raises(ValueError, match="not a FINISHED_"):
        sched.finish_requests("r", RequestStatus.RUNNING)


def test_duplicate_request_id_is_rejected():
    sched, _ = setup()
    sched.add_request(make_request("r", [1]))
    with pytest.raises(ValueError, match="already unfinished"):
        sched.add_request(make_request("r", [1]))


def test_schedule_twice_without_update_raises():
    sched, _ = setup()
    sched.schedule()
    with pytest.raises(RuntimeError, match="before update_from_output"):
        sched.schedule()


def test_update_with_a_stale_output_is_rejected_and_changes_nothing():
    sched, runner = setup()
    sched.add_request(make_request("r", [1, 2]))
    stale = sched.schedule()
    sched.update_from_output(stale, [5])
    sched.schedule()
    with pytest.raises(ValueError, match="not the pending output"):
        sched.update_from_output(stale, [5])
    assert sched.get_request("r").output_token_ids == [5]


def test_get_request_of_unknown_id_raises_key_error():
    sched, _ = setup()
    with pytest.raises(KeyError, match="no unfinished request"):
        sched.get_request("nope")


def test_queue_time_and_stats_are_recorded():
    clock = FakeClock(100.0)
    sched, runner = setup(clock, max_num_seqs=1)
    a = make_request("a", [1] * 6, max_tokens=2, arrival_time=100.0)
    b = make_request("b", [2] * 6, max_tokens=2, arrival_time=100.0)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    stats = sched.stats
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (1, 1, 30)
    assert stats.kv_cache_usage == 2 / 32
    clock.advance(3.0)
    run_until_done(sched, runner)
    assert (a.queue_time, b.queue_time) == (0.0, 3.0)
