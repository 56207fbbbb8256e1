"""KV cache events: which full blocks the prefix cache gained and lost (vLLM's ``BlockStored``, ``BlockRemoved``).

Recorded on the host as the blocks are registered (``KVCacheManager.cache_computed_blocks``) and evicted
(``BlockPool.get_new_blocks``), and as the host tier keeps and evicts them (``scheduler.kv.host_tier``), drained by the engine core after each step (``Scheduler.take_kv_events``), which
publishes them in vLLM's wire format (``jaxllm.core.kv_events``). Hashes are the 16-byte chained block hashes of
``scheduler.block_hash``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """A run of consecutive full blocks of one request became cached.

    Attributes:
      block_hashes: their hashes, in order.
      parent_block_hash: the hash of the block before the first (None: the first is the request's first block).
      token_ids: the tokens the blocks hold, ``len(block_hashes) * block_size`` of them.
      block_size: tokens per block.
      medium: the tier, vLLM's names: "GPU" (the device pool) or "CPU" (the host tier, ``scheduler.kv.host_tier``,
        whose events carry no tokens nor parent, as vLLM's offloading events).
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


KVEvent = Union[BlockStored, BlockRemoved]
