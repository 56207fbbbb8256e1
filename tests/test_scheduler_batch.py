"""BucketTable and build_batch: exact arrays for a hand-built mixed batch."""

import numpy as np
import pytest

from scheduler import BucketTable, Scheduler, SchedulerConfig, SchedulerOutput, build_batch
from tests._scheduler_harness import FakeClock, make_request


def test_ladders_are_powers_of_two_capped_exactly_at_the_maxima():
    table = BucketTable.from_limits(384, 64, 2048, 16)
    assert table.token_buckets == (8, 16, 32, 64, 128, 256, 384)
    assert table.seq_buckets == (8, 16, 32, 64)
    assert table.width_buckets == (4, 8, 16, 32, 64, 128)


def test_pick_takes_the_smallest_bucket_holding_each_size():
    table = BucketTable.from_limits(512, 64, 2048, 16)
    assert table.pick(9, 3, 5) == (16, 16, 8)
    assert table.pick(40, 40, 5) == (64, 64, 8)
    assert table.pick(512, 64, 128) == (512, 64, 128)
    assert table.pick(300, 2, 1) == (512, 64, 4)


def test_each_token_bucket_pairs_with_one_seq_bucket():
    # S is the smallest seq bucket holding min(T, max S) rows; it may exceed T.
    table = BucketTable((4, 8, 16), (1, 8), (1,))
    assert [table.seq_bucket_for(t) for t in table.token_buckets] == [8, 8, 8]
    assert table.pick(3, 3, 1) == (4, 8, 1)
    table = BucketTable((16, 24, 32, 512), (16, 24, 32), (4,))
    assert [table.seq_bucket_for(t) for t in table.token_buckets] == [16, 24, 32, 32]
    assert table.pick(20, 17, 4) == (24, 24, 4)


@pytest.mark.parametrize("num_tokens", range(1, 65))
def test_pick_holds_every_batch_that_fits(num_tokens):
    table = BucketTable((4, 8, 12, 16, 32, 64), (2, 4, 16), (1, 2))
    for num_seqs in range(1, min(num_tokens, 16) + 1):
        t, s, w = table.pick(num_tokens, num_seqs, 2)
        assert (t, s, w) in table.all_shapes()
        assert t >= num_tokens and s >= num_seqs and w == 2
        assert t == min(v for v in table.token_buckets if v >= num_tokens)


def test_pick_past_a_maximum_raises_naming_it():
    table = BucketTable.from_limits(512, 64, 2048, 16)
    with pytest.raises(ValueError, match="num_tokens=513 exceeds the largest bucket 512"):
        table.pick(513, 1, 1)
    with pytest.raises(ValueError, match="width=129 exceeds the largest bucket 128"):
        table.pick(8, 1, 129)


def test_all_shapes_lists_one_program_per_token_bucket_and_width():
    table = BucketTable((8, 16), (8, 16), (4, 8))
    assert table.all_shapes() == [(8, 8, 4), (8, 8, 8), (16, 16, 4), (16, 16, 8)]
    assert len(table) == 4


def test_ladder_must_increase():
    with pytest.raises(ValueError, match="strictly increasing"):
        BucketTable((8, 8), (1,), (1,))


def test_mixed_batch_of_decodes_and_a_prefill_chunk_on_a_cached_prefix_is_exact():
    config = SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=10, max_model_len=64)
    sched = Scheduler(config, clock=FakeClock())
    a1 = [10, 11, 12, 13, 14]
    a2 = [20, 21, 22, 23, 24]
    b = a1[:4] + list(range(30, 40))
    sched.add_request(make_request("a1", a1, arrival_time=0.0))
    sched.add_request(make_request("a2", a2, arrival_time=1.0))
    first = sched.schedule()
    sched.update_from_output(first, np.array([42, 43], dtype=np.int32))
    sched.add_request(make_request("b", b, arrival_time=2.0))
    out = sched.schedule()

    batch = build_batch(out, BucketTable((4, 8, 16), (1, 2, 4), (2, 4)))

    assert batch.shape == (16, 4, 4)
    assert (batch.num_seqs, batch.num_tokens, batch.request_ids) == (3, 10, ["a1", "a2", "b"])
    np.testing.assert_array_equal(batch.input_ids, [42, 43, 30, 31, 32, 33, 34, 35, 36, 37, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.positions, [5, 5, 4, 5, 6, 7, 8, 9, 10, 11, 0, 0, 0, 0, 0, 0])
    # a1 holds blocks [1, 2], a2 [3, 4]; b reuses a1's block 1 and gets [5, 6].
    np.testing.assert_array_equal(batch.slot_mapping, [9, 17, 20, 21, 22, 23, 24, 25, 26, 27, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.block_tables, [[1, 2, 0, 0], [3, 4, 0, 0], [1, 5, 6, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(batch.seq_lens, [6, 6, 12, 0])
    np.testing.assert_array_equal(batch.query_start_loc, [0, 1, 2, 10, 10])
    np.testing.assert_array_equal(batch.logits_indices, [0, 1, 9, 0])
    np.testing.assert_array_equal(batch.sample_mask, [True, True, False, False])
    assert all(a.dtype == np.int32 for a in (batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables))


def test_empty_batch_is_all_padding():
    batch = build_batch(SchedulerOutput(block_size=4), BucketTable((4,), (1,), (1,)))
    assert (batch.num_seqs, batch.num_tokens) == (0, 0)
    np.testing.assert_array_equal(batch.query_start_loc, [0, 0])
    np.testing.assert_array_equal(batch.slot_mapping, [0, 0, 0, 0])
