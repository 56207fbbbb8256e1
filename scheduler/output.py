"""What one ``Scheduler.schedule()`` call hands to the runner, and the scheduler's counters."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from scheduler.kv.tier import BlockCopy, CopyKind
from scheduler.request import Request


class ScheduledRequest:
    """One row of the batch (vLLM v1 ``NewRequestData``/``CachedRequestData`` folded into one).

    Each attribute is the row's entry of the ``SchedulerOutput`` array of that name (``block_table_row`` is its
    ``batch_rows``), plus ``request`` and ``block_ids``: its whole block table, enough for
    ``num_computed_tokens + num_new_tokens`` tokens (a new list per read). The row's query tokens are
    ``all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]``.
    """

    __slots__ = (
        "request", "num_new_tokens", "num_computed_tokens", "samples", "block_table_row", "sample_index",
        "prev_row", "num_spec_tokens", "_tables", "_index",
    )

    def __init__(
        self, request: Request, num_new_tokens: int, num_computed_tokens: int, samples: bool, block_table_row: int,
        sample_index: int, prev_row: int, tables: tuple[np.ndarray, np.ndarray], index: int, num_spec_tokens: int = 0,
    ) -> None:
        self.request = request
        self.num_new_tokens = num_new_tokens
        self.num_computed_tokens = num_computed_tokens
        self.samples = samples
        self.block_table_row = block_table_row
        self.sample_index = sample_index
        self.prev_row = prev_row
        self.num_spec_tokens = num_spec_tokens
        # (SchedulerOutput.block_tables, SchedulerOutput.num_blocks), shared by the rows of one output.
        self._tables = tables
        self._index = index

    @property
    def block_ids(self) -> list[int]:
        (block_tables, num_blocks), i = self._tables, self._index
        return block_tables[i, : num_blocks[i]].tolist()

    def __repr__(self) -> str:
        return (
            f"ScheduledRequest({self.request.request_id!r}, new={self.num_new_tokens}, "
            f"computed={self.num_computed_tokens}, samples={self.samples}, prev_row={self.prev_row})"
        )


def _ints(dtype=np.int32, shape=(0,)):
    return dataclasses.field(default_factory=lambda: np.zeros(shape, dtype=dtype))


@dataclasses.dataclass
class SchedulerOutput:
    """The batch of one step, in batch order (vLLM v1 ``InputBatch`` style arrays), plus the block copies to do first.

    The runner does every one of ``block_copies`` in order, then the model step (the copies even with no rows).

    Attributes:
      requests: each row's ``Request``.
      num_new_tokens: int32[num_seqs] tokens computed this step (a prefill chunk, 1 for a decode), >= 1.
      num_computed_tokens: int32[num_seqs] tokens in the KV cache before this step (the first query position).
      samples: bool[num_seqs] whether the row's sample is used (False for a partial prefill: discarded).
      sample_index: int32[num_seqs] outputs generated before this row's sample (seeds its draw).
      prev_row: int32[num_seqs] async scheduling: the previous output's row whose sample is this row's input, else -1.
      num_spec_tokens: int32[num_seqs] drafts verified: a decode row computes its last token, then
        ``request.spec_token_ids[:num_spec_tokens]``, sampling after each; 0 without speculation.
      batch_rows: intp[num_seqs] each ``Request.batch_row`` (persistent batch and block table row).
      last_token_ids: int32[num_seqs] each request's last known token (the input when ``prev_row`` is -1).
      num_blocks: int32[num_seqs] blocks in each row's table.
      block_tables: int32[num_seqs, max(num_blocks)] block ids, zero past ``num_blocks``.
      total_num_scheduled_tokens: sum of ``num_new_tokens``.
      preempted: requests preempted during this call.
      finished: requests ignored or aborted (finished outside ``update_from_output``) since the last ``schedule()``.
      block_copies: ``BlockCopy`` list sorted by ``CopyKind``, each kind in queue order; a ``COPY`` dst appears once.
      block_size: tokens per KV block (for ``build_batch``'s slots).
    """

    requests: list[Request] = dataclasses.field(default_factory=list)
    num_new_tokens: np.ndarray = _ints()
    num_computed_tokens: np.ndarray = _ints()
    samples: np.ndarray = _ints(np.bool_)
    sample_index: np.ndarray = _ints()
    prev_row: np.ndarray = _ints()
    num_spec_tokens: np.ndarray = _ints()
    batch_rows: np.ndarray = _ints(np.intp)
    last_token_ids: np.ndarray = _ints()
    num_blocks: np.ndarray = _ints()
    block_tables: np.ndarray = _ints(shape=(0, 0))
    total_num_scheduled_tokens: int = 0
    preempted: list[Request] = dataclasses.field(default_factory=list)
    finished: list[Request] = dataclasses.field(default_factory=list)
    block_copies: list[BlockCopy] = dataclasses.field(default_factory=list)
    block_size: int = 0

    @property
    def num_seqs(self) -> int:
        """Rows in the batch."""
        return len(self.requests)

    def copies(self, kind: CopyKind) -> list[tuple[int, int]]:
        """The ``(src, dst)`` pairs of ``block_copies`` of ``kind``, in order."""
        return [(c.src, c.dst) for c in self.block_copies if c.kind is kind]

    @functools.cached_property
    def scheduled(self) -> list[ScheduledRequest]:
        """One ``ScheduledRequest`` per row, in batch order (built on first access)."""
        num = len(self.requests)
        return list(map(
            ScheduledRequest, self.requests, self.num_new_tokens.tolist(), self.num_computed_tokens.tolist(),
            self.samples.tolist(), self.batch_rows.tolist(), self.sample_index.tolist(), self.prev_row.tolist(),
            [(self.block_tables, self.num_blocks)] * num, range(num), self.num_spec_tokens.tolist(),
        ))


@dataclasses.dataclass
class SchedulerStats:
    """A snapshot of the scheduler for metrics (vLLM v1 ``SchedulerStats``); "total" fields are cumulative.

    Attributes:
      num_running, num_waiting: requests seated / queued (preempted included).
      num_preempted_waiting, num_waiting_for_fsm: of the waiting, those preempted / whose grammar was compiling.
      kv_cache_usage: fraction of non-null device blocks referenced, in [0, 1].
      prefix_cache_queries, prefix_cache_hits, prefix_cache_hits_host: prompt tokens looked up, served from cache,
        and of those loaded from the host tier; total.
      num_preemptions: total.
      num_free_blocks, num_blocks: device blocks in the free queue / in all (null block included).
      max_num_seqs, max_num_batched_tokens: the limits in force (lower while degraded).
      num_predicted_finished: requests stopped or length-capped whose length the predictor learned; total.
      predicted_output_tokens, actual_output_tokens, prediction_abs_error_tokens: their predicted, actual and
        ``|predicted - actual|`` output tokens summed; total.
      num_offload_blocks, num_offload_cached_blocks: host-tier blocks, and those holding one (0 without a tier).
      num_blocks_offloaded, num_blocks_loaded: device -> host tier copies and back; total.
      num_pool_blocks, num_pool_in_use: the pool tier's slots (``KVCacheManager.POOL_TIER``; null excluded) and
        those held (0 without). num_blocks_pooled: blocks it took instead of a preemption; total.
    """

    num_running: int
    num_waiting: int
    num_preempted_waiting: int
    num_waiting_for_fsm: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_predicted_finished: int
    predicted_output_tokens: int
    actual_output_tokens: int
    prediction_abs_error_tokens: int
    prefix_cache_hits_host: int = 0
    num_offload_blocks: int = 0
    num_offload_cached_blocks: int = 0
    num_blocks_offloaded: int = 0
    num_pool_blocks: int = 0
    num_pool_in_use: int = 0
    num_blocks_pooled: int = 0
    num_blocks_loaded: int = 0
