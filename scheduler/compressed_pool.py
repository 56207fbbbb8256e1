"""Compressed KV blocks: a second, smaller-per-block pool that full blocks move into before a preemption.

When the free device blocks run short, the scheduler may re-encode full, computed blocks that only one request
holds from the cache's dtype into a one-byte dtype with per-block scales (``kernels_pallas.storage.CompressedKV``),
held here, and give their device blocks back (``KVCacheManager.compress``; the rules in ``Scheduler``). A block
table then mixes the two kinds: a compressed block's id is ``base + slot`` with ``base`` the device pool's
``num_blocks``, which is what the attention ops read from the compressed pool. Slot 0 (id ``base``) is the null
slot, as block 0 is the null block: never handed out.

A compressed block has no prefix-cache hash (the device block it came from keeps its own and stays revivable while
free), is never written again, and goes back here when its request finishes or is preempted.
"""

from __future__ import annotations

from typing import Iterable

from scheduler.block_pool import KVBlock


class CompressedBlockPool:
    """The compressed blocks and their ref counts.

    Args:
      num_blocks: compressed blocks in all, the null slot included, >= 2.
      base: the id of slot 0 (the device pool's ``num_blocks``).

    Attributes:
      num_blocks, base: as given.
      blocks: the ``KVBlock`` of each slot, ``blocks[s].block_id == base + s``.
      num_compressed: blocks compressed so far, cumulative.

    Raises:
      ValueError: ``num_blocks < 2`` or ``base < 2``.
    """

    def __init__(self, num_blocks: int, base: int) -> None:
        if num_blocks < 2 or base < 2:
            raise ValueError(f"CompressedBlockPool: num_blocks={num_blocks} and base={base} must be >= 2 (slot 0 "
                             "is the null slot, block 0 the null block)")
        self.num_blocks = num_blocks
        self.base = base
        self.blocks = [KVBlock(base + s) for s in range(num_blocks)]
        # Popped from the end: the lowest slots go first.
        self._free = self.blocks[:0:-1]
        self.num_compressed = 0

    @property
    def num_free_blocks(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    def holds(self, block: KVBlock) -> bool:
        """Whether ``block`` is one of this pool's (by id: the device pool's ids are all below ``base``)."""
        return block.block_id >= self.base

    def take(self, n: int) -> list[KVBlock]:
        """``n`` free blocks, each with ref_cnt 1.

        Raises:
          ValueError: fewer than ``n`` are free (nothing is taken).
        """
        if n > len(self._free):
            raise ValueError(f"CompressedBlockPool.take: asked for {n} blocks, only {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for block in blocks:
            block.ref_cnt = 1
        self.num_compressed += n
        return blocks

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference from each block; one that reaches 0 is free again.

        Raises:
          ValueError: a block is already free, or is the null slot.
        """
        for block in blocks:
            if block.ref_cnt <= 0 or block.block_id == self.base:
                raise ValueError(f"CompressedBlockPool.free: block {block.block_id} has ref_cnt {block.ref_cnt}; "
                                 "need >= 1")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block)
