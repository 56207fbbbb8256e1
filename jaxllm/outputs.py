"""Request outputs, shaped as vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union


@dataclasses.dataclass
class CompletionOutput:
    """One continuation of a prompt.

    Attributes:
      index: which of the request's ``n`` continuations this is.
      text: detokenized output text (stop string cut unless asked to keep it).
      token_ids: generated token ids.
      finish_reason: "stop" (eos, stop token or string), "length"
        (max_tokens or max_model_len), "abort", or None while running.
      stop_reason: the stop token id or stop string that ended it, if any.
      cumulative_logprob: sum of the chosen tokens' logprobs (when asked for).
      logprobs: per generated token, {token_id: logprob} (when asked for):
        the top ``SamplingParams.logprobs`` tokens plus the chosen one, of
        the raw model distribution (``log_softmax`` of the logits before
        penalties, bias and temperature; vLLM's ``raw_logprobs``).
      delta_text / delta_token_ids: what this step added (for streaming).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, float]]] = None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """Everything the engine says about one request after a step.

    Attributes:
      request_id: the id given to ``add_request``.
      prompt: the prompt text (None when token ids were given).
      prompt_token_ids: the prompt as token ids.
      outputs: one CompletionOutput per continuation.
      finished: True once every continuation has finished.
      delta_text / delta_token_ids: what this step added to the first
        continuation (for streaming; see ``outputs[i].delta_*`` for the others).
      ignored_reason: why the scheduler refused the request, if it did.
      prompt_logprobs: with ``SamplingParams.prompt_logprobs=k``, one entry
        per prompt token recorded so far (all of them once the prompt is
        computed): None for the first, then {token_id: logprob} holding the
        prompt token and the top ``k``, of the raw model distribution (as
        ``CompletionOutput.logprobs``); None when not asked for.
      metrics: timestamps in seconds (``arrival_time``, ``first_scheduled_time``,
        ``first_token_time``, ``finished_time``).
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignored_reason: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
