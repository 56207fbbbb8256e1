"""Front-end output processing: core outputs in, ``RequestOutput`` out (vLLM's ``OutputProcessor``).

Stop strings, as vLLM's: searched only after ``min_tokens``; the first match to end wins, the text cut before it
(after, with ``include_stop_str_in_output``); the eos/stop token adds no text unless that flag. A stream holds
back only a tail that may begin a stop string, so its ``delta_text``s add up to the final ``text``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Protocol, Sequence, Union

from jaxllm.core.messages import EngineCoreOutput, EngineCoreRequest, SampleLogprobs
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.tokenizer import IncrementalDetokenizer
from scheduler import RequestOutputKind, SamplingParams


class Detokenizer(Protocol):
    """What ``OutputText`` needs of a detokenizer (``tokenizer.IncrementalDetokenizer``)."""

    def step(self, token_id: int) -> str: ...


class OutputText:
    """One sequence's output text: detokenized, cut at stop strings, streamed (rules in the module docstring).

    Args:
      detokenizer: the sequence's incremental detokenizer; None: the text stays empty. params: its SamplingParams.

    Attributes:
      text: the output text so far. num_tokens: tokens decoded so far.
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
        """Decode new ids, looking for stop strings; returns the stop string that matched, else None
        (``stopped_by_token``: the last id is the eos or stop token that ended the sequence)."""
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
    """Logprob token texts of one sequence (vLLM's ``Logprob.decoded_token``): what each candidate adds after the
    tokens before it, so the chosen tokens' texts add up to the text.

    Args:
      tokenizer: None makes every text None. context: the ids before the first position.
      skip_special_tokens: the sequence's. special_texts: ``special_token_texts``' mapping.
    """

    def __init__(self, tokenizer, context: Sequence[int] = (), skip_special_tokens: bool = True,
                 special_texts: Optional[dict[int, str]] = None) -> None:
        self._detokenizer = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, list(context), skip_special_tokens=skip_special_tokens)
        self._special = special_texts if special_texts is not None else special_token_texts(tokenizer)

    def __call__(self, token_id: int) -> Optional[str]:
        """The text of ``token_id`` as the next token (None without a tokenizer)."""
        if self._detokenizer is None:
            return None
        special = self._special.get(token_id)
        return special if special is not None else self._detokenizer.peek(token_id)

    def advance(self, token_id: int) -> None:
        """``token_id`` is the position's token: later texts are read after it."""
        if self._detokenizer is not None:
            self._detokenizer.step(token_id)


def special_token_texts(tokenizer) -> dict[int, str]:
    """Special token id -> ``decode([id])`` with special tokens shown ({} without a tokenizer)."""
    if tokenizer is None:
        return {}
    # A config's eos id may lie past the tokenizer's vocabulary; such an id has no text to show.
    return {i: tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.all_special_ids
            if i < tokenizer.vocab_size}


def logprob_entry(token_id: int, logprob: float, rank: int, top_ids: Sequence[int], top_logprobs: Sequence[float],
                  decode: Callable[[int], Optional[str]]) -> dict[int, Logprob]:
    """One position's ``{token_id: Logprob}`` in vLLM's order: the chosen token, then the top ``k``; ``decode``
    maps an id to its text here."""
    entry = {int(token_id): Logprob(float(logprob), int(rank), decode(int(token_id)))}
    for i, (t, lp) in enumerate(zip(top_ids, top_logprobs)):
        entry[int(t)] = Logprob(float(lp), i + 1, decode(int(t)))
    return entry


def _entries(rows: Sequence[SampleLogprobs], texts: TokenTexts) -> list[dict[int, Logprob]]:
    """The rows' entries, in order; ``texts`` moves past each row's token."""
    entries = []
    for row in rows:
        entries.append(logprob_entry(row.token_id, row.logprob, row.rank, row.top_ids, row.top_logprobs, texts))
        texts.advance(row.token_id)
    return entries


@dataclasses.dataclass
class _SequenceState:
    """One sequence's text, tokens, logprobs and finish, as the front end knows them."""

    index: int
    output: OutputText
    texts: Optional[TokenTexts] = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    # Token ids and logprob rows already sent (DELTA outputs send what follows).
    num_sent: int = 0


@dataclasses.dataclass
class RequestState:
    """One request in the front end: its prompt, its ``n`` sequences, its ``RequestOutputKind`` and its
    timestamps (monotonic seconds)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    seqs: list[_SequenceState]
    arrival_time: float
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    prompt_texts: Optional[TokenTexts] = None
    num_cached_tokens: int = 0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    ignored_reason: Optional[str] = None
    # Prompt logprob rows already sent (DELTA outputs send what follows).
    num_prompt_sent: int = 0

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.seqs)


class OutputProcessor:
    """Turns core outputs into ``RequestOutput``s for the open requests (``requests``: id -> ``RequestState``);
    ``tokenizer`` None leaves every text empty."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._special_texts = special_token_texts(tokenizer)

    def add_request(self, request: EngineCoreRequest, prompt: Optional[str]) -> None:
        """Open the front-end state of a request (``prompt``: its text, None for token ids).
        Raises ValueError: its id is already open."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        params = request.sampling_params
        ids = request.prompt_token_ids
        skip = params.skip_special_tokens
        # detokenize=False (vLLM's): no text, no logprob token texts, no detokenizer run.
        tokenizer = self.tokenizer if params.detokenize else None
        seqs = []
        for i in range(params.n):
            detok = None
            if tokenizer is not None:
                detok = IncrementalDetokenizer(tokenizer, ids, skip_special_tokens=skip)
            seq = _SequenceState(i, OutputText(detok, params))
            if params.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
                seq.texts = TokenTexts(tokenizer, ids, skip, self._special_texts)
            seqs.append(seq)
        state = RequestState(request.request_id, prompt, ids, seqs, request.arrival_time, params.output_kind)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
            state.prompt_texts = TokenTexts(tokenizer, ids[:1], skip, self._special_texts)
        self.requests[request.request_id] = state

    @property
    def num_open_sequences(self) -> int:
        """Sequences of the open requests (``n`` per request), finished ones of an open request included."""
        return sum(len(state.seqs) for state in self.requests.values())

    def abort_requests(self, request_ids: Sequence[str]) -> list[str]:
        """Close requests; returns those that were open (the caller aborts them in the core)."""
        return [rid for rid in request_ids if self.requests.pop(rid, None) is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: Sequence[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[tuple[str, int]], list[RequestState]]:
        """Apply one step's core outputs. Returns a ``RequestOutput`` per open request touched that its
        ``output_kind`` asks one of (FINAL_ONLY: finished ones only; finished ones are closed), the
        ``(request_id, index)`` sequences a stop string ended (for the caller to stop), and every touched
        request's state (the metrics read its new tokens and times from it)."""
        touched: dict[str, RequestState] = {}
        to_stop: list[tuple[str, int]] = []
        now = time.monotonic()
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            if out.request_id not in touched:
                touched[out.request_id] = state
                for seq in state.seqs:
                    seq.delta_token_ids = []
            seq = state.seqs[out.index]
            if seq.finish_reason is not None:
                continue
            if self._update(state, seq, out, now):
                to_stop.append((out.request_id, out.index))
        request_outputs = []
        for state in touched.values():
            finished = state.finished
            if finished:
                state.finished_time = now
                del self.requests[state.request_id]
            if finished or state.output_kind is not RequestOutputKind.FINAL_ONLY:
                request_outputs.append(self._make_output(state, finished))
        return request_outputs, to_stop, list(touched.values())

    def _update(self, state: RequestState, seq: _SequenceState, out: EngineCoreOutput, now: float) -> bool:
        """Apply one sequence's output; True when a stop string ended it before the core did."""
        new_ids = out.new_token_ids
        decoded = seq.output.num_tokens
        # The core finishes on eos and stop_token_ids only; stop strings are found here.
        stop = seq.output.add_tokens(new_ids, stopped_by_token=out.finish_reason == "stop")
        if stop is not None:
            # Several tokens of one step (speculative decoding) may run past the one that completed the stop string.
            new_ids = new_ids[: seq.output.num_tokens - decoded]
        seq.delta_token_ids = new_ids
        seq.token_ids += new_ids
        if new_ids and state.first_token_time is None:
            state.first_token_time = now
        if out.index == 0 and state.first_scheduled_time is None:
            state.first_scheduled_time = out.first_scheduled_time
        state.num_cached_tokens = out.num_cached_tokens
        if out.ignored_reason is not None:
            state.ignored_reason = out.ignored_reason
        rows = (out.new_logprobs or [])[: len(new_ids)]
        if rows:
            seq.logprobs += _entries(rows, seq.texts)
            for row in rows:
                seq.cumulative_logprob += row.logprob
        if out.new_prompt_logprobs:
            state.prompt_logprobs += _entries(out.new_prompt_logprobs, state.prompt_texts)
        if stop is not None:
            stopped_here = out.finish_reason is None
            seq.finish_reason, seq.stop_reason = "stop", stop
            return stopped_here
        if out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        delta = state.output_kind is RequestOutputKind.DELTA
        completions = []
        for seq in state.seqs:
            # The delta is taken whatever the kind: a stream's held-back stop-string tail is tracked by it.
            delta_text = seq.output.delta(seq.finish_reason is not None)
            # What followed the last output (this step's tokens, unless FINAL_ONLY skipped outputs before).
            sent, seq.num_sent = seq.num_sent, len(seq.token_ids)
            new_ids = seq.token_ids[sent:]
            logprobs = seq.logprobs
            if logprobs is not None:
                logprobs = logprobs[sent:] if delta else list(logprobs)
            completions.append(CompletionOutput(
                index=seq.index, text=delta_text if delta else seq.output.text,
                token_ids=list(new_ids) if delta else list(seq.token_ids), finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, cumulative_logprob=seq.cumulative_logprob, logprobs=logprobs,
                delta_text=delta_text, delta_token_ids=new_ids,
            ))
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is not None:
            sent, state.num_prompt_sent = state.num_prompt_sent, len(prompt_logprobs)
            prompt_logprobs = prompt_logprobs[sent:] if delta else list(prompt_logprobs)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=completions, finished=finished, delta_text=completions[0].delta_text,
            delta_token_ids=completions[0].delta_token_ids, ignored_reason=state.ignored_reason,
            prompt_logprobs=prompt_logprobs, num_cached_tokens=state.num_cached_tokens,
            metrics=dict(arrival_time=state.arrival_time, first_scheduled_time=state.first_scheduled_time,
                         first_token_time=state.first_token_time, finished_time=state.finished_time),
        )
