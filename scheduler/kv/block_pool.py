"""Device KV blocks: ref counts, an LRU free queue, the prefix-cache map (vLLM v1's ``BlockPool``)."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from scheduler.kv.host_tier import HostTier
from scheduler.kv_events import AllBlocksCleared, BlockRemoved, KVEvent


class KVBlock:
    """One device KV block: block_id (in [0, num_blocks)), ref_cnt (tables holding it), block_hash (16 bytes while
    registered, else None), prev/next (free-queue links, None outside it)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None
        self.prev: Optional[KVBlock] = None
        self.next: Optional[KVBlock] = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked free blocks, front evicted first (vLLM v1's ``FreeKVCacheBlockQueue``); O(1) push at either
    end, pop at the front, removal anywhere."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        # Sentinels remove the empty-list and end-of-list special cases.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        node = self._head.next
        while node is not self._tail:
            yield node
            node = node.next

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev is not None

    def popleft(self) -> KVBlock:
        """Remove and return the front block. Raises ValueError when empty."""
        block = self._head.next
        if block is self._tail:
            raise ValueError("FreeBlockQueue.popleft: the queue is empty (0 free blocks)")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Remove and return the first ``n`` blocks, front first; ValueError, removing nothing, if fewer are queued."""
        if n > self._len:
            raise ValueError(f"FreeBlockQueue.popleft_n: asked for {n} blocks, only {self._len} queued")
        out = []
        node = self._head.next
        for _ in range(n):
            nxt = node.next
            node.prev = node.next = None
            out.append(node)
            node = nxt
        self._head.next = node
        node.prev = self._head
        self._len -= n
        return out

    def append(self, block: KVBlock) -> None:
        """Put ``block`` at the back (evicted last)."""
        self._link(block, self._tail.prev, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        """Put ``block`` at the front (evicted first)."""
        self._link(block, self._head, self._head.next)

    def extend(self, blocks: list[KVBlock]) -> None:
        """Put ``blocks`` at the back in order; ValueError, adding nothing, if one is queued already."""
        self._check_unqueued(blocks)
        self._splice_back(blocks)

    def _splice_back(self, blocks: list[KVBlock]) -> None:
        prev = self._tail.prev
        for block in blocks:
            prev.next = block
            block.prev = prev
            prev = block
        prev.next = self._tail
        self._tail.prev = prev
        self._len += len(blocks)

    def extendleft(self, blocks: list[KVBlock]) -> None:
        """Put each of ``blocks`` at the front in turn (the last ends first); ValueError, adding nothing, if one is
        queued already."""
        self._check_unqueued(blocks)
        self._splice_front(blocks)

    def _splice_front(self, blocks: list[KVBlock]) -> None:
        nxt = self._head.next
        for block in blocks:
            block.next = nxt
            nxt.prev = block
            nxt = block
        self._head.next = nxt
        nxt.prev = self._head
        self._len += len(blocks)

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from wherever it is. Raises ValueError if it is not queued."""
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"FreeBlockQueue.remove: block {block.block_id} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._len -= 1

    @staticmethod
    def _check_unqueued(blocks: list[KVBlock]) -> None:
        for block in blocks:
            if block.prev is not None:
                raise ValueError(f"FreeBlockQueue: block {block.block_id} is already in the free queue")

    def _link(self, block: KVBlock, prev: KVBlock, nxt: KVBlock) -> None:
        if block.prev is not None:
            raise ValueError(f"FreeBlockQueue: block {block.block_id} is already in the free queue")
        block.prev, block.next = prev, nxt
        prev.next = block
        nxt.prev = block
        self._len += 1


class BlockPool:
    """All device KV blocks, their ref counts, and the hash -> block map (vLLM v1's ``BlockPool``).

    Block 0 is the null block (never allocated or freed; padded slots write into it). A freed hashed block goes to
    the free queue's back, an unhashed one to its front; allocation pops the front, evicting its hash.

    Args:
      num_blocks: total blocks including the null block, >= 2 (else ValueError).
      enable_caching: keep the hash -> block map.
      enable_kv_cache_events: record events in :attr:`kv_events`.
      num_offload_blocks: host-tier slots (``scheduler.kv.host_tier``), 0: none; an evicted hashed block is
        offloaded there before reuse.
      offload_base: the tier's first slot id in the runner's host pool.
      block_size: tokens per block, for the tier's events.

    Attributes: kv_events (``scheduler.kv_events`` events since the last take; None when off), host_tier (None
    without one).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_kv_cache_events: bool = False,
                 num_offload_blocks: int = 0, offload_base: int = 0, block_size: int = 1) -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool: num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}
        self.kv_events: Optional[list[KVEvent]] = [] if enable_kv_cache_events and enable_caching else None
        self.host_tier = HostTier(
            num_offload_blocks, offload_base, block_size, record=self._record if self.kv_events is not None else None,
        ) if num_offload_blocks and enable_caching else None

    def _record(self, event: KVEvent) -> None:
        # Looked up per event: Scheduler.take_kv_events replaces the list.
        self.kv_events.append(event)

    def take_kv_events(self) -> list[KVEvent]:
        """The ``BlockStored`` / ``BlockRemoved`` events since the last call, oldest first."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue, cached-but-unreferenced ones included."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the non-null blocks that some request holds, in [0, 1]."""
        return 1.0 - len(self.free_queue) / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the free queue's front, ref_cnt 1, evicting (and offloading) their hashes;
        ValueError, taking nothing, if ``n`` exceeds the free blocks."""
        if n > len(self.free_queue):
            raise ValueError(f"BlockPool.get_new_blocks: asked for {n} blocks, only {len(self.free_queue)} free")
        blocks = self.free_queue.popleft_n(n)
        cached = self.cached
        tier = self.host_tier
        evicted = []
        for block in blocks:
            # A hashed block is the one the map holds under its hash (cache_blocks registers only unhashed
            # blocks under new hashes).
            if block.block_hash is not None:
                del cached[block.block_hash]
                evicted.append(block.block_hash)
                if tier is not None:
                    tier.offload(block.block_id, block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
        if evicted and self.kv_events is not None:
            self.kv_events.append(BlockRemoved(evicted))
        return blocks

    def offloads_to_take(self, n: int, skip: frozenset[int] = frozenset()) -> list[bool]:
        """Per first ``n`` free-queue blocks not in ``skip``, front first: whether taking it now queues a host-tier
        copy (its hash is not in the tier). Shorter when fewer are free; all False without a tier."""
        tier = self.host_tier
        out: list[bool] = []
        if n <= 0:
            return out
        for block in self.free_queue:
            if block.block_id in skip:
                continue
            out.append(tier is not None and block.block_hash is not None and not tier.holds(block.block_hash))
            if len(out) == n:
                break
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block, reviving it from the free queue if unreferenced."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference from each block in order; at 0 a hashed block goes to the queue's back, an unhashed one
        to its front. ValueError if a block is free already or is the null block."""
        hashed: list[KVBlock] = []
        unhashed: list[KVBlock] = []
        null = self.null_block
        # Queued in two splices, also when a bad block stops the loop, so
        # the blocks freed before it are not lost.
        try:
            for block in blocks:
                if block.ref_cnt <= 0 or block is null:
                    raise ValueError(
                        f"BlockPool.free_blocks: block {block.block_id} has ref_cnt {block.ref_cnt}; need >= 1"
                    )
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    (unhashed if block.block_hash is None else hashed).append(block)
        finally:
            # Referenced until now, so none of them is queued.
            self.free_queue._splice_back(hashed)
            self.free_queue._splice_front(unhashed)

    def reset_prefix_cache(self) -> int:
        """Forget every hash (vLLM's ``reset_prefix_cache``) and empty the host tier, recording ``AllBlocksCleared``;
        ref counts and queue places stay. Returns the number of blocks that lost their hash."""
        for block in self.cached.values():
            block.block_hash = None
        num = len(self.cached)
        self.cached.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return num

    def get_cached_block(self, block_hash: bytes) -> Optional[KVBlock]:
        """The block registered under ``block_hash``, or None."""
        return self.cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full, computed block under ``block_hash``; if another holds it already, ``block`` stays
        unhashed."""
        self.cache_blocks((block,), (block_hash,))

    def cache_blocks(self, blocks: Sequence[KVBlock], block_hashes: Sequence[bytes]) -> None:
        """:meth:`cache_block` for each pair of ``blocks`` and ``block_hashes``, in one loop."""
        if not self.enable_caching:
            return
        cached = self.cached
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is None and block_hash not in cached:
                block.block_hash = block_hash
                cached[block_hash] = block

    def uncache_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop the hashes of ``blocks`` holding one (with ``BlockRemoved`` events), for KV never written."""
        gone = [b for b in blocks if b.block_hash is not None]
        for block in gone:
            del self.cached[block.block_hash]
        if gone and self.kv_events is not None:
            self.kv_events.append(BlockRemoved([b.block_hash for b in gone]))
        for block in gone:
            block.block_hash = None

    # ------------------------------------------------------ compaction and resizing (between steps)

    def compact(self, num_blocks: Optional[int] = None) -> list[tuple[int, int]]:
        """Renumber so that the ``k`` referenced and cached free blocks have ids below ``k + 1``, each keeping its ref
        count, hash and queue place (objects swap ids with empty free blocks; ``KVCacheManager.renumber`` follows).

        With ``num_blocks`` (a shrink to come), cached free blocks beyond ``num_blocks - 1 - referenced`` are
        evicted first, front first. Returns ``(old id, new id)`` moves for the device to copy, no destination a
        source. ValueError, changing nothing, if ``num_blocks`` is below the referenced blocks + 1.
        """
        referenced = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached_free = sum(1 for b in self.cached.values() if b.ref_cnt == 0)
        if num_blocks is not None:
            if num_blocks < referenced + 1:
                raise ValueError(f"BlockPool.compact: {referenced} referenced blocks and the null block do not "
                                 f"fit in num_blocks={num_blocks}")
            evicted = max(cached_free - (num_blocks - 1 - referenced), 0)
            self._evict_cached_free(evicted)
            cached_free -= evicted
        kept = referenced + cached_free
        blocks = self.blocks
        holes = [b for b in blocks[1:kept + 1] if not self._is_live(b)]
        movers = [b for b in blocks[kept + 1:] if self._is_live(b)]
        moves = []
        for mover, hole in zip(movers, holes):
            moves.append((mover.block_id, hole.block_id))
            mover.block_id, hole.block_id = hole.block_id, mover.block_id
            blocks[mover.block_id], blocks[hole.block_id] = mover, hole
        return moves

    @staticmethod
    def _is_live(block: KVBlock) -> bool:
        return block.ref_cnt > 0 or block.block_hash is not None

    def _evict_cached_free(self, n: int) -> None:
        """Unhash the first ``n`` cached free blocks of the queue and move them to its front."""
        if n <= 0:
            return
        victims = [b for b in self.free_queue if b.block_hash is not None][:n]
        for block in victims:
            del self.cached[block.block_hash]
            self.free_queue.remove(block)
        if self.kv_events is not None:
            self.kv_events.append(BlockRemoved([b.block_hash for b in victims]))
        for block in victims:
            block.block_hash = None
        self.free_queue._splice_front(victims)

    def resize(self, num_blocks: int) -> None:
        """Grow with empty free blocks (at the queue's front), or drop the top ids, which must be empty free blocks
        (:meth:`compact` first). ValueError, changing nothing, if ``num_blocks < 2`` or a dropped block is in use."""
        if num_blocks < 2:
            raise ValueError(f"BlockPool.resize: num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
        dropped = self.blocks[num_blocks:]
        live = [b.block_id for b in dropped if self._is_live(b)]
        if live:
            raise ValueError(f"BlockPool.resize: blocks {live[:8]} at or above num_blocks={num_blocks} are "
                             "referenced or cached; compact(num_blocks) first")
        for block in dropped:
            self.free_queue.remove(block)
        grown = [KVBlock(i) for i in range(self.num_blocks, num_blocks)]
        self.free_queue.extendleft(grown[::-1])
        self.blocks = self.blocks[:num_blocks] + grown
        self.num_blocks = num_blocks
