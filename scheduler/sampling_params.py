"""Per-request sampling and stopping parameters (host side, no JAX).

Follows vLLM's ``vllm.SamplingParams``: the same field names, defaults and
ranges, so code written against vLLM ports by changing the import. It lives in
``scheduler/`` because the scheduler needs the stopping fields (``max_tokens``,
``min_tokens``, ``stop_token_ids``, ``ignore_eos``) and must not import
``jaxllm``; ``jaxllm`` re-exports it.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``); give exactly one of the first five.

    The engine turns it into a grammar (``jaxllm.structured_output``) and
    masks, every step, the tokens that cannot continue the text within it.

    Attributes:
      json: a JSON schema (a dict, or its JSON text): the output is one JSON
        value that validates against it.
      regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
      choice: the output is exactly one of these strings.
      grammar: a context-free grammar in Lark syntax (llguidance's dialect)
        or GBNF (llama.cpp's); the output is a sentence of it.
      json_object: any JSON object (``{"type": "object"}``).
      disable_any_whitespace: JSON without whitespace between tokens (by
        default any run of spaces, tabs and newlines may separate them).

    Raises:
      ValueError: no constraint or several, or one of the wrong type (an
        empty regex, a choice list that is empty or holds a non-string, a
        schema that is not JSON); the message names the field. A schema,
        regex or grammar the grammar engine rejects is found by the engine
        at ``add_request``, with the same kind of message.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: bool = False
    disable_any_whitespace: bool = False

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
    """How to sample the tokens of one request and when to stop.

    Attributes follow vLLM:
      n: number of continuations per prompt (>= 1).
      temperature: softmax temperature (>= 0); 0 means greedy (argmax).
      top_p: nucleus mass in (0, 1]; 1 disables it.
      top_k: keep the k most likely tokens; 0 or -1 disables it.
      min_p: drop tokens whose probability is below ``min_p`` times the
        top token's, in [0, 1].
      presence_penalty, frequency_penalty: OpenAI-style additive penalties in
        [-2, 2] over generated tokens.
      repetition_penalty: CTRL-style multiplicative penalty (> 0) over prompt
        and generated tokens; 1 disables it.
      seed: per-request random seed, an int in ``[SEED_MIN, SEED_MAX - n + 1]``
        (int64; sequence i of n uses ``seed + i``); with it, the sampled tokens
        do not depend on what else is in the batch, and distinct seeds give
        independent streams.
      max_tokens: number of tokens to generate at most (>= 1).
      min_tokens: eos and ``stop_token_ids`` are banned before this many
        tokens; a stop string counts only where it ends in the text of a
        later token (vLLM).
      stop: stop strings, checked on detokenized text; the first to end
        wins, and the text is cut before it.
      stop_token_ids: token ids that end generation (besides eos).
      include_stop_str_in_output: keep the stop string, or the text of the
        eos / ``stop_token_ids`` token that ended the sequence, in the text.
      ignore_eos: keep generating after the eos token.
      logprobs: number of top log-probabilities to return per generated token,
        0 to ``MAX_LOGPROBS`` (20, vLLM's default ``max_logprobs``); the chosen
        token's is always included; None for none.
      prompt_logprobs: likewise for each prompt token.
      logit_bias: {token_id: bias} added to the logits before sampling.
      allowed_token_ids: restrict sampling to these ids.
      bad_words: words that may not be generated, each both bare and after
        a space, whatever the token counts of the two.
      skip_special_tokens: drop special tokens from the detokenized text.
      structured_outputs: a ``StructuredOutputsParams`` constraint (JSON
        schema, regex, choice, grammar) on the output, or None.
      allow_kv_compression: our addition: with ``kv_cache_compression`` on,
        the scheduler may re-encode this request's full KV blocks in one
        byte rather than preempt (``scheduler.kv.compressed_pool``); False opts
        out (exact KV always). A request with ``priority < 0`` is never
        compressed either way.

    Raises:
      ValueError: a field out of its range; the message names the field, the
        value and the range.
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
    structured_outputs: Optional[StructuredOutputsParams] = None
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
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list or None")
        if not isinstance(self.allow_kv_compression, bool):
            raise bad("allow_kv_compression", self.allow_kv_compression, "True or False")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0, or top_k == 1)."""
        return self.temperature < GREEDY_EPS or self.top_k == 1

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Check token ids in this request against the model's vocabulary.

        Raises:
          ValueError: a token id in ``stop_token_ids``, ``logit_bias`` or
            ``allowed_token_ids`` is not in ``[0, vocab_size)``.
        """
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
