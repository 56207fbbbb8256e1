"""KV cache diagnostics: the block map and the numbers an operator reads when scheduling delay spikes.

The report holds only ints, floats, strings, lists and string-keyed dicts (msgpack- and JSON-safe). What the
fragmentation and crowding figures mean: ``docs/design/scheduler.md``.
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
    """A snapshot of ``scheduler``'s KV blocks and queue (nothing changed); ``block_map`` adds ``blocks``.

    Returns a dict with:

    * ``num_blocks``, ``block_size``; ``num_used_blocks`` (referenced by a request, pin or pending copy, plus the
      null block), ``num_cached_free_blocks`` (unreferenced, holding a prefix-cache entry) and ``num_free_blocks``
      (empty), summing to ``num_blocks``; ``num_pinned_blocks``, ``num_shared_blocks`` (held by > 1 request);
    * ``allocated_slots``, ``empty_allocated_slots``, ``fragmentation`` (their ratio, 0 with none allocated),
      ``cache_crowding`` (cached free / free blocks, 0 with none free);
    * ``highest_live_block`` (largest used or cached free id, 0 with none), ``num_holes`` (empty free blocks below it);
    * ``num_preemptions`` (cumulative), ``num_running``, ``num_waiting``, ``num_preempted_waiting``,
      ``max_num_seqs`` and ``max_num_batched_tokens`` in force, ``degradation_level``;
    * ``request_blocks`` (running request id -> blocks held), ``largest_request`` (``{"request_id", "num_blocks",
      "num_tokens"}`` or None);
    * ``host_tier``: None or ``{"num_blocks", "num_cached_blocks", "num_free_blocks", "num_offloaded_blocks",
      "num_loaded_blocks", "hit_tokens"}`` (the last three cumulative);
    * ``scaled_pool``: the pool tier, None or
      ``{"num_blocks", "num_used_blocks", "num_free_blocks", "num_blocks_pooled"}``
      (slots without the null slot; the last cumulative);
    * ``blocks``: per block id ``{"state": "null" | "used" | "cached_free" | "free", "ref_cnt", "holders"}``, holders
      the request ids holding it plus ``"<pinned>"`` / ``"<copy source>"``.
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
    cpool = kv.scaled_pool
    report["scaled_pool"] = None if cpool is None else {
        "num_blocks": cpool.num_blocks - 1, "num_used_blocks": cpool.num_blocks - 1 - cpool.num_free_blocks,
        "num_free_blocks": cpool.num_free_blocks, "num_blocks_pooled": cpool.stats()["num_blocks_pooled"]}
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
