"""KV cache events: full blocks the prefix cache gained and lost (vLLM's ``BlockStored``, ``BlockRemoved``).

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


KVEvent = Union[BlockStored, BlockRemoved]
