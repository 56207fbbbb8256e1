"""Host-side (CPU memory) block ids for swap-mode preemption."""

from __future__ import annotations


class HostBlockPool:
    """Ids ``0..num_host_blocks-1`` of host KV blocks, handed out and returned by the scheduler.

    The copies themselves are the runner's; this pool only decides which host
    block holds which device block. Ids released by a swap-in are held back
    until :meth:`end_step`, because the runner copies out before it copies in:
    reusing such an id for a swap-out in the same step would overwrite data
    that the swap-in has not read yet.

    Raises:
      ValueError: ``num_host_blocks < 0``; ``allocate`` past the free count;
        ``free`` of an id out of range or already free.
    """

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
