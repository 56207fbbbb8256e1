"""What one ``Scheduler.schedule()`` call hands to the runner, and the scheduler's counters."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from scheduler.kv.tier import BlockCopy, CopyKind
from scheduler.request import Request


class ScheduledRequest:
    """One row of the batch (vLLM v1 ``NewRequestData``/``CachedRequestData`` folded into one).

    Built from the ``SchedulerOutput`` arrays when ``SchedulerOutput.scheduled``
    is first read; each attribute is that row's entry there.

    Attributes:
      request: the request.
      num_new_tokens: tokens computed for it this step (a prefill chunk, or
        1 for a decode), >= 1.
      num_computed_tokens: its tokens already in the KV cache before this
        step; its query tokens are ``all_token_ids[num_computed_tokens :
        num_computed_tokens + num_new_tokens]`` at positions starting there.
      block_ids: its whole block table at this step, enough blocks for
        ``num_computed_tokens + num_new_tokens`` tokens (a new list per read).
      samples: True when this row's sampled token will be used: the chunk
        reaches the end of the request's known tokens. False for a partial
        prefill, whose sample ``update_from_output`` discards.
      block_table_row: its ``batch_row`` (persistent batch and block table
        row) at this step.
      sample_index: how many tokens the request has generated before this
        row's sample (what seeds its random draw).
      prev_row: with async scheduling, the row of the previous output whose
        sample (not yet known on the host) is this row's input token; -1
        when the input token is known.
      num_spec_tokens: draft tokens this row verifies (the last
        ``num_spec_tokens`` of its ``num_new_tokens``, the first of
        ``request.spec_token_ids``); 0 without speculation.
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
    """The batch of one step, in batch order, plus the block copies to do first.

    Rows are held as arrays, one entry per row (the persistent batch's view
    of this step, vLLM v1 ``InputBatch`` style); ``scheduled`` presents the
    same rows as ``ScheduledRequest`` objects.

    The runner does every one of ``block_copies``, in order, then the model step -- the copies even when there
    are no rows.

    Attributes:
      requests: each row's ``Request``, in batch order.
      num_new_tokens: int32[num_seqs] tokens computed per row this step, >= 1.
      num_computed_tokens: int32[num_seqs] each row's tokens in the KV cache
        before this step.
      samples: bool[num_seqs] whether each row's sample is used (see
        ``ScheduledRequest.samples``).
      sample_index: int32[num_seqs] outputs each row's request has generated
        before this row's sample.
      prev_row: int32[num_seqs] async scheduling: the row of the previous
        output whose sample is this row's input token, else -1.
      num_spec_tokens: int32[num_seqs] draft tokens each row verifies
        (speculative decoding): a decode row computes its last token and
        then these, ``request.spec_token_ids[:num_spec_tokens]``, at the
        following positions, and samples after each of them.
      batch_rows: intp[num_seqs] each row's ``Request.batch_row``.
      last_token_ids: int32[num_seqs] each row's request's last known token
        id: the input of a row with one new token that samples and has
        ``prev_row`` -1.
      num_blocks: int32[num_seqs] blocks in each row's block table.
      block_tables: int32[num_seqs, max(num_blocks)] each row's block ids,
        zero past its ``num_blocks``.
      total_num_scheduled_tokens: sum of ``num_new_tokens``.
      preempted: requests preempted during this call.
      finished: requests ignored, aborted (or otherwise finished outside
        ``update_from_output``) since the previous ``schedule()``.
      block_copies: the ``BlockCopy`` list of the step, sorted by ``CopyKind`` (which states why that order),
        each kind in the order queued; a ``COPY`` dst appears once.
      block_size: tokens per KV block (what ``build_batch`` computes slots
        with); set by the scheduler.
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
    """A snapshot of the scheduler for metrics (vLLM v1 ``SchedulerStats``).

    Attributes:
      num_running: requests holding a batch seat.
      num_waiting: requests in the waiting queue, preempted ones included.
      num_preempted_waiting: of those, requests that were preempted.
      num_waiting_for_fsm: of those, requests whose grammar (structured
        output) was still compiling when last looked at.
      kv_cache_usage: fraction of non-null device blocks referenced, in [0, 1]
        (cached-but-free blocks count as free).
      prefix_cache_queries: prompt tokens looked up in the prefix cache, cumulative.
      prefix_cache_hits: of those, tokens served from cache (not recomputed), cumulative.
      num_preemptions: preemptions so far, cumulative.
      num_free_blocks: device blocks in the free queue.
      num_blocks: device blocks in all, including the null block.
      max_num_seqs, max_num_batched_tokens: the limits in force (lower than
        the configured ones while graceful degradation backs off).
      num_predicted_finished: requests that stopped or were length-capped,
        whose output length the predictor (``scheduler.predictor``) learned;
        cumulative.
      predicted_output_tokens: their output tokens as predicted at arrival,
        summed; cumulative.
      actual_output_tokens: their output tokens, summed; cumulative.
      prediction_abs_error_tokens: ``|predicted - actual|`` output tokens,
        summed over them; cumulative (divide by ``num_predicted_finished``
        for the mean error).
      prefix_cache_hits_host: of ``prefix_cache_hits``, tokens loaded from the host tier, cumulative.
      num_offload_blocks, num_offload_cached_blocks: the host tier's blocks, and those holding a block (0
        without a tier).
      num_blocks_offloaded, num_blocks_loaded: blocks copied device -> host tier and back, cumulative.
      num_compressed_blocks, num_compressed_in_use: the compressed pool's slots without the null slot, and those
        requests hold (0 without compression).
      num_blocks_compressed: blocks compressed instead of a preemption, cumulative.
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
    num_compressed_blocks: int = 0
    num_compressed_in_use: int = 0
    num_blocks_compressed: int = 0
    num_blocks_loaded: int = 0
