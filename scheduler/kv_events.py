"""KV cache events: full blocks the prefix cache gained and lost, and its wipes (vLLM's ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``).

Drained by ``Scheduler.take_kv_events``, published by ``jaxllm.core.kv_events``; hashes are ``scheduler.block_hash``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """A run of consecutive full blocks of one request became cached.

    Attributes:
      block_hashes: their hashes, in order.
      parent_block_hash: the hash of the block before the first (None: the request's first block).
      token_ids: ``len(block_hashes) * block_size`` tokens.
      block_size: tokens per block.
      medium: "GPU" (the device pool) or "CPU" (the host tier; no tokens nor parent, as vLLM's).
    """

    block_hashes: list[bytes]
    parent_block_hash: Optional[bytes]
    token_ids: list[int]
    block_size: int
    medium: str = "GPU"


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted from ``medium`` ("GPU" or "CPU", as :class:`BlockStored`): their hashes no longer
    hit there."""

    block_hashes: list[bytes]
    medium: str = "GPU"


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block was forgotten, on the device and in the host tier (``BlockPool.reset_prefix_cache``: a
    prefix-cache reset, sleep, a weight update): no hash published before it hits any more."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
