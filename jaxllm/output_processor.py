"""Front-end output processing: a sequence's text, its stop strings, what a stream may show, and logprob entries.

This is the part of vLLM's ``OutputProcessor`` (``vllm.v1.engine.detokenizer``)
that works on strings; the engine core (scheduler + runner) only hands it
token ids and whether a token stopped the sequence.

Rules, as vLLM's:

* Stop strings are searched only in text produced after the first
  ``min_tokens`` tokens: a match must end in the text of a later token (it may
  begin before). The first match to end wins (the longest of those ending at
  the same character), whatever the tokens' boundaries. The text is cut
  before it, or after it with ``include_stop_str_in_output``; tokens after
  the one that completed it add no text.
* The eos or ``stop_token_ids`` token that ended a sequence adds no text
  unless ``include_stop_str_in_output``.
* A stream shows text once no stop string can cut it: the longest tail of
  the text that is a proper prefix of some stop string is held back until it
  cannot be (vLLM holds back a fixed ``len(longest stop) - 1`` characters;
  this holds back only what may still match). Nothing is held back with
  ``include_stop_str_in_output`` (a cut then never reaches text already
  there) nor once the sequence has finished. So a stream's ``delta_text``s
  add up to the final ``text``, always.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from jaxllm.outputs import Logprob
from scheduler import SamplingParams


class Detokenizer(Protocol):
    """What ``OutputText`` needs of a detokenizer (``tokenizer.IncrementalDetokenizer``)."""

    def step(self, token_id: int) -> str: ...


class OutputText:
    """One sequence's output text: detokenized, cut at stop strings, streamed (rules in the module docstring).

    Args:
      detokenizer: the sequence's incremental detokenizer; None for a model
        without a tokenizer (the text stays empty, stop strings never match).
      params: the sequence's SamplingParams (``stop``,
        ``include_stop_str_in_output``, ``min_tokens``).

    Attributes:
      text: the output text so far (cut at a stop string once one matched).
      num_tokens: tokens decoded so far.
    """

    def __init__(self, detokenizer: Optional[Detokenizer], params: SamplingParams) -> None:
        self._detokenizer = detokenizer
        self._stop = list(params.stop) if detokenizer is not None else []
        self._include = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._longest = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self.num_tokens = 0
        self._streamed = 0

    def add_tokens(self, token_ids: Sequence[int], stopped_by_token: bool = False) -> Optional[str]:
        """Decode new token ids in order, looking for stop strings after each.

        Args:
          token_ids: the ids generated since the last call.
          stopped_by_token: the last id is the eos or ``stop_token_ids``
            token that ended the sequence (its text is then left out unless
            ``include_stop_str_in_output``).

        Returns:
          the stop string that matched (the text is cut, and later ids are
          not decoded), else None.
        """
        if self._detokenizer is None:
            return None
        if stopped_by_token and not self._include:
            token_ids = token_ids[:-1]
        for token in token_ids:
            self.num_tokens += 1
            before = len(self.text)
            self.text += self._detokenizer.step(token)
            if self._stop and self.num_tokens > self._min_tokens and len(self.text) > before:
                stop = self._match(before)
                if stop is not None:
                    return stop
        return None

    def _match(self, before: int) -> Optional[str]:
        """Cut the text at the first stop string that ends past ``before`` characters; return it."""
        best = None
        for stop in self._stop:
            start = self.text.find(stop, max(before - len(stop) + 1, 0))
            # The earliest end first, then the longest.
            if start >= 0 and (best is None or (start + len(stop), -len(stop)) < best[0]):
                best = ((start + len(stop), -len(stop)), start, stop)
        if best is None:
            return None
        _, start, stop = best
        self.text = self.text[: start + len(stop) if self._include else start]
        return stop

    def delta(self, finished: bool) -> str:
        """Text not streamed yet that no stop string can cut any more (all of it once ``finished``)."""
        end = len(self.text)
        if not finished and not self._include:
            end -= self._pending_tail()
        delta = self.text[self._streamed:end]
        self._streamed = end
        return delta

    def _pending_tail(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        for k in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(len(stop) > k and stop.startswith(tail) for stop in self._stop):
                return k
        return 0


class TokenTexts:
    """Token id -> ``tokenizer.decode([id])`` with special tokens shown
    (vLLM's ``Logprob.decoded_token``), remembered per id; None without a tokenizer."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> Optional[str]:
        if self._tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def logprob_entry(token_id: int, logprob: float, rank: int, top_ids: np.ndarray, top_logprobs: np.ndarray,
                  decode: Callable[[int], Optional[str]]) -> dict[int, Logprob]:
    """One position's ``{token_id: Logprob}``, shaped as vLLM's.

    Args:
      token_id, logprob, rank: the chosen (or prompt) token, its raw logprob
        and its 1-based rank.
      top_ids: int[k], top_logprobs: float[k]: the top ``k`` tokens, descending.
      decode: token id -> its text (``TokenTexts``).

    Returns:
      the chosen token first, then the top ``k`` with ranks ``1..k``; a
      chosen token among the top keeps its first place and takes its top
      rank (vLLM builds the dict in the same order).
    """
    entry = {int(token_id): Logprob(float(logprob), int(rank), decode(int(token_id)))}
    for i, (t, lp) in enumerate(zip(top_ids.tolist(), top_logprobs.tolist())):
        entry[t] = Logprob(float(lp), i + 1, decode(t))
    return entry
