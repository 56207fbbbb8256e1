"""Request outputs, shaped as vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union


@dataclasses.dataclass
class Logprob:
    """One token's log-probability, as vLLM's ``vllm.logprobs.Logprob``.

    Attributes:
      logprob: natural log of its probability under the raw model
        distribution (``log_softmax`` of the float32 logits before
        penalties, bias and temperature; vLLM's ``raw_logprobs``).
      rank: 1-based rank in that distribution: 1..k for the top ``k``
        tokens, and for the chosen (or prompt) token the number of tokens
        at least as likely as it (vLLM's rule).
      decoded_token: the token's text at its position: what it adds to the
        text after the tokens before it, leading spaces included
        (``frontend.output_processor.TokenTexts``); None for a model without
        a tokenizer.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclasses.dataclass
class CompletionOutput:
    """One continuation of a prompt.

    Attributes:
      index: which of the request's ``n`` continuations this is.
      text: detokenized output text. A stop string and all after it are cut
        (with ``include_stop_str_in_output`` the stop string is kept); the
        text of the eos or ``stop_token_ids`` token that ended the sequence
        is left out unless ``include_stop_str_in_output`` (vLLM's rule).
      token_ids: generated token ids.
      finish_reason: "stop" (eos, stop token or string), "length"
        (max_tokens or max_model_len), "abort", or None while running.
      stop_reason: the stop token id or stop string that ended it, if any.
      cumulative_logprob: sum of the chosen tokens' logprobs (when asked for).
      logprobs: per generated token, ``{token_id: Logprob}`` (when asked
        for): the chosen token first, then the top ``SamplingParams.logprobs``
        tokens (ranks 1..k; the chosen one keeps its place if among them).
      delta_text / delta_token_ids: what this step added (for streaming).
        ``delta_token_ids`` are the ids generated this step;
        ``delta_text`` is the text that can no longer change: text that
        could still begin a stop string is held back until it cannot (or
        the sequence finishes), so a stream's deltas add up to ``text`` and
        ``token_ids`` exactly.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, Logprob]]] = None
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
        computed): None for the first, then ``{token_id: Logprob}`` holding
        the prompt token (first) and the top ``k``, of the raw model
        distribution (as ``CompletionOutput.logprobs``); None when not asked for.
      num_cached_tokens: prompt tokens read from the prefix cache when the
        request was first scheduled (vLLM's field; 0 before that).
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
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
