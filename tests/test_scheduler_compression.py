"""Compressing KV blocks before preempting (``scheduler.kv.compressed_pool``), one scenario per test.

The scenario: 6 usable device blocks of 4 tokens, two requests of 8 prompt tokens and 9 outputs; each ends holding
4 blocks (16 KV tokens), 8 in all, so 2 are missing near the end. Without compression the later request is preempted
once and recomputes; with a compressed pool, 2 of their full blocks are compressed instead, at the step where the
pool first runs dry. The fake runner's compression is lossless, so every output must equal the scheduler-free
reference either way; the invariants of both pools are checked after every step.
"""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.degradation import GracefulDegradation
from scheduler.kv.tier import CopyKind
from tests._scheduler_harness import (FakeClock, FakeRunner, check_block_invariants, make_request, reference_output,
                                      run_until_done)

MAX_MODEL_LEN = 64


def _config(num_pool_blocks: int, **overrides) -> SchedulerConfig:
    cfg = dict(num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN,
               num_pool_blocks=num_pool_blocks, graceful_degradation=False)
    cfg.update(overrides)
    return SchedulerConfig(**cfg)


def _run(config: SchedulerConfig, allow=(True, True), priority=(0, 0)):
    """Both requests to the end. Returns (scheduler, requests, per step: {request id: compressed ids it holds})."""
    sched, runner = Scheduler(config, clock=FakeClock()), FakeRunner(config)
    reqs = [make_request(f"r{i}", [i + 1] * 8, params=SamplingParams(max_tokens=9, temperature=0,
                                                                      allow_kv_compression=allow[i]),
                         priority=priority[i]) for i in range(2)]
    for req in reqs:
        sched.add_request(req)
    held = []
    kv = sched.kv_cache_manager
    while sched.has_unfinished_requests():
        out = sched.schedule()
        check_block_invariants(sched)
        sched.update_from_output(out, runner(out))
        check_block_invariants(sched)
        base = config.num_blocks
        held.append({rid: [i for i in ids if i >= base] for rid, ids in kv.req_to_block_ids.items()})
    for req in reqs:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.sampling_params, None,
                                                        MAX_MODEL_LEN)
    assert sched.block_pool.num_free_blocks == config.num_blocks - 1
    cpool = kv.scaled_pool
    assert cpool is None or cpool.num_free_blocks == cpool.num_blocks - 1
    return sched, reqs, held


def test_without_compression_the_later_request_is_preempted_once():
    # The baseline of the scenario (module docstring).
    sched, reqs, _ = _run(_config(0))
    assert (sched.num_preemptions, reqs[1].num_preemptions, sched.stats.num_blocks_pooled) == (1, 1, 0)


def test_compression_replaces_the_preemption():
    sched, reqs, held = _run(_config(5))
    stats = sched.stats
    assert (sched.num_preemptions, stats.num_blocks_pooled, stats.num_pool_blocks) == (0, 2, 4)
    # Victim order (FCFS: the latest arrival first), its oldest blocks first: r1's first two blocks, slots 1 and 2.
    first = next(i for i, h in enumerate(held) if any(h.values()))
    assert held[first] == {"r0": [], "r1": [8, 9]}


def test_the_compressions_of_one_step_are_reported_as_device_block_and_slot_pairs():
    config = _config(5)
    sched, runner = Scheduler(config, clock=FakeClock()), FakeRunner(config)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", [i + 1] * 8, max_tokens=9))
    pairs = []
    while sched.has_unfinished_requests():
        before = {rid: list(ids) for rid, ids in sched.kv_cache_manager.req_to_block_ids.items()}
        out = sched.schedule()
        if out.copies(CopyKind.ENCODE):
            pairs.append((before["r1"][:2], out.copies(CopyKind.ENCODE)))
        sched.update_from_output(out, runner(out))
    assert len(pairs) == 1
    old_ids, compress = pairs[0]
    assert compress == [(old_ids[0], 1), (old_ids[1], 2)]


def test_a_pool_of_one_slot_compresses_one_block_then_preempts():
    sched, _, _ = _run(_config(2))
    assert (sched.num_preemptions, sched.stats.num_blocks_pooled) == (1, 1)


@pytest.mark.parametrize("allow, priority, holder", [
    ((True, False), (0, 0), "r0"),    # r1 opted out: r0's blocks go instead
    ((True, True), (0, -1), "r0"),    # r1 of high priority: likewise
    ((False, True), (0, 0), "r1"),
    ((True, True), (-1, 0), "r1"),
])
def test_opted_out_and_high_priority_requests_are_never_compressed(allow, priority, holder):
    sched, _, held = _run(_config(5, scheduling_policy="priority"), allow, priority)
    assert (sched.num_preemptions, sched.stats.num_blocks_pooled) == (0, 2)
    other = {"r0": "r1", "r1": "r0"}[holder]
    assert any(h.get(holder) for h in held) and not any(h.get(other) for h in held)


def test_when_no_request_may_be_compressed_the_preemption_happens_as_before():
    sched, reqs, held = _run(_config(5), allow=(False, False))
    assert (sched.num_preemptions, reqs[1].num_preemptions, sched.stats.num_blocks_pooled) == (1, 1, 0)
    assert not any(any(h.values()) for h in held)


def test_compression_without_prefix_caching():
    sched, _, _ = _run(_config(5, enable_prefix_caching=False))
    assert (sched.num_preemptions, sched.stats.num_blocks_pooled) == (0, 2)


def _finish_exactly(sched, runner, reqs):
    """Run ``sched`` to the end; every request then holds exactly its scheduler-free reference output."""
    run_until_done(sched, runner)
    for req in reqs:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.sampling_params, None,
                                                        MAX_MODEL_LEN)


def test_preempting_a_request_with_compressed_blocks_frees_both_kinds():
    config = _config(5)
    sched, runner = Scheduler(config, clock=FakeClock()), FakeRunner(config)
    reqs = [make_request(f"r{i}", [i + 1] * 8, max_tokens=9) for i in range(2)]
    for req in reqs:
        sched.add_request(req)
    kv = sched.kv_cache_manager
    while not any(b >= config.num_blocks for b in kv.get_block_ids("r1")):
        out = sched.schedule()
        sched.update_from_output(out, runner(out))
    # r1: 2 compressed blocks and 2 device blocks; r0: 4 device blocks; nothing free on the device.
    ids = kv.get_block_ids("r1")
    assert (len(ids), sum(b >= config.num_blocks for b in ids), len(kv.get_block_ids("r0"))) == (4, 2, 4)
    assert (sched.block_pool.num_free_blocks, kv.scaled_pool.num_free_blocks) == (0, 2)
    sched.reset_prefix_cache(reset_running_requests=True)  # a recompute preemption of every running request
    check_block_invariants(sched)
    assert (sched.block_pool.num_free_blocks, kv.scaled_pool.num_free_blocks) == (6, 4)
    _finish_exactly(sched, runner, reqs)


@pytest.mark.parametrize("num_compressed, preempted, compressed", [(0, [(4, ["r1"])], []), (5, [], [(4, 1), (5, 3)])])
def test_an_urgent_arrival_compresses_instead_of_preempting(num_compressed, preempted, compressed):
    """Under the priority policy an urgent arrival may preempt a running request for its blocks; compression frees
    them instead (1 block for its prompt at its arrival, then 3 as the others grow)."""
    config = _config(num_compressed, scheduling_policy="priority")
    sched, runner = Scheduler(config, clock=FakeClock()), FakeRunner(config)
    reqs = [make_request(f"r{i}", [i + 1] * 8, max_tokens=9, priority=1) for i in range(2)]
    for req in reqs:
        sched.add_request(req)
    seen_preempted, seen_compressed, n = [], [], 0
    while sched.has_unfinished_requests():
        if n == 4:
            reqs.append(make_request("urgent", [7] * 4, max_tokens=2, priority=0))
            sched.add_request(reqs[-1])
        out = sched.schedule()
        check_block_invariants(sched)
        if out.preempted:
            seen_preempted.append((n, [r.request_id for r in out.preempted]))
        if out.copies(CopyKind.ENCODE):
            seen_compressed.append((n, len(out.copies(CopyKind.ENCODE))))
        sched.update_from_output(out, runner(out))
        n += 1
    assert (seen_preempted, seen_compressed) == (preempted, compressed)
    for req in reqs:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.sampling_params, None,
                                                        MAX_MODEL_LEN)


def test_a_discarded_output_restarts_the_requests_its_compressions_touched():
    """A step that never ran never re-encoded its blocks: whoever holds them starts over (the fake runner would
    read -1s from the compressed pool otherwise, and the outputs would differ from the reference)."""
    config = _config(5)
    sched, runner = Scheduler(config, clock=FakeClock()), FakeRunner(config)
    reqs = [make_request(f"r{i}", [i + 1] * 8, max_tokens=9) for i in range(2)]
    for req in reqs:
        sched.add_request(req)
    while True:
        out = sched.schedule()
        if out.copies(CopyKind.ENCODE):
            break
        sched.update_from_output(out, runner(out))
    sched.discard_output(out)
    check_block_invariants(sched)
    assert not sched.running and sched.kv_cache_manager.scaled_pool.num_free_blocks == 4
    _finish_exactly(sched, runner, reqs)


def test_graceful_degradation_backs_off_only_once_compression_cannot_cover():
    # Every step under the low-water mark (half the blocks free) counts as pressure unless compression can free
    # enough blocks to lift it.
    settings = GracefulDegradation(low_free_fraction=0.5, cooldown=1)
    plain, _, _ = _run(_config(0, graceful_degradation=settings))
    compressed, _, _ = _run(_config(5, graceful_degradation=settings))
    assert (plain.degradation.num_backoffs, compressed.degradation.num_backoffs) == (8, 3)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_pool_blocks=1), "num_pool_blocks=1 is out of range: must be 0 .* or an int >= 2"),
    (dict(num_pool_blocks=True), "num_pool_blocks=True"),
    (dict(num_pool_blocks=4, preemption_mode="swap", num_host_blocks=4), "preemption_mode='swap'"),
    (dict(num_pool_blocks=4, num_offload_blocks=4), r"host tier \(num_offload_blocks=4\)"),
])
def test_bad_compression_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(num_blocks=7, **overrides)


def test_allow_kv_compression_must_be_a_bool():
    with pytest.raises(ValueError, match="allow_kv_compression=1 is out of range: must be True or False"):
        SamplingParams(allow_kv_compression=1)


def test_compaction_and_resizing_are_refused_with_a_compressed_pool():
    sched = Scheduler(_config(5))
    with pytest.raises(ValueError, match=r"compact_kv_cache\(\): not with a compressed KV pool"):
        sched.compact_kv_cache()
    with pytest.raises(ValueError, match=r"resize_kv_cache\(num_blocks=9\): not with a compressed KV pool"):
        sched.resize_kv_cache(9)
    assert sched.block_pool.num_blocks == 7 and np.all(sched.kv_cache_manager.block_table.lengths == 0)
