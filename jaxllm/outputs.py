"""Request outputs, shaped as vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union


@dataclasses.dataclass
class Logprob:
    """One token's log-probability (vLLM's ``vllm.logprobs.Logprob``).

    Attributes:
      logprob: natural log under the raw distribution (vLLM's ``raw_logprobs``).
      rank: 1-based; for the chosen token, how many tokens are at least as likely (vLLM's rule).
      decoded_token: what the token adds to the text at its position; None without a tokenizer.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclasses.dataclass
class CompletionOutput:
    """One continuation of a prompt (vLLM's ``CompletionOutput``).

    Attributes:
      index: which of the ``n`` continuations. text: the output, cut at a stop string (vLLM's rules).
      token_ids: generated ids. finish_reason: "stop", "length", "abort" or None while running.
      stop_reason: the stop token id or string that ended it. cumulative_logprob: when asked for (always the
        whole output's).
      logprobs: per token ``{token_id: Logprob}``, the chosen token first, then the top k.
      text, token_ids and logprobs hold the output so far, or under ``RequestOutputKind.DELTA`` only what
      followed the request's previous output.
      delta_text / delta_token_ids: what followed the previous output (all of it in a FINAL_ONLY request's one
        output); the deltas add up to the whole ``text``/``token_ids``.
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
    """Everything the engine says about one request after a step (vLLM's ``RequestOutput``).

    Attributes:
      request_id, prompt (None for token ids), outputs (one per continuation).
      prompt_token_ids: the prompt, one list shared by the request's outputs (as vLLM's): copy it to change it.
      finished: every continuation finished. delta_text / delta_token_ids: the first continuation's.
      ignored_reason: why the scheduler refused it, if it did.
      prompt_logprobs: per recorded prompt token (None first) ``{token_id: Logprob}``, or None; under
        ``RequestOutputKind.DELTA`` only the rows recorded since the previous output.
      num_cached_tokens: prompt tokens from the prefix cache. metrics: timestamps in seconds.
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
