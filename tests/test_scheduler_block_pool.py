"""BlockPool and FreeBlockQueue: the vLLM v1 free-queue and prefix-map rules."""

import pytest

from scheduler import BlockPool, FreeBlockQueue, KVBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_null_block_is_never_handed_out():
    pool = BlockPool(4)
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert pool.num_free_blocks == 0


def test_free_queue_removes_a_block_from_the_middle():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    assert len(queue) == 4
    assert queue.popleft() is blocks[0]


def test_free_queue_rejects_removing_a_block_it_does_not_hold():
    queue = FreeBlockQueue([])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(KVBlock(7))


def test_freed_hashed_blocks_go_to_the_back_and_unhashed_to_the_front():
    pool = BlockPool(5)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_block(a, b"hash-a")
    pool.free_blocks([a, b])
    assert ids(pool.free_queue) == [b.block_id, a.block_id]


def test_allocation_evicts_from_the_front_and_clears_the_stale_hash():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"hash-a")
    pool.free_blocks([a, b])
    assert pool.get_new_blocks(1) == [b]
    assert pool.get_cached_block(b"hash-a") is a
    assert pool.get_new_blocks(1) == [a]
    assert a.block_hash is None
    assert pool.get_cached_block(b"hash-a") is None


def test_touch_revives_a_free_cached_block_and_raises_its_ref_count():
    pool = BlockPool(4)
    a, _, _ = pool.get_new_blocks(3)
    pool.cache_block(a, b"hash-a")
    pool.free_blocks([a])
    pool.touch([a])
    assert a.ref_cnt == 1
    assert pool.num_free_blocks == 0
    pool.touch([a])
    assert a.ref_cnt == 2


def test_asking_for_more_blocks_than_free_raises_and_takes_nothing():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="asked for 4 blocks, only 3 free"):
        pool.get_new_blocks(4)
    assert pool.num_free_blocks == 3


def test_freeing_a_free_block_raises():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="ref_cnt 0"):
        pool.free_blocks([a])


def test_a_second_block_with_the_same_hash_stays_unhashed():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    assert pool.get_cached_block(b"same") is a
    assert b.block_hash is None


def test_usage_is_the_fraction_of_non_null_blocks_referenced():
    pool = BlockPool(5)
    pool.get_new_blocks(1)
    assert pool.usage == 0.25


def test_pool_needs_a_block_besides_the_null_block():
    with pytest.raises(ValueError, match="num_blocks=1 must be >= 2"):
        BlockPool(1)


def test_batched_free_queue_splices_keep_the_order_of_single_operations():
    blocks = [KVBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks[:2])
    queue.extend(blocks[2:4])
    queue.extendleft(blocks[4:6])
    assert ids(queue) == [5, 4, 0, 1, 2, 3]
    assert ids(queue.popleft_n(3)) == [5, 4, 0]
    assert (ids(queue), len(queue)) == ([1, 2, 3], 3)
    with pytest.raises(ValueError, match="asked for 4 blocks, only 3 queued"):
        queue.popleft_n(4)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.extend([blocks[2]])
