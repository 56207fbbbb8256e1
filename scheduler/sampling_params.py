"""Per-request sampling and stopping parameters (host side, no JAX), vLLM's ``SamplingParams`` field for field.

Here because the scheduler needs the stopping fields and must not import ``jaxllm`` (which re-exports it).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import Optional, Sequence, Union

# Temperatures below this sample greedily (argmax), here and in the device sampler.
GREEDY_EPS = 1e-5
# vLLM's default ``max_logprobs``: the most top log-probabilities a request may
# ask for (per generated token, or per prompt token). The sampler always
# computes this many so its shapes stay static.
MAX_LOGPROBS = 20
# The seeds a request may give: int64's range (vLLM's OpenAI protocol's bound).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class RequestOutputKind(enum.Enum):
    """Which ``RequestOutput``s a request gets, and what their completions hold (vLLM's ``RequestOutputKind``).

    CUMULATIVE: one each step that touches the request, each completion's text, token ids and logprobs so far.
    DELTA: one each step that touches the request, each completion's text, token ids and logprobs (and the prompt
      logprobs) added since the previous one.
    FINAL_ONLY: only the finished one, whole (no work is spent on the others: ``LLM.generate`` asks for this).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``); give exactly one of the first five.

    Attributes:
      json: a JSON schema (dict or JSON text) the output validates against.
      regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
      choice: the output is exactly one of these strings.
      grammar: a Lark (llguidance's dialect) or GBNF (llama.cpp's) grammar the output is a sentence of.
      json_object: any JSON object.
      disable_any_whitespace: JSON without whitespace between tokens.
      disable_additional_properties: an object schema that declares ``properties`` and says nothing of others
        admits no undeclared key (``jaxllm.structured_output.closed_objects``), as vLLM's default backend does;
        False: JSON Schema's own default, any other key allowed.

    Raises ValueError naming the field for no constraint, several, or one of the wrong type (empty regex or
    choices, a non-string choice, a schema that is not JSON); what the grammar engine rejects fails at ``add_request``.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True

    def __post_init__(self) -> None:
        given = self.kinds()
        if len(given) != 1:
            raise ValueError("SamplingParams.structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")

        def bad(field: str, limit: str) -> ValueError:
            return ValueError(f"SamplingParams.structured_outputs.{field}={getattr(self, field)!r} is invalid: "
                              f"must be {limit}")

        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise bad("json", f"a JSON schema (as a dict or JSON text): {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise bad("json", "a JSON schema: an object (or true/false)")
        for field in ("regex", "grammar"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(field, "a non-empty string")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise bad("choice", "a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    def kinds(self) -> list[str]:
        """The constraint fields that are set (exactly one once constructed)."""
        return [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None] + (
            ["json_object"] if self.json_object else [])


@dataclasses.dataclass
class SamplingParams:
    """How to sample the tokens of one request and when to stop (vLLM's fields, defaults and ranges).

    Attributes:
      n: continuations per prompt, >= 1.
      temperature: >= 0; 0 is greedy.
      top_p: nucleus mass in (0, 1]; 1 disables it.
      top_k: keep the k most likely tokens; 0 or -1 disables it.
      min_p: drop tokens under ``min_p`` times the top token's probability, in [0, 1].
      presence_penalty, frequency_penalty: additive, in [-2, 2], over generated tokens.
      repetition_penalty: multiplicative, > 0, over prompt and generated tokens; 1 disables it.
      seed: int in ``[SEED_MIN, SEED_MAX - n + 1]`` (sequence i uses ``seed + i``): tokens then independent of the
        batch, distinct seeds independent streams.
      max_tokens: tokens to generate at most, >= 1.
      min_tokens: eos and ``stop_token_ids`` banned before this many; a stop string counts only where it ends in a
        later token's text.
      stop: stop strings on the detokenized text; the first to end wins, the text cut before it.
      stop_token_ids: token ids that end generation (besides eos).
      include_stop_str_in_output: keep the stop string (or eos / stop token text) in the text.
      ignore_eos: keep generating after eos.
      logprobs, prompt_logprobs: top log-probabilities per generated / prompt token, 0 to ``MAX_LOGPROBS`` (20),
        the chosen token's always included; None for none.
      logit_bias: {token_id: bias} added to the logits.
      allowed_token_ids: restrict sampling to these ids.
      bad_words: words never generated, bare or after a space.
      skip_special_tokens: drop special tokens from the text.
      detokenize: False leaves every text empty (token ids and logprobs only, logprob token texts None) and
        runs no detokenizer; ``stop`` strings then raise, as vLLM's.
      structured_outputs: a ``StructuredOutputsParams`` or None.
      output_kind: a ``RequestOutputKind``: every step's outputs cumulative (the default) or as deltas, or the
        final one only.
      allow_kv_compression: our addition: False keeps this request's KV exact under ``kv_cache_compression``
        (``priority < 0`` always does).

    Raises ValueError naming the field, the value and the range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Union[str, Sequence[str]]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict] = None
    allowed_token_ids: Optional[Sequence[int]] = None
    bad_words: Optional[Sequence[str]] = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    allow_kv_compression: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(field: str, value, limit: str) -> ValueError:
            return ValueError(f"SamplingParams.{field}={value!r} is out of range: must be {limit}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, getattr(self, name), "a finite number")
        if any(not math.isfinite(v) for v in (self.logit_bias or {}).values()):
            raise bad("logit_bias", self.logit_bias, "finite bias values")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, ">= 1")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, ">= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "0 or -1 (off), or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, value, "in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0 (1 means off)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, ">= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, value, f"an int in [0, {MAX_LOGPROBS}] (max_logprobs) or None")
        # 64 bits, as vLLM's OpenAI server bounds it: every seed in range gets its own stream, none is folded
        # onto another. Sequence i of n samples with seed + i, so that must fit too.
        top = SEED_MAX - (self.n - 1)
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_MIN <= self.seed <= top):
            why = "int64" if self.n == 1 else f"int64 less n - 1 = {self.n - 1} at the top: sequence i uses seed + i"
            raise bad("seed", self.seed, f"an int in [{SEED_MIN}, {top}] ({why}) or None")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "non-negative token ids")
        if any(s == "" for s in self.stop):
            raise bad("stop", self.stop, "non-empty strings")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", self.detokenize, "True or False")
        if self.stop and not self.detokenize:
            raise ValueError(f"SamplingParams.stop={self.stop!r} needs detokenize=True: stop strings are matched on "
                             "the detokenized text")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list or None")
        if not isinstance(self.allow_kv_compression, bool):
            raise bad("allow_kv_compression", self.allow_kv_compression, "True or False")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0, or top_k == 1)."""
        return self.temperature < GREEDY_EPS or self.top_k == 1

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a ``stop_token_ids``, ``logit_bias`` or ``allowed_token_ids`` id is not in
        ``[0, vocab_size)``."""
        fields = {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": list((self.logit_bias or {}).keys()),
            "allowed_token_ids": list(self.allowed_token_ids or []),
        }
        for name, ids in fields.items():
            for t in ids:
                if not 0 <= int(t) < vocab_size:
                    raise ValueError(
                        f"SamplingParams.{name} holds token id {t}, outside the vocabulary [0, {vocab_size})"
                    )
