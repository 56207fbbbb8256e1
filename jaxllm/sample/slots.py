"""Host side of the sampler in the engine core: sampling slots and per-sequence rows.

Each running sequence holds a *sampling slot*: a row of the device tables
(``sampler.SamplerTables``) with its output-token counts, prompt-token
presence, bias row and stop row. A slot is taken when the sequence is
scheduled without one (admission, or readmission after preemption) and is
then refilled from the sequence's tokens, and given back when the sequence
is preempted or finished; so at most ``max_num_seqs`` slots are in use.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence

import numpy as np

from jaxllm.sample.sampler import SamplingArrays
from scheduler import Request, SamplingParams, SchedulerOutput


class SlotTables(Protocol):
    """What the runner offers for writing the device tables (``ModelRunner``)."""

    def fill_slot(self, slot: int, token_ids: Sequence[int], num_prompt: int) -> None: ...

    def set_slot_rows(self, slot: int, bias: np.ndarray, stop: np.ndarray) -> None: ...


@dataclasses.dataclass
class SequenceSampling:
    """Sampling state of one sequence that lives on the host.

    Attributes:
      params: its SamplingParams (n == 1).
      seed: its random seed (its own, or one the engine drew).
      stop_ids: eos and stop token ids, banned until ``min_tokens``.
      multi_token_bad_words: bad words of two or more tokens; single-token
        ones are in the bias row.
      bias: the dense bias row (float32[V]) or None when it would be zero.
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
    """Precompute one sequence's host sampling state.

    The bias row adds ``logit_bias``, puts -inf outside ``allowed_token_ids``
    and on single-token bad words. The front end has checked every id
    against the vocabulary and the number of multi-token bad words against
    ``sampler.MAX_BANNED_IDS`` (``jaxllm.frontend.input_processor``).

    Args:
      bad_words: the bad words' token-id lists (``input_processor.bad_words_token_ids``).
    """
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
    """Assigns sampling slots and builds each step's :class:`SamplingArrays`.

    Args:
      num_slots: rows of the device tables, slot 0 included (>= max_num_seqs + 1).
      vocab_size: the model's vocabulary.
      tables: writes the device tables (the runner).
    """

    def __init__(self, num_slots: int, vocab_size: int, tables: SlotTables) -> None:
        self.vocab_size = vocab_size
        self.tables = tables
        self.sequences: dict[str, SequenceSampling] = {}
        # Ids of the sequences with multi-token bad words (most steps have none to look up).
        self._multi_word_ids: set[str] = set()
        self.slots: dict[str, int] = {}
        self._free = list(range(num_slots - 1, 0, -1))

    def register(self, request_id: str, sampling: SequenceSampling) -> None:
        """Remember a sequence's sampling state; it gets a slot when scheduled."""
        self.sequences[request_id] = sampling
        if sampling.multi_token_bad_words:
            self._multi_word_ids.add(request_id)

    def release(self, request_id: str) -> None:
        """Give back the sequence's slot (preempted: refilled on readmission)."""
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def forget(self, request_id: str) -> None:
        """The sequence finished or was aborted: drop its slot and state."""
        self.release(request_id)
        self.sequences.pop(request_id, None)
        self._multi_word_ids.discard(request_id)

    def _slot(self, request: Request, sampling: SequenceSampling) -> int:
        rid = request.request_id
        slot = self.slots.get(rid)
        if slot is None:
            slot = self.slots[rid] = self._free.pop()
            self.tables.fill_slot(slot, request.all_token_ids, request.num_prompt_tokens)
            if sampling.bias is not None or sampling.params.min_tokens > 0:
                stop = np.zeros(self.vocab_size, bool)
                stop[sampling.stop_ids] = True
                bias = sampling.bias if sampling.bias is not None else np.zeros(self.vocab_size, np.float32)
                self.tables.set_slot_rows(slot, bias, stop)
        return slot

    def needs_previous_samples(self, output: SchedulerOutput) -> bool:
        """True when a row of ``output`` that samples and has multi-token bad words takes the previous step's
        sample as input (``prev_row``, async scheduling): its bans match its last generated tokens, which the
        host must know first."""
        if not self._multi_word_ids:
            return False
        fed = ((output.prev_row >= 0) & output.samples).nonzero()[0]
        return any(output.requests[i].request_id in self._multi_word_ids for i in fed.tolist())

    def arrays(self, output: SchedulerOutput, num_rows: int, num_positions: int = 1) -> SamplingArrays:
        """The step's per-row controls; rows of unregistered requests (a fork parent) stay inert.

        Preempted sequences must have been :meth:`release`-d first, so
        their slots are free for this step's admissions.

        With ``num_positions > 1`` (speculative decoding) every row is
        repeated for its positions (``SamplingArrays.repeat``), and a row
        verifying drafts bans at each position the bad words its output
        plus the drafts before that position would complete.
        """
        arrays = SamplingArrays.empty(num_rows)
        for i, row in enumerate(output.scheduled):
            request = row.request
            sampling = self.sequences.get(request.request_id)
            if sampling is None:
                continue
            outputs = request.output_token_ids
            arrays.set_row(
                i, sampling.params, slot=self._slot(request, sampling), seed=sampling.seed,
                num_generated=row.sample_index, sample=row.samples, uses_bias=sampling.bias is not None,
                banned=sampling.banned_ids(outputs) if sampling.multi_token_bad_words else (),
            )
        if num_positions == 1:
            return arrays
        wide = arrays.repeat(num_positions)
        for i, row in enumerate(output.scheduled):
            sampling = self.sequences.get(row.request.request_id)
            if not row.num_spec_tokens or sampling is None or not sampling.multi_token_bad_words:
                continue
            outputs, drafts = row.request.output_token_ids, row.request.spec_token_ids
            for j in range(1, row.num_spec_tokens + 1):
                wide.set_banned(i * num_positions + j, sampling.banned_ids(outputs + drafts[:j]))
        return wide
