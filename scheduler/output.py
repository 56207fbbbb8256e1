"""What one ``Scheduler.schedule()`` call hands to the runner, and the scheduler's counters."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from scheduler.request import Request


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    """One row of the batch (vLLM v1 ``NewRequestData``/``CachedRequestData`` folded into one).

    Attributes:
      request: the request.
      num_new_tokens: tokens computed for it this step (a prefill chunk, or
        1 for a decode), >= 1.
      num_computed_tokens: its tokens already in the KV cache before this
        step; its query tokens are ``all_token_ids[num_computed_tokens :
        num_computed_tokens + num_new_tokens]`` at positions starting there.
      block_ids: its whole block table at this step (a copy), enough blocks
        for ``num_computed_tokens + num_new_tokens`` tokens.
      samples: True when this row's sampled token will be used: the chunk
        reaches the end of the request's known tokens. False for a partial
        prefill, whose sample ``update_from_output`` discards.
      block_table_row: the row of ``SchedulerOutput.block_table`` holding
        the same block ids.
    """

    request: Request
    num_new_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    samples: bool = True
    block_table_row: int = -1


@dataclasses.dataclass
class SchedulerOutput:
    """The batch of one step, in batch order, plus the block copies to do first.

    The runner does, in order: every ``blocks_to_swap_out`` copy, every
    ``blocks_to_swap_in`` copy, every ``blocks_to_copy`` copy, then the model
    step. Swap-outs go first because their device blocks may be handed to
    swap-ins or copies in the same step. A copy's source is a cached block
    that no swap-in or copy of this step writes: the scheduler holds a
    reference to it until ``update_from_output``, so it cannot be reused.

    Attributes:
      scheduled: one ``ScheduledRequest`` per row, in batch order.
      total_num_scheduled_tokens: sum of ``num_new_tokens`` over rows.
      preempted: requests preempted during this call.
      finished: requests ignored, aborted (or otherwise finished outside
        ``update_from_output``) since the previous ``schedule()``.
      blocks_to_swap_out: ``(device_block, host_block)`` pairs.
      blocks_to_swap_in: ``(host_block, device_block)`` pairs.
      blocks_to_copy: ``(src_block, dst_block)`` device pairs: a fully cached
        prompt's last block, copied into the fresh block that replaces it in
        the request's table, where its last token's K/V is written (see
        ``KVCacheManager``). Each dst appears once.
      block_size: tokens per KV block (what ``build_batch`` computes slots
        with); set by the scheduler.
      block_table: int32[rows, width] the KV cache manager's persistent block
        table (rows indexed by ``ScheduledRequest.block_table_row``, zero past
        each request's blocks). Shared, not copied: valid until the next
        ``schedule()``.
    """

    scheduled: list[ScheduledRequest] = dataclasses.field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted: list[Request] = dataclasses.field(default_factory=list)
    finished: list[Request] = dataclasses.field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    block_size: int = 0
    block_table: Optional[np.ndarray] = None

    @property
    def num_seqs(self) -> int:
        """Rows in the batch."""
        return len(self.scheduled)


@dataclasses.dataclass
class SchedulerStats:
    """A snapshot of the scheduler for metrics (vLLM v1 ``SchedulerStats``).

    Attributes:
      num_running: requests holding a batch seat.
      num_waiting: requests in the waiting queue, preempted ones included.
      num_preempted_waiting: of those, requests that were preempted.
      kv_cache_usage: fraction of non-null device blocks referenced, in [0, 1]
        (cached-but-free blocks count as free).
      prefix_cache_queries: prompt tokens looked up in the prefix cache, cumulative.
      prefix_cache_hits: of those, tokens served from cache (not recomputed), cumulative.
      num_preemptions: preemptions so far, cumulative.
      num_free_blocks: device blocks in the free queue.
      num_blocks: device blocks in all, including the null block.
    """

    num_running: int
    num_waiting: int
    num_preempted_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_blocks: int
