"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` over the chat machinery (vLLM's ``OpenAIServingResponses``).

A request becomes a chat request; its output is read into ``reasoning``, ``message`` and ``function_call``
items, streamed as OpenAI's events (``response.created`` ... ``response.completed``, status ``incomplete``
when ``max_output_tokens`` cut it); the unstreamed response is built from the same events. The last
``STORE_SIZE`` stored responses are kept in memory for ``previous_response_id``.
"""

from __future__ import annotations

import collections
import copy
import time
import uuid
from typing import Any, AsyncIterator, Optional

import msgspec
import pydantic

from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest
from jaxllm.entrypoints.openai.serving import APIError, OpenAIServing, _output_rows, check_fields, merge, stream_error

STORE_SIZE = 1024
# Chat request fields as a Responses request names them, in the errors the chat checks raise.
PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text",
          "reasoning_effort": "reasoning", "truncate_prompt_tokens": "truncation"}
# The include item that asks for output_text logprobs.
LOGPROBS = "message.output_text.logprobs"
# Fields a Responses request passes to its chat request as they are.
SAME_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "seed", "stop", "stop_token_ids", "logit_bias", "ignore_eos",
               "skip_special_tokens", "include_stop_str_in_output", "priority", "cache_salt", "structured_outputs",
               "chat_template_kwargs", "include_reasoning", "parallel_tool_calls", "stream")
TEXT_EVENTS = {"reasoning": "reasoning_text", "content": "output_text"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one response (``items``, OpenAI's shapes), built from a chat choice's deltas, and the
    stream events that build them (without ``sequence_number``).
    """

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: Optional[str] = None  # the kind of the last item while it is open
        self._calls: dict[int, int] = {}  # chat call index -> item index

    def feed(self, delta: dict, logprobs: Optional[list[dict]] = None) -> list[dict]:
        """The events of one delta (``{"reasoning"}``, ``{"content"}`` or ``{"tool_calls": [one part]}``);
        ``logprobs``: the entries of the tokens the delta came with, kept by output text."""
        if "tool_calls" in delta:
            return self._call(delta["tool_calls"][0])
        kind = "reasoning" if "reasoning" in delta else "content"
        events = [] if self._open == kind else self.close() + self._add(kind)
        index = len(self.items) - 1
        item = self.items[index]
        item["content"][0]["text"] += delta[kind]
        event = {"type": f"response.{TEXT_EVENTS[kind]}.delta", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "delta": delta[kind]}
        if kind != "content":
            return events + [event]
        item["content"][0]["logprobs"] += logprobs or []
        return events + [{**event, "logprobs": logprobs or []}]

    def _add(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        self._open = kind
        index = len(self.items) - 1
        events = [{"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(item)},
                  {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                   "content_index": 0, "part": dict(part)}]
        item["content"].append(part)
        return events

    def _call(self, part: dict) -> list[dict]:
        events = []
        if "id" in part:
            events = self.close()
            self.items.append({"type": "function_call", "id": _id("fc"), "call_id": part["id"],
                               "name": part["function"]["name"], "arguments": "", "status": "in_progress"})
            self._open, self._calls[part["index"]] = "call", len(self.items) - 1
            events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                           "item": dict(self.items[-1])})
        index = self._calls[part["index"]]
        if part["function"]["arguments"]:
            self.items[index]["arguments"] += part["function"]["arguments"]
            events.append({"type": "response.function_call_arguments.delta", "item_id": self.items[index]["id"],
                           "output_index": index, "delta": part["function"]["arguments"]})
        return events

    def close(self, status: str = "completed") -> list[dict]:
        """The events that finish the open item (none when none is open), with ``status``."""
        if self._open is None:
            return []
        index, item = len(self.items) - 1, self.items[-1]
        item["status"] = status
        events = []
        if self._open == "call":
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            done = {"type": f"response.{TEXT_EVENTS[self._open]}.done", "item_id": item["id"], "output_index": index,
                    "content_index": 0, "text": part["text"]}
            events += [{**done, "logprobs": list(part["logprobs"])} if self._open == "content" else done,
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": dict(part)}]
        self._open = None
        return events + [{"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]


class OpenAIServingResponses:
    """The Responses API over ``serving`` (an ``OpenAIServing``), keeping ``store_size`` responses."""

    def __init__(self, serving: OpenAIServing, store_size: int = STORE_SIZE) -> None:
        self.serving = serving
        self.store_size = store_size
        self._store: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()

    def retrieve(self, response_id: str) -> dict:
        """A stored response. Raises: APIError 404 for an id not stored (or no longer)."""
        if response_id not in self._store:
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id", "not_found")
        return self._store[response_id][0]

    def prepare(self, request: ResponsesRequest):
        """Check and start a request; returns (the response skeleton, its conversation, the chat's start).

        Raises:
          APIError: 400 naming the Responses field; 404 for an unknown model or ``previous_response_id``.
        """
        self.serving.check_model(request.model)
        check_fields("responses", request)
        conversation = self._history(request.previous_response_id) + input_messages(request.input)
        system = [{"role": "system", "content": request.instructions}] if request.instructions is not None else []
        try:
            chat = chat_request(request, system + conversation, self.serving.max_model_len)
        except pydantic.ValidationError as e:
            raise APIError(400, f"input: {e.errors()[0]['msg']}", "input") from None
        try:
            # Every step's output: reasoning, text and tool-call parts each take the logprobs of their own steps.
            started = self.serving.prepare_chat(chat, set_output_kind=False)
        except APIError as e:
            message = e.message
            for chat_name, name in PARAMS.items():
                message = message.replace(chat_name, name)
            raise APIError(e.status, message, PARAMS.get(e.param, e.param), e.code) from None
        return self._skeleton(request, started[0]), conversation, started

    def _history(self, response_id: Optional[str]) -> list[dict]:
        """The conversation a stored response ended (none without an id). Raises: APIError 404, not stored."""
        if response_id is None:
            return []
        if response_id not in self._store:
            raise APIError(404, f"previous_response_id '{response_id}' is not stored (store: true keeps the last "
                                f"{self.store_size} responses)", "previous_response_id", "not_found")
        return list(self._store[response_id][1])

    def _skeleton(self, request: ResponsesRequest, chat_id: str) -> dict:
        fmt = request.text.format if request.text is not None and request.text.format is not None else None
        return {
            "id": "resp_" + chat_id.removeprefix("chatcmpl-"), "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": self.serving.models.model_name(request.model), "output": [],
            "error": None, "incomplete_details": None, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "temperature": request.temperature,
            "top_p": request.top_p, "parallel_tool_calls": request.parallel_tool_calls,
            "tool_choice": (request.tool_choice.model_dump() if hasattr(request.tool_choice, "model_dump")
                            else request.tool_choice or "auto"),
            "tools": [t.model_dump() for t in request.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "previous_response_id": request.previous_response_id, "store": request.store,
            "metadata": request.metadata or {}, "truncation": request.truncation or "disabled", "usage": None,
            "background": False, "top_logprobs": request.top_logprobs,
            "reasoning": request.reasoning.model_dump() if request.reasoning is not None else None,
            "user": request.model_extra.get("user"), "service_tier": request.model_extra.get("service_tier", "auto"),
            "max_tool_calls": request.model_extra.get("max_tool_calls"),
        }

    async def create(self, request: ResponsesRequest, prepared) -> dict:
        """The whole response of a non-streaming request (stored when ``store``)."""
        body = None
        async for event in self._events(request, prepared):
            body = event.get("response", body)
        return body

    async def stream(self, request: ResponsesRequest, prepared) -> AsyncIterator[bytes]:
        """The server-sent events of a streaming request, each with its ``sequence_number``."""
        try:
            number = 0
            async for event in self._events(request, prepared):
                yield b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(
                    {**event, "sequence_number": number}) + b"\n\n"
                number += 1
        except Exception as e:
            yield b"event: error\ndata: " + msgspec.json.encode({"type": "error", **stream_error(e)["error"]}) + b"\n\n"

    async def _events(self, request: ResponsesRequest, prepared) -> AsyncIterator[dict]:
        skeleton, conversation, (_, _, ids, streams, parsing, params) = prepared
        yield {"type": "response.created", "response": copy.deepcopy(skeleton)}
        yield {"type": "response.in_progress", "response": copy.deepcopy(skeleton)}
        reader, items, text, final = parsing.choice(), OutputItems(), "", None
        with_logprobs = LOGPROBS in (request.include or [])
        async for _, final in merge(streams):
            choice = final.outputs[0]
            text += choice.delta_text
            logprobs = None
            if with_logprobs and choice.delta_token_ids:
                logprobs = self.serving._chat_logprobs(_output_rows(choice, len(choice.delta_token_ids)),
                                                       request.top_logprobs or 0)["content"]
            for delta in reader.update(text, final=choice.finish_reason is not None):
                for event in items.feed(delta, logprobs):
                    yield event
                if "content" in delta:
                    logprobs = None  # a step's tokens go with its first output text
        cut = choice.finish_reason == "length"
        for event in items.close("incomplete" if cut else "completed"):
            yield event
        output_tokens = len(choice.token_ids)
        usage = {"input_tokens": len(ids), "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                 "output_tokens": output_tokens, "total_tokens": len(ids) + output_tokens,
                 "output_tokens_details": {"reasoning_tokens": self.serving.reasoning_tokens(parsing,
                                                                                             choice.token_ids, params)}}
        body = {**skeleton, "status": "incomplete" if cut else "completed", "output": items.items,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "usage": usage}
        if request.store:
            self._keep(body, conversation + output_messages(items.items))
        yield {"type": "response.completed", "response": body}

    def _keep(self, body: dict, conversation: list[dict]) -> None:
        self._store[body["id"]] = (body, conversation)
        while len(self._store) > self.store_size:
            self._store.popitem(last=False)


def chat_request(request: ResponsesRequest, messages: list[dict], max_model_len: int) -> ChatCompletionRequest:
    """The chat request a Responses request runs as (``truncation: "auto"`` keeps the prompt's last
    ``max_model_len - max(max_output_tokens, 1)`` tokens)."""
    choice = request.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    fmt = request.text.format if request.text is not None else None
    response_format = None
    if fmt is not None:
        response_format = {"type": fmt.type}
        if fmt.type == "json_schema":
            response_format["json_schema"] = {"name": fmt.name, "description": fmt.description,
                                              "schema": fmt.json_schema, "strict": fmt.strict}
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
             for t in request.tools] if request.tools else None
    with_logprobs = LOGPROBS in (request.include or [])
    effort = request.reasoning.effort if request.reasoning is not None else None
    truncate = max_model_len - max(request.max_output_tokens or 1, 1) if request.truncation == "auto" else None
    return ChatCompletionRequest(
        messages=messages, max_tokens=request.max_output_tokens, tools=tools, tool_choice=choice,
        response_format=response_format, logprobs=with_logprobs,
        top_logprobs=request.top_logprobs if with_logprobs else None, reasoning_effort=effort,
        truncate_prompt_tokens=truncate, **{name: getattr(request, name) for name in SAME_FIELDS})


def input_messages(items: Any) -> list[dict]:
    """Chat messages of a Responses ``input`` (``developer`` is ``system``; function calls join the assistant's
    ``tool_calls``; outputs are ``tool`` messages; ``reasoning`` items dropped).

    Raises:
      APIError: 400 naming ``input``.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        try:
            if kind == "message":
                role = {"developer": "system"}.get(item["role"], item["role"])
                messages.append({"role": role, "content": _text(item["content"])})
            elif kind == "function_call":
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": None})
                messages[-1].setdefault("tool_calls", []).append(call)
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
            elif kind != "reasoning":
                raise APIError(400, f"input[{i}].type={kind!r} is not supported: give message, function_call, "
                                    "function_call_output or reasoning items", "input")
        except (KeyError, TypeError) as e:
            raise APIError(400, f"input[{i}] ({kind}) lacks or mistypes a field: {e}", "input") from None
    return messages


def _text(content: Any) -> str:
    """The text of a string or of text parts (``input_text``, ``output_text``), joined by newlines as vLLM joins
    a chat message's text parts.

    Raises:
      TypeError: a part that is not text.
    """
    if isinstance(content, str):
        return content
    if any(not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") for p in content):
        raise TypeError("only text content parts (input_text, output_text) are supported")
    return "\n".join(p["text"] for p in content)


def output_messages(items: list[dict]) -> list[dict]:
    """The assistant messages a response's output items add to its conversation (reasoning dropped)."""
    messages = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": item["content"][0]["text"]})
        elif item["type"] == "function_call":
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return messages
