"""Issue 27, item 3: ``/v1/responses`` through the official ``openai`` client (``responses.create`` and its
``responses.stream`` helper) against a real ``jaxllm serve`` on stories260K: text, the streamed event sequence,
function calls (named and required choices), input items with calls and their outputs, ``text.format``,
reasoning items, ``store`` and ``previous_response_id``.

The server runs ``--reasoning-parser qwen3`` with ``test_openai_tools.TEMPLATE``, whose generation prompt here
also opens a think block when the last message ends with ``/think`` (Qwen3's soft switch).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from jaxllm.entrypoints.openai.chat_outputs import ChatParsing
from jaxllm.entrypoints.openai.reasoning_parsers import Qwen3ReasoningParser
from jaxllm.entrypoints.openai.serving_responses import OutputItems
from jaxllm.entrypoints.openai.tool_parsers import HermesParser
from jaxllm.tokenizer import load_tokenizer
from tests.server_process import ENGINE, Server, engine_flags
from tests.test_openai_tools import SCHEMAS, TEMPLATE, WEATHER

openai = pytest.importorskip("openai")

RESPONSES_TEMPLATE = TEMPLATE.replace("{% if enable_thinking %}",
                                      "{% if enable_thinking or messages[-1].content.endswith('/think') %}")
TOOLS = [{"type": "function", "name": name, "description": f"{name} of a place", "parameters": schema}
         for name, schema in SCHEMAS.items()]
MOOD = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("responses_server")
    (folder / "template.jinja").write_text(RESPONSES_TEMPLATE)
    server = Server(stories_dir, *engine_flags(), "--chat-template", str(folder / "template.jinja"),
                    "--served-model-name", "stories", "--reasoning-parser", "qwen3",
                    log=folder / "server.log").start()
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


def create(client, **body):
    return client.responses.create(model="stories", **{"temperature": 0, **body})


def test_text_response_is_the_chat_answer_with_instructions_as_the_system_message(client):
    response = create(client, input="Tell me a story.", instructions="Be kind.", max_output_tokens=12)
    chat = client.chat.completions.create(model="stories", temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell me a story."}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content and len(response.output_text) > 10
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert response.instructions == "Be kind." and response.max_output_tokens == 12


def test_stream_sends_openais_event_sequence_and_joins_to_the_unstreamed_response(client):
    body = dict(input="Tell me a story.", max_output_tokens=12)
    whole = create(client, **body)
    with client.responses.stream(model="stories", temperature=0, **body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"}, "required"],
                         ids=["named", "required"])
def test_function_call_items_validate_streamed_or_not(client, tool_choice):
    body = dict(input="What is the weather in Paris?", tools=TOOLS, tool_choice=tool_choice,
                parallel_tool_calls=False)
    response = create(client, **body)
    (call,) = response.output
    assert call.type == "function_call" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    with client.responses.stream(model="stories", temperature=0, **body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert streamed == done.arguments == final.output[0].arguments == call.arguments
    assert final.output[0].name == call.name


def test_input_items_with_a_function_call_and_its_output_render_into_the_template(client, tokenizer):
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    response = create(client, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=4)
    want = ('<s>Tools: get_weather get_time\nuser: What is the weather in Paris?\nassistant: <tool_call>'
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>\n'
            'tool call_1: sunny\nassistant:')
    assert response.usage.input_tokens == len(tokenizer.encode(want, add_special_tokens=False))


def test_text_format_json_schema_constrains_the_output_as_chat_response_format_does(client):
    # stories260K may write the schema's white space for ever: the output is compared with chat's.
    response = create(client, input="How do you feel?", max_output_tokens=24, text={"format": {
        "type": "json_schema", "name": "mood", "schema": MOOD, "strict": True}})
    chat = client.chat.completions.create(
        model="stories", temperature=0, max_tokens=24, messages=[{"role": "user", "content": "How do you feel?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "mood", "schema": MOOD, "strict": True}})
    assert response.output_text == chat.choices[0].message.content and response.output_text.startswith("{")
    assert response.text.format.type == "json_schema"


def test_reasoning_is_a_reasoning_item_and_counts_its_tokens(client):
    response = create(client, input="Why is the sky blue? /think", max_output_tokens=10)
    (item,) = response.output
    assert item.type == "reasoning" and len(item.content[0].text) > 5
    assert response.usage.output_tokens_details.reasoning_tokens == 10
    with client.responses.stream(model="stories", temperature=0, input="Why is the sky blue? /think",
                                 max_output_tokens=10) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == item.content[0].text


def test_previous_response_id_continues_the_stored_conversation(client, tokenizer):
    first = create(client, input="Tell me a story.", max_output_tokens=6)
    second = create(client, input="Go on.", previous_response_id=first.id, max_output_tokens=6)
    rendered = (f"<s>user: Tell me a story.\nassistant: {first.output_text}\nuser: Go on.\nassistant:")
    assert second.usage.input_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_store_false_keeps_nothing(client):
    response = create(client, input="Tell me a story.", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as info:
        create(client, input="Go on.", previous_response_id=response.id)
    assert info.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param, words", [
    (dict(input="Hi", max_output_tokens=10_000), "max_output_tokens", "max_output_tokens"),
    (dict(input=[{"type": "image_generation_call", "id": "x"}]), "input", "image_generation_call"),
    (dict(input="Hi", tool_choice="required"), "tool_choice", "needs tools"),
    (dict(input="Hi", background=True), "background", "background responses are not implemented"),
    (dict(input="Hi", extra_body={"conversation": "conv_1"}), "conversation", "does not support this field"),
], ids=["too-long", "unknown-item", "choice-without-tools", "refused-value", "unsupported-field"])
def test_requests_that_cannot_be_honoured_are_refused_naming_the_field(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **body)
    assert info.value.body["param"] == param and words in info.value.body["message"], info.value.body


def test_temperature_and_top_p_reach_sampling_and_metadata_is_echoed(client):
    greedy = create(client, input="Tell me a story.", max_output_tokens=12)
    # top_p that keeps only the most likely token makes T=1 sampling greedy.
    narrow = create(client, input="Tell me a story.", max_output_tokens=12, temperature=1.0, top_p=1e-6,
                    metadata={"user": "alice"})
    assert narrow.output_text == greedy.output_text and (narrow.temperature, narrow.top_p) == (1.0, 1e-6)
    assert narrow.metadata == {"user": "alice"}
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input="Hi", top_p=1.5)
    assert info.value.body["param"] == "top_p"


def test_output_items_follow_the_text_and_their_events_rebuild_them():
    text = ('<think>Paris.</think>Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
            " Done.")
    parsing = ChatParsing(reasoning=lambda: Qwen3ReasoningParser(False), tools=HermesParser)
    stream, items, events = parsing.choice(), OutputItems(), []
    for end in range(1, len(text) + 1):
        for delta in stream.update(text[:end], final=end == len(text)):
            events += items.feed(delta)
    events += items.close()
    assert [(i["type"], i["status"]) for i in items.items] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed"), ("message", "completed")]
    assert items.items[0]["content"][0]["text"] == "Paris." and items.items[2]["arguments"] == '{"zone": "CET"}'
    # The messages hold the chat message's content, split where the call was (the space before the call is
    # held until text follows it).
    assert [i["content"][0]["text"] for i in items.items if i["type"] == "message"] == ["Sure.", "  Done."]
    assert parsing.message(text)[0]["content"] == "Sure.  Done."
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == items.items and [e["output_index"] for e in events if e["type"] == "response.output_item.added"
                                    ] == [0, 1, 2, 3]


# ---- issue 55: the Responses fields vLLM declares ----------------------------------------------------------------


def test_issue55_include_output_text_logprobs_fills_them_with_top_logprobs_streamed_or_not(client):
    body = dict(input="Tell me a story.", max_output_tokens=8, include=["message.output_text.logprobs"],
                top_logprobs=2)
    response = create(client, **body)
    chat = client.chat.completions.create(model="stories", temperature=0, max_tokens=8, logprobs=True,
                                          top_logprobs=2, messages=[{"role": "user", "content": "Tell me a story."}])
    (part,) = response.output[0].content
    logprobs = [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in part.logprobs]
    assert logprobs == [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs])
                        for lp in chat.choices[0].logprobs.content]
    assert "".join(token for token, _, _ in logprobs) == part.text and len(logprobs) == 8
    assert all(len(top) == 2 and top[0] == token for token, _, top in logprobs)  # greedy
    assert response.top_logprobs == 2
    with client.responses.stream(model="stories", temperature=0, **body) as stream:
        deltas = [lp.token for event in stream if event.type == "response.output_text.delta"
                  for lp in event.logprobs]
        final = stream.get_final_response()
    assert deltas == [token for token, _, _ in logprobs] and final.output[0].content[0].logprobs == part.logprobs
    # Without the include item there are none, whatever top_logprobs says (vLLM's is_include_output_logprobs).
    assert create(client, **{**body, "include": []}).output[0].content[0].logprobs == []


def test_issue55_truncation_auto_drops_the_oldest_prompt_tokens_and_disabled_refuses(client):
    long = "Once upon a time " * 200  # well over max_model_len tokens
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        create(client, input=long, max_output_tokens=4)
    response = create(client, input=long, max_output_tokens=4, truncation="auto")
    assert response.usage.input_tokens == ENGINE["max_model_len"] - 4 and response.usage.output_tokens == 4
    assert response.truncation == "auto"


def test_issue55_reasoning_effort_opens_the_think_block_and_advisory_fields_are_echoed(client):
    thinking = create(client, input="Why is the sky blue?", max_output_tokens=6, reasoning={"effort": "low"},
                      user="user-1", service_tier="auto", max_tool_calls=2, prompt_cache_key="k-1",
                      extra_body={"cache_salt": "salt-1"})
    assert [item.type for item in thinking.output] == ["reasoning"]  # the template opened <think>
    assert thinking.reasoning.effort == "low" and thinking.user == "user-1" and thinking.max_tool_calls == 2
    plain = create(client, input="Why is the sky blue?", max_output_tokens=6, reasoning={"effort": "none"})
    assert [item.type for item in plain.output] == ["message"]
