"""Issue 27, items 1-2, through the official ``openai`` client against real ``jaxllm serve`` processes on
stories260K: tools in chat completions (enforced ``required`` and named choices whose arguments validate against
the tool's schema, greedy and over many seeds; ``auto`` read by every ``--tool-call-parser`` from real model
output, forced with a ``structured_outputs`` regex; streamed calls that join to the unstreamed ones; a history
with tool calls and results rendered), and the reasoning split (``--reasoning-parser qwen3``).

The main server runs ``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`` with
``TEMPLATE``, a small chat template that renders tools, tool calls and tool results, and opens a think block when
``enable_thinking`` is set. Each other parser gets a server of its own, one at a time (``parser_server``).
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from jaxllm.tokenizer import load_tokenizer
from tests.server_process import ENGINE, Server, engine_flags

openai = pytest.importorskip("openai")

# Line breaks are written as expressions: HF's template settings (trim_blocks) drop one that follows a tag.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}tool {{ m.tool_call_id }}: {{ m.content }}"
    "{% elif m.tool_calls %}{{ m.role }}:{% for c in m.tool_calls %} <tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.role }}: {{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking %}<think>{% endif %}{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} of a place", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = range(4)
N = 4  # choices per seeded request: 16 seeded draws in all


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools_template") / "template.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(stories_dir, template_file):
    server = Server(stories_dir, *engine_flags(), "--chat-template", str(template_file), "--served-model-name",
                    "stories", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser",
                    "qwen3", log=template_file.parent / "server.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    return load_tokenizer(stories_dir)


def chat(client, **body):
    return client.chat.completions.create(model="stories", messages=body.pop("messages", USER), **body)


def forced(text: str) -> dict:
    """``extra_body`` making the model write exactly ``text``."""
    return {"structured_outputs": {"regex": "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)}}


def hermes_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def joined_stream(chunks):
    """(content, reasoning, calls, finish reasons, first delta of each call) of a one-choice stream."""
    content, reasoning, calls, finishes, firsts = "", "", [], [], []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            for part in delta.tool_calls or []:
                if part.index == len(calls):
                    firsts.append(part)
                    calls.append({"id": part.id, "name": part.function.name, "arguments": ""})
                calls[part.index]["arguments"] += part.function.arguments or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    return content, reasoning, calls, finishes, firsts


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


# ------------------------------------------------------------------ templates

def prompt_ids(response) -> list[int]:
    """The prompt's token ids, read from ``prompt_logprobs`` (the first, BOS, has no entry)."""
    return [1] + [int(next(iter(entry))) for entry in response.model_extra["prompt_logprobs"][1:]]


def test_tools_tool_calls_and_tool_results_reach_the_chat_template(client, tokenizer):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1,
                    extra_body={"prompt_logprobs": 0})
    want = ('<s>Tools: get_weather get_time\nuser: What is the weather in Paris?\nassistant: <tool_call>'
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>\n'
            'tool call_1: sunny\nassistant:')
    assert tokenizer.decode(prompt_ids(response), skip_special_tokens=False) == want


def test_chat_template_kwargs_reach_the_template(client, tokenizer):
    response = chat(client, max_tokens=1, extra_body={"prompt_logprobs": 0,
                                                      "chat_template_kwargs": {"enable_thinking": True}})
    assert tokenizer.decode(prompt_ids(response), skip_special_tokens=False).endswith("assistant:<think>")


def test_issue55_reasoning_effort_reaches_the_chat_template(client, tokenizer):
    """vLLM's reasoning_effort: enable_thinking unless "none"; the request's chat_template_kwargs win."""
    def prompt(**body):
        response = chat(client, max_tokens=1, extra_body={"prompt_logprobs": 0, **body})
        return tokenizer.decode(prompt_ids(response), skip_special_tokens=False)

    assert prompt(reasoning_effort="low").endswith("assistant:<think>")
    assert prompt(reasoning_effort="none").endswith("assistant:")
    assert prompt(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}).endswith("assistant:")


# ------------------------------------------------------------------ enforced choices

def assert_valid_calls(message, names=tuple(SCHEMAS)):
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.function.name in names and call.id.startswith("chatcmpl-tool-") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature, seeds", [(0, [None]), (1, SEEDS)], ids=["greedy", "seeded"])
def test_named_tool_choice_returns_a_call_whose_arguments_validate(client, temperature, seeds):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in seeds:
        response = chat(client, tools=TOOLS, tool_choice=named, temperature=temperature, seed=seed,
                        n=1 if seed is None else N)
        for choice in response.choices:
            assert_valid_calls(choice.message, names=("get_weather",))
            assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "stop"


@pytest.mark.parametrize("temperature, seeds", [(0, [None]), (1, SEEDS)], ids=["greedy", "seeded"])
def test_required_tool_choice_returns_calls_whose_arguments_validate(client, temperature, seeds):
    names = set()
    for seed in seeds:
        response = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                        temperature=temperature, seed=seed, n=1 if seed is None else N)
        for choice in response.choices:
            assert_valid_calls(choice.message)
            assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"
            names.add(choice.message.tool_calls[0].function.name)
    assert temperature == 0 or names == set(SCHEMAS)  # both tools are drawn


def test_a_required_call_cut_by_max_tokens_is_left_as_content_finished_by_length(client):
    # stories260K never closes a parallel call array: it goes on adding calls.
    response = chat(client, tools=TOOLS, tool_choice="required", max_tokens=30, temperature=0)
    (choice,) = response.choices
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith('[{"name":"get_')


@pytest.mark.parametrize("tool_choice, finish", [
    ({"type": "function", "function": {"name": "get_weather"}}, "stop"), ("required", "tool_calls")],
    ids=["named", "required"])
def test_streamed_enforced_call_sends_id_and_name_first_then_arguments_joining_to_the_unstreamed(
        client, tool_choice, finish):
    body = dict(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, temperature=1, seed=7)
    whole = chat(client, **body)
    content, _, calls, finishes, firsts = joined_stream(chat(client, stream=True, **body))
    assert content == "" and finishes == [finish]
    assert firsts[0].id and firsts[0].function.name and firsts[0].function.arguments == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]


# ------------------------------------------------------------------ auto

PARIS = ("get_weather", {"city": "Paris", "days": 2})
CET = ("get_time", {"zone": "CET"})
HERMES_TEXT = f"Sure. {hermes_call(*PARIS)}\n{hermes_call(*CET)}"


def test_auto_hermes_reads_several_calls_from_model_text_and_keeps_the_text_around(client):
    response = chat(client, tools=TOOLS, temperature=0, max_tokens=300, extra_body=forced(HERMES_TEXT))
    (choice,) = response.choices
    assert calls_of(choice.message) == [PARIS, CET]
    assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"


def test_auto_streamed_tool_call_deltas_join_to_the_unstreamed_calls(client):
    body = dict(tools=TOOLS, temperature=0, max_tokens=300, extra_body=forced(HERMES_TEXT))
    whole = chat(client, **body).choices[0]
    content, _, calls, finishes, firsts = joined_stream(chat(client, stream=True, **body))
    assert content == whole.message.content and finishes == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(f.id and f.type == "function" and f.function.name for f in firsts)


def test_auto_malformed_call_stays_content(client):
    text = '<tool_call>{"name": get_weather}</tool_call>'
    response = chat(client, tools=TOOLS, temperature=0, max_tokens=60, extra_body=forced(text))
    assert response.choices[0].message.content == text and not response.choices[0].message.tool_calls
    assert response.choices[0].finish_reason == "stop"


def test_tool_choice_none_leaves_the_text_alone(client):
    response = chat(client, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=300,
                    extra_body=forced(HERMES_TEXT))
    assert response.choices[0].message.content == HERMES_TEXT and not response.choices[0].message.tool_calls


PARSER_TEXTS = {
    "llama3_json": ("<|python_tag|>" + json.dumps({"name": PARIS[0], "parameters": PARIS[1]}) + "; "
                    + json.dumps({"name": CET[0], "parameters": CET[1]}), None),
    "mistral": ("Here. [TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in (PARIS, CET)]), "Here."),
    "pythonic": ('[get_weather(city="Paris", days=2), get_time(zone="CET")] done', " done"),
}


@pytest.fixture(scope="module", params=sorted(PARSER_TEXTS))
def parser_server(request, stories_dir, template_file):
    server = Server(stories_dir, *engine_flags(), "--chat-template", str(template_file), "--served-model-name",
                    "stories", "--enable-auto-tool-choice", "--tool-call-parser", request.param,
                    log=template_file.parent / f"{request.param}.log").start()
    try:
        yield request.param, server.openai_client()
    finally:
        server.stop()


def test_auto_every_parser_reads_the_calls_from_model_text(parser_server):
    name, client = parser_server
    text, content = PARSER_TEXTS[name]
    body = dict(tools=TOOLS, temperature=0, max_tokens=300, extra_body=forced(text))
    (choice,) = chat(client, **body).choices
    assert calls_of(choice.message) == [PARIS, CET]
    assert choice.message.content == content and choice.finish_reason == "tool_calls"
    streamed, _, calls, finishes, _ = joined_stream(chat(client, stream=True, **body))
    assert (streamed or None, finishes) == (content, ["tool_calls"])
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [PARIS, CET]


ID_SCHEMES = {"mistral": r"[A-Za-z0-9]{9}", "llama3_json": r"chatcmpl-tool-[0-9a-f]{32}",
              "pythonic": r"chatcmpl-tool-[0-9a-f]{32}"}


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_tool_call_ids_follow_the_parser_whatever_the_tool_choice(parser_server, choice):
    """Issue 55, fault 4 (vLLM #47734): ``required`` and named choices gave ``chatcmpl-tool-`` ids under
    ``--tool-call-parser mistral``, which Mistral's templates refuse in the next turn; streamed and not."""
    name, client = parser_server
    if choice == "auto":
        body = dict(extra_body=forced(PARSER_TEXTS[name][0]))
    else:
        # stories260K never closes a parallel call array: one call.
        body = dict(parallel_tool_calls=False, tool_choice="required" if choice == "required" else
                    {"type": "function", "function": {"name": "get_time"}})
    body = dict(tools=TOOLS, temperature=0, max_tokens=300, **body)
    (response,) = chat(client, **body).choices
    _, _, streamed, _, _ = joined_stream(chat(client, stream=True, **body))
    ids = [c.id for c in response.message.tool_calls] + [c["id"] for c in streamed]
    assert ids and all(re.fullmatch(ID_SCHEMES[name], i) for i in ids), ids


# ------------------------------------------------------------------ refusals

def refusal(client, **body) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=4, **body)
    return info.value


@pytest.mark.parametrize("body, param, words", [
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_moon"}}), "tool_choice",
     "'get_moon'"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
          tool_choice="required"), "tools", "objekt"),
    (dict(extra_body={"chat_template_kwargs": {"messages": []}}), "chat_template_kwargs", "messages"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "paramters": {}}}]), "tools", "paramters"),
], ids=["choice-without-tools", "unknown-function", "with-response-format", "bad-schema", "template-clash",
        "unknown-tool-field"])
def test_tool_requests_that_cannot_be_honoured_are_refused_naming_the_field(client, body, param, words):
    error = refusal(client, **body)
    assert error.body["param"] == param and words in error.body["message"], error.body


def test_auto_without_enable_auto_tool_choice_is_refused_naming_the_flag(stories_dir, template_file):
    server = Server(stories_dir, *engine_flags(), "--chat-template", str(template_file), "--served-model-name",
                    "stories", log=template_file.parent / "plain.log").start()
    try:
        plain = server.openai_client()
        for choice in ("auto", None):  # tools without a tool_choice mean "auto", as OpenAI's
            error = refusal(plain, tools=TOOLS, tool_choice=choice)
            assert error.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in error.body["message"]
        assert chat(plain, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0].message.tool_calls
    finally:
        server.stop()


def test_serve_refuses_enable_auto_tool_choice_without_a_parser(capsys):
    from jaxllm.entrypoints.openai.api_server import main

    assert main(["--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err


# ------------------------------------------------------------------ reasoning

THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


def test_a_prompt_that_opens_a_think_block_makes_the_text_reasoning_and_counts_its_tokens(client):
    response = chat(client, max_tokens=20, temperature=0, extra_body=THINKING)
    message = response.choices[0].message
    assert message.content is None and len(message.reasoning) > 20
    assert response.usage.completion_tokens_details.reasoning_tokens == response.usage.completion_tokens == 20
    content, reasoning, _, _, _ = joined_stream(chat(client, max_tokens=20, temperature=0, extra_body=THINKING,
                                                     stream=True))
    assert (content, reasoning) == ("", message.reasoning)


def test_reasoning_and_answer_are_split_on_real_output_streamed_or_not(client, tokenizer):
    text = "<think>It is sunny.</think>Take a hat."
    body = dict(max_tokens=60, temperature=0, logprobs=True, extra_body={**forced(text),
                                                                         "return_tokens_as_token_ids": True})
    response = chat(client, **body)
    message = response.choices[0].message
    assert (message.reasoning, message.content) == ("It is sunny.", "Take a hat.")
    ids = [int(t.token.split(":")[1]) for t in response.choices[0].logprobs.content]
    ended = next(k for k in range(len(ids) + 1) if "</think>" in tokenizer.decode(ids[:k]))
    # Issue 55, fault 6: the tokens holding "It is sunny.", not the tags' (vLLM counts the reasoning only).
    ends = [len(tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]
    start, end = len("<think>"), len("<think>It is sunny.")
    thinking = sum(1 for k in range(len(ids)) if ends[k] < end and ends[k + 1] > start)
    assert response.usage.completion_tokens_details.reasoning_tokens == thinking < ended - 2
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **body))
    content, reasoning, _, _, _ = joined_stream(chunks)
    assert (reasoning, content) == ("It is sunny.", "Take a hat.")
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking


def test_tool_calls_are_read_from_the_answer_after_the_reasoning(client):
    text = f"<think>Paris, then.</think>{hermes_call(*PARIS)}"
    response = chat(client, tools=TOOLS, temperature=0, max_tokens=300, extra_body=forced(text))
    message = response.choices[0].message
    assert message.reasoning == "Paris, then." and calls_of(message) == [PARIS] and message.content is None


def test_include_reasoning_false_drops_the_reasoning(client):
    response = chat(client, max_tokens=8, temperature=0, extra_body={**THINKING, "include_reasoning": False})
    message = response.choices[0].message
    assert "reasoning" not in (message.model_extra or {}) and message.content is None


def test_enable_thinking_false_leaves_the_text_all_answer(client):
    response = chat(client, max_tokens=8, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = response.choices[0].message
    assert message.reasoning is None and len(message.content) > 5
    assert response.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_constraint_waits_for_the_end_of_a_reasoning_the_prompt_opened(client):
    body = dict(max_tokens=12, temperature=0)
    free = chat(client, extra_body=THINKING, **body).choices[0]
    constrained = chat(client, extra_body={**THINKING, "structured_outputs": {"regex": "[0-9]+"}}, **body).choices[0]
    # The reasoning runs as it would unconstrained (stories260K never closes it within 12 tokens).
    assert constrained.message.reasoning == free.message.reasoning and constrained.finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, extra_body={**THINKING, "structured_outputs": {"grammar": 'start: "x"'}}, **body)
    assert info.value.body["param"] == "structured_outputs" and "reasoning" in info.value.body["message"]


# ------------------------------------------------------------------ tokenize and render

HISTORY = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
RENDERED = ('<s>Tools: get_weather get_time\nuser: What is the weather in Paris?\nassistant: <tool_call>'
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>\n'
            'tool call_1: sunny\nassistant:<think>')


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": "stories", **body}, timeout=300)


def test_tokenize_renders_tools_and_chat_template_kwargs_as_the_chat_route_does(server, client, tokenizer):
    kwargs = {"enable_thinking": True}
    tokens = post(server, "/tokenize", messages=HISTORY, tools=TOOLS, chat_template_kwargs=kwargs).json()["tokens"]
    response = chat(client, messages=HISTORY, tools=TOOLS, tool_choice="none", max_tokens=1,
                    extra_body={"prompt_logprobs": 0, "chat_template_kwargs": kwargs})
    assert tokens == prompt_ids(response)
    assert tokenizer.decode(tokens, skip_special_tokens=False) == RENDERED


@pytest.mark.parametrize("body, param", [
    (dict(prompt="Hi", tools=TOOLS), "tools"),
    (dict(prompt="Hi", chat_template_kwargs={"enable_thinking": True}), "chat_template_kwargs"),
    (dict(messages=USER, chat_template_kwargs={"tools": []}), "chat_template_kwargs"),
    (dict(messages=USER, tools=[{"type": "function", "function": {"name": ""}}]), "tools"),
], ids=["tools-with-a-prompt", "kwargs-with-a-prompt", "kwargs-setting-tools", "a-nameless-tool"])
def test_tokenize_refuses_chat_fields_it_cannot_honour_naming_them(server, body, param):
    response = post(server, "/tokenize", **body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_chat_render_returns_the_chat_routes_prompt_and_sampling_params(server, client):
    body = dict(messages=HISTORY, tools=TOOLS, tool_choice="none", chat_template_kwargs={"enable_thinking": True},
                temperature=0.5, seed=7, max_tokens=3, stop=["\n"], cache_salt="tenant-a")
    rendered = post(server, "/v1/chat/completions/render", **body).json()
    response = chat(client, extra_body={"prompt_logprobs": 0, "chat_template_kwargs": body.pop("chat_template_kwargs")},
                    **{k: v for k, v in body.items() if k != "cache_salt"})
    assert rendered["token_ids"] == prompt_ids(response)
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["model"] == "stories"
    assert (rendered["features"], rendered["stream"], rendered["cache_salt"], rendered["priority"]) == (
        None, False, "tenant-a", 0)
    params = rendered["sampling_params"]
    assert (params["temperature"], params["seed"], params["max_tokens"], params["stop"], params["n"]) == (
        0.5, 7, 3, ["\n"], 1)


def test_completion_render_returns_one_generate_request_per_prompt(server, tokenizer):
    rendered = post(server, "/v1/completions/render", prompt=["Once upon a time", "One day"], top_k=3).json()
    assert [r["token_ids"] for r in rendered] == [tokenizer.encode("Once upon a time"), tokenizer.encode("One day")]
    assert post(server, "/v1/completions/render", prompt=[1, 5, 9]).json()[0]["token_ids"] == [1, 5, 9]
    assert [(r["sampling_params"]["max_tokens"], r["sampling_params"]["top_k"]) for r in rendered] == [(16, 3)] * 2
    assert all(r["request_id"].startswith("cmpl-") for r in rendered)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions/render", dict(prompt="Hi", bogus=1), "bogus"),
    ("/v1/completions/render", dict(prompt="Hi", max_tokens=600), "max_tokens"),
    ("/v1/completions/render", dict(prompt="Hi", priority=1), "priority"),
    ("/v1/chat/completions/render", dict(messages=USER, tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions/render", dict(messages=USER, stream_options={"include_usage": True}), "stream_options"),
], ids=["unknown-field", "too-long", "priority-under-fcfs", "required-without-tools", "stream-options-alone"])
def test_render_refuses_what_the_generation_route_refuses_naming_the_field(server, path, body, param):
    response = post(server, path, **body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


# ------------------------------------------------------------------ LLM.chat

@pytest.fixture(scope="module")
def llm(stories_dir):
    from jaxllm import LLM

    return LLM(stories_dir, **ENGINE)


def test_llm_chat_renders_tools_and_chat_template_kwargs_as_the_server_does(llm, client, tokenizer):
    from jaxllm import SamplingParams

    kwargs = {"enable_thinking": True}
    out = llm.chat(HISTORY, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), chat_template=TEMPLATE,
                   tools=TOOLS, chat_template_kwargs=kwargs, use_tqdm=False)[0]
    response = chat(client, messages=HISTORY, tools=TOOLS, tool_choice="none", max_tokens=1,
                    extra_body={"prompt_logprobs": 0, "chat_template_kwargs": kwargs})
    assert out.prompt_token_ids == prompt_ids(response)
    assert tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) == RENDERED
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("messages, kwargs, field", [
    (USER, {"tools": []}, "chat_template_kwargs"),
    (USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{zone"}}]}], None, "messages"),
], ids=["kwargs-setting-tools", "arguments-not-json"])
def test_llm_chat_refuses_what_the_server_refuses_naming_the_argument(llm, messages, kwargs, field):
    from jaxllm.tokenizer import ChatInputError

    with pytest.raises(ChatInputError) as info:
        llm.chat(messages, chat_template=TEMPLATE, tools=TOOLS, chat_template_kwargs=kwargs, use_tqdm=False)
    assert info.value.field == field
