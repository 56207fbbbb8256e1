"""One generation request as the scheduler sees it (vLLM v1 ``Request``)."""

from __future__ import annotations

import enum
import time
from typing import Callable, Optional

import numpy as np

from scheduler.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is in its life (vLLM v1's ``RequestStatus``); ``FINISHED_*`` are final. ``PREEMPTED`` and
    ``WAITING_FOR_FSM`` (grammar compiling; admission skips it) requests sit in the waiting queue."""

    WAITING = 0
    WAITING_FOR_FSM = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_IGNORED = 7

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        """True for the four ``FINISHED_*`` statuses (no more tokens will come)."""
        return status >= RequestStatus.FINISHED_STOPPED


# IGNORED reports "length" because, as in vLLM, a request is ignored for being
# too long for the model or the cache.
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


class Request:
    """A prompt, its sampling parameters, and the scheduler's progress on it (vLLM v1's ``Request``): no phases,
    only ``num_computed_tokens`` (KV in the cache) catching up with ``num_tokens`` (prompt + generated).

    Args:
      request_id: unique among one scheduler's unfinished requests.
      prompt_token_ids: the prompt, non-empty, ids >= 0.
      sampling_params: sampling and stopping parameters.
      eos_token_id: the model's eos id; None disables eos stops.
      arrival_time: seconds on the scheduler's clock; None means now.
      priority: an int, lower = more urgent (vLLM's).
      cache_salt: mixed into the first block's hash; different salts never share prefix-cache blocks.
      skip_reading_prefix_cache: compute every token even on a hit (vLLM's flag; for prompt logprobs); its blocks
        are still cached. May be cleared later.
      grammar_ready: with a structured-output constraint, whether its grammar is compiled (until then it waits as
        ``WAITING_FOR_FSM``); None: unconstrained.
      lora_int_id: the LoRA adapter it runs under (0: the base model); at most ``max_loras`` distinct ones run.
      lora_epoch: the adapter's version (bumped by an in-place update); with the id, the prefix-cache key.

    Attributes (beyond the arguments):
      output_token_ids: generated ids, in order.
      num_computed_tokens: tokens whose KV is in the cache.
      status: a ``RequestStatus``.
      stop_reason: the stop token id or engine-set stop string that ended it; None for eos, length, aborts.
      ignored_reason: why it was ``FINISHED_IGNORED``.
      num_preemptions: times preempted.
      first_scheduled_time: clock time of its first admission.
      block_hashes: 16-byte hashes of its full blocks, filled lazily, once each.
      prompt_array: int64[num_prompt_tokens], the prompt read-only.
      length_limit: ``num_tokens`` at which it is length-capped (``max_model_len`` or prompt + ``max_tokens``); set
        at ``add_request``.
      batch_row: its ``PersistentBatch`` and block table row while it holds blocks; -1 otherwise.
      prefill_only: set before ``add_request`` on a ``fork_request`` parent: never scheduled past its prompt.
      spec_token_ids: drafts its next decode row verifies (vLLM v1's); emptied once used or on preemption.
      predicted_output_tokens: its predicted output length (``scheduler.predictor``), set at ``add_request``.

    Raises ValueError for an empty prompt, a negative id, or a non-int priority.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "arrival_time",
        "priority", "cache_salt", "output_token_ids", "num_computed_tokens", "status",
        "stop_reason", "ignored_reason", "num_preemptions", "first_scheduled_time",
        "block_hashes", "prompt_array", "_all_token_ids", "_max_tokens", "_seq", "length_limit", "batch_row",
        "prefill_only", "skip_reading_prefix_cache", "spec_token_ids", "grammar_ready",
        "predicted_output_tokens", "lora_int_id", "lora_epoch",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: Optional[int] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        skip_reading_prefix_cache: bool = False,
        grammar_ready: Optional[Callable[[], bool]] = None,
        lora_int_id: int = 0,
        lora_epoch: int = 0,
    ) -> None:
        prompt_array = np.array(prompt_token_ids, dtype=np.int64).reshape(-1)
        if not prompt_array.size:
            raise ValueError(f"Request {request_id!r}: prompt_token_ids is empty; need at least 1 token")
        if prompt_array.min() < 0:
            raise ValueError(
                f"Request {request_id!r}: prompt token id {prompt_array.min()} is negative; ids must be >= 0"
            )
        prompt_array.flags.writeable = False
        prompt = prompt_array.tolist()
        if not isinstance(priority, (int, np.integer)) or isinstance(priority, bool):
            raise ValueError(f"Request {request_id!r}: priority={priority!r} must be an int")
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else float(arrival_time)
        self.priority = int(priority)
        self.cache_salt = cache_salt
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.grammar_ready = grammar_ready
        self.lora_int_id = int(lora_int_id)
        self.lora_epoch = int(lora_epoch)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.ignored_reason: Optional[str] = None
        self.num_preemptions = 0
        self.first_scheduled_time: Optional[float] = None
        self.block_hashes: list[bytes] = []
        self.prompt_array = prompt_array
        # Kept alongside output_token_ids so slicing the next chunk's ids is one
        # C-level slice on the hot path instead of a concatenation.
        self._all_token_ids = list(prompt)
        self._max_tokens = sampling_params.max_tokens
        # Set by the scheduler on add_request: a tie-break for policy keys.
        self._seq = 0
        self.length_limit = 0
        self.batch_row = -1
        self.prefill_only = False
        self.spec_token_ids: list[int] = []
        self.predicted_output_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt, in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by generated tokens; the scheduler's own list, do not mutate."""
        return self._all_token_ids

    @property
    def max_tokens(self) -> Optional[int]:
        """``sampling_params.max_tokens`` (None: bounded by max_model_len only)."""
        return self._max_tokens

    @property
    def lora_key(self) -> Optional[bytes]:
        """The adapter's part of the first block's hash (None: the base model). Starts with 0xff, a byte no UTF-8
        salt holds, so a salt and an adapter never read as another pair."""
        if not self.lora_int_id:
            return None
        return b"\xfflora" + self.lora_int_id.to_bytes(8, "little") + self.lora_epoch.to_bytes(8, "little")

    @property
    def use_structured_output(self) -> bool:
        """True for a request under a structured-output constraint (it has ``grammar_ready``)."""
        return self.grammar_ready is not None

    @property
    def is_finished(self) -> bool:
        """True once the status is one of the ``FINISHED_*`` statuses."""
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        """"stop", "length" (also for IGNORED, as vLLM), "abort", or None while unfinished."""
        return _FINISH_REASONS.get(self.status)

    @property
    def queue_time(self) -> Optional[float]:
        """Seconds from arrival to first admission; None until admitted."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    def append_output_token(self, token_id: int) -> None:
        """Record one generated token (``Scheduler.update_from_output``)."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def stop_status(self, token: int, max_model_len: int) -> Optional[RequestStatus]:
        """The status appended ``token`` finishes this request with, or None (rules: ``Scheduler.update_from_output``)."""
        sp = self.sampling_params
        num_output = len(self.output_token_ids)
        if num_output >= sp.min_tokens:
            if token == self.eos_token_id and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and token in sp.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        max_tokens = self.max_tokens
        if (max_tokens is not None and num_output >= max_tokens) or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
