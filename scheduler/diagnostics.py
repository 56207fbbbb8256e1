"""KV cache diagnostics: the block map and the numbers an operator reads when scheduling delay spikes.

:func:`kv_cache_report` takes a snapshot of a ``Scheduler``: every block's state and holders, the counts by state,
fragmentation, the largest request and the queue. Block ids are logical (any free block serves any request), so
there is no external fragmentation to measure; what wastes KV memory is

* *internal* fragmentation: token slots of allocated blocks that hold no computed token -- the partly filled last
  block of each request (at most ``block_size - 1`` slots each), plus slots reserved for tokens a step is about to
  compute. Reported as ``fragmentation`` = empty allocated slots / allocated slots (the
  ``kv_cache_fragmentation_ratio`` metric). Many short requests, or a large ``block_size``, push it up.
* *revivable-cache crowding*: free blocks that still hold a prefix-cache entry. They are free (allocation takes
  them, evicting the entry) but an allocation evicts them only after every empty free block, and each eviction
  loses a prefix some later request might have hit. Reported as ``cache_crowding`` = cached free blocks / free
  blocks; near 1 with a low hit rate means the cache holds prefixes nobody reuses.

Block ids themselves matter once the pool is to give memory back: ``Scheduler.resize_kv_cache`` can drop only
the top ids. ``highest_live_block`` is the largest id that is used or cached free, and ``num_holes`` counts the empty
free blocks below it -- what ``Scheduler.compact_kv_cache`` closes up (``LLM.kv_cache_compact``, ``jaxllm diag
--compact``); a resize accepts any ``num_blocks`` from ``num_used_blocks`` on, evicting cached free blocks past it.

The result holds only ints, floats, strings, lists and string-keyed dicts, so it crosses process boundaries
(msgpack) and becomes JSON as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from scheduler.request import RequestStatus

if TYPE_CHECKING:
    from scheduler.kv.block_pool import BlockPool
    from scheduler.scheduler import Scheduler

# Block states in the map, in the order the counts add up.
NULL, USED, CACHED_FREE, FREE = "null", "used", "cached_free", "free"


def kv_cache_report(scheduler: "Scheduler", block_map: bool = True) -> dict[str, Any]:
    """A snapshot of ``scheduler``'s KV blocks and queue.

    Args:
      scheduler: the scheduler to read (nothing is changed).
      block_map: include ``blocks`` (one entry per block; leave out for a
        large cache when only the numbers matter).

    Returns:
      A dict with:

      * ``num_blocks``, ``block_size`` (tokens);
      * ``num_used_blocks`` (referenced by a request, a pin or a pending
        copy, plus the null block 0), ``num_cached_free_blocks``
        (unreferenced, still holding a prefix-cache entry: revivable) and
        ``num_free_blocks`` (unreferenced, empty); the three add up to
        ``num_blocks``;
      * ``num_pinned_blocks`` (held by the prefix-cache warm-up), ``num_shared_blocks``
        (held by more than one request);
      * ``allocated_slots``, ``empty_allocated_slots`` (token slots), ``fragmentation``
        (their ratio, 0 with nothing allocated), ``cache_crowding`` (cached free
        blocks / free blocks, 0 with none free); see the module docstring;
      * ``highest_live_block`` (largest id used or cached free, 0 with none) and ``num_holes`` (empty free
        blocks below it, which a compaction closes up);
      * ``num_preemptions`` (cumulative), ``num_running``, ``num_waiting``,
        ``num_preempted_waiting`` (the queue depth), ``max_num_seqs`` and
        ``max_num_batched_tokens`` in force, ``degradation_level`` (0 when
        off or calm);
      * ``request_blocks``: request id -> blocks it holds (running requests);
        ``largest_request``: ``{"request_id", "num_blocks", "num_tokens"}`` of
        the one holding most blocks, or None;
      * ``host_tier``: the prefix cache's host tier (``scheduler.kv.host_tier``), None without one, else
        ``{"num_blocks", "num_cached_blocks", "num_free_blocks"}`` (the two add up to ``num_blocks``),
        ``"num_offloaded_blocks"`` and ``"num_loaded_blocks"`` (copies device -> host and back, cumulative) and
        ``"hit_tokens"`` (prompt tokens it served, cumulative);
      * ``compressed_pool``: the one-byte pool of ``kv_cache_compression`` (``scheduler.kv.compressed_pool``), None
        without one, else ``{"num_blocks", "num_used_blocks", "num_free_blocks"}`` (slots without the null slot;
        the two add up to ``num_blocks``) and ``"num_compressed_blocks"`` (blocks compressed instead of a
        preemption, cumulative);
      * ``blocks`` (with ``block_map``): per block id, ``{"state": "null" |
        "used" | "cached_free" | "free", "ref_cnt", "holders"}``, holders being
        the request ids whose tables hold it, plus ``"<pinned>"`` and
        ``"<copy source>"`` for the scheduler's own references.
    """
    pool, kv = scheduler.block_pool, scheduler.kv_cache_manager
    bs = kv.block_size
    holders: dict[int, list[str]] = {}
    for rid, ids in kv.req_to_block_ids.items():
        for block_id in ids:
            holders.setdefault(block_id, []).append(rid)
    for name, blocks in (("<pinned>", kv.pinned_blocks), ("<copy source>", kv.copy_sources)):
        for block in blocks:
            holders.setdefault(block.block_id, []).append(name)
    counts, entries, highest = _block_states(pool, holders if block_map else None)
    running = scheduler.running
    request_blocks = {r.request_id: len(kv.req_to_block_ids.get(r.request_id, ())) for r in running}
    allocated = counts[USED] * bs
    # Only full blocks are shared, pinned or copied: unused slots sit in running requests' own tail blocks.
    empty = sum(max(request_blocks[r.request_id] * bs - r.num_computed_tokens, 0) for r in running)
    largest = max(running, key=lambda r: (request_blocks[r.request_id], r.num_tokens), default=None)
    num_free_queue = counts[CACHED_FREE] + counts[FREE]
    degradation = scheduler.degradation
    report = {
        "num_blocks": pool.num_blocks,
        "block_size": bs,
        "num_used_blocks": counts[USED] + counts[NULL],
        "num_cached_free_blocks": counts[CACHED_FREE],
        "num_free_blocks": counts[FREE],
        "num_pinned_blocks": len(kv.pinned_blocks),
        "num_shared_blocks": sum(1 for b in pool.blocks if b.ref_cnt > 1),
        "allocated_slots": allocated,
        "empty_allocated_slots": empty,
        "fragmentation": empty / allocated if allocated else 0.0,
        "cache_crowding": counts[CACHED_FREE] / num_free_queue if num_free_queue else 0.0,
        "highest_live_block": highest,
        "num_holes": highest - counts[USED] - counts[CACHED_FREE],
        "num_preemptions": scheduler.num_preemptions,
        "num_running": len(running),
        "num_waiting": len(scheduler.waiting),
        "num_preempted_waiting": sum(1 for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED),
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "degradation_level": 0 if degradation is None else degradation.level,
        "request_blocks": request_blocks,
        "largest_request": None if largest is None else {
            "request_id": largest.request_id, "num_blocks": request_blocks[largest.request_id],
            "num_tokens": largest.num_tokens,
        },
    }
    report["host_tier"] = _host_tier_report(scheduler)
    cpool = kv.compressed_pool
    report["compressed_pool"] = None if cpool is None else {
        "num_blocks": cpool.num_blocks - 1, "num_used_blocks": cpool.num_blocks - 1 - cpool.num_free_blocks,
        "num_free_blocks": cpool.num_free_blocks, "num_compressed_blocks": cpool.num_compressed}
    if block_map:
        report["blocks"] = entries
    return report


def _block_states(pool: "BlockPool", holders: Optional[dict[int, list[str]]]) -> tuple[dict[str, int], list, int]:
    """``(blocks by state, one map entry per block (none without holders), the highest used or cached free id)``."""
    counts = {NULL: 0, USED: 0, CACHED_FREE: 0, FREE: 0}
    entries = []
    highest = 0
    for block in pool.blocks:
        if block is pool.null_block:
            state = NULL
        elif block.ref_cnt > 0:
            state = USED
        else:
            state = FREE if block.block_hash is None else CACHED_FREE
        counts[state] += 1
        if state in (USED, CACHED_FREE):
            highest = block.block_id
        if holders is not None:
            entries.append({"state": state, "ref_cnt": block.ref_cnt, "holders": holders.get(block.block_id, [])})
    return counts, entries, highest


def _host_tier_report(scheduler: "Scheduler") -> Any:
    tier = scheduler.block_pool.host_tier
    if tier is None:
        return None
    return {"num_blocks": tier.num_slots, "num_cached_blocks": tier.num_cached, "num_free_blocks": tier.num_free_slots,
            "num_offloaded_blocks": tier.num_offloaded, "num_loaded_blocks": tier.num_loaded,
            "hit_tokens": scheduler.prefix_cache_hits_host}
