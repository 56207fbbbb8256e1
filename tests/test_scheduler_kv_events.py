"""KV cache events: the blocks the prefix cache registers and evicts, with their chained hashes and tokens."""

from scheduler import BlockPool, KVCacheManager, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.block_hash import hash_block_tokens
from scheduler.kv_events import BlockRemoved, BlockStored


def manager(num_blocks=6, block_size=4, events=True):
    return KVCacheManager(BlockPool(num_blocks, True, events), block_size, True)


def compute(kv, request, num_tokens):
    assert kv.allocate_slots(request, num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = num_tokens
    kv.cache_computed_blocks(request)


def chain(tokens, block_size=4):
    hashes, parent = [], None
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[i:i + block_size])
        hashes.append(parent)
    return hashes


def test_computed_full_blocks_are_stored_with_their_chained_hashes_parent_and_tokens():
    kv = manager()
    prompt = list(range(10, 20))
    request = Request("a", prompt, SamplingParams())
    compute(kv, request, 10)
    h0, h1 = chain(prompt)
    assert kv.block_pool.kv_events == [BlockStored([h0, h1], None, prompt[:8], 4)]
    request.append_output_token(7)
    request.append_output_token(8)
    compute(kv, request, 12)
    h2 = hash_block_tokens(h1, prompt[8:] + [7, 8])
    assert kv.block_pool.kv_events[1:] == [BlockStored([h2], h1, prompt[8:] + [7, 8], 4)]


def test_a_block_whose_hash_another_block_holds_is_not_stored_and_splits_the_run():
    kv = manager(num_blocks=9)
    first = Request("a", list(range(4)), SamplingParams())
    compute(kv, first, 4)
    both = list(range(4)) + list(range(4, 12))
    second = Request("b", both, SamplingParams())
    # Computed from scratch beside the first (no hit looked up), so its block 0 duplicates the first's.
    compute(kv, second, 12)
    h0, h1, h2 = chain(both)
    assert kv.block_pool.kv_events == [BlockStored([h0], None, both[:4], 4),
                                       BlockStored([h1, h2], h0, both[4:12], 4)]


def test_evicted_cached_blocks_are_removed_in_eviction_order():
    kv = manager(num_blocks=4)
    prompt = list(range(8))
    request = Request("a", prompt, SamplingParams())
    compute(kv, request, 8)
    kv.free(request)
    kv.block_pool.kv_events.clear()
    other = Request("b", list(range(100, 112)), SamplingParams())
    assert kv.allocate_slots(other, 12)
    h0, h1 = chain(prompt)
    # Freed tail first, so the head (h0) is evicted last; the one never-cached block goes first, unreported.
    assert kv.block_pool.kv_events == [BlockRemoved([h1, h0])]


def test_without_events_nothing_is_recorded_and_take_kv_events_is_empty():
    kv = manager(events=False)
    compute(kv, Request("a", list(range(8)), SamplingParams()), 8)
    assert kv.block_pool.kv_events is None
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    assert scheduler.take_kv_events() == []


def test_scheduler_hands_out_each_event_once():
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                          enable_kv_cache_events=True))
    prompt = list(range(30, 39))
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=1)))
    out = scheduler.schedule()
    scheduler.update_from_output(out, [5])
    assert scheduler.take_kv_events() == [BlockStored(chain(prompt), None, prompt[:8], 4)]
    assert scheduler.take_kv_events() == []
