"""KV pool compaction and resizing on the host: the plan (which blocks move where), the rewritten block tables,
the kept prefix cache, refusals that change nothing, and the ordering of block moves with chains and cycles.

The fake runner (``tests._scheduler_harness.FakeRunner``) samples from the KV it reads back through the block
tables, so a request generating its reference output after a compaction or resize read every moved block right.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Scheduler, SchedulerConfig
from scheduler.block_moves import order_block_moves
from tests._scheduler_harness import FakeRunner, check_block_invariants, make_request, reference_output

BLOCK_SIZE = 4


def _scheduler(num_blocks=12, caching=False):
    config = SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=64, enable_prefix_caching=caching)
    return Scheduler(config), FakeRunner(config)


def _step(sched, runner):
    out = sched.schedule()
    sched.update_from_output(out, runner(out))
    check_block_invariants(sched)


def _run_to_end(sched, runner):
    for _ in range(200):
        if not sched.has_unfinished_requests():
            return
        _step(sched, runner)
    raise AssertionError("requests did not finish")


def _three_running_one_aborted(caching=False):
    """a, b, c prefilled (two blocks each: a [1, 2], b [3, 4], c [5, 6]), then b aborted: a hole at 3-4."""
    sched, runner = _scheduler(caching=caching)
    reqs = [make_request(rid, [10 * i + j for j in range(1, 9)], max_tokens=6) for i, rid in enumerate("abc")]
    for req in reqs:
        sched.add_request(req)
    _step(sched, runner)
    assert [sched.kv_cache_manager.get_block_ids(r) for r in "abc"] == [[1, 2], [3, 4], [5, 6]]
    sched.abort_request("b")
    return sched, runner, reqs


def _expected(req):
    return reference_output(req.prompt_token_ids, req.sampling_params, None, 64)


def test_compaction_moves_live_blocks_into_the_lowest_free_ids_and_rewrites_the_tables():
    sched, runner, (a, _, c) = _three_running_one_aborted()
    moves = sched.compact_kv_cache()
    assert moves == [(5, 3), (6, 4)]
    runner.relocate(moves)
    kv = sched.kv_cache_manager
    assert kv.get_block_ids("a") == [1, 2] and kv.get_block_ids("c") == [3, 4]
    assert kv.block_table.table[c.batch_row, :2].tolist() == [3, 4]
    assert sorted(b.block_id for b in sched.block_pool.free_queue) == list(range(5, 12))
    check_block_invariants(sched)
    _run_to_end(sched, runner)
    assert a.output_token_ids == _expected(a) and c.output_token_ids == _expected(c)
    assert sched.block_pool.num_free_blocks == 11


def test_compaction_of_a_compact_pool_moves_nothing():
    sched, runner, _ = _three_running_one_aborted()
    runner.relocate(sched.compact_kv_cache())
    assert sched.compact_kv_cache() == []


def test_compaction_keeps_cached_free_blocks_and_their_hashes_so_a_resent_prompt_still_hits():
    sched, runner, (a, b, c) = _three_running_one_aborted(caching=True)
    sched.abort_request("a")  # a's prompt blocks 1-2 stay cached free; b's 3-4 too
    hashes = {b_.block_hash for b_ in sched.block_pool.blocks if b_.block_hash is not None}
    moves = sched.compact_kv_cache()
    assert moves == []  # 1-6 are all live (cached or referenced): already compact
    sched.abort_request("c")
    _step(sched, runner)
    again = make_request("a2", a.prompt_token_ids, max_tokens=6)
    sched.add_request(again)
    hits = sched.prefix_cache_hits
    _run_to_end(sched, runner)
    assert {b_.block_hash for b_ in sched.block_pool.blocks if b_.block_hash is not None} >= hashes
    assert sched.prefix_cache_hits > hits and again.output_token_ids == _expected(again)


def test_cached_free_blocks_above_the_live_ones_move_down_with_their_hashes():
    sched, runner = _scheduler(caching=True)
    first = make_request("a", list(range(1, 9)), max_tokens=1)
    sched.add_request(first)
    _run_to_end(sched, runner)  # blocks 1-2 now cached free at the back of the free queue
    filler = make_request("f", list(range(20, 36)), max_tokens=1)
    sched.add_request(filler)
    _step(sched, runner)
    # Allocation took the empty blocks first (3..6): the filler finished, its blocks cached free too.
    cached = {blk.block_hash: blk.block_id for blk in sched.block_pool.blocks if blk.block_hash is not None}
    assert sorted(cached.values()) == [1, 2, 3, 4, 5, 6]
    sched.block_pool.compact(5)  # keep 4 of the 6: the two evicted first go (a's, freed before the filler's)
    assert sorted(blk.block_id for blk in sched.block_pool.cached.values()) == [1, 2, 3, 4]
    check_block_invariants(sched)


def test_shrink_compacts_then_drops_the_top_ids_and_requests_finish_as_without_it():
    sched, runner, (a, _, c) = _three_running_one_aborted()
    moves = sched.resize_kv_cache(8)
    assert moves == [(5, 3), (6, 4)]
    runner.relocate(moves)
    runner.resize(8)
    assert sched.block_pool.num_blocks == sched.config.num_blocks == 8 and sched.block_pool.num_free_blocks == 3
    check_block_invariants(sched)
    _run_to_end(sched, runner)
    assert a.output_token_ids == _expected(a) and c.output_token_ids == _expected(c)
    assert sched.block_pool.num_free_blocks == 7


def test_grow_adds_empty_blocks_that_new_requests_can_use():
    sched, runner, (a, _, c) = _three_running_one_aborted()
    assert sched.resize_kv_cache(40) == []
    runner.resize(40)
    big = make_request("big", list(range(1, 57)), max_tokens=4)  # 15 blocks: more than the old pool had
    sched.add_request(big)
    _run_to_end(sched, runner)
    assert big.output_token_ids == _expected(big) and a.output_token_ids == _expected(a)
    assert sched.block_pool.num_free_blocks == 39


def test_shrink_below_the_blocks_in_use_is_refused_naming_both_and_changes_nothing():
    sched, runner, _ = _three_running_one_aborted()
    tables = {r: list(sched.kv_cache_manager.get_block_ids(r)) for r in "ac"}
    with pytest.raises(ValueError, match=r"num_blocks=4 is below the 5 blocks in use"):
        sched.resize_kv_cache(4)
    assert {r: sched.kv_cache_manager.get_block_ids(r) for r in "ac"} == tables
    assert sched.block_pool.num_blocks == 12 and sched.block_pool.num_free_blocks == 7


def test_shrink_below_what_a_waiting_request_needs_is_refused_naming_it():
    sched, _, _ = _three_running_one_aborted()
    sched.add_request(make_request("long", list(range(1, 30)), max_tokens=8))  # 9 blocks
    with pytest.raises(ValueError, match=r"request 'long' needs 9 blocks, more than the 7 usable of num_blocks=8"):
        sched.resize_kv_cache(8)
    assert sched.block_pool.num_blocks == 12


@pytest.mark.parametrize("bad", [1, 0, -3, 2.5, True, "8"])
def test_resize_and_a_compaction_for_a_shrink_refuse_a_bad_value_naming_it(bad):
    sched, _ = _scheduler()
    for call in (sched.resize_kv_cache, sched.compact_kv_cache):
        with pytest.raises(ValueError, match=f"num_blocks={bad!r} must be an int >= 2"):
            call(bad)
    assert sched.block_pool.num_blocks == 12


def test_compaction_and_resize_are_refused_while_a_step_is_in_flight():
    sched, runner = _scheduler()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=2))
    out = sched.schedule()
    for call in (sched.compact_kv_cache, lambda: sched.resize_kv_cache(6)):
        with pytest.raises(RuntimeError, match="has not been applied yet"):
            call()
    sched.update_from_output(out, runner(out))
    assert sched.block_pool.num_blocks == 12


# ------------------------------------------------------------------ order_block_moves


def _simultaneous(kv, pairs):
    out = kv.copy()
    for src, dst in pairs:
        out[dst] = kv[src]
    return out


def _in_rounds(kv, rounds, chunk=2):
    """The rounds run as the device runs them: chunk by chunk, each chunk reading before it writes."""
    kv = kv.copy()
    for moves in rounds:
        for start in range(0, len(moves), chunk):
            part = moves[start:start + chunk]
            values = [kv[src] for src, _ in part]
            for (_, dst), value in zip(part, values):
                kv[dst] = value
    return kv


def test_a_chain_runs_from_its_end():
    assert order_block_moves([(1, 2), (2, 3), (3, 4)]) == [[(3, 4)], [(2, 3)], [(1, 2)]]


def test_a_cycle_is_broken_through_the_scratch_block():
    rounds = order_block_moves([(1, 2), (2, 3), (3, 1)])
    assert rounds == [[(2, 0)], [(1, 2)], [(3, 1)], [(0, 3)]]
    kv = np.arange(5) * 10
    assert _in_rounds(kv, rounds)[1:].tolist() == [30, 10, 20, 40]


def test_disjoint_moves_are_one_round():
    assert order_block_moves([(5, 1), (6, 2), (7, 3)]) == [[(5, 1), (6, 2), (7, 3)]]


@pytest.mark.parametrize("pairs", [[(1, 2), (3, 2)], [(0, 2)], [(2, 0)]])
def test_two_writers_or_the_scratch_block_are_refused(pairs):
    with pytest.raises(ValueError):
        order_block_moves(pairs)


@settings(max_examples=200, deadline=None)
@given(st.permutations(range(1, 9)), st.integers(1, 8), st.lists(st.tuples(st.integers(1, 8), st.integers(1, 8))))
def test_any_permutation_with_fan_out_runs_as_if_all_sources_were_read_first(perm, num, extra):
    pairs = list(zip(range(1, num + 1), perm[:num]))
    written = {d for _, d in pairs}
    for src, dst in extra:  # extra copies into blocks nothing writes yet (sources may repeat)
        if dst not in written:
            pairs.append((src, dst))
            written.add(dst)
    kv = np.arange(9) * 10
    assert _in_rounds(kv, order_block_moves(pairs))[1:].tolist() == _simultaneous(kv, pairs)[1:].tolist()


def test_the_report_counts_the_holes_a_compaction_closes_up():
    from scheduler import kv_cache_report

    sched, runner, _ = _three_running_one_aborted()
    report = kv_cache_report(sched, block_map=False)
    assert (report["highest_live_block"], report["num_holes"], report["num_used_blocks"]) == (6, 2, 5)
    runner.relocate(sched.compact_kv_cache())
    report = kv_cache_report(sched, block_map=False)
    assert (report["highest_live_block"], report["num_holes"]) == (4, 0)


def test_a_shrink_that_evicts_cached_blocks_reports_them_removed_and_a_compaction_reports_nothing():
    from scheduler.kv_events import BlockRemoved

    config = SchedulerConfig(num_blocks=12, block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=64, enable_kv_cache_events=True)
    sched, runner = Scheduler(config), FakeRunner(config)
    sched.add_request(make_request("a", list(range(1, 9)), max_tokens=1))
    _run_to_end(sched, runner)  # its two prompt blocks cached free
    hashes = [b.block_hash for b in sched.block_pool.blocks if b.block_hash is not None]
    sched.take_kv_events()
    runner.relocate(sched.compact_kv_cache())
    assert sched.take_kv_events() == []
    sched.resize_kv_cache(2)  # room for one: the prompt's tail goes (freed first), its head stays (block 1)
    assert sched.take_kv_events() == [BlockRemoved([hashes[1]])]
    assert list(sched.block_pool.cached) == [hashes[0]] and sched.block_pool.blocks[1].block_hash == hashes[0]
