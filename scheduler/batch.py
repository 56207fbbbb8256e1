"""SchedulerOutput -> padded numpy arrays for one jitted model step."""

from __future__ import annotations

import dataclasses

import numpy as np

from scheduler.buckets import BucketTable
from scheduler.output import SchedulerOutput


@dataclasses.dataclass
class BatchDescriptor:
    """Host arrays of one step, padded to a bucket shape (T, S, W).

    The layout is vLLM v1's flattened ragged batch: the query tokens of all
    rows back to back, row s owning ``[query_start_loc[s], query_start_loc[s+1])``.

    Attributes:
      input_ids: int32[T] token ids; padding 0.
      positions: int32[T] position of each token in its sequence; padding 0.
      slot_mapping: int32[T] KV slot ``block_id * block_size + offset`` each
        token's K/V is written to; padding 0 (a slot of null block 0).
      block_tables: int32[S, W] each row's block ids; padding 0.
      seq_lens: int32[S] tokens in each row's KV after this step
        (computed + new); padding rows 0.
      query_start_loc: int32[S+1] prefix sums of query lengths; padding rows
        repeat the last real value.
      logits_indices: int32[S] index of each row's last query token, whose
        logits are sampled; padding rows 0.
      sample_mask: bool[S] True where the row's sample is used (decode, or a
        chunk reaching the end of the prompt); padding rows False.
      num_seqs: real rows.
      num_tokens: real tokens.
      request_ids: real rows' request ids, in row order.
      blocks_to_swap_out: int32[K, 2] (device_block, host_block) copies, done first.
      blocks_to_swap_in: int32[K, 2] (host_block, device_block) copies, done second.
      blocks_to_copy: int32[K, 2] (src_block, dst_block) device copies, done
        third, before the model step.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    logits_indices: np.ndarray
    sample_mask: np.ndarray
    num_seqs: int
    num_tokens: int
    request_ids: list[str]
    blocks_to_swap_out: np.ndarray
    blocks_to_swap_in: np.ndarray
    blocks_to_copy: np.ndarray

    @property
    def shape(self) -> tuple[int, int, int]:
        """The bucket (T, S, W)."""
        return (self.input_ids.shape[0], self.seq_lens.shape[0], self.block_tables.shape[1])


def build_batch(output: SchedulerOutput, buckets: BucketTable) -> BatchDescriptor:
    """Flatten ``output.scheduled`` into padded arrays (vLLM v1 ``GPUModelRunner._prepare_inputs``).

    Query token i of row s has position ``num_computed_tokens + i`` and slot
    ``block_ids[pos // block_size] * block_size + pos % block_size``;
    ``seq_lens = num_computed_tokens + num_new_tokens``;
    ``logits_indices[s] = query_start_loc[s+1] - 1``. Per-row work is one
    Python pass; per-token work is numpy. Call it before
    ``update_from_output`` (it reads the requests' token lists).

    Raises:
      ValueError: the batch exceeds the largest buckets, or
        ``output.block_size`` is not set.
    """
    bs = output.block_size
    if bs < 1:
        raise ValueError(f"build_batch: output.block_size={bs} must be >= 1 (set by Scheduler.schedule)")
    rows = output.scheduled
    num_seqs = len(rows)
    # One-token rows' ids, in row order; longer chunks are copied as slices
    # (numpy ones from the prompt array where they lie in the prompt) once
    # their offsets are known, which spares converting prompt ints.
    singles: list[int] = []
    chunks: list[tuple[int, np.ndarray | list[int]]] = []
    new: list[int] = []
    computed: list[int] = []
    table_rows: list[int] = []
    samples: list[bool] = []
    request_ids: list[str] = []
    width = 1
    for s, row in enumerate(rows):
        k, m = row.num_computed_tokens, row.num_new_tokens
        req = row.request
        if m == 1:
            singles.append(req._all_token_ids[k])
        elif k + m <= len(req.prompt_array):
            chunks.append((s, req.prompt_array[k : k + m]))
        else:
            chunks.append((s, req._all_token_ids[k : k + m]))
        new.append(m)
        computed.append(k)
        table_rows.append(row.block_table_row)
        samples.append(row.samples)
        request_ids.append(req.request_id)
        if len(row.block_ids) > width:
            width = len(row.block_ids)
    num_tokens = sum(new)
    T, S, W = buckets.pick(num_tokens, num_seqs, width)

    new_a = np.array(new, dtype=np.int32)
    computed_a = np.array(computed, dtype=np.int32)
    query_start_loc = np.empty(S + 1, dtype=np.int32)
    query_start_loc[0] = 0
    np.cumsum(new_a, out=query_start_loc[1 : num_seqs + 1])
    query_start_loc[num_seqs + 1 :] = num_tokens

    block_tables = np.zeros((S, W), dtype=np.int32)
    if num_seqs:
        source = output.block_table
        if source is None:
            raise ValueError("build_batch: output.block_table is None but the output has rows")
        w = min(W, source.shape[1])
        block_tables[:num_seqs, :w] = source[table_rows, :w]

    if num_tokens == num_seqs:
        # All decodes: one token per row, so no repeat is needed.
        row_of_token = np.arange(num_seqs)
        pos = computed_a
    else:
        row_of_token = np.repeat(np.arange(num_seqs), new_a)
        pos = computed_a[row_of_token] + (np.arange(num_tokens, dtype=np.int32) - query_start_loc[row_of_token])
    positions = np.zeros(T, dtype=np.int32)
    positions[:num_tokens] = pos
    slot_mapping = np.zeros(T, dtype=np.int32)
    slot_mapping[:num_tokens] = block_tables[row_of_token, pos // bs] * bs + pos % bs
    input_ids = np.zeros(T, dtype=np.int32)
    if not chunks:
        input_ids[:num_tokens] = singles
    else:
        if singles:
            input_ids[query_start_loc[:num_seqs][new_a == 1]] = singles
        for s, chunk in chunks:
            input_ids[query_start_loc[s] : query_start_loc[s + 1]] = chunk

    seq_lens = np.zeros(S, dtype=np.int32)
    seq_lens[:num_seqs] = computed_a + new_a
    logits_indices = np.zeros(S, dtype=np.int32)
    logits_indices[:num_seqs] = query_start_loc[1 : num_seqs + 1] - 1
    sample_mask = np.zeros(S, dtype=bool)
    sample_mask[:num_seqs] = samples

    return BatchDescriptor(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        logits_indices=logits_indices,
        sample_mask=sample_mask,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        request_ids=request_ids,
        blocks_to_swap_out=_pairs(output.blocks_to_swap_out),
        blocks_to_swap_in=_pairs(output.blocks_to_swap_in),
        blocks_to_copy=_pairs(output.blocks_to_copy),
    )


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.array(pairs, dtype=np.int32).reshape(-1, 2)
