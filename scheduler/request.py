"""One generation request as the scheduler sees it (vLLM v1 ``Request``)."""

from __future__ import annotations

import enum
import time
from typing import Callable, Optional

import numpy as np

from scheduler.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; the ``FINISHED_*`` members are final.

    Follows vLLM v1 ``RequestStatus``. ``PREEMPTED`` requests sit in the
    waiting queue until they are readmitted; so do ``WAITING_FOR_FSM`` ones,
    whose grammar (structured output) is still being compiled, skipped by
    admission until it is ready.
    """

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
    """A prompt, its sampling parameters, and the scheduler's progress on it.

    Follows vLLM v1 ``Request``: there is no prefill or decode phase, only
    ``num_computed_tokens`` (tokens whose KV is in the cache) catching up with
    ``num_tokens`` (prompt plus generated tokens).

    Args:
      request_id: unique among unfinished requests of one scheduler.
      prompt_token_ids: the prompt, non-empty, token ids >= 0.
      sampling_params: sampling and stopping parameters.
      eos_token_id: the model's end-of-sequence id; None disables eos stops.
      arrival_time: seconds on the scheduler's clock (``time.monotonic`` by
        default); None means now.
      priority: lower value = more urgent (as in vLLM); used by the
        ``priority`` and ``aging`` policies.
      cache_salt: mixed into the first block's hash so requests with different
        salts never share prefix-cache blocks.
      skip_reading_prefix_cache: compute every token even where the prefix
        cache holds it (vLLM's flag of the same name; the engine sets it for
        prompt logprobs, which need every prompt position computed). Its
        blocks are still cached for others. May be cleared later.
      grammar_ready: for a request under a structured-output constraint,
        returns whether its grammar is compiled; until then the request
        waits (``WAITING_FOR_FSM``) and others are admitted past it. None:
        unconstrained.

    Attributes (beyond the arguments):
      output_token_ids: generated token ids, in order.
      num_computed_tokens: prompt+output tokens whose KV is in the cache.
      status: a ``RequestStatus``.
      stop_reason: the stop token id that ended it, or a stop string set by the
        engine; None for eos, length caps and aborts.
      ignored_reason: why it was finished as ``FINISHED_IGNORED``.
      num_preemptions: times it was preempted.
      first_scheduled_time: clock time of its first admission (queue time is
        ``first_scheduled_time - arrival_time``).
      block_hashes: prefix-cache hashes (16-byte ``bytes``) of its full blocks,
        filled in lazily by the KV cache manager, one per block, once.
      prompt_array: int64[num_prompt_tokens] the prompt again, read-only, so
        hashing and ``build_batch`` slice prompt tokens without converting
        Python ints every step.
      length_limit: ``num_tokens`` at which it is length-capped
        (``max_model_len``, or prompt + ``max_tokens`` if smaller); set by
        the scheduler on ``add_request``.
      batch_row: its row in the scheduler's ``PersistentBatch`` and the KV
        cache manager's block table while it holds KV blocks; -1 otherwise.
      prefill_only: set before ``add_request`` for a parent that only
        prefills a prompt for ``Scheduler.fork_request``: it is never
        scheduled past its prompt.
      spec_token_ids: draft tokens (speculative decoding) its next decode
        row verifies after its last token (vLLM v1's field); set through
        ``Scheduler.update_draft_token_ids``, emptied once a step used them
        or the request is preempted.
      predicted_output_tokens: its output tokens in all as predicted at
        arrival (``scheduler.predictor``); set by the scheduler on
        ``add_request``, 0 before.

    Raises:
      ValueError: empty prompt, a negative token id, or a non-int priority.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "arrival_time",
        "priority", "cache_salt", "output_token_ids", "num_computed_tokens", "status",
        "stop_reason", "ignored_reason", "num_preemptions", "first_scheduled_time",
        "block_hashes", "prompt_array", "_all_token_ids", "_max_tokens", "_seq", "length_limit", "batch_row",
        "prefill_only", "skip_reading_prefix_cache", "spec_token_ids", "grammar_ready",
        "predicted_output_tokens",
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
        """The status ``token``, just appended, finishes this request with, or None: once ``min_tokens`` outputs
        exist, eos (unless ``ignore_eos``) or a ``stop_token_ids`` member (then its ``stop_reason``) stops it;
        ``max_tokens`` outputs or ``max_model_len`` tokens cap it."""
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
