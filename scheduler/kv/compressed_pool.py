"""Compressed KV blocks: a second, smaller-per-block pool that full blocks move into before a preemption.

Full, computed, singly-held blocks are re-encoded to one byte with per-block scales
(``kernels_pallas.storage.ScaledKV``) and their device blocks given back. A compressed block's id is
``base + slot`` (``base``: the device pool's ``num_blocks``); slot 0 is the null slot. It has no prefix-cache
hash, is never written again, and returns here when its request finishes or is preempted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from scheduler.kv.block_pool import KVBlock
from scheduler.kv.tier import BlockCopy, CopyKind, KVTier, first_refused
from scheduler.request import Request

if TYPE_CHECKING:
    from scheduler.kv.kv_cache_manager import KVCacheManager

# The settings compression cannot run with: (field, refused when, how the refusal reads; {} is "field=value").
# Fields of both the engine's flat config and SchedulerConfig; a config without the field is not checked for it.
_REFUSED = (
    ("kv_cache_dtype", lambda v: v != "auto", "{} (the cache is one byte a number already; use 'auto')"),
    ("speculative_config", lambda v: v is not None, "speculative_config (a draft model reads the same block tables)"),
    ("preemption_mode", lambda v: v == "swap", "{} (swaps copy device blocks only)"),
    ("kv_offloading_size", bool, "{} (the host tier copies device blocks only)"),
    ("num_offload_blocks", bool, "a host tier ({})"),
    ("tensor_parallel_size", lambda v: v > 1, "{}"),
    ("batching", lambda v: v == "static", "{}"),
    ("attention_backend", lambda v: v == "pallas", "{} (its kernels read one pool; use 'xla' or 'reference')"),
)


def may_compress(request: Request) -> bool:
    """Whether ``request``'s KV may be compressed: ``allow_kv_compression`` and ``priority >= 0``."""
    return request.sampling_params.allow_kv_compression and request.priority >= 0


class CompressedBlockPool(KVTier):
    """The compressed blocks and their ref counts; the tier that makes room by compressing full blocks of the victims
    that :func:`may_compress`, in victim order, oldest first.

    Args: kv (the ``KVCacheManager`` whose tables it rewrites), num_blocks (slots, null included, >= 2), base (slot
    0's id, >= 2). Attributes: num_blocks, base, blocks (``blocks[s].block_id == base + s``), num_compressed
    (cumulative). Raises ValueError out of range.
    """

    makes_room = True

    def __init__(self, kv: "KVCacheManager", num_blocks: int, base: int) -> None:
        if num_blocks < 2 or base < 2:
            raise ValueError(f"CompressedBlockPool: num_blocks={num_blocks} and base={base} must be >= 2 (slot 0 "
                             "is the null slot, block 0 the null block)")
        self.num_blocks = num_blocks
        self.base = base
        self.blocks = [KVBlock(base + s) for s in range(num_blocks)]
        # Popped from the end: the lowest slots go first.
        self._free = self.blocks[:0:-1]
        self.num_compressed = 0
        self.kv = kv
        self._copies: list[BlockCopy] = []

    @property
    def num_free_blocks(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    def holds(self, block: KVBlock) -> bool:
        """Whether ``block`` is one of this pool's (by id: the device pool's ids are all below ``base``)."""
        return block.block_id >= self.base

    def take(self, n: int) -> list[KVBlock]:
        """``n`` free blocks with ref_cnt 1; ValueError, taking nothing, if fewer are free."""
        if n > len(self._free):
            raise ValueError(f"CompressedBlockPool.take: asked for {n} blocks, only {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for block in blocks:
            block.ref_cnt = 1
        self.num_compressed += n
        return blocks

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference from each block (free at 0); ValueError if one is free already or the null slot."""
        for block in blocks:
            if block.ref_cnt <= 0 or block.block_id == self.base:
                raise ValueError(f"CompressedBlockPool.free: block {block.block_id} has ref_cnt {block.ref_cnt}; "
                                 "need >= 1")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block)

    @classmethod
    def refuses(cls, config: Any) -> Optional[str]:
        return first_refused(config, _REFUSED)

    def compressible(self, request: Request) -> list[int]:
        """Table indices of ``request``'s blocks :meth:`compress` may take, oldest first: full computed device
        blocks (already registered when caching) with ref_cnt 1."""
        kv = self.kv
        blocks = kv.req_to_blocks.get(request.request_id)
        if not blocks:
            return []
        full = min(request.num_computed_tokens, request.num_tokens) // kv.block_size
        if kv.enable_caching:
            full = min(full, kv.num_cached_blocks(request))
        return [i for i, b in enumerate(blocks[:full]) if b.ref_cnt == 1 and not self.holds(b)]

    def compress(self, request: Request, n: int) -> list[tuple[int, int]]:
        """Move up to ``n`` :meth:`compressible` blocks, oldest first, into free slots, freeing the device blocks;
        returns ``(device block, compressed slot)`` pairs to re-encode (``CopyKind.ENCODE``)."""
        indices = self.compressible(request)[:min(n, self.num_free_blocks)]
        if not indices:
            return []
        kv, rid = self.kv, request.request_id
        blocks, ids = kv.req_to_blocks[rid], kv.req_to_block_ids[rid]
        pairs, freed = [], []
        for i, new in zip(indices, self.take(len(indices))):
            pairs.append((blocks[i].block_id, new.block_id - self.base))
            freed.append(blocks[i])
            blocks[i], ids[i] = new, new.block_id
        kv.block_table.table[request.batch_row, indices] = [ids[i] for i in indices]
        kv.block_pool.free_blocks(freed)
        return pairs

    def make_room(self, need: int, victims: Sequence[Request]) -> bool:
        if need < 1 or need > self.num_free_blocks:
            return False
        plan, found = [], 0
        for victim in filter(may_compress, victims):
            k = min(len(self.compressible(victim)), need - found)
            if k:
                plan.append((victim, k))
                found += k
            if found == need:
                break
        if found < need:
            return False
        for victim, k in plan:
            self._copies += [BlockCopy(CopyKind.ENCODE, d, slot) for d, slot in self.compress(victim, k)]
        return True

    def reclaimable(self, running: Sequence[Request]) -> int:
        found = sum(len(self.compressible(r)) for r in running if may_compress(r))
        return min(found, self.num_free_blocks)

    def take_copies(self) -> list[BlockCopy]:
        copies, self._copies = self._copies, []
        return copies

    def forget(self, copies: Sequence[BlockCopy], running: Sequence[Request]) -> list[Request]:
        ids = {self.base + c.dst for c in copies if c.kind is CopyKind.ENCODE}
        if not ids:
            return []
        return [r for r in running if ids.intersection(self.kv.get_block_ids(r.request_id))]

    def refuses_compaction(self) -> Optional[str]:
        # Compressed blocks' ids are the device pool's size plus their slot: renumbering or resizing would move them.
        return f"not with a compressed KV pool (num_pool_blocks={self.num_blocks}, kv_cache_compression)"

    def stats(self) -> dict[str, int]:
        return dict(num_pool_blocks=self.num_blocks - 1, num_pool_in_use=self.num_blocks - 1
                    - self.num_free_blocks, num_blocks_pooled=self.num_compressed)
