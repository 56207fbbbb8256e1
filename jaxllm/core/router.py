"""Which data-parallel engine core gets a request: the one holding the longest cached prefix of its prompt."""

from __future__ import annotations

import collections
import itertools
from typing import Optional, Sequence

from jaxllm.core.messages import CoreInfo
from scheduler.block_hash import extend_block_hashes


class PrefixRouter:
    """The front end's (possibly stale) picture of each core's prefix cache, for routing (SGLang's cache-aware
    router in spirit): per core, an LRU of the chained hashes of full prompt blocks routed to it (the block with
    the last prompt token never counts). ``infos``: each core's ``CoreInfo``.
    """

    def __init__(self, infos: Sequence[CoreInfo]) -> None:
        self.block_size = infos[0].block_size
        self.enabled = infos[0].enable_prefix_caching
        self._capacity = [info.num_blocks - 1 for info in infos]
        self._blocks: list[collections.OrderedDict[bytes, None]] = [collections.OrderedDict() for _ in infos]

    def _hashes(self, token_ids: Sequence[int], cache_salt: Optional[str]) -> list[bytes]:
        hashes: list[bytes] = []
        num_full = len(token_ids) // self.block_size if self.block_size > 1 else len(token_ids) - 1
        extend_block_hashes(hashes, token_ids, num_full, self.block_size, cache_salt)
        return hashes

    def cached_prefix_tokens(self, core: int, token_ids: Sequence[int], cache_salt: Optional[str] = None) -> int:
        """Prompt tokens ``core`` is thought to hold in its prefix cache."""
        if not self.enabled:
            return 0
        blocks = self._blocks[core]
        hits = sum(1 for _ in itertools.takewhile(blocks.__contains__, self._hashes(token_ids, cache_salt)))
        return min(hits * self.block_size, len(token_ids) - 1)

    def choose(self, token_ids: Sequence[int], cache_salt: Optional[str], loads: Sequence[int]) -> int:
        """The core for a prompt: most cached prefix tokens, then lowest load, then lowest index."""
        if not self.enabled or len(loads) == 1:
            return min(range(len(loads)), key=lambda i: (loads[i], i))
        hashes = self._hashes(token_ids, cache_salt)

        def hits(core: int) -> int:
            return sum(1 for _ in itertools.takewhile(self._blocks[core].__contains__, hashes))

        return min(range(len(loads)), key=lambda i: (-hits(i), loads[i], i))

    def resize(self, num_blocks: int) -> None:
        """Follow a KV pool resize: at most ``num_blocks - 1`` blocks remembered per core, least recent dropped."""
        self._capacity = [num_blocks - 1] * len(self._capacity)
        for blocks in self._blocks:
            while len(blocks) > num_blocks - 1:
                blocks.popitem(last=False)

    def record(self, core: int, token_ids: Sequence[int], cache_salt: Optional[str]) -> None:
        """Remember that ``core`` was given this prompt (its full blocks are in its cache now)."""
        if not self.enabled:
            return
        blocks = self._blocks[core]
        for h in self._hashes(token_ids, cache_salt):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self._capacity[core]:
            blocks.popitem(last=False)
