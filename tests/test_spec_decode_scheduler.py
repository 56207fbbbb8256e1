"""Speculative decoding in the scheduler: draft tokens on decode rows, rollback of rejected ones, lookahead slots.

The fake runner (``FakeSpecRunner``) verifies drafts greedily against the fake model, which samples from the KV it
reads back through the block tables: a draft whose slot, rollback or prefix-cache hash went wrong changes the
generated tokens. The stateful machine is the scheduler's (random arrivals, shared prefixes, aborts, preemption
in both modes, chunked prefill), with drafts handed in before every step -- correct continuations, corrupted ones
and random lengths -- and random lookahead; every request must still generate exactly the scheduler-free
reference, and every block come back.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.block_hash import extend_block_hashes
from tests._scheduler_harness import (
    VOCAB,
    FakeSpecRunner,
    check_block_invariants,
    make_request,
    reference_output,
)
from tests.test_scheduler_stateful import MAX_MODEL_LEN, SchedulerMachine

MAX_DRAFTS = 5


def _propose(sched: Scheduler, rng: np.random.Generator, references: dict) -> None:
    """Drafts for every running request: its true continuation, sometimes corrupted, of random length."""
    drafts = {}
    for req in sched.running:
        key = (tuple(req.prompt_token_ids), req.sampling_params.max_tokens, req.sampling_params.min_tokens,
               req.eos_token_id)
        if key not in references:
            references[key] = reference_output(req.prompt_token_ids, req.sampling_params, req.eos_token_id,
                                               MAX_MODEL_LEN) + [0] * MAX_DRAFTS
        true = references[key][req.num_output_tokens: req.num_output_tokens + MAX_DRAFTS]
        guess = [t if rng.random() < 0.8 else int(rng.integers(VOCAB)) for t in true]
        drafts[req.request_id] = guess[: int(rng.integers(0, MAX_DRAFTS + 1))]
    sched.update_draft_token_ids(drafts)


class SpecSchedulerMachine(SchedulerMachine):
    @initialize(
        num_blocks=st.integers(2, 12),
        caching=st.booleans(),
        chunked=st.booleans(),
        threshold=st.sampled_from([0, 5]),
        lookahead=st.sampled_from([0, 3]),
        seed=st.integers(0, 2**16),
    )
    def setup(self, num_blocks, caching, chunked, threshold, lookahead, seed):
        SchedulerMachine.setup(self, num_blocks, caching, chunked, threshold)
        self.config.num_lookahead_tokens = lookahead
        self.runner = FakeSpecRunner(self.config)
        self.rng = np.random.default_rng(seed)
        self.references = {}

    def step(self):
        _propose(self.sched, self.rng, self.references)
        out = self.sched.schedule()
        self.broken = True
        for row in out.scheduled:
            req = row.request
            assert row.num_spec_tokens <= len(req.spec_token_ids)
            if row.num_spec_tokens:
                # A decode row, and nothing written at or past the length limit.
                assert row.num_computed_tokens == req.num_tokens - 1 and row.samples
                assert row.num_computed_tokens + row.num_new_tokens <= req.length_limit - 1
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        check_block_invariants(self.sched)
        updated = self.sched.update_from_output(out, *self.runner(out))
        self.broken = False
        assert len({id(r) for r in updated}) == len(updated)
        kv, bs = self.sched.kv_cache_manager, self.config.block_size
        for req in self.sched.running:
            assert req.num_computed_tokens <= req.num_tokens
            # Registered blocks hold accepted tokens only: their hashes are those of the request's own tokens.
            registered = kv._num_cached.get(req.request_id, 0)
            assert registered <= req.num_computed_tokens // bs
            expected = []
            extend_block_hashes(expected, req.all_token_ids, req.num_tokens // bs, bs, req.cache_salt, req.prompt_array)
            assert req.block_hashes[:registered] == expected[:registered]


def _test_case(mode):
    machine = type(f"SpecSchedulerMachine_{mode}", (SpecSchedulerMachine,), {"policy": "fcfs", "mode": mode})
    case = machine.TestCase
    case.settings = settings(
        max_examples=30, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    return case


TestSpecStatefulRecompute = _test_case("recompute")
TestSpecStatefulSwap = _test_case("swap")


def _scheduler(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(**{**dict(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                                                max_model_len=64), **kw}))


def _decode_ready(sched: Scheduler, req) -> FakeSpecRunner:
    runner = FakeSpecRunner(sched.config)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, *runner(out))
    assert req.num_computed_tokens == req.num_tokens - 1
    return runner


def test_drafts_ride_on_the_decode_row_and_rejected_ones_are_taken_back():
    sched = _scheduler()
    req = make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=20)
    runner = _decode_ready(sched, req)
    true = reference_output(req.prompt_token_ids, req.sampling_params, None, 64)
    sched.update_draft_token_ids({"a": [true[1], true[2], (true[3] + 1) % VOCAB, true[4]]})
    out = sched.schedule()
    assert (out.num_new_tokens.tolist(), out.num_spec_tokens.tolist()) == ([5], [4])
    assert out.total_num_scheduled_tokens == 5
    tokens, counts = runner(out)
    assert counts.tolist() == [3]  # two drafts accepted, then the model's own token
    sched.update_from_output(out, tokens, counts)
    assert req.output_token_ids == true[:4]
    assert req.num_computed_tokens == req.num_tokens - 1 == 9
    assert req.spec_token_ids == []


def test_drafts_are_cut_at_the_length_limit_and_dropped_off_a_decode():
    sched = _scheduler()
    req = make_request("a", [1, 2, 3], max_tokens=4)
    _decode_ready(sched, req)
    sched.update_draft_token_ids({"a": [7, 7, 7, 7, 7], "unknown": [1]})
    assert req.spec_token_ids == [7, 7]  # 1 output + 1 sampled + 2 drafts = max_tokens
    waiting = make_request("b", list(range(1, 40)), max_tokens=4)
    sched.add_request(waiting)
    sched.update_draft_token_ids({"b": [1, 2]})
    assert waiting.spec_token_ids == []


def test_drafts_give_way_to_the_budget():
    sched = _scheduler(max_num_batched_tokens=8)
    a, b = make_request("a", [1, 2, 3], max_tokens=30), make_request("b", [4, 5, 6], max_tokens=30)
    runner = FakeSpecRunner(sched.config)
    for req in (a, b):
        sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, *runner(out))
    sched.update_draft_token_ids({"a": [1] * 5, "b": [2] * 5})
    out = sched.schedule()
    assert out.num_new_tokens.tolist() == [6, 2] and out.num_spec_tokens.tolist() == [5, 1]
    sched.update_from_output(out, *runner(out))
    assert a.spec_token_ids == b.spec_token_ids == []
    check_block_invariants(sched)


def test_lookahead_slots_are_reserved_while_blocks_last():
    sched = _scheduler(num_lookahead_tokens=5, num_blocks=9)
    blocks = sched.kv_cache_manager.get_block_ids
    a = make_request("a", [1, 2, 3, 4, 5], max_tokens=12)
    runner = _decode_ready(sched, a)
    assert len(blocks("a")) == 2  # admissions take no lookahead
    out = sched.schedule()
    sched.update_from_output(out, *runner(out))
    # 6 computed + 1 new + 5 lookahead slots = 12 slots: 3 blocks of 4.
    assert len(blocks("a")) == 3
    sched.add_request(make_request("b", list(range(20, 36)), max_tokens=4))
    out = sched.schedule()
    sched.update_from_output(out, *runner(out))
    assert (len(blocks("a")), len(blocks("b")), sched.block_pool.num_free_blocks) == (3, 4, 1)
    # Both want a lookahead block, one is free: neither gets lookahead, b gets the block its token needs.
    out = sched.schedule()
    sched.update_from_output(out, *runner(out))
    assert (len(blocks("a")), len(blocks("b")), sched.block_pool.num_free_blocks) == (3, 5, 0)
    check_block_invariants(sched)


def test_preempting_a_request_drops_its_drafts():
    sched = _scheduler(num_blocks=5, max_num_seqs=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=9)
    runner = _decode_ready(sched, a)
    b = make_request("b", [9, 8, 7, 6, 5, 4, 3], max_tokens=9)
    sched.add_request(b)
    out = sched.schedule()
    sched.update_from_output(out, *runner(out))
    sched.update_draft_token_ids({"a": [1, 2, 3], "b": [1, 2, 3]})
    out = sched.schedule()
    assert out.preempted and all(r.spec_token_ids == [] for r in out.preempted)
    sched.update_from_output(out, *runner(out))
    check_block_invariants(sched)


def test_a_stop_token_among_accepted_drafts_ends_the_row_there():
    params = SamplingParams(temperature=0, max_tokens=20)
    prompt = [1, 2, 3, 4, 5, 6]
    true = reference_output(prompt, params, None, 64)
    eos = true[2]
    sched = _scheduler()
    req = make_request("a", prompt, params=params, eos_token_id=eos)
    runner = _decode_ready(sched, req)
    sched.update_draft_token_ids({"a": true[1:5]})
    out = sched.schedule()
    updated = sched.update_from_output(out, *runner(out))
    assert updated == [req] and req.is_finished
    assert req.output_token_ids == true[:3] == reference_output(prompt, params, eos, 64)
    assert sched.block_pool.num_free_blocks == sched.config.num_blocks - 1
