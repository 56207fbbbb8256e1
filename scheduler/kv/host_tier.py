"""The host-memory tier of the prefix cache (vLLM's CPU offloading, ``--kv-offloading-size``, simplest form).

A hashed device block about to be reused is copied to a host slot first; a prefix lookup that misses on the device
continues its hash chain here, a hit loaded into a fresh device block before the step reads it. Slots are
``base .. base + num_slots - 1`` of the runner's host pool, after the swap pool. Details: ``docs/design/scheduler.md``.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from scheduler.kv.tier import Admission, BlockCopy, CopyKind, KVTier, copies_of, first_refused
from scheduler.kv_events import BlockRemoved, BlockStored, KVEvent
from scheduler.request import Request

if TYPE_CHECKING:
    from scheduler.kv.kv_cache_manager import KVCacheManager

MEDIUM_HOST = "CPU"  # vLLM's name for the host tier in KV events


class HostHit:
    """A prefix block found in the host tier: block_hash (16 bytes) and the slot holding it; ``ref_cnt`` 0, so the
    capacity rule counts it as one free-queue block."""

    __slots__ = ("block_hash", "slot")
    ref_cnt = 0

    def __init__(self, block_hash: bytes, slot: int) -> None:
        self.block_hash = block_hash
        self.slot = slot

    def __repr__(self) -> str:
        return f"HostHit(slot={self.slot})"


class HostTier(KVTier):
    """Host slots holding full blocks by hash, with their own LRU (front evicted first); continues prefix hits.

    Args:
      num_slots: host blocks, >= 0 (0: keeps nothing).
      base: the first slot's id in the runner's host pool (the swap pool's size), >= 0.
      block_size: tokens per block (for events).
      record: called with each ``BlockStored`` / ``BlockRemoved`` event (medium ``"CPU"``), or None.

    Attributes: kv (the ``KVCacheManager`` served), slots (hash -> slot, LRU first), num_offloaded and num_loaded
    (copies each way so far), num_dropped (hashed blocks reused with every slot busy). Raises ValueError for a
    negative ``num_slots`` or ``base``.
    """

    def __init__(self, num_slots: int, base: int = 0, block_size: int = 1,
                 record: Optional[Callable[[KVEvent], None]] = None) -> None:
        if num_slots < 0 or base < 0:
            raise ValueError(f"HostTier: num_slots={num_slots} and base={base} must be >= 0")
        self.num_slots = num_slots
        self.base = base
        self.block_size = block_size
        self.record = record
        self.kv: Optional["KVCacheManager"] = None
        self.slots: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._free = list(range(base + num_slots - 1, base - 1, -1))
        # Slots read by this step's loads: the runner gathers offloads before it loads, so overwriting one in the
        # same step would hand the load the wrong contents.
        self._reading: set[int] = set()
        # Slots this step's offloads write, after the step is dispatched: not readable yet.
        self._writing: set[int] = set()
        self._offloads: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self.num_offloaded = 0
        self.num_loaded = 0
        self.num_dropped = 0

    @property
    def num_cached(self) -> int:
        """Slots holding a block."""
        return len(self.slots)

    @classmethod
    def refuses(cls, config: Any) -> Optional[str]:
        return first_refused(config, (("enable_prefix_caching", lambda v: not v,
                                       "{} (the tier holds prefix-cache blocks)"),))

    def match(self, request: Request, hits: list, admission: Admission) -> Optional[tuple[list, int]]:
        """``hits`` continued along ``request``'s hash chain here and, between host hits, on the device.

        None (wait a step) when its loads and offloads would take the step's copies past ``admission.copy_budget``
        after another request's loads (the first loading request always goes), or when the step has rows
        (``admission.may_wait``) and the hits stop at a block this step offloads.
        """
        kv = self.kv
        hits = self._extend(request, hits)
        hashes, bs = request.block_hashes, kv.block_size
        if admission.may_wait and len(hits) < min(len(hashes), (request.num_tokens - 1) // bs) and (
                self.being_written(hashes[len(hits)])):
            return None
        num_host = sum(1 for b in hits if type(b) is HostHit)
        if num_host and self.num_loads_this_step:
            num_new = admission.chunk(request.num_tokens - len(hits) * bs, admission.budget)
            copies = num_host + kv.num_offloads_to_allocate(request, num_new, hits)
            if self.num_copies_this_step + copies > admission.copy_budget:
                return None
        return hits, num_host

    def _extend(self, request: Request, hits: list) -> list:
        """``hits`` extended by blocks found here or on the device, never covering the last token."""
        kv = self.kv
        max_blocks = (request.num_tokens - 1) // kv.block_size
        if len(hits) >= max_blocks or request.skip_reading_prefix_cache:
            return hits
        hashes, cached = request.block_hashes, kv.block_pool.cached
        more: list = []
        for i in range(len(hits), max_blocks):
            found = cached.get(hashes[i]) or self.lookup(hashes[i])
            if found is None:
                break
            more.append(found)
        return hits + more if more else hits

    def forget(self, copies: Sequence[BlockCopy], running: Sequence[Request]) -> list[Request]:
        """Forget the slots this step's offloads were to write and the hashes its loads were to fill."""
        self._forget_slots([c.dst for c in copies if c.kind is CopyKind.OFFLOAD])
        pool = self.kv.block_pool
        lost = []
        for c in copies:
            if c.kind is not CopyKind.LOAD:
                continue
            block = pool.blocks[c.dst]
            if block.block_hash is not None and pool.cached.get(block.block_hash) is block:
                del pool.cached[block.block_hash]
                lost.append(block.block_hash)
                block.block_hash = None
        if lost and pool.kv_events is not None:
            pool.kv_events.append(BlockRemoved(lost))
        return []

    def stats(self) -> dict[str, int]:
        return dict(num_offload_blocks=self.num_slots, num_offload_cached_blocks=self.num_cached,
                    num_blocks_offloaded=self.num_offloaded, num_blocks_loaded=self.num_loaded)

    def lookup(self, block_hash: bytes) -> Optional[HostHit]:
        """The block held under ``block_hash``, or None (also while its slot's write is not complete)."""
        slot = self.slots.get(block_hash)
        return None if slot is None or slot in self._writing else HostHit(block_hash, slot)

    def being_written(self, block_hash: bytes) -> bool:
        """Whether ``block_hash``'s slot is written by this step's offloads (a hit from the next step on)."""
        slot = self.slots.get(block_hash)
        return slot is not None and slot in self._writing

    def holds(self, block_hash: bytes) -> bool:
        """Whether a slot holds (or is being written with) ``block_hash``: offloading it again copies nothing."""
        return block_hash in self.slots

    def offload(self, block_id: int, block_hash: bytes) -> None:
        """Queue device block ``block_id`` (about to be reused) for a copy to a slot under ``block_hash``: a held hash
        is only made recent; else the LRU slot not read this step is evicted, or the block dropped (``num_dropped``)."""
        if block_hash in self.slots:
            self.slots.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            self.num_dropped += 1
            return
        self.slots[block_hash] = slot
        self._writing.add(slot)
        self._offloads.append((block_id, slot))
        self.num_offloaded += 1
        if self.record is not None:
            # vLLM's offloading events carry no tokens nor parent: the device's BlockStored had them.
            self.record(BlockStored([block_hash], None, [], self.block_size, MEDIUM_HOST))

    def _take_slot(self) -> Optional[int]:
        if self._free:
            return self._free.pop()
        for victim, slot in self.slots.items():
            if slot not in self._reading:
                if slot in self._writing:
                    # Written by this step already (the most recent slots, so the last resort): that copy is
                    # dropped rather than done and overwritten.
                    self._offloads = [pair for pair in self._offloads if pair[1] != slot]
                    self.num_offloaded -= 1
                del self.slots[victim]
                if self.record is not None:
                    self.record(BlockRemoved([victim], MEDIUM_HOST))
                return slot
        return None

    @property
    def num_free_slots(self) -> int:
        """Slots holding nothing."""
        return len(self._free)

    @property
    def num_loads_this_step(self) -> int:
        """Host slots read by the loads queued in this step."""
        return len(self._reading)

    @property
    def num_copies_this_step(self) -> int:
        """Offload and load copies queued and not yet taken."""
        return len(self._offloads) + len(self._loads)

    def pin(self, hits: list[HostHit]) -> None:
        """Keep ``hits``' slots from eviction until :meth:`end_step` (they are about to be loaded)."""
        self._reading.update(h.slot for h in hits)

    def load(self, hit: HostHit, block_id: int) -> None:
        """Queue the copy of ``hit`` into device block ``block_id``; its slot is kept and made most recent."""
        self.slots.move_to_end(hit.block_hash)
        self._reading.add(hit.slot)
        self._loads.append((hit.slot, block_id))
        self.num_loaded += 1

    def take_copies(self) -> list[BlockCopy]:
        """The offloads then the loads queued since the last call."""
        out = copies_of(CopyKind.OFFLOAD, self._offloads) + copies_of(CopyKind.LOAD, self._loads)
        self._offloads, self._loads = [], []
        return out

    def end_step(self) -> None:
        """Slots read by this step's loads may be evicted again."""
        self._reading.clear()

    def start_step(self) -> None:
        """The previous steps' offloads have been written (or forgotten): their slots are hits."""
        self._writing.clear()

    def _forget_slots(self, slots: list[int]) -> None:
        """Free ``slots`` and forget the blocks they held (their copies in never ran)."""
        gone = set(slots)
        self._writing -= gone
        lost = [h for h, slot in self.slots.items() if slot in gone]
        for h in lost:
            self._free.append(self.slots.pop(h))
        if lost and self.record is not None:
            self.record(BlockRemoved(lost, MEDIUM_HOST))

    def clear(self) -> None:
        """Forget every block (the weights changed). Call between steps, with no copies queued."""
        self._free.extend(reversed(self.slots.values()))
        self.slots.clear()
        self._writing.clear()
