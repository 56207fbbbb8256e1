"""Tool-call and reasoning parsers on canned model outputs (issue 27, items 1-2): every parser finds several calls,
keeps the text around them as content and leaves malformed calls as content; streamed in any chunking, the
deltas join to the unstreamed message (hypothesis)."""

from __future__ import annotations

import functools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.entrypoints.openai.chat_outputs import ChatParsing, join_deltas, reasoning_token_count
from jaxllm.entrypoints.openai.reasoning_parsers import (
    THINK_END,
    THINK_START,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    opens_reasoning,
)
from jaxllm.entrypoints.openai.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    PythonicParser,
    RequiredParser,
    required_schema,
)

WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"zone": "CET", "exact": True, "tags": ["a", "b"]})


def message(parser, text, **kw):
    return ChatParsing(tools=parser, **kw).message(text)[0]


def calls_of(msg):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]


def hermes(name, args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def llama3(name, args):
    return json.dumps({"name": name, "parameters": args})


def mistral_v11(name, args):
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(args)}"


def pythonic_call(name, args):
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"


CANNED = [
    # (parser, model text, calls, content)
    (HermesParser, f"{hermes(*WEATHER)}\n{hermes(*TIME)}", [WEATHER, TIME], None),
    (HermesParser, f"Let me look.\n{hermes(*WEATHER)}\nDone.", [WEATHER], "Let me look.\n\nDone."),
    (HermesParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', [WEATHER], None),
    (Llama3JsonParser, f"<|python_tag|>{llama3(*WEATHER)}; {llama3(*TIME)}", [WEATHER, TIME], None),
    (Llama3JsonParser, f"Here: {llama3(*WEATHER)} and {{not a call}}", [WEATHER], "Here:  and {not a call}"),
    (MistralParser, "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in (WEATHER, TIME)]),
     [WEATHER, TIME], None),
    (MistralParser, f"Sure. {mistral_v11(*WEATHER)}{mistral_v11(*TIME)}", [WEATHER, TIME], "Sure."),
    (PythonicParser, f"[{pythonic_call(*WEATHER)}, {pythonic_call(*TIME)}]", [WEATHER, TIME], None),
    (PythonicParser, f"Calling [{pythonic_call(*WEATHER)}] now; see [1].", [WEATHER], "Calling  now; see [1]."),
    (RequiredParser, json.dumps([{"name": n, "parameters": a} for n, a in (WEATHER, TIME)]), [WEATHER, TIME], None),
]


@pytest.mark.parametrize("parser, text, calls, content", CANNED)
def test_parser_finds_every_call_and_keeps_the_text_around_as_content(parser, text, calls, content):
    msg = message(parser, text)
    assert calls_of(msg) == [(n, a) for n, a in calls]
    assert msg["content"] == content
    # Mistral's templates take nine letters and digits only.
    spelling = r"[A-Za-z0-9]{9}" if parser is MistralParser else r"chatcmpl-tool-[0-9a-f]{32}"
    assert all(re.fullmatch(spelling, c["id"]) and c["type"] == "function" for c in msg["tool_calls"])
    assert len({c["id"] for c in msg["tool_calls"]}) == len(calls)


MALFORMED = [
    (HermesParser, '<tool_call>{"name": "get_weather", "arguments": {city: Paris}}</tool_call> sorry'),
    (HermesParser, '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Paris"'),  # cut short
    (MistralParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"},]'),
    (PythonicParser, '[get_weather("Paris")]'),  # a positional argument
    (PythonicParser, "[get_weather(city=open('x'))]"),  # not a literal
    (RequiredParser, '[{"name": "get_weather", "parameters": {"city": "Pa'),  # cut by max_tokens
]


@pytest.mark.parametrize("parser, text", MALFORMED)
def test_malformed_call_is_left_as_content(parser, text):
    msg = message(parser, text)
    assert "tool_calls" not in msg and msg["content"] == text


def test_plain_text_without_calls_is_all_content():
    for parser in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser):
        assert message(parser, "Once upon a time < there was [a] dog.") == {
            "role": "assistant", "content": "Once upon a time < there was [a] dog."}


def test_parallel_tool_calls_false_keeps_the_first_call():
    assert calls_of(message(HermesParser, hermes(*WEATHER) + hermes(*TIME), single_call=True)) == [WEATHER]


def test_named_parser_streams_the_arguments_as_they_grow():
    stream = ChatParsing(tools=functools.partial(NamedParser, "get_weather"), named=True).choice()
    first = stream.update('{"city": "Pa', final=False)
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1]["tool_calls"][0]["function"] == {"arguments": '{"city": "Pa'}
    assert stream.update('{"city": "Paris"}', final=True) == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}]


def test_finish_reason_is_tool_calls_for_chosen_calls_and_stays_for_a_named_one():
    assert ChatParsing(tools=HermesParser).finish_reason("stop", 1) == "tool_calls"
    assert ChatParsing(tools=HermesParser).finish_reason("stop", 0) == "stop"
    assert ChatParsing(tools=HermesParser).finish_reason("length", 1) == "length"
    assert ChatParsing(tools=functools.partial(NamedParser, "f"), named=True).finish_reason("stop", 1) == "stop"


def test_required_schema_is_an_array_of_name_and_parameters_objects_one_per_tool():
    schema = required_schema([{"name": "a", "parameters": {"type": "object"}}, {"name": "b"}], parallel=False)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["a"], ["b"]]
    assert "maxItems" not in required_schema([{"name": "a"}], parallel=True)


# Issue 55, fault 4: plain JSON answers read as llama3_json calls (the reported inputs).
LLAMA3_PLAIN_JSON = ['{"name": "Alice"}', '{"name": "Lily", "age": 3, "likes": ["cats"]}',
                     'Here is a user: {"name": "Alice"}']


@pytest.mark.parametrize("text", LLAMA3_PLAIN_JSON)
def test_llama3_json_object_with_a_name_but_no_parameters_or_arguments_is_content(text):
    for tool_names in (None, frozenset({"get_weather"}), frozenset({"Alice", "Lily"})):
        msg = message(functools.partial(Llama3JsonParser, tool_names), text)
        assert "tool_calls" not in msg and msg["content"] == text


json_keys = st.text(alphabet="abcnmepr_", min_size=1, max_size=10).filter(lambda k: k not in ("arguments",
                                                                                              "parameters", "name"))
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-9, 9), st.text("ab ", max_size=4)),
                           lambda inner: st.lists(inner, max_size=2) | st.dictionaries(json_keys, inner, max_size=2),
                           max_leaves=4)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["get_weather", "Alice", "x"]), others=st.dictionaries(json_keys, json_values,
                                                                                   max_size=3),
       declared=st.sampled_from([None, frozenset({"get_weather"})]), prefix=st.sampled_from(["", "User: "]))
def test_llama3_json_object_is_a_call_only_with_arguments_and_a_declared_name(name, others, declared, prefix):
    """The class of fault 4: any object without ``parameters``/``arguments`` is content, and so is one naming an
    undeclared function; an object with both is a call, its arguments whole."""
    parser = functools.partial(Llama3JsonParser, declared)
    plain = prefix + json.dumps({"name": name, **others})
    msg = message(parser, plain)
    assert "tool_calls" not in msg and msg["content"] == plain
    call = prefix + json.dumps({"name": name, "parameters": others})
    msg = message(parser, call)
    if declared is None or name in declared:
        assert calls_of(msg) == [(name, others)]
    else:
        assert "tool_calls" not in msg and msg["content"] == call


def test_pythonic_list_naming_an_undeclared_function_is_content():
    text = f"[{pythonic_call('print_me', {'x': 1})}]"
    assert message(functools.partial(PythonicParser, frozenset({"get_weather"})), text)["content"] == text
    assert calls_of(message(PythonicParser, text)) == [("print_me", {"x": 1})]


@pytest.mark.parametrize("parser", [RequiredParser, functools.partial(NamedParser, "get_weather")],
                         ids=["required", "named"])
def test_enforced_tool_choices_take_the_call_id_scheme_they_are_given(parser):
    text = json.dumps([{"name": WEATHER[0], "parameters": WEATHER[1]}]) if parser is RequiredParser \
        else json.dumps(WEATHER[1])
    msg = ChatParsing(tools=parser, tool_call_id=MistralParser.new_id).message(text)[0]
    assert calls_of(msg) == [WEATHER] and re.fullmatch(r"[A-Za-z0-9]{9}", msg["tool_calls"][0]["id"])


# ------------------------------------------------------------------ streaming = unstreamed (hypothesis)

# "<" begins a hermes and a llama3_json start marker: held back until it cannot.
words = st.text(alphabet=st.sampled_from("ab xy.,<\n"), min_size=0, max_size=12)
values = st.one_of(st.integers(-99, 99), st.booleans(), st.text(alphabet="abc é\"\\'", max_size=6))
arguments = st.dictionaries(st.sampled_from(["city", "days", "unit"]), values, max_size=3)
calls = st.tuples(st.sampled_from(["get_weather", "get_time"]), arguments)
FORMATS = {
    HermesParser: lambda pieces: "".join(p if isinstance(p, str) else hermes(*p) for p in pieces),
    Llama3JsonParser: lambda pieces: "".join(p if isinstance(p, str) else llama3(*p) for p in pieces),
    MistralParser: lambda pieces: "".join(p if isinstance(p, str) else mistral_v11(*p) for p in pieces),
    PythonicParser: lambda pieces: "".join(p if isinstance(p, str) else f"[{pythonic_call(*p)}]" for p in pieces),
}


def stream_deltas(parsing, text, cuts):
    stream, deltas, bounds = parsing.choice(), [], sorted(set(cuts)) + [len(text)]
    for end in bounds:
        deltas += stream.update(text[:end], final=end == len(text))
    return deltas


@settings(max_examples=150, deadline=None)
@given(parser=st.sampled_from(sorted(FORMATS, key=lambda p: p.__name__)),
       pieces=st.lists(st.one_of(words, calls), max_size=5), data=st.data())
def test_streamed_deltas_in_any_chunking_join_to_the_unstreamed_message(parser, pieces, data):
    text = FORMATS[parser](pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    parsing = ChatParsing(tools=parser)
    whole = parsing.message(text)[0]
    joined = join_deltas(stream_deltas(parsing, text, cuts), parsing)
    assert calls_of(joined) == calls_of(whole) == [(n, a) for n, a in (p for p in pieces if isinstance(p, tuple))]
    assert joined["content"] == whole["content"]


@settings(max_examples=100, deadline=None)
@given(reasoning=words, answer=st.lists(st.one_of(words, calls), max_size=3), opened=st.booleans(),
       data=st.data())
def test_reasoning_then_calls_stream_as_they_are_unstreamed(reasoning, answer, opened, data):
    text = ("" if opened else "<think>") + reasoning + "</think>" + FORMATS[HermesParser](answer)
    parsing = ChatParsing(reasoning=functools.partial(Qwen3ReasoningParser, opened), tools=HermesParser)
    whole = parsing.message(text)[0]
    joined = join_deltas(stream_deltas(parsing, text, data.draw(st.lists(st.integers(0, len(text))))), parsing)
    assert (joined["reasoning"], joined["content"], calls_of(joined)) == (
        whole["reasoning"], whole["content"], calls_of(whole))
    assert whole["reasoning"] == (reasoning or None)
    assert calls_of(whole) == [p for p in answer if isinstance(p, tuple)]


# ------------------------------------------------------------------ reasoning

def reasoning_message(parser, text, prompt_opens=False, include=True):
    return ChatParsing(reasoning=functools.partial(parser, prompt_opens), include_reasoning=include).message(text)[0]


def test_reasoning_is_the_text_between_the_think_tags_and_content_the_rest():
    msg = reasoning_message(Qwen3ReasoningParser, "<think>\nIt is sunny.\n</think>\n\nTake a hat.")
    assert (msg["reasoning"], msg["content"]) == ("\nIt is sunny.\n", "\n\nTake a hat.")


def test_a_prompt_that_opens_the_think_block_makes_the_text_reasoning_until_the_closing_tag():
    prompt = "<|im_start|>assistant\n<think>\n"
    assert opens_reasoning(prompt) and not opens_reasoning(prompt + "\n</think>\n\n")
    msg = reasoning_message(Qwen3ReasoningParser, "Hmm.</think>Hello", prompt_opens=True)
    assert (msg["reasoning"], msg["content"]) == ("Hmm.", "Hello")
    truncated = reasoning_message(Qwen3ReasoningParser, "Still thinking", prompt_opens=True)
    assert (truncated["reasoning"], truncated["content"]) == ("Still thinking", None)


def test_qwen3_without_a_think_block_is_all_content_and_deepseek_r1_all_reasoning_until_the_tag():
    assert reasoning_message(Qwen3ReasoningParser, "Hello there") == {
        "role": "assistant", "content": "Hello there", "reasoning": None}
    msg = reasoning_message(DeepSeekR1ReasoningParser, "Hmm.</think>Hello")
    assert (msg["reasoning"], msg["content"]) == ("Hmm.", "Hello")


def test_include_reasoning_false_drops_it():
    assert reasoning_message(Qwen3ReasoningParser, "<think>x</think>y", include=False) == {
        "role": "assistant", "content": "y"}


def test_reasoning_tokens_count_the_reasoning_not_its_tags():
    """Issue 55, fault 6: the count took the think tags' tokens too (23 for 10 tokens of reasoning)."""
    pieces = ["<th", "ink>", "a", "b", "</", "think", ">", "c", "d"]
    decode = lambda ids: "".join(pieces[i] for i in ids)
    parsing = ChatParsing(reasoning=functools.partial(Qwen3ReasoningParser, False))
    assert reasoning_token_count(parsing, list(range(len(pieces))), decode) == 2
    assert reasoning_token_count(parsing, [7, 8], decode) == 0
    assert reasoning_token_count(parsing, [0, 1, 2, 3], decode) == 2
    opened = ChatParsing(reasoning=functools.partial(Qwen3ReasoningParser, True))
    assert reasoning_token_count(opened, [2, 3, 4, 5, 6, 7], decode) == 2


@settings(max_examples=150, deadline=None)
@given(reasoning=st.lists(st.text(alphabet="ab <>/", min_size=1, max_size=3), min_size=1, max_size=6),
       answer=st.text(alphabet="cd <>", max_size=6), opened=st.booleans(), closed=st.booleans(),
       cuts=st.tuples(st.integers(0, 7), st.integers(0, 8)))
def test_reasoning_tokens_are_the_tokens_holding_reasoning_however_the_tags_are_cut(reasoning, answer, opened,
                                                                                  closed, cuts):
    """The fault's class: tags cut anywhere into tokens, or sharing a token with the reasoning, the block opened
    by the prompt or the text, closed or not. The reasoning's alphabet cannot spell a tag."""
    head = "" if opened else THINK_START
    tail = THINK_END + answer if closed else ""
    pieces = [p for p in (head[:cuts[0]], head[cuts[0]:] + reasoning[0], *reasoning[1:],
                          tail[:cuts[1]], tail[cuts[1]:]) if p]
    decode = lambda ids: "".join(pieces[i] for i in ids)
    parsing = ChatParsing(reasoning=functools.partial(Qwen3ReasoningParser, opened))
    start = len(head)
    end = start + len("".join(reasoning))
    offsets = [len("".join(pieces[:k])) for k in range(len(pieces) + 1)]
    want = sum(1 for k in range(len(pieces)) if offsets[k] < end and offsets[k + 1] > start)
    assert parsing.reasoning().span(decode(range(len(pieces)))) == (start, end)
    assert reasoning_token_count(parsing, list(range(len(pieces))), decode) == want
    assert want <= len(reasoning)


# ------------------------------------------------------------------ a constraint after the reasoning

@pytest.fixture(scope="module")
def ll_tokenizer(stories_dir):
    import llguidance

    from jaxllm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(stories_dir)
    return tokenizer, llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                             eos_token=[tokenizer.eos_token_id])


def accepts(ll_tokenizer, params, text) -> bool:
    import llguidance

    from jaxllm.structured_output import grammar_spec

    tokenizer, ll = ll_tokenizer
    matcher = llguidance.LLMatcher(ll, grammar_spec(params)[1], log_level=0)
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and \
        matcher.is_accepting()


@pytest.mark.parametrize("constraint, good, bad", [
    (dict(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                "additionalProperties": False}), '{"a": 12}', '{"a": "x"}'),
    (dict(regex="[0-9]+ cats"), "12 cats", "12 dogs"),
    (dict(choice=["yes", "no"]), "no", "maybe"),
])
def test_a_constraint_after_reasoning_lets_the_reasoning_run_free_then_holds_the_answer(ll_tokenizer, constraint,
                                                                                       good, bad):
    from jaxllm.structured_output import after_reasoning, validate_structured_outputs
    from scheduler import StructuredOutputsParams

    params = after_reasoning(StructuredOutputsParams(**constraint), "</think>")
    validate_structured_outputs(params)
    assert accepts(ll_tokenizer, params, "Some {free} </thin reasoning.</think>" + good)
    assert not accepts(ll_tokenizer, params, "Some reasoning.</think>" + bad)
    assert not accepts(ll_tokenizer, params, good)  # the reasoning comes first


def test_a_grammar_constraint_cannot_follow_reasoning():
    from jaxllm.structured_output import after_reasoning
    from scheduler import StructuredOutputsParams

    with pytest.raises(ValueError, match="structured_outputs.grammar"):
        after_reasoning(StructuredOutputsParams(grammar='start: "x"'), "</think>")
