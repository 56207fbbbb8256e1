"""The prefix cache's host tier (``scheduler.kv.host_tier``) in the scheduler, against the fake runner's simulated KV:
eviction to host and revival with exact contents, host hits equal to fresh computation, the tier's LRU, load
budget, events and reset."""

import numpy as np
import pytest

from scheduler import Scheduler, SchedulerConfig
from scheduler.kv.host_tier import HostTier
from scheduler.kv.tier import BlockCopy, CopyKind
from scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests._scheduler_harness import FakeRunner, check_block_invariants, make_request, reference_output, run_until_done

BS = 4


def _sched(num_blocks=5, num_offload_blocks=8, **kw):
    config = SchedulerConfig(num_blocks=num_blocks, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=64, num_offload_blocks=num_offload_blocks, **kw)
    return Scheduler(config), FakeRunner(config)


def _run(sched, runner, rid, prompt, max_tokens=1):
    req = make_request(rid, prompt, max_tokens=max_tokens)
    sched.add_request(req)
    outs = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        outs.append(out)
        sched.update_from_output(out, runner(out))
        check_block_invariants(sched)
    assert req.output_token_ids == reference_output(prompt, req.sampling_params, None, 64)
    return req, outs


A = list(range(1, 9))  # two full blocks
B = list(range(20, 33))  # three full blocks and one token


def test_evicted_block_is_offloaded_then_revived_with_exact_contents():
    sched, runner = _sched()
    a, _ = _run(sched, runner, "a", A)
    a_blocks = [sched.block_pool.cached[h].block_id for h in a.block_hashes]
    _, outs = _run(sched, runner, "b", B)
    # B needs all four usable blocks, so both of A's cached blocks are reused (A's tail first: a request's
    # blocks are freed tail first), copied to slots 0 and 1 before.
    assert outs[0].copies(CopyKind.OFFLOAD) == [(a_blocks[1], 0), (a_blocks[0], 1)]
    assert runner.host[0].tolist() == A[4:] and runner.host[1].tolist() == A[:4]
    again, outs = _run(sched, runner, "a2", A + [40])
    loads = outs[0].copies(CopyKind.LOAD)
    assert [slot for slot, _ in loads] == [1, 0]
    assert [runner.kv[d * BS:(d + 1) * BS].tolist() for _, d in loads] == [A[:4], A[4:]]
    assert (outs[0].num_computed_tokens.tolist(), outs[0].num_new_tokens.tolist()) == ([8], [1])
    assert sched.prefix_cache_hits_host == 8
    assert [sched.block_pool.cached[h].block_id for h in again.block_hashes[:2]] == [d for _, d in loads]


def test_host_hit_gives_the_tokens_of_a_fresh_computation():
    prompt = list(range(1, 14))
    sched, runner = _sched(num_blocks=6)
    _run(sched, runner, "a", prompt[:12])
    _run(sched, runner, "b", B)  # takes the two unhashed blocks, then a's last two
    hit, outs = _run(sched, runner, "a2", prompt, max_tokens=6)
    assert len(outs[0].copies(CopyKind.LOAD)) == 2 and outs[0].num_computed_tokens.tolist() == [12]
    fresh_sched, fresh_runner = _sched(num_blocks=6, num_offload_blocks=0)
    fresh, fresh_outs = _run(fresh_sched, fresh_runner, "a2", prompt, max_tokens=6)
    assert fresh_outs[0].num_computed_tokens.tolist() == [0]
    assert hit.output_token_ids == fresh.output_token_ids


def test_host_hits_never_cover_the_last_token():
    sched, runner = _sched()
    _run(sched, runner, "a", A)
    _run(sched, runner, "b", B)
    # A whole-block prompt all in the host tier: the last block is recomputed, not copied on write.
    _, outs = _run(sched, runner, "a2", A)
    assert len(outs[0].copies(CopyKind.LOAD)) == 1 and not outs[0].copies(CopyKind.COPY)
    assert (outs[0].num_computed_tokens.tolist(), outs[0].num_new_tokens.tolist()) == ([4], [4])


def test_host_tier_lru_evicts_its_least_recent_block_under_pressure():
    sched, runner = _sched(num_offload_blocks=2)
    _run(sched, runner, "a", A)
    _run(sched, runner, "b", B)  # A's two blocks fill the tier
    tier = sched.block_pool.host_tier
    assert list(tier.slots) == a_hashes(sched, A)[::-1]
    # B's three blocks, offloaded tail first, evict A's and then the first of their own.
    _run(sched, runner, "c", list(range(60, 73)))
    b_hashes = a_hashes(sched, B[:12])
    assert list(tier.slots) == [b_hashes[1], b_hashes[0]] and tier.num_free_slots == 0
    assert runner.host[tier.slots[b_hashes[0]]].tolist() == B[:4]


def a_hashes(sched, tokens):
    probe = make_request("probe", tokens)
    sched.kv_cache_manager.hash_blocks(probe)
    return probe.block_hashes


def test_prefix_evicted_from_both_tiers_is_recomputed():
    sched, runner = _sched(num_offload_blocks=2)
    _run(sched, runner, "a", A)
    _run(sched, runner, "b", B)
    _run(sched, runner, "c", list(range(60, 73)))
    again, outs = _run(sched, runner, "a2", A + [40], max_tokens=4)
    assert not outs[0].copies(CopyKind.LOAD) and outs[0].num_computed_tokens.tolist() == [0]
    assert sched.prefix_cache_hits_host == 0


def test_cache_salt_isolates_host_tier_hits():
    sched, runner = _sched()
    sched.add_request(make_request("a", A, max_tokens=1, cache_salt="alice"))
    run_until_done(sched, runner)
    _run(sched, runner, "b", B)
    bob = make_request("bob", A + [40], max_tokens=1, cache_salt="bob")
    sched.add_request(bob)
    out = sched.schedule()
    assert not out.copies(CopyKind.LOAD) and out.num_computed_tokens.tolist() == [0]


def test_a_second_loading_request_waits_past_the_step_load_budget():
    config = SchedulerConfig(num_blocks=9, block_size=BS, max_num_seqs=4, max_num_batched_tokens=8,
                             max_model_len=64, num_offload_blocks=16)
    sched, runner = Scheduler(config), FakeRunner(config)
    for rid, prompt in (("a", A), ("c", list(range(60, 68)))):
        _run(sched, runner, rid, prompt)
    _run(sched, runner, "b", list(range(20, 52)))  # fills the device: A's and C's blocks go to the host
    for rid, prompt in (("a2", A + [1]), ("c2", list(range(60, 68)) + [1])):
        sched.add_request(make_request(rid, prompt, max_tokens=1))
    # The budget is 8 // 4 = 2 blocks: a2 loads 2, so c2 (2 more) waits a step.
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["a2"] and len(out.copies(CopyKind.LOAD)) == 2
    sched.update_from_output(out, runner(out))
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["c2"] and len(out.copies(CopyKind.LOAD)) == 2


def test_events_name_the_tier_of_each_store_and_removal():
    sched, runner = _sched(num_offload_blocks=2, enable_kv_cache_events=True)
    _run(sched, runner, "a", A)
    sched.take_kv_events()
    _run(sched, runner, "b", B)
    ha = a_hashes(sched, A)
    events = sched.take_kv_events()
    assert events[:3] == [BlockStored([ha[1]], None, [], BS, "CPU"), BlockStored([ha[0]], None, [], BS, "CPU"),
                          BlockRemoved(ha[::-1], "GPU")]
    _run(sched, runner, "a2", A + [40])
    events = [e for e in sched.take_kv_events() if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert events[:2] == [BlockStored([ha[0]], None, A[:4], BS, "GPU"), BlockStored([ha[1]], ha[0], A[4:], BS, "GPU")]


def test_reset_prefix_cache_empties_the_host_tier():
    sched, runner = _sched()
    _run(sched, runner, "a", A)
    _run(sched, runner, "b", B)
    sched.reset_prefix_cache()
    tier = sched.block_pool.host_tier
    assert tier.num_cached == 0 and tier.num_free_slots == 8
    _, outs = _run(sched, runner, "a2", A + [40])
    assert not outs[0].copies(CopyKind.LOAD)


@pytest.mark.parametrize("num_offload_blocks", [0, 8], ids=["device-only", "host-tier"])
@pytest.mark.parametrize("reset_running_requests", [False, True], ids=["reset", "reset-running"])
def test_a_prefix_cache_reset_records_all_blocks_cleared_after_the_blocks_it_forgets(num_offload_blocks,
                                                                                  reset_running_requests):
    """Every wipe (a reset alone, or with the running requests as a weight update does) of either tier layout
    is one AllBlocksCleared, after the events of the blocks it forgets, and leaves no hash behind."""
    sched, runner = _sched(num_offload_blocks=num_offload_blocks, enable_kv_cache_events=True)
    _run(sched, runner, "a", A)
    _run(sched, runner, "b", B)
    sched.add_request(make_request("c", A + [41], max_tokens=4))
    out = sched.schedule()
    sched.update_from_output(out, runner(out))
    before = sched.take_kv_events()
    assert any(isinstance(e, BlockStored) and e.medium == ("CPU" if num_offload_blocks else "GPU") for e in before)
    sched.reset_prefix_cache(reset_running_requests=reset_running_requests)
    assert sched.take_kv_events() == [AllBlocksCleared()]
    tier = sched.block_pool.host_tier
    assert not sched.block_pool.cached and (tier is None or tier.num_cached == 0)


def test_a_full_tier_whose_slots_are_all_read_this_step_drops_the_offload():
    tier = HostTier(1, base=3)
    tier.offload(5, b"h1")
    assert tier.take_copies() == [BlockCopy(CopyKind.OFFLOAD, 5, 3)]
    tier.end_step()
    tier.start_step()
    hit = tier.lookup(b"h1")
    tier.pin([hit])
    tier.load(hit, 7)
    tier.offload(6, b"h2")
    assert tier.take_copies() == [BlockCopy(CopyKind.LOAD, 3, 7)] and list(tier.slots) == [b"h1"] and tier.num_dropped == 1
    tier.end_step()
    tier.start_step()
    tier.offload(6, b"h2")
    assert tier.take_copies() == [BlockCopy(CopyKind.OFFLOAD, 6, 3)] and list(tier.slots) == [b"h2"]


@pytest.mark.parametrize("value", [-1, 1.5])
def test_bad_num_offload_blocks_is_refused_naming_the_value(value):
    with pytest.raises(ValueError, match=f"num_offload_blocks={value}"):
        SchedulerConfig(num_blocks=4, num_offload_blocks=value)


def test_num_offload_blocks_needs_prefix_caching():
    with pytest.raises(ValueError, match="num_offload_blocks=2 .*enable_prefix_caching"):
        SchedulerConfig(num_blocks=4, num_offload_blocks=2, enable_prefix_caching=False)


def test_async_scheduling_with_the_tier_generates_the_reference_tokens():
    from tests._scheduler_harness import run_async_until_done

    config = SchedulerConfig(num_blocks=8, block_size=BS, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64,
                             num_offload_blocks=12, async_scheduling=True)
    sched, runner = Scheduler(config), FakeRunner(config)
    requests = []
    for turn in range(3):
        for c in range(4):
            req = make_request(f"c{c}-{turn}", [c * 60 + i + 3 for i in range(9 + 6 * turn)], max_tokens=3)
            sched.add_request(req)
            requests.append(req)
        run_async_until_done(sched, runner, check=check_block_invariants)
    for req in requests:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.sampling_params, None, 64), req
    assert sched.prefix_cache_hits_host > 0


def test_a_fork_that_reuses_a_cached_block_queues_its_offload_for_before_the_fork_copies():
    from scheduler import SamplingParams
    from tests._scheduler_harness import step

    sched, runner = _sched(num_blocks=5, num_offload_blocks=4)
    a, _ = _run(sched, runner, "a", A[:4])
    a_block = sched.block_pool.cached[a.block_hashes[0]].block_id
    prompt = [5, 8, 13, 21, 34, 2, 7, 1, 9, 4]
    parent = make_request("parent", prompt[:-1], params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    sched.add_request(parent)
    step(sched, runner)
    children = [make_request(f"c{i}", prompt, max_tokens=2) for i in range(2)]
    copies = sched.fork_request("parent", children)
    # The second child's copy of the partial block lands in a's cached block, the only free one: the engine runs
    # this offload before the copies (EngineCore._advance_parent).
    assert sched.kv_cache_manager.take_block_copies() == [BlockCopy(CopyKind.OFFLOAD, a_block, 0)]
    assert copies[0][1] == a_block
    runner.host[0] = runner.kv[a_block * BS:(a_block + 1) * BS]
    for src, dst in copies:
        runner.kv[dst * BS:(dst + 1) * BS] = runner.kv[src * BS:(src + 1) * BS]
    run_until_done(sched, runner, check=check_block_invariants)
    assert runner.host[0].tolist() == A[:4]


P = list(range(1, 13))  # three full blocks
Q = list(range(100, 139))  # nine full blocks and three tokens


def _waiting_setup(max_num_batched_tokens=64, long_prompt=Q[:8] + [7]):
    """P's last two blocks in the host tier (slots 1 and 0), its first one cached on the device in block 1, at the
    front of the free queue behind an empty block; then "long" (one seat) is admitted and "p2" (P and one
    token) waits."""
    config = SchedulerConfig(num_blocks=12, block_size=BS, max_num_seqs=1, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=64, num_offload_blocks=16)
    sched, runner = Scheduler(config), FakeRunner(config)
    _run(sched, runner, "p", P)  # blocks 1, 2, 3
    _run(sched, runner, "q", Q)  # takes the eight empty blocks, then 3 and 2: P's tail goes to slots 0 and 1
    pool, tier = sched.block_pool, sched.block_pool.host_tier
    p_hashes = a_hashes(sched, P)
    assert [tier.slots.get(h) for h in p_hashes] == [None, 1, 0] and pool.cached[p_hashes[0]].block_id == 1
    assert [b.block_id for b in pool.free_queue][:3] == [2, 1, 3]  # Q's partial last block, P's first, Q's tail
    sched.add_request(make_request("long", long_prompt, max_tokens=1))
    p2 = make_request("p2", P + [40], max_tokens=4)
    sched.add_request(p2)
    return sched, runner, p2


def test_a_waiting_request_loads_its_host_hits_at_admission():
    sched, runner, p2 = _waiting_setup()
    out = sched.schedule()
    assert not out.copies(CopyKind.LOAD) and not out.copies(CopyKind.OFFLOAD)
    sched.update_from_output(out, runner(out))
    out = sched.schedule()
    assert out.copies(CopyKind.LOAD) == [(1, 2), (0, 3)] and sched.prefix_cache_hits_host == 8


def test_an_offloaded_block_is_no_hit_until_the_step_that_writes_it_has_run():
    config = SchedulerConfig(num_blocks=9, block_size=BS, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                             num_offload_blocks=8)
    sched, runner = Scheduler(config), FakeRunner(config)
    _run(sched, runner, "a", A)  # blocks 1, 2
    _run(sched, runner, "d", list(range(60, 68)))  # blocks 3, 4: the free queue ends with A's 2, 1, then 4, 3
    tier, a1 = sched.block_pool.host_tier, a_hashes(sched, A)[1]
    x = make_request("x", list(range(80, 100)), max_tokens=1)  # five blocks: the four empty ones, then A's tail
    a2 = make_request("a2", A + [40], max_tokens=1)
    sched.add_request(x)
    sched.add_request(a2)
    out = sched.schedule()
    # A's tail is written to slot 0 after this step is dispatched: a2 would stop its hits there and recompute
    # it, so it waits a step instead.
    assert out.copies(CopyKind.OFFLOAD) == [(2, 0)] and tier.slots[a1] == 0
    assert [r.request_id for r in out.requests] == ["x"] and tier.lookup(a1) is None and tier.being_written(a1)
    assert runner.host[0].tolist() == [-1] * BS
    sched.update_from_output(out, runner(out))
    assert runner.host[0].tolist() == A[4:]
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["a2"] and out.copies(CopyKind.LOAD)[0][0] == 0
    assert out.num_computed_tokens.tolist() == [8]
    sched.update_from_output(out, runner(out))
    run_until_done(sched, runner, check=check_block_invariants)
    assert a2.output_token_ids == reference_output(a2.prompt_token_ids, a2.sampling_params, None, 64)


def test_a_second_loading_request_counts_the_offloads_its_allocation_causes():
    # 16 tokens a step: a copy budget of 4. a2 goes first: two loads and three offloads (its two loaded blocks
    # and its fresh one take cached blocks of b). c2's two loads would fit 4 with loads alone counted, but with
    # its three offloads the step would queue 10 copies: it waits a step.
    config = SchedulerConfig(num_blocks=9, block_size=BS, max_num_seqs=4, max_num_batched_tokens=16,
                             max_model_len=64, num_offload_blocks=16)
    sched, runner = Scheduler(config), FakeRunner(config)
    C = list(range(60, 68))
    for rid, prompt in (("a", A), ("c", C), ("b", list(range(20, 52)))):
        _run(sched, runner, rid, prompt)  # b's eight blocks take the whole pool: A's and C's go to the host
    for rid, prompt in (("a2", A + [1]), ("c2", C + [1])):
        sched.add_request(make_request(rid, prompt, max_tokens=1))
    assert sched.copy_budget == 4
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["a2"]
    assert (len(out.copies(CopyKind.LOAD)), len(out.copies(CopyKind.OFFLOAD))) == (2, 3)
    sched.update_from_output(out, runner(out))
    out = sched.schedule()
    # Its fresh block is now a2's empty last block: two offloads.
    assert [r.request_id for r in out.requests] == ["c2"]
    assert (len(out.copies(CopyKind.LOAD)), len(out.copies(CopyKind.OFFLOAD))) == (2, 2)
    sched.update_from_output(out, runner(out))
    run_until_done(sched, runner, check=check_block_invariants)


def test_kv_cache_report_and_diag_summary_show_the_host_tier():
    from jaxllm.entrypoints.diag import summarize
    from scheduler.diagnostics import kv_cache_report

    sched, runner = _sched()
    assert kv_cache_report(_sched(num_offload_blocks=0)[0])["host_tier"] is None
    _run(sched, runner, "a", A)
    _run(sched, runner, "b", B)
    _run(sched, runner, "a2", A + [40])
    report = kv_cache_report(sched, block_map=False)
    # A's two blocks went to the host for b, and two of b's for a2's fresh blocks.
    assert report["host_tier"] == {"num_blocks": 8, "num_cached_blocks": 4, "num_free_blocks": 4,
                                   "num_offloaded_blocks": 4, "num_loaded_blocks": 2, "hit_tokens": 8}
    assert ("host tier: 8 blocks: 4 cached, 4 free; 4 offloaded and 2 loaded so far; 8 prompt tokens served"
            in summarize(report))


def test_a_discarded_output_forgets_the_blocks_its_tier_copies_were_to_fill():
    sched, runner = _sched()
    a, _ = _run(sched, runner, "a", A)
    _run(sched, runner, "b", B)
    again = make_request("a2", A + [40], max_tokens=1)
    sched.add_request(again)
    out = sched.schedule()
    assert len(out.copies(CopyKind.LOAD)) == 2 and len(out.copies(CopyKind.OFFLOAD)) == 2
    loaded = [d for _, d in out.copies(CopyKind.LOAD)]
    offloaded = {slot for _, slot in out.copies(CopyKind.OFFLOAD)}
    sched.discard_output(out)  # the runner failed: none of the copies ran
    tier = sched.block_pool.host_tier
    assert all(sched.block_pool.blocks[d].block_hash is None for d in loaded)
    assert offloaded.isdisjoint(tier.slots.values()) and tier.num_cached == 2
    run_until_done(sched, runner, check=check_block_invariants)
    assert again.output_token_ids == reference_output(again.prompt_token_ids, again.sampling_params, None, 64)


def test_a_request_waiting_for_the_copy_budget_preempts_no_one():
    # Priority policy: c2 outranks the running "low", but what holds it back is the step's copy budget (a2's five
    # copies and its own five pass 4), which preempting "low" would not shorten.
    config = SchedulerConfig(num_blocks=11, block_size=BS, max_num_seqs=4, max_num_batched_tokens=16,
                             max_model_len=64, num_offload_blocks=16, scheduling_policy="priority")
    sched, runner = Scheduler(config), FakeRunner(config)
    C = list(range(60, 68))
    for rid, prompt in (("a", A), ("c", C), ("b", list(range(20, 60)))):
        _run(sched, runner, rid, prompt)
    low = make_request("low", [5, 6, 7], max_tokens=20, priority=5)
    sched.add_request(low)
    out = sched.schedule()
    sched.update_from_output(out, runner(out))
    for rid, prompt in (("a2", A + [1]), ("c2", C + [1])):
        sched.add_request(make_request(rid, prompt, max_tokens=1, priority=0))
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["low", "a2"] and sched.num_preemptions == 0
    assert (len(out.copies(CopyKind.LOAD)), len(out.copies(CopyKind.OFFLOAD))) == (2, 3)
    sched.update_from_output(out, runner(out))
