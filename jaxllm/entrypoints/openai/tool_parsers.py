"""Tool-call parsers (vLLM's ``--tool-call-parser``): the calls a model wrote in its text, and the text around them.

A block that may hold calls is held back until it closes, then read as calls if it decodes, else content, so
a stream's deltas join to what the whole text gives. Arguments are JSON text of an object.
``RequiredParser`` and ``NamedParser`` read the enforced tool choices' output.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import re
import string
import uuid
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    """One call: the function's ``name`` and its ``arguments`` (JSON text of an object)."""

    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class Parsed:
    """What a parser decided so far: the ``content`` (text outside calls) and the ``calls``, in order."""

    content: str
    calls: list[ParsedCall]


class ToolParser:
    """A parser of calls between start markers (``starts``) and ``_end``, decoded by ``_decode``; ``separator`` is a
    regex of the text between calls that is not content.
    """

    starts: tuple[str, ...] = ()
    separator = re.compile(r"\s*")
    # A start marker that is ordinary text (``{``, ``[``): a block is a call only when it names a declared tool.
    bare = False
    # Whether the generation keeps special tokens (vLLM's adjust_request): the markers are special tokens in
    # the models these formats come from (Qwen's <tool_call>, Mistral's [TOOL_CALLS]).
    keeps_special_tokens = False

    def __init__(self, tool_names: Optional[frozenset[str]] = None) -> None:
        """``tool_names``: the request's declared functions (None: any name is a call's)."""
        self.tool_names = tool_names

    @staticmethod
    def new_id() -> str:
        """A new call id (vLLM's spelling)."""
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def scan(self, text: str, final: bool) -> Parsed:
        """The pieces of ``text`` decided so far (``final``: the text is whole, so nothing is held back)."""
        pieces: list[Any] = []
        pos = 0
        while (start := self._next_start(text, pos)) is not None:
            pieces.append(text[pos:start])
            end = self._end(text, start)
            if end is None and not final:
                return _join(pieces, self.separator)
            end = len(text) if end is None else end
            calls = self._decode(text[start:end])
            if calls is not None and self.bare and self.tool_names is not None and \
                    any(c.name not in self.tool_names for c in calls):
                calls = None
            pieces.extend(calls) if calls is not None else pieces.append(text[start:end])
            pos = end
        pieces.append(text[pos:len(text) - (0 if final else self._partial_start(text[pos:]))])
        return _join(pieces, self.separator)

    def _next_start(self, text: str, pos: int) -> Optional[int]:
        found = [i for i in (text.find(s, pos) for s in self.starts) if i >= 0]
        return min(found) if found else None

    def _partial_start(self, tail: str) -> int:
        """Length of the longest end of ``tail`` that begins a start marker (held back: it may become one)."""
        return max((k for s in self.starts for k in range(1, len(s)) if tail.endswith(s[:k])), default=0)

    def _end(self, text: str, start: int) -> Optional[int]:
        """Where the block at ``start`` ends; None while it is still open."""
        raise NotImplementedError

    def _decode(self, block: str) -> Optional[list[ParsedCall]]:
        """The calls in a closed block (or an open one at the end of the text); None: the block is content."""
        raise NotImplementedError


def _join(pieces: list[Any], separator: re.Pattern) -> Parsed:
    calls = [p for p in pieces if isinstance(p, ParsedCall)]
    content = []
    for i, piece in enumerate(pieces):
        between_calls = 0 < i < len(pieces) - 1 and isinstance(pieces[i - 1], ParsedCall) and isinstance(
            pieces[i + 1], ParsedCall)
        if isinstance(piece, str) and not (between_calls and separator.fullmatch(piece)):
            content.append(piece)
    return Parsed("".join(content), calls)


def strip_separators(content: str, separator: re.Pattern) -> str:
    """``content`` without the separator characters it ends with."""
    end = len(content)
    while end > 0 and separator.fullmatch(content[end - 1]):
        end -= 1
    return content[:end]


def matching_close(text: str, start: int, quotes: str = '"') -> Optional[int]:
    """The index after the bracket closing ``text[start]``, skipping quoted strings; None when not closed."""
    depth, quote, escaped = 0, None, False
    for i in range(start, len(text)):
        ch = text[i]
        if quote is not None:
            escaped, quote = (not escaped and ch == "\\"), (None if ch == quote and not escaped else quote)
        elif ch in quotes:
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def call_from_json(value: Any, keys: tuple[str, ...] = ("arguments", "parameters"),
                   need_arguments: bool = False) -> Optional[ParsedCall]:
    """A call from a decoded ``{"name", "arguments"}`` (arguments under the first of ``keys``; ``need_arguments``:
    none of ``keys`` is no call, else ``{}``); None if not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    if need_arguments and not any(k in value for k in keys):
        return None
    arguments = next((value[k] for k in keys if k in value), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _calls_from_array(text: str) -> Optional[list[ParsedCall]]:
    """The calls of a JSON array of call objects; None unless every item is one."""
    items = _loads(text)
    if not isinstance(items, list):
        return None
    calls = [call_from_json(item) for item in items]
    return calls if calls and all(calls) else None


class HermesParser(ToolParser):
    """``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): ``<tool_call>{json}</tool_call>``; an open block at the end closes."""

    starts = ("<tool_call>",)
    close = "</tool_call>"
    keeps_special_tokens = True

    def _end(self, text: str, start: int) -> Optional[int]:
        at = text.find(self.close, start)
        return None if at < 0 else at + len(self.close)

    def _decode(self, block: str) -> Optional[list[ParsedCall]]:
        inner = block[len(self.starts[0]):]
        inner = inner[:-len(self.close)] if inner.endswith(self.close) else inner
        call = call_from_json(_loads(inner.strip()))
        return None if call is None else [call]


class Llama3JsonParser(ToolParser):
    """``llama3_json``: ``{"name", "parameters"}`` objects separated by ``;``, optionally after ``<|python_tag|>``;
    a call only with ``parameters``/``arguments`` and, where tools are declared, a declared name (vLLM's rule)."""

    tag = "<|python_tag|>"
    starts = (tag, "{")
    separator = re.compile(r"[\s;]*")
    keeps_special_tokens = True
    bare = True

    def _end(self, text: str, start: int) -> Optional[int]:
        brace = start
        if text.startswith(self.tag, start):
            brace = start + len(self.tag)
            while brace < len(text) and text[brace].isspace():
                brace += 1
            if brace == len(text):
                return None
            if text[brace] != "{":
                return brace
        return matching_close(text, brace)

    def _decode(self, block: str) -> Optional[list[ParsedCall]]:
        body = block[len(self.tag):] if block.startswith(self.tag) else block
        call = call_from_json(_loads(body.strip()), need_arguments=True)
        return None if call is None else [call]


class MistralParser(ToolParser):
    """``mistral``: ``[TOOL_CALLS]`` then a JSON array of calls, or ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+)."""

    starts = ("[TOOL_CALLS]",)
    args = "[ARGS]"
    keeps_special_tokens = True
    _name = re.compile(r"[\w.\-]+")

    @staticmethod
    def new_id() -> str:
        """Nine letters and digits: Mistral's chat templates refuse a tool call id of another form."""
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def _end(self, text: str, start: int) -> Optional[int]:
        i = start + len(self.starts[0])
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return None
        if text[i] == "[":
            return matching_close(text, i)
        name = self._name.match(text, i)
        if name is None:
            return i
        i = name.end()
        if self.args.startswith(text[i:i + len(self.args)]) and i + len(self.args) > len(text):
            return None  # the text ends inside [ARGS]
        i += len(self.args) if text.startswith(self.args, i) else 0
        if i == len(text):
            return None
        return matching_close(text, i) if text[i] == "{" else i

    def _decode(self, block: str) -> Optional[list[ParsedCall]]:
        body = block[len(self.starts[0]):].strip()
        if body.startswith("["):
            return _calls_from_array(body)
        name = self._name.match(body)
        if name is None:
            return None
        arguments = _loads(body[name.end():].removeprefix(self.args))
        return [ParsedCall(name[0], json.dumps(arguments, ensure_ascii=False))] if isinstance(arguments, dict) \
            else None


class PythonicParser(ToolParser):
    """``pythonic`` (Llama 3.2 and 4, ToolACE): ``[f(a="x"), g(b=1)]`` with Python-literal arguments; where tools
    are declared, a list naming another function is content."""

    starts = ("[",)
    separator = re.compile(r"[\s,]*")
    bare = True

    def _end(self, text: str, start: int) -> Optional[int]:
        return matching_close(text, start, quotes="\"'")

    def _decode(self, block: str) -> Optional[list[ParsedCall]]:
        try:
            tree = ast.parse(block, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            return [self._call(node) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError):
            return None

    @staticmethod
    def _call(node: ast.AST) -> ParsedCall:
        """Raises: ValueError, a node that is not ``name(key=literal, ...)``."""
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            raise ValueError("not a call with keyword arguments")
        name = ast.unparse(node.func)
        if not re.fullmatch(r"[\w.]+", name):
            raise ValueError(f"not a function name: {name}")
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


class RequiredParser(ToolParser):
    """The output of ``tool_choice: "required"``: the JSON array ``required_schema`` allows; otherwise content."""

    starts = ("[",)

    def _end(self, text: str, start: int) -> Optional[int]:
        return matching_close(text, start)

    def _decode(self, block: str) -> Optional[list[ParsedCall]]:
        return _calls_from_array(block)


class NamedParser(ToolParser):
    """The output of a named ``tool_choice``: the whole text is the arguments of one call to ``name``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def scan(self, text: str, final: bool) -> Parsed:
        return Parsed("", [ParsedCall(self.name, text)] if text else [])


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}


def parameters_schema(function: dict) -> dict:
    """A function's arguments schema (an object of any keys when it declares no ``parameters``)."""
    return function.get("parameters") or {"type": "object"}


def required_schema(functions: list[dict], parallel: bool) -> dict:
    """The schema ``tool_choice: "required"`` enforces (vLLM's): one or more calls, one unless ``parallel``."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                               "parameters": parameters_schema(f)},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    return {**schema, "maxItems": 1} if not parallel else schema
