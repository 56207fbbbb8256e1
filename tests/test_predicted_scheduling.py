"""Predicted output lengths in the scheduler: set at arrival, learned at finishes."""

from __future__ import annotations

from scheduler import SamplingParams, Scheduler, SchedulerConfig
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
