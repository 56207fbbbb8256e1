"""Scheduler.fork_request: n continuations sharing a prefilled prompt's KV blocks."""

import pytest

from scheduler import RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from tests._scheduler_harness import (
    FakeClock,
    FakeRunner,
    check_block_invariants,
    make_request,
    reference_output,
    run_until_done,
    step,
)

PROMPT = [5, 8, 13, 21, 34, 2, 7, 1, 9, 4]  # 10 tokens; the parent prefills 9: two full blocks and one partial


def _prefilled_parent(**overrides):
    cfg = dict(num_blocks=33, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64)
    cfg.update(overrides)
    config = SchedulerConfig(**cfg)
    sched, runner = Scheduler(config, clock=FakeClock()), FakeRunner(config)
    parent = make_request("parent", PROMPT[:-1], params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    sched.add_request(parent)
    step(sched, runner)
    return sched, runner, parent


def _copy(runner, pairs):
    bs = runner.block_size
    for src, dst in pairs:
        runner.kv[dst * bs:(dst + 1) * bs] = runner.kv[src * bs:(src + 1) * bs]


def _children(k):
    return [make_request(f"c{i}", PROMPT, max_tokens=6 + i) for i in range(k)]


def test_forked_children_share_full_blocks_and_copy_the_partial_one():
    sched, runner, parent = _prefilled_parent()
    parent_blocks = sched.kv_cache_manager.get_block_ids("parent")[:]
    children = _children(3)
    copies = sched.fork_request("parent", children)
    check_block_invariants(sched)
    tables = [sched.kv_cache_manager.get_block_ids(c.request_id) for c in children]
    assert tables[0] == parent_blocks
    assert all(t[:2] == parent_blocks[:2] for t in tables)
    assert [sched.block_pool.blocks[b].ref_cnt for b in parent_blocks[:2]] == [3, 3]
    assert copies == [(parent_blocks[2], tables[1][2]), (parent_blocks[2], tables[2][2])]
    assert parent.status == RequestStatus.FINISHED_STOPPED and "parent" not in sched.requests
    _copy(runner, copies)
    run_until_done(sched, runner, check=check_block_invariants)
    for c in children:
        assert c.output_token_ids == reference_output(PROMPT, c.sampling_params, None, 64)
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_blocks - 1


def test_children_beyond_free_seats_are_queued_and_still_finish():
    sched, runner, _ = _prefilled_parent(max_num_seqs=2)
    children = _children(3)
    _copy(runner, sched.fork_request("parent", children))
    assert [c.status for c in children] == [RequestStatus.RUNNING] * 2 + [RequestStatus.WAITING]
    run_until_done(sched, runner, check=check_block_invariants)
    for c in children:
        assert c.output_token_ids == reference_output(PROMPT, c.sampling_params, None, 64)
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_blocks - 1


def test_fork_rejects_a_child_that_does_not_continue_the_parent():
    sched, _, _ = _prefilled_parent()
    with pytest.raises(ValueError, match="continuation"):
        sched.fork_request("parent", [make_request("c", [99] + PROMPT[1:])])


@pytest.mark.parametrize("prefill_budget, lookahead", [(4, 4), (4, 7), (8, 4), (8, 5)])
def test_blocks_reserved_past_the_computed_tokens_stay_with_the_first_child(prefill_budget, lookahead):
    """A parent holding blocks beyond its computed tokens (lookahead slots of a chunked prefill): only the blocks
    holding computed tokens are shared; the others stay with the first child. Regression: every child shared the
    reserved block and wrote its own tokens into it (an 8-token parent, chunks of 4 tokens, lookahead 3)."""
    config = SchedulerConfig(num_blocks=33, block_size=4, max_num_seqs=4, max_num_batched_tokens=prefill_budget,
                             max_model_len=64, num_lookahead_tokens=lookahead)
    sched, runner = Scheduler(config, clock=FakeClock()), FakeRunner(config)
    parent = make_request("parent", PROMPT[:-1], params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    parent.prefill_only = True
    sched.add_request(parent)
    while parent.num_computed_tokens < len(PROMPT) - 1:
        step(sched, runner)
    parent_blocks = sched.kv_cache_manager.get_block_ids("parent")[:]
    used = -(-parent.num_computed_tokens // 4)
    assert len(parent_blocks) > used  # the case under test: a block past the computed tokens
    children = _children(3)
    copies = sched.fork_request("parent", children)
    check_block_invariants(sched)
    tables = [sched.kv_cache_manager.get_block_ids(c.request_id) for c in children]
    assert tables[0] == parent_blocks
    for t in tables[1:]:
        assert t[:used - 1] == parent_blocks[:used - 1] and len(t) == used and not set(t[used - 1:]) & set(parent_blocks)
    assert copies == [(parent_blocks[used - 1], t[used - 1]) for t in tables[1:]]
    _copy(runner, copies)
    run_until_done(sched, runner, check=check_block_invariants)
    for c in children:
        assert c.output_token_ids == reference_output(PROMPT, c.sampling_params, None, 64)
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_blocks - 1
