"""Per-request block tables on top of the block pool (vLLM v1 ``KVCacheManager``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from scheduler.block_hash import extend_block_hashes, hash_block_tokens
from scheduler.block_table import BlockTable
from scheduler.kv.block_pool import BlockPool, KVBlock
from scheduler.kv.compressed_pool import CompressedBlockPool
from scheduler.kv.host_tier import HostHit
from scheduler.kv.swap import SwapTier
from scheduler.kv.tier import BlockCopy, CopyKind, KVTier, copies_of
from scheduler.kv_events import BlockStored
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from scheduler.config import SchedulerConfig


class KVCacheManager:
    """Allocates, frees, prefix-matches and swaps each request's KV blocks (vLLM v1's ``KVCacheManager``).

    A request's table covers its first ``num_computed_tokens + num_new_tokens`` tokens. A block is prefix-cacheable
    once full and computed (:meth:`cache_computed_blocks`) or full and scheduled by an admission
    (:meth:`cache_scheduled_blocks`). When hits cover every token, the last block is copied on write (our
    addition; see ``docs/design/scheduler.md``).

    Args:
      block_pool: the device blocks.
      block_size: tokens per block, >= 1.
      enable_caching: look up and register prefix-cache hashes.
      num_host_blocks: host blocks of the swap tier (``scheduler.kv.swap``).
      num_pool_blocks: slots of the :attr:`POOL_TIER` (the compressed tier), null slot included; 0: none.

    Attributes:
      req_to_blocks, req_to_block_ids: request_id -> its table as ``KVBlock`` list / ints.
      block_table: the tables as a ``BlockTable``, a request's row its ``batch_row``.
      copy_sources: cached blocks read by copies handed out since :meth:`release_copy_sources`, each held by one
        extra reference until copied.
      swap, scaled_pool (the :attr:`POOL_TIER`, None without one), tiers (scaled_pool, swap, the pool's host tier,
        when present).
      pinned_blocks: the blocks :meth:`pin_prefix` holds.
      scheduled_blocks: blocks :meth:`cache_scheduled_blocks` registered in this schedule; emptied by :meth:`end_step`.
    """

    # The tier that makes room before a preemption in a pool of its own (its slots: ``num_pool_blocks``).
    POOL_TIER = CompressedBlockPool

    def __init__(self, block_pool: BlockPool, block_size: int, enable_caching: bool = True, num_host_blocks: int = 0,
                 num_pool_blocks: int = 0):
        if block_size < 1:
            raise ValueError(f"KVCacheManager: block_size={block_size} must be >= 1")
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.block_table = BlockTable()
        self.copy_sources: list[KVBlock] = []
        # request_id -> (cached block id, fresh block id) of copies not yet taken.
        self._copies: dict[str, tuple[int, int]] = {}
        # How many leading blocks of each table are already registered.
        self._num_cached: dict[str, int] = {}
        self.swap = SwapTier(self, num_host_blocks)
        self.scaled_pool = (self.POOL_TIER(self, num_pool_blocks, block_pool.num_blocks)
                            if num_pool_blocks else None)
        if block_pool.host_tier is not None:
            block_pool.host_tier.kv = self
        self.tiers: list[KVTier] = [t for t in (self.scaled_pool, self.swap, block_pool.host_tier)
                                    if t is not None]
        self.scheduled_blocks: list[KVBlock] = []
        self.pinned_blocks: list[KVBlock] = []

    @classmethod
    def for_config(cls, block_pool: BlockPool, config: "SchedulerConfig") -> "KVCacheManager":
        """The manager of ``block_pool`` with the tiers ``config`` sizes."""
        return cls(block_pool, config.block_size, config.enable_prefix_caching, config.num_host_blocks,
                   config.num_pool_blocks)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (the manager's list; do not mutate)."""
        return self.req_to_block_ids.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks prefixing ``request``'s tokens, as ``(blocks, num_tokens)``.

        ``blocks`` are not yet referenced (pass them to :meth:`allocate_slots`); ``num_tokens`` is
        ``min(len(blocks) * block_size, request.num_tokens - 1)``: the last token is always computed. A last block
        the step being scheduled computes is not hit. ``skip_reading_prefix_cache`` hits nothing.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        bs = self.block_size
        num_tokens = request.num_tokens
        # One-token blocks: the last block would hold only the recomputed
        # token, so it is left out rather than copied.
        max_blocks = num_tokens // bs if bs > 1 else num_tokens - 1
        self.hash_blocks(request)
        hashes = request.block_hashes
        cached = self.block_pool.cached
        hits = []
        for i in range(max_blocks):
            block = cached.get(hashes[i])
            if block is None:
                break
            hits.append(block)
        if len(hits) * bs >= num_tokens and any(hits[-1] is b for b in self.scheduled_blocks):
            hits.pop()
        return hits, min(len(hits) * bs, num_tokens - 1)

    def hash_blocks(self, request: Request) -> None:
        """Hash ``request``'s full blocks of known tokens not hashed yet (at arrival, as vLLM v1); no-op without caching."""
        if self.enable_caching:
            extend_block_hashes(
                request.block_hashes, request.all_token_ids, request.num_tokens // self.block_size, self.block_size,
                request.cache_salt, request.prompt_array,
            )

    def copies_last_block(self, request: Request, computed_blocks: Sequence[KVBlock]) -> bool:
        """Whether admitting ``request`` with these hits copies the last one on write (they cover every token)."""
        return bool(computed_blocks) and len(computed_blocks) * self.block_size >= request.num_tokens

    def num_blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> int:
        """Free-queue blocks :meth:`allocate_slots` with the same arguments takes (the one capacity rule): hits
        unreferenced in the free queue, a copy-on-write block, and fresh blocks for ``num_new_tokens`` +
        ``num_lookahead_tokens`` (vLLM v1's lookahead slots) beyond those held. Hits others hold cost nothing."""
        fresh, revive, _ = self._plan(request, num_new_tokens, computed_blocks, num_lookahead_tokens)
        return fresh + revive

    def _plan(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock], num_lookahead_tokens: int
    ) -> tuple[int, int, bool]:
        """``(fresh blocks, hits to revive from the free queue, copy_last)`` of one allocation."""
        bs = self.block_size
        num_held = len(self.req_to_blocks.get(request.request_id, ()))
        num_hits = len(computed_blocks)
        copy_last = self.copies_last_block(request, computed_blocks)
        # The copied block's last slot is recomputed, so it counts once as a hit and once as fresh.
        num_hit_tokens = request.num_tokens - 1 if copy_last else num_hits * bs
        slots = request.num_computed_tokens + num_hit_tokens + num_new_tokens + num_lookahead_tokens
        fresh = max(-(-slots // bs) - num_held - num_hits + copy_last, 0)
        revive = sum(1 for b in computed_blocks if b.ref_cnt == 0) if computed_blocks else 0
        return fresh, revive, copy_last

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Grow ``request``'s table to its computed tokens, ``computed_blocks``, ``num_new_tokens`` more and
        ``num_lookahead_tokens`` slots beyond.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, only for a request with no blocks) are referenced
        first; a full hit's last block goes to :attr:`copy_sources` and a fresh one takes its place. Returns False,
        changing nothing, when the free queue holds fewer than :meth:`num_blocks_to_allocate`.
        """
        pool = self.block_pool
        fresh, revive, copy_last = self._plan(request, num_new_tokens, computed_blocks, num_lookahead_tokens)
        if fresh + revive > len(pool.free_queue):
            return False
        if not fresh and not computed_blocks:
            return True
        rid = request.request_id
        if rid not in self.req_to_blocks:
            self._start_table(request)
        shared = list(computed_blocks)
        if shared:
            # Touched before the new blocks are taken, so allocation cannot
            # evict a hit (the copy source included). The fresh copy counts as
            # registered: the cached block keeps the hash.
            host = [b for b in shared if type(b) is HostHit]
            pool.touch([b for b in shared if type(b) is not HostHit] if host else shared)
            self._num_cached[rid] = len(self.req_to_blocks[rid]) + len(shared)
            if host:
                shared = self._load_host_hits(request, shared, host)
        new_blocks = pool.get_new_blocks(fresh)
        if copy_last:
            source = shared.pop()
            self.copy_sources.append(source)
            self._copies[rid] = (source.block_id, new_blocks[0].block_id)
        self._extend_table(request, shared + new_blocks)
        return True

    def _load_host_hits(self, request: Request, shared: list, host: list[HostHit]) -> list[KVBlock]:
        """``shared`` with its ``host`` hits replaced by fresh registered device blocks, the tier's loads queued."""
        pool, tier = self.block_pool, self.block_pool.host_tier
        # Pinned first: taking the fresh blocks may offload others into the tier, which must not evict these.
        tier.pin(host)
        fresh = iter(pool.get_new_blocks(len(host)))
        num_held = len(self.req_to_blocks[request.request_id])
        out = []
        for i, block in enumerate(shared):
            if type(block) is HostHit:
                hit, block = block, next(fresh)
                tier.load(hit, block.block_id)
                pool.cache_block(block, hit.block_hash)
                self._record_loaded(request, num_held + i)
            out.append(block)
        return out

    def _record_loaded(self, request: Request, i: int) -> None:
        """A device ``BlockStored`` for block ``i`` of ``request``, loaded from the host tier."""
        events = self.block_pool.kv_events
        if events is not None:
            bs, hashes = self.block_size, request.block_hashes
            events.append(BlockStored([hashes[i]], hashes[i - 1] if i else None,
                                      request.all_token_ids[i * bs:(i + 1) * bs], bs))

    def num_offloads_to_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence = (),
                                 num_lookahead_tokens: int = 0) -> int:
        """Host-tier copies :meth:`allocate_slots` with the same arguments would queue now (hashed free blocks it
        takes from the free queue's front that the tier lacks)."""
        fresh, _, _ = self._plan(request, num_new_tokens, computed_blocks, num_lookahead_tokens)
        num_host = sum(1 for b in computed_blocks if type(b) is HostHit)
        revived = frozenset(b.block_id for b in computed_blocks if type(b) is not HostHit and b.ref_cnt == 0)
        return sum(self.block_pool.offloads_to_take(fresh + num_host, revived))

    def append_blocks(self, requests: Sequence[Request], rows: np.ndarray, counts: np.ndarray) -> None:
        """Give each request ``counts[i]`` (>= 1) fresh blocks at its table's end, ``rows`` their ``batch_row``s: the
        same blocks as one :meth:`allocate_slots` each. Raises ValueError, taking nothing, if ``counts.sum()``
        exceeds the free blocks."""
        blocks = self.block_pool.get_new_blocks(int(counts.sum()))
        ids = [b.block_id for b in blocks]
        self.block_table.append_rows(rows, counts, ids)
        start = 0
        for request, count in zip(requests, counts.tolist()):
            rid, end = request.request_id, start + count
            self.req_to_blocks[rid] += blocks[start:end]
            self.req_to_block_ids[rid] += ids[start:end]
            start = end

    def fork(self, parent: Request, children: Sequence[Request]) -> tuple[int, list[tuple[int, int]]]:
        """Hand ``parent``'s blocks to ``children``, which continue from its computed tokens.

        The first child takes over the parent's table; the others reference its full computed blocks and get a
        fresh block for a partly written last one, to be copied. Children are forked in order while free blocks
        last; the parent's table is gone. Returns ``(num_forked, copies)``: leading children now holding a table, and
        ``(src_block, dst_block)`` copies to run before the next step.
        """
        rid, bs = parent.request_id, self.block_size
        blocks = self.req_to_blocks.pop(rid)
        first = children[0].request_id
        self.req_to_blocks[first] = blocks
        self.req_to_block_ids[first] = self.req_to_block_ids.pop(rid)
        children[0].batch_row, parent.batch_row = parent.batch_row, -1
        num_cached = self._num_cached[first] = self._num_cached.pop(rid)
        partial = parent.num_computed_tokens % bs != 0
        # Blocks past the computed tokens (lookahead slots, an async admission's first decode slot) stay with
        # the first child alone: the others would each write their own tokens into one shared block.
        used = -(-parent.num_computed_tokens // bs)
        shared = blocks[:used - 1] if partial else blocks[:used]
        copies = []
        for i, child in enumerate(children[1:], start=1):
            if partial and self.block_pool.num_free_blocks == 0:
                return i, copies
            cid = child.request_id
            self._start_table(child)
            self.block_pool.touch(shared)
            fresh = self.block_pool.get_new_blocks(int(partial))
            self._extend_table(child, shared + fresh)
            self._num_cached[cid] = num_cached
            if partial:
                copies.append((blocks[used - 1].block_id, fresh[0].block_id))
        return len(children), copies

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """``(cached_block, fresh_block)`` copies queued since the last call, for the runner to do before the step."""
        pairs = list(self._copies.values())
        self._copies.clear()
        return pairs

    def release_copy_sources(self) -> None:
        """Drop the references pinning :attr:`copy_sources`; call once the runner has done the copies."""
        if self.copy_sources:
            self.block_pool.free_blocks(self.copy_sources)
            self.copy_sources = []

    def _start_table(self, request: Request) -> None:
        rid = request.request_id
        self.req_to_blocks[rid] = []
        self.req_to_block_ids[rid] = []
        self._num_cached[rid] = 0
        request.batch_row = self.block_table.acquire()

    def _extend_table(self, request: Request, blocks: list[KVBlock]) -> None:
        rid = request.request_id
        ids = [b.block_id for b in blocks]
        self.req_to_blocks[rid].extend(blocks)
        self.req_to_block_ids[rid].extend(ids)
        self.block_table.append(request.batch_row, ids)

    def cache_computed_blocks(self, *requests: Request) -> None:
        """Register every full block of each request whose tokens are all computed; each block is hashed once."""
        if self.enable_caching:
            self._cache_full_blocks(requests, [r.num_computed_tokens for r in requests])

    def cache_scheduled_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the full blocks of ``request``'s first ``num_tokens`` tokens as the step computing them is
        scheduled (vLLM v1's ``allocate_slots``), so later admissions this step hit them. Only for requests just
        admitted (never preempted in that step); listed in :attr:`scheduled_blocks`."""
        if self.enable_caching:
            self.scheduled_blocks += self._cache_full_blocks((request,), (num_tokens,))

    def _cache_full_blocks(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[KVBlock]:
        """Register the not yet registered full blocks of each request's first ``num_tokens[i]``; returns those hashed."""
        bs, num_cached = self.block_size, self._num_cached
        blocks: list[KVBlock] = []
        block_hashes: list[bytes] = []
        runs: Optional[list[tuple[Request, int, int]]] = None if self.block_pool.kv_events is None else []
        for request, count in zip(requests, num_tokens):
            rid = request.request_id
            # With async scheduling the computed count can run one sampled
            # token ahead of the known ids; only blocks of known tokens are hashed.
            num_full = min(count, request.num_tokens) // bs
            done = num_cached.get(rid, 0)
            if num_full <= done:
                continue
            hashes = request.block_hashes
            if len(hashes) == num_full - 1 and num_full > 1:
                # The common case while decoding: one more block, after hashed ones.
                hashes.append(hash_block_tokens(hashes[-1], request.all_token_ids[(num_full - 1) * bs : num_full * bs]))
            else:
                extend_block_hashes(hashes, request.all_token_ids, num_full, bs, request.cache_salt, request.prompt_array)
            blocks += self.req_to_blocks[rid][done:num_full]
            block_hashes += hashes[done:num_full]
            num_cached[rid] = num_full
            if runs is not None:
                runs.append((request, done, num_full))
        self.block_pool.cache_blocks(blocks, block_hashes)
        if runs:
            self._record_stored(runs)
        return [b for b, h in zip(blocks, block_hashes) if b.block_hash is h]

    def _record_stored(self, runs: list[tuple[Request, int, int]]) -> None:
        """A ``BlockStored`` for each run of consecutive registered blocks ``[done, num_full)``."""
        bs, events = self.block_size, self.block_pool.kv_events
        for request, done, num_full in runs:
            table, hashes = self.req_to_blocks[request.request_id], request.block_hashes
            start = done
            for i in range(done, num_full + 1):
                if i < num_full and table[i].block_hash is not None:
                    continue
                if i > start:
                    events.append(BlockStored(hashes[start:i], hashes[start - 1] if start else None,
                                              request.all_token_ids[start * bs:i * bs], bs))
                start = i + 1

    def free(self, request: Request) -> None:
        """Release all of ``request``'s device blocks (tail first, so its prefix is evicted last) and host blocks."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        # A copy not yet taken would write into a block that may be reused.
        self._copies.pop(rid, None)
        self.req_to_block_ids.pop(rid, None)
        self._num_cached.pop(rid, None)
        if request.batch_row >= 0:
            self.block_table.release(request.batch_row)
            request.batch_row = -1
        if blocks:
            cpool = self.scaled_pool
            if cpool is not None:
                cpool.free(b for b in blocks if cpool.holds(b))
                blocks = [b for b in blocks if not cpool.holds(b)]
            self.block_pool.free_blocks(reversed(blocks))
        self.swap.free(request)

    def renumber(self, moves: Sequence[tuple[int, int]]) -> None:
        """Rewrite every block table's ids after ``BlockPool.compact`` swapped those of ``moves`` (``(old, new)``
        pairs); call it before the pool is resized."""
        if not moves:
            return
        remap = np.arange(self.block_pool.num_blocks, dtype=np.int32)
        old, new = np.asarray(moves, np.int32).T
        remap[old], remap[new] = new, old
        self.block_table.table = remap[self.block_table.table]
        for rid, blocks in self.req_to_blocks.items():
            self.req_to_block_ids[rid][:] = [b.block_id for b in blocks]

    def pin_prefix(self, token_ids: Sequence[int], cache_salt: Optional[str] = None) -> int:
        """Reference the cached full blocks prefixing ``token_ids`` until :meth:`release_pinned_prefixes`; returns the
        blocks newly pinned."""
        probe = Request("pin-probe", list(token_ids), SamplingParams(), cache_salt=cache_salt)
        blocks, _ = self.get_computed_blocks(probe)
        held = {b.block_id for b in self.pinned_blocks}
        new = [b for b in blocks if b.block_id not in held]
        self.block_pool.touch(new)
        self.pinned_blocks += new
        return len(new)

    def release_pinned_prefixes(self) -> None:
        """Drop the pins of :meth:`pin_prefix`; the blocks become ordinary LRU entries."""
        blocks, self.pinned_blocks = self.pinned_blocks, []
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def num_cached_blocks(self, request: Request) -> int:
        """How many leading blocks of ``request``'s table are registered in the prefix cache."""
        return self._num_cached.get(request.request_id, 0)

    def give_fresh_table(self, request: Request, n: int) -> None:
        """Give ``request``, holding no blocks, a table of ``n`` fresh blocks."""
        self._start_table(request)
        self._extend_table(request, self.block_pool.get_new_blocks(n))

    def take_block_copies(self) -> list[BlockCopy]:
        """Every copy queued since the last call (tiers' and copies on write), in ``CopyKind`` order, for before the step."""
        copies = [c for tier in self.tiers for c in tier.take_copies()]
        copies += copies_of(CopyKind.COPY, self.take_blocks_to_copy())
        copies.sort(key=lambda c: c.kind)
        return copies

    def start_step(self) -> None:
        """Called at the start of ``Scheduler.schedule``: earlier steps' copies have run or were discarded."""
        for tier in self.tiers:
            tier.start_step()

    def end_step(self) -> None:
        """Called at the end of ``Scheduler.schedule``: freed host ids and read host slots become reusable, and
        :attr:`scheduled_blocks` empties."""
        self.scheduled_blocks = []
        for tier in self.tiers:
            tier.end_step()
