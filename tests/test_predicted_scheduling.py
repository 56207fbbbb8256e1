"""Predicted output lengths in the scheduler: learned at finishes, ordering ``scheduling_policy="predicted"`` (with its
anti-starvation bound), and reserving blocks at admission (``reserve_predicted_output``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import PredictedPolicy, RequestStatus, SamplingParams, Scheduler, SchedulerConfig, get_policy
from tests._scheduler_harness import FakeClock, FakeRunner, check_block_invariants, make_request, step

EOS = 0
SYSTEM_A = [1, 2, 3, 4, 11, 12, 13, 14]
SYSTEM_B = [1, 2, 3, 4, 21, 22, 23, 24]


def setup(**overrides) -> Scheduler:
    cfg = dict(num_blocks=65, block_size=4, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64)
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg), clock=FakeClock())


def eos_request(rid: str, prompt, max_tokens: int = 40):
    return make_request(rid, prompt, params=SamplingParams(max_tokens=max_tokens), eos_token_id=EOS)


def run(sched: Scheduler, lengths: dict[str, int], admitted: list[str] | None = None, arrivals=None) -> None:
    """Step until done; request ``rid`` emits eos as its ``lengths[rid]``-th token. ``admitted`` collects request ids
    in the order they were first scheduled; ``arrivals`` maps a step number to requests added before it."""
    seen = set()
    for n in range(10_000):
        for req in (arrivals or {}).get(n, ()):
            sched.add_request(req)
        if not sched.has_unfinished_requests() and n > max(arrivals or {0: 0}):
            return
        out = sched.schedule()
        for req in out.requests:
            if admitted is not None and req.request_id not in seen:
                seen.add(req.request_id)
                admitted.append(req.request_id)
        sched.update_from_output(out, [EOS if r.num_output_tokens + 1 >= lengths[r.request_id] else 1
                                       for r in out.requests])
        check_block_invariants(sched)
    raise AssertionError("not done after 10000 steps")


def train(sched: Scheduler, samples, max_tokens: int = 40) -> None:
    """Finish one request per ``(prompt, output length)``, one after another."""
    for i, (prompt, length) in enumerate(samples):
        sched.add_request(eos_request(f"train{i}", prompt, max_tokens))
        run(sched, {f"train{i}": length})


# ------------------------------------------------------------------------------------------------- learning


def test_under_any_policy_each_arrival_is_predicted_its_templates_last_output_length():
    sched = setup()
    train(sched, [(SYSTEM_A + [5], 3), (SYSTEM_B + [5], 20)])
    a, b = eos_request("a", SYSTEM_A + [6]), eos_request("b", SYSTEM_B + [6])
    sched.add_request(a)
    sched.add_request(b)
    assert (a.predicted_output_tokens, b.predicted_output_tokens) == (3, 20)


def test_stats_count_predictions_outputs_and_errors_of_finished_requests():
    sched = setup()
    # Predicted: 40 (the prior 128 capped at max_tokens), then 3 (the template's first output).
    train(sched, [(SYSTEM_A, 3), (SYSTEM_A, 5)])
    s = sched.stats
    assert (s.num_predicted_finished, s.predicted_output_tokens, s.actual_output_tokens,
            s.prediction_abs_error_tokens) == (2, 43, 8, 39)


def test_an_aborted_request_teaches_the_predictor_nothing():
    sched = setup()
    sched.add_request(eos_request("gone", SYSTEM_A))
    step(sched, FakeRunner(sched.config))
    sched.abort_request("gone")
    late = eos_request("late", SYSTEM_A)
    sched.add_request(late)
    assert (sched.stats.num_predicted_finished, late.predicted_output_tokens) == (0, 40)


# ------------------------------------------------------------------------------------------------- the policy


@pytest.mark.parametrize("policy, order", [("predicted", ["short", "long"]), ("sjf", ["long", "short"])])
def test_predicted_admits_the_template_predicted_shorter_first_where_sjf_goes_by_prompt(policy, order):
    sched = setup(scheduling_policy=policy)
    train(sched, [(SYSTEM_A + [5], 2), (SYSTEM_B + [5], 20)])
    admitted = []
    run(sched, {"long": 20, "short": 2}, admitted, arrivals={0: [eos_request("long", SYSTEM_B + [6]),
                                                             eos_request("short", SYSTEM_A + [6, 7, 8, 9, 10])]})
    assert admitted == order


def _short_stream_behind_a_long_request(policy):
    """A long request (max_tokens 20) then, one per step for 60 steps, short ones (max_tokens 2) into one seat.
    Returns the long request and how many short ones were first scheduled before it."""
    sched = setup(scheduling_policy=policy, num_blocks=129)
    runner = FakeRunner(sched.config)
    sched.add_request(make_request("busy", [9] * 4, max_tokens=3))
    step(sched, runner)
    long = make_request("long", [8] * 4, max_tokens=20)
    sched.add_request(long)
    overtakers: set[str] = set()
    for t in range(60):
        sched.add_request(make_request(f"s{t}", [t % 40 + 10] * 4, max_tokens=2))
        out, _ = step(sched, runner)
        if long.first_scheduled_time is None:
            overtakers.update(r.request_id for r in out.requests if r.request_id.startswith("s"))
    return long, len(overtakers)


def test_a_long_request_is_overtaken_by_exactly_the_bounds_number_of_short_arrivals():
    long, overtakers = _short_stream_behind_a_long_request(PredictedPolicy(aging_per_arrival=1.0,
                                                                           max_num_batched_tokens=16))
    # W(long) - W(short) = 20 - 2: a short request k arrivals later overtakes it while k < 18.
    assert (long.status, overtakers) == (RequestStatus.FINISHED_LENGTH_CAPPED, 17)


def test_sjf_starves_it_under_the_same_stream():
    long, overtakers = _short_stream_behind_a_long_request("sjf")
    assert (long.status, long.first_scheduled_time) == (RequestStatus.WAITING, None)


@settings(max_examples=60, deadline=None)
@given(
    jobs=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(0, 9), st.integers(0, 3)),
                  min_size=1, max_size=14),
    seats=st.integers(1, 3),
    num_blocks=st.integers(16, 48),
    beta=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    training=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30)), max_size=4),
    reserve=st.booleans(),
)
def test_no_request_is_overtaken_by_more_later_arrivals_than_the_theorem_allows(jobs, seats, num_blocks, beta,
                                                                                training, reserve):
    """Any arrivals (template, true output length, user prompt tokens, steps to the next arrival), predictions
    trained or not, blocks reserved for them or not: a request r is first scheduled after a later arrival k requests behind it only if
    k < (W(r) - 1) / beta, so after at most ceil((W(r) - 1) / beta) - 1 of them."""
    sched = setup(scheduling_policy=PredictedPolicy(beta, 16), max_num_seqs=seats, num_blocks=num_blocks,
                  reserve_predicted_output=reserve)
    systems = [SYSTEM_A, SYSTEM_B, [5, 6, 7, 8, 31, 32, 33, 34]]
    train(sched, [(systems[t], n) for t, n in training])
    arrivals, lengths, work, t = {}, {}, {}, 0
    for i, (template, length, user, gap) in enumerate(jobs):
        req = eos_request(f"j{i}", systems[template] + [40 + i] * user)
        arrivals.setdefault(t, []).append(req)
        lengths[req.request_id] = length
        t += gap
    originals = sched.add_request

    def add_and_measure(req):
        originals(req)
        work[req.request_id] = sched.policy.remaining_work(req)

    sched.add_request = add_and_measure
    admitted = []
    run(sched, lengths, admitted, arrivals)
    rank = {rid: i for i, rid in enumerate(admitted)}
    for i in range(len(jobs)):
        overtaken_by = [k - i for k in range(i + 1, len(jobs)) if rank[f"j{k}"] < rank[f"j{i}"]]
        w = work[f"j{i}"]
        assert all(k < (w - 1) / beta for k in overtaken_by)
        assert len(overtaken_by) <= max(math.ceil((w - 1) / beta) - 1, 0)


def test_the_latest_longest_running_request_is_the_victim():
    policy = PredictedPolicy(aging_per_arrival=1.0, max_num_batched_tokens=16)
    sched = setup(scheduling_policy=policy, max_num_seqs=3)
    requests = [eos_request(rid, SYSTEM_A, max_tokens=n) for rid, n in (("a", 30), ("b", 5), ("c", 30))]
    for req in requests:
        sched.add_request(req)
    assert policy.select_victim(requests, 0.0).request_id == "c"


@pytest.mark.parametrize("kwargs, message", [
    (dict(aging_per_arrival=0), r"aging_per_arrival=0 must be > 0 \(steps per arrival\)"),
    (dict(aging_per_arrival=True), r"aging_per_arrival=True must be > 0"),
    (dict(aging_per_arrival=float("nan")), r"aging_per_arrival=nan must be > 0"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens=0 must be an int >= 1"),
])
def test_out_of_range_policy_arguments_are_refused_naming_the_value_and_the_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PredictedPolicy(**kwargs)


def test_by_name_the_policy_takes_the_schedulers_token_budget_and_ignores_priority():
    sched = setup(scheduling_policy="predicted", max_num_batched_tokens=32)
    assert (type(sched.policy), sched.policy.max_num_batched_tokens, sched.policy.aging_per_arrival) == (
        PredictedPolicy, 32, 4.0)
    assert get_policy("predicted").reads_priority is False


# ------------------------------------------------------------------------------------------------- reservation


def _two_requests_of_14_tokens_in_ten_blocks(reserve: bool):
    """Two 8-token prompts that cannot stop before 14 outputs (so each is predicted 14 and needs 6 blocks) into
    10 free blocks. Returns the requests, the scheduler's preemptions, and b's first step."""
    sched = setup(num_blocks=11, max_num_seqs=2, reserve_predicted_output=reserve)
    runner = FakeRunner(sched.config)
    requests = [make_request(rid, SYSTEM_A, params=SamplingParams(max_tokens=14, ignore_eos=True)) for rid in "ab"]
    for req in requests:
        sched.add_request(req)
    first_step_of_b = None
    for n in range(100):
        if not sched.has_unfinished_requests():
            break
        out, _ = step(sched, runner)
        check_block_invariants(sched)
        if first_step_of_b is None and requests[1] in out.requests:
            first_step_of_b = n
    return requests, sched.num_preemptions, first_step_of_b


def test_without_reservation_both_are_admitted_and_the_second_is_preempted_once():
    (a, b), preemptions, first_step_of_b = _two_requests_of_14_tokens_in_ten_blocks(reserve=False)
    assert (preemptions, a.num_preemptions, b.num_preemptions, first_step_of_b) == (1, 0, 1, 0)


def test_reservation_holds_the_second_back_until_the_first_finishes_and_nothing_is_preempted():
    (a, b), preemptions, first_step_of_b = _two_requests_of_14_tokens_in_ten_blocks(reserve=True)
    # a's prefill step and 13 decode steps, then b.
    assert (preemptions, first_step_of_b, b.status) == (0, 14, RequestStatus.FINISHED_LENGTH_CAPPED)


def test_reservation_admits_side_by_side_requests_whose_predicted_outputs_fit():
    sched = setup(num_blocks=11, max_num_seqs=2, reserve_predicted_output=True)
    train(sched, [(SYSTEM_A, 3)], max_tokens=14)
    admitted = []
    run(sched, {"a": 3, "b": 3}, admitted, arrivals={0: [eos_request("a", SYSTEM_A + [5], 14),
                                                          eos_request("b", SYSTEM_A + [6], 14)]})
    # Predicted 3 outputs each: 3 blocks each of 10 free.
    assert (admitted, sched.num_preemptions) == (["a", "b"], 0)


def test_reserve_predicted_output_must_be_a_bool():
    with pytest.raises(ValueError, match=r"reserve_predicted_output='yes' is out of range: must be a bool"):
        SchedulerConfig(num_blocks=11, reserve_predicted_output="yes")
