"""Structured output: JSON schema, regex, choice and grammar constraints, enforced by a token bitmask each step.

vLLM v1's ``StructuredOutputManager`` with its ``guidance`` backend (llguidance). The core compiles off the step
loop (a request waits in ``WAITING_FOR_FSM``), builds an ``int32[S, ceil(V/32)]`` bitmask per step and advances
the matchers; a grammar that consumed EOS ends its sequence whatever ``min_tokens``/``ignore_eos`` say (vLLM #54218).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import os
import re
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import llguidance
import llguidance.numpy
import numpy as np

from scheduler import Request, SchedulerOutput, StructuredOutputsParams

if TYPE_CHECKING:
    from jaxllm.core.requests import CoreSequence

# Compiled grammars kept (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one packed token-bitmask row: ``ceil(vocab_size / 32)``."""
    return -(-vocab_size // 32)


# Keys of a schema node whose values are schemas, and those whose values are lists or maps of schemas.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """``schema`` (a JSON schema: dict or bool) with ``"additionalProperties": false`` on every object node that
    declares ``properties`` and says nothing of its others; a new tree, ``schema`` untouched.

    JSON Schema's default admits undeclared keys, and a small model under such a grammar tends to invent keys
    until ``max_tokens``; vLLM's default backend (xgrammar) rejects them, as its guidance backend does with
    ``disable_additional_properties``. Left open, as vLLM's rewrite leaves them: an object inside ``allOf``
    (closing one branch would refuse the other branches' keys), one beside ``anyOf``/``oneOf``/``$ref`` (its keys
    may be declared there), and one whose ``required`` names a key not in ``properties``.
    """
    return _close(schema, in_all_of=False)


def _close(node: Any, *, in_all_of: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = _close(out[key], in_all_of=False)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(n, in_all_of=key == "allOf") for n in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(n, in_all_of=False) for name, n in out[key].items()}
    properties = out.get("properties")
    open_by_design = (in_all_of or any(k in out for k in ("anyOf", "oneOf", "$ref"))
                      or not set(out.get("required", ())) <= set(properties or ()))
    if isinstance(properties, dict) and "additionalProperties" not in out and not open_by_design:
        out["additionalProperties"] = False
    return out


def _json_schema(params: StructuredOutputsParams) -> Any:
    """The JSON schema ``params`` asks for (``json_object``: any object), closed unless it allows undeclared keys."""
    if params.json_object:
        return {"type": "object"}
    schema = json.loads(params.json) if isinstance(params.json, str) else params.json
    return closed_objects(schema) if params.disable_additional_properties else schema


def grammar_spec(params: StructuredOutputsParams) -> tuple[str, str]:
    """The constraint as llguidance grammar text: ``(field, grammar)``.
    Raises ValueError: a schema that is not a JSON object, or an unconvertible GBNF grammar (field named)."""
    field = params.kinds()[0]
    try:
        if field in ("json", "json_object"):
            options = {"whitespace_flexible": not params.disable_any_whitespace}
            return field, llguidance.LLMatcher.grammar_from_json_schema(_json_schema(params), overrides=options)
        if field == "regex":
            return field, llguidance.LLMatcher.grammar_from_regex(params.regex)
        if field == "choice":
            return field, llguidance.grammar_from("choice", params.choice)
        return field, llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise ValueError(f"SamplingParams.structured_outputs.{field} is invalid: {e}") from None


def after_reasoning(params: StructuredOutputsParams, end_tag: str) -> StructuredOutputsParams:
    """``params`` applied after a model's reasoning: free text up to the first ``end_tag``, then the constraint.
    Raises ValueError: a ``grammar`` constraint (it cannot be composed)."""
    field = params.kinds()[0]
    if field == "grammar":
        raise ValueError("SamplingParams.structured_outputs.grammar cannot follow a reasoning parser's reasoning; "
                         "use json, regex or choice, or serve without --reasoning-parser")
    if field in ("json", "json_object"):
        schema = _json_schema(params)
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        answer = "%json " + json.dumps({**schema, "x-guidance": options})
    elif field == "regex":
        answer = "/" + params.regex.replace("/", "\\/") + "/"
    else:
        answer = " | ".join(json.dumps(c) for c in params.choice)
    end = re.escape(end_tag).replace("/", "\\/")
    return StructuredOutputsParams(grammar=f"start: think answer\nthink[lazy]: /(?s:.*){end}/\nanswer: {answer}\n")


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Check that the constraint compiles (vLLM's ``validate_guidance_grammar``), without a tokenizer.
    Raises ValueError: an invalid JSON schema, regex or grammar (the field and llguidance's error named)."""
    field, grammar = grammar_spec(params)
    error = _grammar_error(grammar)
    if error is not None:
        raise ValueError(f"SamplingParams.structured_outputs.{field} is invalid: {error}")


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _grammar_error(grammar: str) -> Optional[str]:
    """llguidance's error for ``grammar``, None when it is valid (cached)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0].strip() if is_error else None


def _compiled_ok(future: concurrent.futures.Future) -> bool:
    return future.done() and future.exception() is None


@dataclasses.dataclass
class SequenceGrammar:
    """One constrained sequence's grammar: the compile future, its own matcher and the tokens it consumed."""

    future: concurrent.futures.Future
    matcher: Optional[llguidance.LLMatcher] = None
    num_consumed: int = 0

    @property
    def error(self) -> Optional[str]:
        """Why the grammar failed to compile; None while it compiles or once it compiled."""
        failed = self.future.done() and self.future.exception() is not None
        return str(self.future.exception()) if failed else None


class StructuredOutputManager:
    """Grammar compilation, per-sequence matchers and the step bitmask of one engine core.

    Args:
      load_tokenizer: returns the model's ``Tokenizer``; called once, when the first constraint arrives.
      vocab_size: logit rows (padding ids past the tokenizer's are never allowed).
      eos_token_ids: extra ids that end generation. max_workers: compile threads (default half the CPUs, 1-4).

    Attributes:
      num_words: ``ceil(vocab_size / 32)``. bitmask_seconds: host seconds of the last :meth:`bitmask` (None
      when it had no constrained row).
    """

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Sequence[int] = (),
                 max_workers: Optional[int] = None):
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self._load_tokenizer = load_tokenizer
        self._eos_token_ids = list(eos_token_ids)
        # The grammar's EOS ids (the tokenizer's and ``eos_token_ids``), known with the tokenizer.
        self._grammar_eos: frozenset[int] = frozenset()
        self._ll_tokenizer: Optional[llguidance.LLTokenizer] = None
        self._tokenizer_lock = threading.Lock()
        workers = max_workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxllm-grammar")
        self._executor: Optional[llguidance.LLExecutor] = None
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._num_sequences = 0
        self._failed = threading.Event()
        self.bitmask_seconds: Optional[float] = None

    # ------------------------------------------------------------ compilation

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled template matcher of ``params`` (a future, cached among ``GRAMMAR_CACHE_SIZE`` grammars)."""
        _, grammar = grammar_spec(params)
        future = self._cache.get(grammar)
        if future is None:
            future = self._cache[grammar] = self._pool.submit(self._compile, grammar)
            future.add_done_callback(lambda f: f.exception() is not None and self._failed.set())
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(grammar)
            if future.done() and future.exception() is not None:
                self._failed.set()  # so that the new request is aborted too
        return future

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                tokenizer = self._load_tokenizer()
                if tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer; this model has none")
                if tokenizer.vocab_size > self.vocab_size:
                    raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                                     f"vocab_size={self.vocab_size}")
                eos = list(dict.fromkeys(list(tokenizer.eos_token_ids) + self._eos_token_ids))
                self._grammar_eos = frozenset(eos)
                self._ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=eos)
            return self._ll_tokenizer

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        # The first mask builds the lexer states the start needs; the sequences' copies share them.
        llguidance.numpy.fill_next_token_bitmask(matcher, np.zeros((1, self.num_words), np.int32))
        return matcher

    # -------------------------------------------------------------- sequences

    def add(self, request: "CoreSequence", future: concurrent.futures.Future) -> None:
        """Constrain ``request`` (a ``CoreSequence``) by the grammar ``future`` compiles."""
        request.grammar = SequenceGrammar(future)
        self._num_sequences += 1

    @staticmethod
    def ready(future: concurrent.futures.Future) -> Callable[[], bool]:
        """A ``Request.grammar_ready`` for the grammar ``future``: True once it compiled without error."""
        return lambda: _compiled_ok(future)

    def remove(self, request: "CoreSequence") -> None:
        """Forget a finished or aborted sequence's grammar (an unconstrained one is ignored)."""
        if request.grammar is not None:
            request.grammar = None
            self._num_sequences -= 1

    @staticmethod
    def constrains(request: "CoreSequence") -> bool:
        """True when ``request`` (one sequence) is under a grammar (speculative decoding gives it no drafts)."""
        return request.grammar is not None

    def grammar_failed(self) -> bool:
        """True once after some grammar failed to compile; its sequences (``grammar.error``) are to abort."""
        if not self._failed.is_set():
            return False
        self._failed.clear()
        return True

    def _matcher(self, seq: SequenceGrammar) -> llguidance.LLMatcher:
        if seq.matcher is None:
            seq.matcher = seq.future.result().deep_copy()
        return seq.matcher

    # ------------------------------------------------------------------- step

    def bitmask(self, output: SchedulerOutput, num_rows: int) -> Optional[np.ndarray]:
        """The step's allowed tokens: ``int32[num_rows, num_words]`` (unconstrained, discarded and padding rows
        all ones), or None when no sampling row is constrained.
        Raises RuntimeError: a matcher is behind or ahead of its sequence (a bug)."""
        rows = []
        if self._num_sequences:
            for i, (request, samples) in enumerate(zip(output.requests, output.samples.tolist())):
                if samples and request.grammar is not None:
                    rows.append((i, request))
        if not rows:
            self.bitmask_seconds = None
            return None
        start = time.perf_counter()
        bitmask = np.full((num_rows, self.num_words), -1, np.int32)
        matchers = []
        for i, request in rows:
            seq = request.grammar
            if seq.num_consumed != output.sample_index[i]:
                raise RuntimeError(f"request {request.request_id!r}: its grammar has consumed "
                                   f"{seq.num_consumed} tokens but the step samples output token "
                                   f"{int(output.sample_index[i])}")
            matchers.append((self._matcher(seq), i))
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        self.bitmask_seconds = time.perf_counter() - start
        return bitmask

    def advance(self, requests: Iterable[Request]) -> list[Request]:
        """Feed each constrained request's new output tokens to its matcher; returns those whose grammar ended.
        Raises RuntimeError: the matcher rejects a sampled token (a bug)."""
        ended = []
        for request in requests:
            seq = request.grammar
            if seq is None:
                continue
            new = request.output_token_ids[seq.num_consumed:]
            if not new:
                continue
            matcher = self._matcher(seq)
            # One by one: llguidance's consume_tokens refuses an eos after the grammar has ended.
            for token in new:
                if not matcher.consume_token(token):
                    raise RuntimeError(f"request {request.request_id!r}: the grammar rejected sampled token {token} "
                                       f"after {seq.num_consumed} outputs: {matcher.get_error()}")
                seq.num_consumed += 1
            # Nothing follows an EOS the matcher took (it rejects every other token after it), so only the last can be.
            if new[-1] in self._grammar_eos and matcher.is_stopped() and not request.is_finished:
                ended.append(request)
        return ended

    def needs_previous_samples(self, output: SchedulerOutput) -> bool:
        """Whether a constrained sampling row takes the previous step's sample as input (async scheduling)."""
        if not self._num_sequences:
            return False
        fed = ((output.prev_row >= 0) & output.samples).nonzero()[0]
        return any(output.requests[i].grammar is not None for i in fed.tolist())

    @property
    def num_grammars(self) -> int:
        """Grammars compiled or compiling, held in the cache."""
        return len(self._cache)

    @property
    def num_sequences(self) -> int:
        """Constrained sequences not removed yet."""
        return self._num_sequences
