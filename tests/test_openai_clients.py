"""Issue 27: real clients as their users run them get valid calls from ``jaxllm serve`` (stories260K): ``instructor``
in its default ``TOOLS`` mode (a named tool choice) and ``TOOLS_STRICT``, and ``langchain-openai``'s
``bind_tools`` (a named or required choice, streamed or not) and ``with_structured_output(method=
"function_calling")``. Both are test dependencies (the ``test`` extra), not runtime ones.

The modes that send ``response_format`` (instructor's ``JSON_SCHEMA``, langchain's default ``json_schema``
method) get the schema enforced too, with JSON's free white space, which stories260K writes until
``max_tokens``; a real model closes its JSON, so they are left out here (the tool modes' grammars are compact).
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.server_process import Server, engine_flags
from tests.test_openai_tools import TEMPLATE, forced, hermes_call

openai = pytest.importorskip("openai")
instructor = pytest.importorskip("instructor")
langchain_openai = pytest.importorskip("langchain_openai")
try:
    import agents  # the OpenAI Agents SDK (openai-agents)
except ImportError:
    agents = None

QUESTION = "What is the weather in Paris?"


class Weather(BaseModel):
    """The weather forecast asked for."""

    # A closed object (extra="forbid" writes additionalProperties: false) with bounded fields: stories260K
    # writes whatever the schema allows, so an open one could grow until max_tokens.
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=12, description="the city")
    days: int = Field(ge=1, le=7, description="days ahead")


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("clients_server")
    (folder / "template.jinja").write_text(TEMPLATE)
    server = Server(stories_dir, *engine_flags(), "--chat-template", str(folder / "template.jinja"),
                    "--served-model-name", "stories", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                    log=folder / "server.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def openai_client(server):
    return server.openai_client()


@pytest.mark.parametrize("mode", ["TOOLS", "TOOLS_STRICT"])
def test_instructor_gets_a_valid_model_from_the_server(openai_client, mode):
    client = instructor.from_openai(openai_client, mode=getattr(instructor.Mode, mode))
    for seed in range(3):
        weather = client.chat.completions.create(model="stories", response_model=Weather, max_retries=0,
                                                 temperature=1, seed=seed,
                                                 messages=[{"role": "user", "content": QUESTION}])
        assert isinstance(weather, Weather) and len(weather.city) <= 12 and 1 <= weather.days <= 7


def test_instructor_default_mode_is_tools(openai_client):
    assert instructor.from_openai(openai_client).mode == instructor.Mode.TOOLS


def chat_model(server):
    return langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model="stories",
                                       temperature=0, max_retries=0, timeout=300)


@pytest.mark.parametrize("tool_choice", ["Weather", "required", "any"])
def test_langchain_bind_tools_gets_a_valid_call(server, tool_choice):
    # One call: stories260K never closes a parallel call array (see test_openai_tools).
    model = chat_model(server).bind_tools([Weather], tool_choice=tool_choice, parallel_tool_calls=False)
    message = model.invoke(QUESTION)
    assert message.tool_calls and not message.invalid_tool_calls
    for call in message.tool_calls:
        assert call["name"] == "Weather" and call["id"].startswith("chatcmpl-tool-")
        Weather.model_validate(call["args"])


def test_langchain_streamed_bind_tools_joins_to_a_valid_call(server):
    model = chat_model(server).bind_tools([Weather], tool_choice="Weather")
    chunks = list(model.stream(QUESTION))
    joined = chunks[0]
    for chunk in chunks[1:]:
        joined += chunk
    (call,) = joined.tool_calls
    assert call["name"] == "Weather" and Weather.model_validate(call["args"])


def test_langchain_with_structured_output_by_function_calling_gets_a_valid_model(server):
    weather = chat_model(server).with_structured_output(Weather, method="function_calling").invoke(QUESTION)
    assert isinstance(weather, Weather)


# ---- issue 55: the OpenAI Agents SDK over the Responses API ------------------------------------------------------

CALL = hermes_call("get_weather", {"city": "Paris"})
ANSWER = "It is sunny in Paris."


def weather_agent(base_url: str):
    """An agent with one function tool on ``OpenAIResponsesModel`` (the SDK's default model class), and run hooks
    that force stories260K's text: the tool call first, then, once the tool has answered, the final answer."""

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny in {city}."

    class ForceText(agents.RunHooks):
        async def on_tool_end(self, context, agent, tool, result):
            assert result == "Sunny in Paris."
            agent.model_settings = agents.ModelSettings(temperature=0, extra_body=forced(ANSWER))

    model = agents.OpenAIResponsesModel(model="stories", openai_client=openai.AsyncOpenAI(
        base_url=base_url, api_key="none", max_retries=0, timeout=300))
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", model=model,
                         tools=[get_weather], model_settings=agents.ModelSettings(temperature=0,
                                                                                  extra_body=forced(CALL)))
    return agent, ForceText()


@pytest.fixture(scope="module")
def agents_sdk(server):
    """The server's /v1 URL for the SDK (skipped without openai-agents); the SDK's tracing export is off."""
    pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    return f"{server.url}/v1"


def run_items(result) -> list[tuple[str, str]]:
    """(item type, then the call's name, its output or the message's text) of a run's new items."""
    described = []
    for item in result.new_items:
        if item.type == "tool_call_item":
            described.append((item.type, item.raw_item.name))
        elif item.type == "tool_call_output_item":
            described.append((item.type, item.output))
        elif item.type == "message_output_item":
            described.append((item.type, agents.ItemHelpers.text_message_output(item)))
    return described


WANTED_ITEMS = [("tool_call_item", "get_weather"), ("tool_call_output_item", "Sunny in Paris."),
                ("message_output_item", ANSWER)]


def test_issue55_agents_sdk_responses_model_runs_a_tool_agent_to_completion(agents_sdk):
    agent, hooks = weather_agent(agents_sdk)
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", hooks=hooks, max_turns=3))
    assert result.final_output == ANSWER and run_items(result) == WANTED_ITEMS
    assert len(result.raw_responses) == 2  # the call, then the answer


def test_issue55_agents_sdk_responses_model_runs_a_tool_agent_to_completion_streamed(agents_sdk):
    agent, hooks = weather_agent(agents_sdk)

    async def run():
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", hooks=hooks, max_turns=3)
        deltas = [event.data.delta async for event in result.stream_events()
                  if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"]
        return result, deltas

    result, deltas = asyncio.run(run())
    assert result.final_output == ANSWER == "".join(deltas) and run_items(result) == WANTED_ITEMS
