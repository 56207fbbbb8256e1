"""Host side of the sampler: sampling slots (rows of ``sampler.SamplerTables``, taken when a sequence is scheduled
without one, given back when it is preempted or finished) and per-sequence rows."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

import numpy as np

from jaxllm.sample.sampler import SamplingArrays
from scheduler import SamplingParams, SchedulerOutput

if TYPE_CHECKING:
    from jaxllm.core.requests import CoreSequence


class SlotTables(Protocol):
    """What the runner offers for writing the device tables (``ModelRunner``)."""

    def fill_slot(self, slot: int, token_ids: Sequence[int], num_prompt: int) -> None: ...

    def set_slot_rows(self, slot: int, bias: np.ndarray, stop: np.ndarray) -> None: ...


@dataclasses.dataclass
class SequenceSampling:
    """Host sampling state of one sequence: ``params`` (n == 1), ``seed``, ``stop_ids`` (banned until
    ``min_tokens``), ``multi_token_bad_words`` (single-token ones are in the bias row), ``bias`` float32[V] or None.
    """

    params: SamplingParams
    seed: int
    stop_ids: list[int]
    multi_token_bad_words: list[list[int]]
    bias: Optional[np.ndarray]

    def banned_ids(self, output_token_ids: Sequence[int]) -> list[int]:
        """Last tokens of bad words whose other tokens end the output (vLLM's rule)."""
        banned = []
        for word in self.multi_token_bad_words:
            prefix = word[:-1]
            if len(output_token_ids) >= len(prefix) and list(output_token_ids[len(output_token_ids) - len(prefix):]) == prefix:
                banned.append(word[-1])
        return banned


def make_sequence_sampling(params: SamplingParams, seed: int, stop_ids: Sequence[int], vocab_size: int,
                           bad_words: Sequence[Sequence[int]] = ()) -> SequenceSampling:
    """One sequence's host sampling state (ids checked by the front end); the bias row adds ``logit_bias`` and
    puts -inf outside ``allowed_token_ids`` and on single-token bad words."""
    multi = [list(w) for w in bad_words if len(w) > 1]
    bias = None
    single = [w[0] for w in bad_words if len(w) == 1]
    if params.logit_bias or params.allowed_token_ids is not None or single:
        bias = np.zeros(vocab_size, np.float32)
        if params.allowed_token_ids is not None:
            bias[:] = -np.inf
            bias[list(params.allowed_token_ids)] = 0.0
        for token, value in (params.logit_bias or {}).items():
            bias[int(token)] += float(value)
        bias[single] = -np.inf
    return SequenceSampling(params, seed, list(stop_ids), multi, bias)


class SamplingSlots:
    """Assigns sampling slots and builds each step's :class:`SamplingArrays`. num_slots: device table rows, slot 0
    included (>= max_num_seqs + 1); vocab_size: the model's; tables: writes the device tables (the runner).
    """

    def __init__(self, num_slots: int, vocab_size: int, tables: SlotTables) -> None:
        self.vocab_size = vocab_size
        self.tables = tables
        # Live sequences with multi-token bad words (most steps have none to look for).
        self._num_multi_word = 0
        self._free = list(range(num_slots - 1, 0, -1))
        # Each slot's sequence's ``SamplingArrays.row_values``, written when the slot is taken: a step gathers its
        # rows' fixed controls in one indexing.
        self._values = np.zeros((num_slots, len(SamplingArrays.SEQUENCE_FIELDS)), np.float64)

    def register(self, request: "CoreSequence", sampling: SequenceSampling) -> None:
        """Give a sequence its sampling state; it gets a slot when scheduled."""
        request.sampling = sampling
        self._num_multi_word += bool(sampling.multi_token_bad_words)

    def release(self, request: "CoreSequence") -> None:
        """Give back the sequence's slot (preempted: refilled on readmission)."""
        if request.slot:
            self._free.append(request.slot)
            request.slot = 0

    def forget(self, request: "CoreSequence") -> None:
        """The sequence finished or was aborted: give back its slot, and it counts no more."""
        self.release(request)
        if request.sampling is not None:
            self._num_multi_word -= bool(request.sampling.multi_token_bad_words)
            request.sampling = None

    def _slot(self, request: "CoreSequence", sampling: SequenceSampling) -> int:
        if not request.slot:
            slot = request.slot = self._free.pop()
            self._values[slot] = SamplingArrays.row_values(sampling.params, sampling.seed, sampling.bias is not None)
            self.tables.fill_slot(slot, request.all_token_ids, request.num_prompt_tokens)
            if sampling.bias is not None or sampling.params.min_tokens > 0:
                stop = np.zeros(self.vocab_size, bool)
                stop[sampling.stop_ids] = True
                bias = sampling.bias if sampling.bias is not None else np.zeros(self.vocab_size, np.float32)
                self.tables.set_slot_rows(slot, bias, stop)
        return request.slot

    def needs_previous_samples(self, output: SchedulerOutput) -> bool:
        """Whether a sampling row with multi-token bad words takes the previous step's sample (async scheduling)."""
        if not self._num_multi_word:
            return False
        fed = ((output.prev_row >= 0) & output.samples).nonzero()[0]
        return any(_has_multi_word(output.requests[i]) for i in fed.tolist())

    def arrays(self, output: SchedulerOutput, num_rows: int, num_positions: int = 1) -> SamplingArrays:
        """The step's per-row controls (preempted sequences released first); with ``num_positions > 1`` each row
        is repeated per position, banning the bad words its output plus the drafts before it would complete.
        Raises ValueError: a row's bad words ban more than ``MAX_BANNED_IDS`` ids at once."""
        arrays = SamplingArrays.empty(num_rows)
        rows, slots = [], []
        for i, request in enumerate(output.requests):
            sampling = request.sampling
            if sampling is None:
                continue
            rows.append(i)
            slots.append(self._slot(request, sampling))
            if sampling.multi_token_bad_words:
                arrays.set_banned(i, sampling.banned_ids(request.output_token_ids))
        if rows:
            rows = np.asarray(rows, np.intp)
            arrays.set_rows(rows, self._values[slots], slot=slots, num_generated=output.sample_index[rows],
                            sample=output.samples[rows])
        if num_positions == 1:
            return arrays
        wide = arrays.repeat(num_positions)
        for i, row in enumerate(output.scheduled):
            if not row.num_spec_tokens or not _has_multi_word(row.request):
                continue
            sampling = row.request.sampling
            outputs, drafts = row.request.output_token_ids, row.request.spec_token_ids
            for j in range(1, row.num_spec_tokens + 1):
                wide.set_banned(i * num_positions + j, sampling.banned_ids(outputs + drafts[:j]))
        return wide


def _has_multi_word(request: "CoreSequence") -> bool:
    return request.sampling is not None and bool(request.sampling.multi_token_bad_words)
