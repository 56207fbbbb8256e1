"""LoadAwarePolicy: FCFS under light load, priority order above a queue threshold, hysteresis between the marks."""

from __future__ import annotations

import pytest

from scheduler import LoadAwarePolicy, Scheduler, SchedulerConfig, get_policy
from tests._scheduler_harness import FakeClock, FakeRunner, check_block_invariants, make_request, reference_output, step


def _run(policy):
    """Four requests (d urgent, arriving last), then at step 5 a burst of five (i urgent, arriving last), into two
    seats; one step per clock second. Returns (waiting before, mode after, rows) per step, first-scheduled steps,
    preemptions, and the requests."""
    clock = FakeClock()
    config = SchedulerConfig(num_blocks=65, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64,
                             scheduling_policy=policy)
    sched, runner = Scheduler(config, clock=clock), FakeRunner(config)
    requests = []

    def add(rid: str, priority: int, max_tokens: int = 6) -> None:
        req = make_request(rid, [ord(rid) % 50 + j for j in range(4)], max_tokens=max_tokens, priority=priority,
                           arrival_time=clock.t)
        requests.append(req)
        sched.add_request(req)
        clock.advance(0.1)

    for rid, priority, max_tokens in [("a", 9, 3), ("b", 9, 8), ("c", 9, 6), ("d", 0, 6)]:
        add(rid, priority, max_tokens)
    trace, first = [], {}
    while sched.has_unfinished_requests():
        if len(trace) == 5:
            for rid, priority in [("e", 5), ("f", 5), ("g", 5), ("h", 5), ("i", 0)]:
                add(rid, priority)
        waiting = len(sched.waiting)
        out, _ = step(sched, runner)
        check_block_invariants(sched)
        for req in out.requests:
            first.setdefault(req.request_id, len(trace))
        trace.append((waiting, getattr(sched.policy, "mode", None), sorted(r.request_id for r in out.requests)))
        clock.advance(1.0)
    return trace, first, sched.num_preemptions, requests


def test_fcfs_while_light_priority_under_the_burst_and_back_without_flapping():
    policy = LoadAwarePolicy(high_watermark=5, low_watermark=1)
    trace, first, preemptions, requests = _run(policy)
    modes = [mode for _, mode, _ in trace]
    # Light (at most 4 waiting): arrival order, c before the urgent d, nothing preempted.
    assert modes[:5] == ["fcfs"] * 5 and first["c"] == 3 < first["d"]
    # Six waiting at step 5: priority order; d and i (priority 0) take the seats of c and b at once.
    assert trace[5] == (6, "priority", ["d", "i"]) and preemptions == 2
    # Hysteresis: 4 and then 2 waiting (under the high mark) keep it in priority until at most 1 waits.
    assert [(w, m) for w, m, _ in trace[11:25]] == [(6, "priority")] + [(4, "priority")] * 6 + \
        [(2, "priority")] * 6 + [(0, "fcfs")]
    assert policy.num_switches == 2 and modes[-1] == "fcfs"
    assert sorted(first, key=lambda r: (first[r], r)) == ["a", "b", "c", "d", "i", "e", "f", "g", "h"]
    for req in requests:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.sampling_params, None, 64)


def test_plain_policies_on_the_same_arrivals_are_the_two_extremes():
    _, fcfs_first, fcfs_preemptions, _ = _run("fcfs")
    _, prio_first, prio_preemptions, _ = _run("priority")
    assert sorted(fcfs_first, key=lambda r: (fcfs_first[r], r)) == list("abcdefghi") and fcfs_preemptions == 0
    # Priority serves d from the start, before c, even while the load is light.
    assert prio_first["d"] == 0 < prio_first["c"] and prio_preemptions == 1


def test_observe_load_switches_only_past_the_marks():
    policy = LoadAwarePolicy(high_watermark=4, low_watermark=1)
    changed = [policy.observe_load(w, 2, 0.0) for w in [0, 3, 4, 3, 2, 4, 1, 2, 3, 5]]
    assert changed == [False, False, True, False, False, False, True, False, False, True]
    assert policy.mode == "priority" and policy.num_switches == 3


@pytest.mark.parametrize("high, low", [(4, 4), (4, 5), (0, 0), (3, -1), (2.5, 1)])
def test_bad_watermarks_are_rejected_naming_them(high, low):
    with pytest.raises(ValueError, match=rf"high_watermark={high!r} and low_watermark={low!r}"):
        LoadAwarePolicy(high_watermark=high, low_watermark=low)


def test_load_aware_by_name_has_the_default_marks():
    policy = get_policy("load_aware")
    assert isinstance(policy, LoadAwarePolicy) and (policy.high_watermark, policy.low_watermark) == (16, 4)
    assert policy.preempts_for_waiting and policy.observes_load
