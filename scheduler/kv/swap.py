"""Swap preemption: a preempted request's computed blocks copied to host blocks, and back when it is admitted again."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from scheduler.kv.tier import BlockCopy, CopyKind, KVTier, copies_of
from scheduler.request import Request

if TYPE_CHECKING:
    from scheduler.kv.kv_cache_manager import KVCacheManager


class HostBlockPool:
    """Host KV block ids ``0..num_host_blocks-1`` (which host block holds which device block; the copies are the
    runner's). Ids freed by a swap-in stay held until :meth:`end_step`, since the runner copies out before in.
    Raises ValueError for ``num_host_blocks < 0``, allocating past the free count, or freeing a bad or free id."""

    def __init__(self, num_host_blocks: int) -> None:
        if num_host_blocks < 0:
            raise ValueError(f"HostBlockPool: num_host_blocks={num_host_blocks} must be >= 0")
        self.num_host_blocks = num_host_blocks
        # Popped from the end, so the lowest ids are used first.
        self._free = list(range(num_host_blocks - 1, -1, -1))
        self._free_set = set(self._free)
        self._held: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        """Host blocks available to a swap-out now."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free host block ids."""
        if n > len(self._free):
            raise ValueError(f"HostBlockPool.allocate: asked for {n} host blocks, only {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self._free_set.difference_update(out)
        return out

    def free(self, ids: list[int], *, after_step: bool = False) -> None:
        """Return host block ids; with ``after_step`` they become reusable only at :meth:`end_step`."""
        for i in ids:
            if not 0 <= i < self.num_host_blocks or i in self._free_set or i in self._held:
                raise ValueError(f"HostBlockPool.free: host block {i} is out of [0, {self.num_host_blocks}) or already free")
        if after_step:
            self._held.extend(ids)
        else:
            self._free.extend(reversed(ids))
            self._free_set.update(ids)

    def end_step(self) -> None:
        """Make ids held back by ``free(after_step=True)`` reusable."""
        if self._held:
            held, self._held = self._held, []
            self.free(held)


class SwapTier(KVTier):
    """Swap preemption's tier (``preemption_mode="swap"``): :meth:`keep` swaps a victim out, :meth:`resume` back in;
    one that does not fit is recomputed. Args: kv (the ``KVCacheManager``), num_host_blocks (>= 0). Attributes:
    host_pool (``HostBlockPool``), swapped (request_id -> host block ids, in table order)."""

    def __init__(self, kv: "KVCacheManager", num_host_blocks: int) -> None:
        self.kv = kv
        self.host_pool = HostBlockPool(num_host_blocks)
        self.swapped: dict[str, list[int]] = {}
        self._copies: list[BlockCopy] = []

    def holds_request(self, request: Request) -> bool:
        return request.request_id in self.swapped

    def keep(self, request: Request) -> bool:
        pairs = self.swap_out(request)
        if pairs is None:
            return False
        self._copies += copies_of(CopyKind.SWAP_OUT, pairs)
        return True

    def resume(self, request: Request, num_new_tokens: int) -> bool:
        pairs = self.swap_in(request, num_new_tokens)
        if pairs is None:
            return False
        self._copies += copies_of(CopyKind.SWAP_IN, pairs)
        return True

    def swap_out(self, request: Request) -> Optional[list[tuple[int, int]]]:
        """Move ``request``'s computed blocks to the host pool, freeing its device blocks; returns
        ``(device_block, host_block)`` pairs to copy, or None, changing nothing, if the host pool is too small."""
        kv, rid = self.kv, request.request_id
        n = -(-request.num_computed_tokens // kv.block_size)
        if n > self.host_pool.num_free_blocks:
            return None
        host = self.host_pool.allocate(n)
        pairs = list(zip(kv.req_to_block_ids[rid][:n], host))
        kv.free(request)
        self.swapped[rid] = host
        return pairs

    def swap_in(self, request: Request, num_new_tokens: int) -> Optional[list[tuple[int, int]]]:
        """Bring a swapped-out request back with room for ``num_new_tokens`` more; returns ``(host_block,
        device_block)`` pairs to copy, or None, changing nothing, if the free queue is too short."""
        kv, rid = self.kv, request.request_id
        host = self.swapped[rid]
        n = max(-(-(request.num_computed_tokens + num_new_tokens) // kv.block_size), len(host))
        if n > kv.block_pool.num_free_blocks:
            return None
        del self.swapped[rid]
        kv.give_fresh_table(request, n)
        self.host_pool.free(host, after_step=True)
        return list(zip(host, kv.req_to_block_ids[rid]))

    def free(self, request: Request) -> None:
        """Release ``request``'s host blocks, if it is swapped out."""
        host = self.swapped.pop(request.request_id, None)
        if host:
            self.host_pool.free(host)

    def take_copies(self) -> list[BlockCopy]:
        copies, self._copies = self._copies, []
        return copies

    def end_step(self) -> None:
        self.host_pool.end_step()
