"""A chat choice's message read from its text: reasoning, then content and tool calls, streamed or whole.

The whole message is the join of a fresh ``ChoiceStream``'s deltas, so a stream and the unstreamed
response agree by construction.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from jaxllm.entrypoints.openai.reasoning_parsers import ReasoningParser, Split
from jaxllm.entrypoints.openai.tool_parsers import ParsedCall, ToolParser, strip_separators


@dataclasses.dataclass(frozen=True)
class ChatParsing:
    """How a chat request's choices are read.

    Attributes:
      reasoning, tools: parser factories (None: not read). include_reasoning: the request's.
      single_call: ``parallel_tool_calls: false``. named: the tool choice names the function.
      tool_call_id: makes a call's id (None: the tool parser's ``new_id``); the server passes its
        ``--tool-call-parser``'s whatever the tool choice (Mistral's templates refuse other ids).
    """

    reasoning: Optional[Callable[[], ReasoningParser]] = None
    tools: Optional[Callable[[], ToolParser]] = None
    include_reasoning: bool = True
    single_call: bool = False
    named: bool = False
    tool_call_id: Optional[Callable[[], str]] = None

    @property
    def active(self) -> bool:
        """Whether the text is read at all (else the content is the text as generated)."""
        return self.reasoning is not None or self.tools is not None

    def choice(self) -> "ChoiceStream":
        """A fresh reader for one choice."""
        return ChoiceStream(self)

    def message(self, text: str) -> tuple[dict, int]:
        """(the whole ``message`` of ``text``, its number of calls)."""
        stream = self.choice()
        return join_deltas(stream.update(text, final=True), self), stream.num_calls

    def finish_reason(self, engine_reason: Optional[str], num_calls: int) -> Optional[str]:
        """``"tool_calls"`` for a choice that chose to call (``auto``, ``required``), else the engine's (vLLM)."""
        return "tool_calls" if num_calls and engine_reason == "stop" and not self.named else engine_reason


class ChoiceStream:
    """One choice's deltas as its text grows: ``update`` returns OpenAI ``delta`` objects of what is new."""

    def __init__(self, parsing: ChatParsing) -> None:
        self.parsing = parsing
        self._reasoning = parsing.reasoning() if parsing.reasoning is not None else None
        self._tools = parsing.tools() if parsing.tools is not None else None
        self._new_id = parsing.tool_call_id or (self._tools.new_id if self._tools is not None else None)
        self._sent = {"reasoning": 0, "content": 0}
        self._calls: list[list] = []  # per call: [id, characters of its arguments sent]

    @property
    def num_calls(self) -> int:
        """Calls announced so far."""
        return len(self._calls)

    def split(self, text: str, final: bool) -> Split:
        """The reasoning split of ``text`` (all content without a reasoning parser)."""
        return self._reasoning.split(text, final) if self._reasoning is not None else Split(None, text, False)

    def update(self, text: str, final: bool) -> list[dict]:
        """The deltas ``text`` (the whole text so far; ``final``: all of it) adds to what was sent."""
        split = self.split(text, final)
        deltas = []
        if split.reasoning is not None and self.parsing.include_reasoning:
            deltas += self._text("reasoning", split.reasoning)
        content, calls = split.content, []
        if self._tools is not None:
            parsed = self._tools.scan(split.content, final)
            calls = parsed.calls[:1] if self.parsing.single_call else parsed.calls
            strip = not final or calls
            content = strip_separators(parsed.content, self._tools.separator) if strip else parsed.content
        return deltas + self._text("content", content) + self._call_deltas(calls)

    def _text(self, field: str, text: str) -> list[dict]:
        new = text[self._sent[field]:]
        self._sent[field] = len(text)
        return [{field: new}] if new else []

    def _call_deltas(self, calls: Sequence[ParsedCall]) -> list[dict]:
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self._calls):
                self._calls.append([self._new_id(), 0])
                deltas.append({"tool_calls": [{"index": index, "id": self._calls[index][0], "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            new = call.arguments[self._calls[index][1]:]
            self._calls[index][1] = len(call.arguments)
            if new:
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": new}}]})
        return deltas


def join_deltas(deltas: Sequence[dict], parsing: ChatParsing) -> dict:
    """The ``message`` one choice's ``deltas`` add up to."""
    content = "".join(d.get("content", "") for d in deltas)
    message = {"role": "assistant", "content": content if content or not parsing.active else None}
    if parsing.reasoning is not None and parsing.include_reasoning:
        message["reasoning"] = "".join(d.get("reasoning", "") for d in deltas) or None
    calls: list[dict] = []
    for delta in deltas:
        for part in delta.get("tool_calls", ()):
            if part["index"] == len(calls):
                calls.append({"id": part["id"], "type": "function",
                              "function": {"name": part["function"]["name"], "arguments": ""}})
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    if calls:
        message["tool_calls"] = calls
    return message


def reasoning_token_count(parsing: ChatParsing, token_ids: Sequence[int], decode: Callable[[list[int]], str]) -> int:
    """Tokens of the reasoning, its tags excluded (vLLM's ``reasoning_tokens``): those whose text overlaps the
    reasoning's characters (0 without a reasoning parser or reasoning)."""
    if parsing.reasoning is None:
        return 0
    span = parsing.reasoning().span(decode(list(token_ids)))
    if span is None or span[0] == span[1]:
        return 0
    ends = lambda k: len(decode(list(token_ids[:k])))  # noqa: E731 - the characters of the first k tokens
    first = _first(len(token_ids), lambda k: ends(k + 1) > span[0])
    past = _first(len(token_ids), lambda k: ends(k) >= span[1])
    return max(0, past - first)


def _first(n: int, holds: Callable[[int], bool]) -> int:
    """The least k in [0, n] for which ``holds`` (monotone: false, then true), n when none."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
