"""SchedulerOutput -> padded numpy arrays for one jitted model step."""

from __future__ import annotations

import dataclasses

import numpy as np

from scheduler.buckets import BucketTable
from scheduler.output import SchedulerOutput
from scheduler.request import Request


@dataclasses.dataclass
class BatchDescriptor:
    """Host arrays of one step padded to bucket (T, S, W); vLLM v1's flattened ragged layout, row s owning tokens
    ``[query_start_loc[s], query_start_loc[s+1])``.

    Attributes:
      input_ids, positions: int32[T] token ids and positions; padding 0.
      slot_mapping: int32[T] KV slot ``block_id * block_size + offset`` per token; padding 0 (null block).
      block_tables: int32[S, W] block ids; padding 0.
      seq_lens: int32[S] KV tokens after this step (computed + new); padding 0.
      query_start_loc: int32[S+1] prefix sums of query lengths; padding repeats the last.
      logits_indices: int32[S] each row's last query token; padding 0.
      num_spec_tokens: int32[S] drafts (the row's last query tokens); it samples after each of its last
        ``num_spec_tokens + 1``; padding 0.
      sample_mask: bool[S] whether the row's sample is used; padding False.
      num_seqs, num_tokens: real rows and tokens.
      requests: real rows' ``Request``s in row order.
      prev_token_index: int32[T] async: the previous step's row whose sample is this token's input, else -1.
      decode_only: every row has one new token and the table has a decode-only program for T (its own program,
        ``BucketTable.program_for``).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    logits_indices: np.ndarray
    num_spec_tokens: np.ndarray
    sample_mask: np.ndarray
    num_seqs: int
    num_tokens: int
    requests: list[Request]
    prev_token_index: np.ndarray
    decode_only: bool = False

    @property
    def request_ids(self) -> list[str]:
        """Real rows' request ids, in row order."""
        return [r.request_id for r in self.requests]

    @property
    def shape(self) -> tuple[int, int, int]:
        """The bucket (T, S, W)."""
        return (self.input_ids.shape[0], self.seq_lens.shape[0], self.block_tables.shape[1])

    @property
    def program(self) -> tuple[int, int, int, bool]:
        """The step program ``(T, S, W, decode_only)`` that runs this batch."""
        return self.shape + (self.decode_only,)


def build_batch(output: SchedulerOutput, buckets: BucketTable) -> BatchDescriptor:
    """Flatten the output's rows into padded arrays (vLLM v1 ``GPUModelRunner._prepare_inputs``); call before
    ``update_from_output``. Raises ValueError if the batch exceeds the largest buckets or ``output.block_size`` is
    unset."""
    bs = output.block_size
    if bs < 1:
        raise ValueError(f"build_batch: output.block_size={bs} must be >= 1 (set by Scheduler.schedule)")
    num_seqs = output.num_seqs
    new = output.num_new_tokens
    computed = output.num_computed_tokens
    num_tokens = int(new.sum())
    width = output.block_tables.shape[1]
    T, S, W = buckets.pick(num_tokens, num_seqs, max(width, 1))

    query_start_loc = np.empty(S + 1, dtype=np.int32)
    query_start_loc[0] = 0
    new.cumsum(out=query_start_loc[1 : num_seqs + 1])
    query_start_loc[num_seqs + 1 :] = num_tokens
    starts = query_start_loc[:num_seqs]

    block_tables = np.zeros((S, W), dtype=np.int32)
    block_tables[:num_seqs, :width] = output.block_tables

    if num_tokens == num_seqs:
        # All rows one token long: no repeat is needed.
        row_of_token = np.arange(num_seqs)
        pos = computed
    else:
        row_of_token = np.arange(num_seqs).repeat(new)
        pos = computed[row_of_token] + (np.arange(num_tokens, dtype=np.int32) - starts[row_of_token])
    positions = np.zeros(T, dtype=np.int32)
    positions[:num_tokens] = pos
    slot_mapping = np.zeros(T, dtype=np.int32)
    # A flat gather is cheaper than a 2-D fancy index.
    slot_mapping[:num_tokens] = block_tables.ravel()[row_of_token * W + pos // bs] * bs + pos % bs

    # Async scheduling: the input is a sample still on the device.
    fed = output.prev_row >= 0
    prev_token_index = np.full(T, -1, dtype=np.int32)
    prev_token_index[starts[fed]] = output.prev_row[fed]
    # A sampling row of one token whose input is known feeds the last known token.
    last = (new == 1) & output.samples & ~fed
    input_ids = np.zeros(T, dtype=np.int32)
    input_ids[starts[last]] = output.last_token_ids[last]
    spec = output.num_spec_tokens
    for s in (~(last | fed)).nonzero()[0].tolist():
        req, k, m, start = output.requests[s], int(computed[s]), int(new[s]), int(starts[s])
        if spec[s]:
            input_ids[start : start + m] = req.all_token_ids[k:] + req.spec_token_ids[: spec[s]]
            continue
        # Prompt tokens come from the prompt array, sparing a conversion of Python ints.
        source = req.prompt_array if k + m <= len(req.prompt_array) else req.all_token_ids
        input_ids[start : start + m] = source[k : k + m]

    seq_lens = np.zeros(S, dtype=np.int32)
    seq_lens[:num_seqs] = computed + new
    logits_indices = np.zeros(S, dtype=np.int32)
    logits_indices[:num_seqs] = query_start_loc[1 : num_seqs + 1] - 1
    num_spec_tokens = np.zeros(S, dtype=np.int32)
    num_spec_tokens[:num_seqs] = spec
    sample_mask = np.zeros(S, dtype=bool)
    sample_mask[:num_seqs] = output.samples

    return BatchDescriptor(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        logits_indices=logits_indices,
        num_spec_tokens=num_spec_tokens,
        sample_mask=sample_mask,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        requests=output.requests,
        prev_token_index=prev_token_index,
        decode_only=buckets.program_for((T, S, W), num_tokens == num_seqs)[3],
    )

