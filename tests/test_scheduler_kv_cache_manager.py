"""KVCacheManager: prefix hits, allocation, caching as blocks fill, swap bookkeeping."""

from scheduler import BlockPool, KVCacheManager, Request, SamplingParams
from scheduler.block_hash import extend_block_hashes, hash_block_tokens
from scheduler.block_table import BlockTable
from scheduler.kv.tier import BlockCopy, CopyKind


def manager(num_blocks=9, block_size=4, num_host_blocks=0):
    return KVCacheManager(BlockPool(num_blocks), block_size, True, num_host_blocks)


def computed(kv, prompt, rid, salt=None):
    """Allocate and 'compute' a whole prompt, registering its full blocks."""
    req = Request(rid, prompt, SamplingParams(), cache_salt=salt)
    assert kv.allocate_slots(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(req)
    return req


def test_prefix_hit_of_a_whole_block_prompt_takes_every_block_but_leaves_the_last_token():
    kv = manager()
    computed(kv, list(range(12)), "a")
    blocks, num_tokens = kv.get_computed_blocks(Request("b", list(range(12)), SamplingParams()))
    assert num_tokens == 11
    assert [b.block_id for b in blocks] == [1, 2, 3]


def test_prefix_hit_leaves_out_the_last_one_token_block():
    kv = manager(block_size=1)
    computed(kv, [5, 6, 7], "a")
    blocks, num_tokens = kv.get_computed_blocks(Request("b", [5, 6, 7], SamplingParams()))
    assert ([b.block_id for b in blocks], num_tokens) == ([1, 2], 2)


def test_request_skipping_prefix_cache_reads_hits_nothing():
    kv = manager()
    computed(kv, list(range(12)), "a")
    skipper = Request("b", list(range(12)), SamplingParams(), skip_reading_prefix_cache=True)
    assert kv.get_computed_blocks(skipper) == ([], 0)


def test_fully_hit_allocation_copies_the_last_block_into_a_fresh_unregistered_one():
    kv = manager()
    a = computed(kv, list(range(8)), "a")
    kv.free(a)
    b = Request("b", list(range(8)), SamplingParams())
    hits, num_tokens = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 1, hits)
    assert kv.get_block_ids("b") == [1, 3]
    assert kv.take_blocks_to_copy() == [(2, 3)]
    assert kv.take_blocks_to_copy() == []
    assert [blk.block_id for blk in kv.copy_sources] == [2]
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[1:4]] == [1, 1, 1]
    b.num_computed_tokens = num_tokens + 1
    kv.cache_computed_blocks(b)
    assert (kv.block_pool.blocks[3].block_hash, kv.block_pool.get_cached_block(b.block_hashes[1]).block_id) == (None, 2)
    kv.release_copy_sources()
    assert (kv.copy_sources, kv.block_pool.blocks[2].ref_cnt) == ([], 0)


def test_blocks_to_allocate_count_revived_hits_the_copy_new_tokens_and_lookahead_slots():
    kv = manager()
    kv.free(computed(kv, list(range(8)), "a"))  # two cached blocks, both in the free queue
    b = Request("b", list(range(8)), SamplingParams())
    hits, _ = kv.get_computed_blocks(b)
    assert kv.copies_last_block(b, hits) and not kv.copies_last_block(b, hits[:1])
    # 2 revived hits + the copy; one lookahead slot (position 8) needs a third block.
    assert kv.num_blocks_to_allocate(b, 1, hits) == 3
    assert kv.num_blocks_to_allocate(b, 1, hits, num_lookahead_tokens=1) == 4
    # One hit fewer: 1 revived + 1 fresh block for the recomputed 4 tokens; no copy.
    assert kv.num_blocks_to_allocate(b, 4, hits[:1]) == 2
    assert kv.num_blocks_to_allocate(b, 8) == 2
    holder = Request("holder", list(range(8)) + [50], SamplingParams())
    assert kv.allocate_slots(holder, 1, hits)  # now holds both hit blocks
    assert kv.num_blocks_to_allocate(b, 1, hits) == 1


def test_allocation_succeeds_exactly_when_the_free_queue_holds_the_blocks_it_needs():
    for free, lookahead in ((2, 0), (3, 0), (3, 1), (4, 1)):
        kv = manager(num_blocks=6)
        kv.free(computed(kv, list(range(8)), "a"))  # 5 free blocks, 2 of them cached
        assert kv.allocate_slots(Request("filler", [99] * 4 * (5 - free), SamplingParams()), 4 * (5 - free))
        assert kv.block_pool.num_free_blocks == free
        b = Request("b", list(range(8)), SamplingParams())
        hits, _ = kv.get_computed_blocks(b)
        need = kv.num_blocks_to_allocate(b, 1, hits, lookahead)
        assert kv.allocate_slots(b, 1, hits, lookahead) == (need <= free), (free, lookahead)
        assert kv.block_pool.num_free_blocks == (free - need if need <= free else free)


def test_prompt_plus_outputs_filling_cached_blocks_is_copied_on_write_too():
    kv = manager()
    computed(kv, list(range(8)), "a")
    resumed = Request("b", list(range(6)), SamplingParams())
    resumed.append_output_token(6)
    resumed.append_output_token(7)
    blocks, num_tokens = kv.get_computed_blocks(resumed)
    assert ([blk.block_id for blk in blocks], num_tokens) == ([1, 2], 7)


def test_freeing_a_request_drops_its_copy_not_yet_taken():
    kv = manager()
    kv.free(computed(kv, list(range(8)), "a"))
    b = Request("b", list(range(8)), SamplingParams())
    assert kv.allocate_slots(b, 1, kv.get_computed_blocks(b)[0])
    kv.free(b)
    assert kv.take_blocks_to_copy() == []


def test_prefix_hit_takes_every_full_block_when_the_prompt_is_longer():
    kv = manager()
    computed(kv, list(range(12)), "a")
    _, num_tokens = kv.get_computed_blocks(Request("b", list(range(12)) + [99], SamplingParams()))
    assert num_tokens == 12


def test_same_block_tokens_after_a_different_prefix_do_not_hit():
    kv = manager()
    computed(kv, [1, 1, 1, 1, 2, 2, 2, 2, 0], "a")
    _, num_tokens = kv.get_computed_blocks(Request("b", [3, 3, 3, 3, 2, 2, 2, 2, 0], SamplingParams()))
    assert num_tokens == 0


def test_block_hash_depends_on_parent_tokens_and_extra_key():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(base) == 16
    assert hash_block_tokens(None, [1, 2, 3, 4]) == base
    assert hash_block_tokens(b"p" * 16, [1, 2, 3, 4]) != base
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], b"salt") != base


def test_cache_salt_keeps_requests_from_sharing_blocks():
    kv = manager()
    computed(kv, list(range(9)), "a", salt="tenant-1")
    _, other_salt = kv.get_computed_blocks(Request("b", list(range(9)), SamplingParams(), cache_salt="tenant-2"))
    _, same_salt = kv.get_computed_blocks(Request("c", list(range(9)), SamplingParams(), cache_salt="tenant-1"))
    assert (other_salt, same_salt) == (0, 8)


def test_failed_allocation_changes_nothing():
    kv = manager(num_blocks=3)
    req = Request("a", list(range(9)), SamplingParams())
    assert not kv.allocate_slots(req, 9)
    assert kv.block_pool.num_free_blocks == 2
    assert "a" not in kv.req_to_blocks


def test_generated_tokens_become_cacheable_when_their_block_fills():
    kv = manager()
    req = computed(kv, [1, 2, 3, 4, 5, 6], "a")
    assert len(kv.block_pool.cached) == 1
    for token in (7, 8):
        req.append_output_token(token)
    assert kv.allocate_slots(req, 2)
    req.num_computed_tokens = 8
    kv.cache_computed_blocks(req)
    assert len(kv.block_pool.cached) == 2
    assert kv.block_pool.get_cached_block(req.block_hashes[1]).block_id == kv.get_block_ids("a")[1]


def test_each_block_is_hashed_once_over_a_request_life():
    kv = manager()
    req = computed(kv, list(range(8)), "a")
    first = list(req.block_hashes)
    kv.cache_computed_blocks(req)
    assert req.block_hashes == first
    assert [h is f for h, f in zip(req.block_hashes, first)] == [True, True]


def test_swap_out_copies_only_computed_blocks_and_frees_the_device_blocks():
    kv = manager(num_host_blocks=4)
    req = Request("a", list(range(6)), SamplingParams())
    assert kv.allocate_slots(req, 6)
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 4)
    assert kv.get_block_ids("a") == [1, 2, 3]
    pairs = kv.swap.swap_out(req)
    assert pairs == [(1, 0), (2, 1)]
    assert kv.block_pool.num_free_blocks == 8
    assert kv.swap.swapped == {"a": [0, 1]}


def test_host_blocks_released_by_swap_in_are_reusable_only_after_the_step():
    kv = manager(num_host_blocks=2)
    req = Request("a", list(range(8)), SamplingParams())
    assert kv.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    kv.swap.swap_out(req)
    assert kv.swap.swap_in(req, 1) == [(0, 1), (1, 2)]
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert kv.swap.host_pool.num_free_blocks == 0
    kv.end_step()
    assert kv.swap.host_pool.num_free_blocks == 2


def test_swap_out_declines_when_the_host_pool_is_too_small():
    kv = manager(num_host_blocks=1)
    req = Request("a", list(range(8)), SamplingParams())
    assert kv.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    assert kv.swap.swap_out(req) is None
    assert kv.get_block_ids("a") == [1, 2]


def test_incremental_hashes_equal_block_by_block_hashes():
    tokens = list(range(100, 113))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 1, 4, "salt")
    extend_block_hashes(hashes, tokens, 3, 4, "salt")
    first = hash_block_tokens(None, tokens[0:4], b"salt")
    second = hash_block_tokens(first, tokens[4:8])
    third = hash_block_tokens(second, tokens[8:12])
    assert hashes == [first, second, third]


def test_blocks_filled_while_decoding_hash_as_the_chain_of_block_hashes():
    kv = manager()
    req = computed(kv, [1, 2, 3, 4, 5, 6], "a", salt="salt")
    for token in (7, 8, 9, 10, 11, 12):
        req.append_output_token(token)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        kv.cache_computed_blocks(req)
    first = hash_block_tokens(None, [1, 2, 3, 4], b"salt")
    second = hash_block_tokens(first, [5, 6, 7, 8])
    third = hash_block_tokens(second, [9, 10, 11, 12])
    assert req.block_hashes == [first, second, third]
    assert [kv.block_pool.get_cached_block(h).block_id for h in req.block_hashes] == kv.get_block_ids("a")


def test_hashes_sliced_from_the_prompt_array_equal_hashes_of_the_token_list():
    req = Request("r", list(range(100, 113)), SamplingParams(), cache_salt="salt")
    from_array: list[bytes] = []
    from_list: list[bytes] = []
    extend_block_hashes(from_array, req.all_token_ids, 3, 4, "salt", req.prompt_array)
    extend_block_hashes(from_list, req.all_token_ids, 3, 4, "salt")
    assert from_array == from_list
    assert len(set(from_array)) == 3


def test_numpy_block_table_grows_on_demand_and_zeroes_released_rows():
    table = BlockTable(rows=1, width=2)
    a, b = table.acquire(), table.acquire()
    table.append(a, [5, 6, 7])
    table.append(b, [9])
    assert table.table.shape == (2, 4)
    assert table.table.tolist() == [[5, 6, 7, 0], [9, 0, 0, 0]]
    table.release(a)
    assert table.table[a].tolist() == [0, 0, 0, 0]
    assert table.acquire() == a


def test_block_copies_come_in_copy_kind_order_each_kind_in_the_order_queued():
    kv = manager(num_host_blocks=4)
    a, b = (Request(rid, list(range(8)), SamplingParams()) for rid in "ab")
    for req in (a, b):
        assert kv.allocate_slots(req, 8)
        req.num_computed_tokens = 8
    assert kv.swap.keep(a)
    assert kv.swap.resume(a, 1)
    assert kv.swap.keep(b)
    # a's swap-in, queued before b's swap-out, comes after it: b's device blocks may go to a swap-in.
    assert kv.take_block_copies() == [
        BlockCopy(CopyKind.SWAP_OUT, 1, 0), BlockCopy(CopyKind.SWAP_OUT, 2, 1),
        BlockCopy(CopyKind.SWAP_OUT, 3, 2), BlockCopy(CopyKind.SWAP_OUT, 4, 3),
        BlockCopy(CopyKind.SWAP_IN, 0, 1), BlockCopy(CopyKind.SWAP_IN, 1, 2),
    ]
    assert kv.take_block_copies() == []
