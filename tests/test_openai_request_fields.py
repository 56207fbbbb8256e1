"""Issue 25, item 4: no request field is silently ignored. Each field the server accepts is honoured (checked here
against ``LLM`` in this process, or by what it changes); every other field, and every combination that cannot be
honoured, is a 400 naming the field; after the refusals no request or KV block is lost.

The server is a real ``jaxllm serve`` on stories260K, which ships no chat template: it gets one with
``--chat-template`` (a file holding ``TEMPLATE``), and runs the ``priority`` scheduling policy. The fcfs refusal of
``priority`` is in ``test_openai_server.py``, whose server runs fcfs.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import numpy as np
import pytest

import tests.test_openai_server as server_tests
import tests.test_openai_tools as tools_tests
from jaxllm import LLM, BeamSearchParams, SamplingParams
from jaxllm.entrypoints.openai.api_server import main as serve_main
from jaxllm.entrypoints.openai import field_policy, protocol
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from jaxllm.entrypoints.openai.serving import chat_template_kwargs
from tests.server_process import ENGINE, Server, engine_flags
from tests.test_openai_server import wait_until_idle

PROMPT = "Once upon a time"
# Role-aware, and with an assistant cue only when add_generation_prompt is true, so both chat switches show.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
USER = [{"role": "user", "content": "Tell me a story."}]
# A prefilled answer for continue_final_message.
PREFILLED = USER + [{"role": "assistant", "content": "Once upon a time"}]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
MAX_MODEL_LEN = ENGINE["max_model_len"]
SEATS = ENGINE["max_num_seqs"]


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fields_server")
    (folder / "template.jinja").write_text(TEMPLATE)
    server = Server(stories_dir, *engine_flags(), "--chat-template", str(folder / "template.jinja"),
                    "--scheduling-policy", "priority", log=folder / "server.log").launch()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def llm(stories_dir, server):
    """The reference (fcfs), built while the server starts."""
    llm = LLM(model=stories_dir, **ENGINE)
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    return llm


@pytest.fixture(scope="module")
def ready(server, llm):
    return server.wait_ready()


def post(server, path, body, timeout=300):
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)


def completion(server, **body):
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def chat(server, **body):
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def refused(server, path, body, param, *words):
    """Assert a 400 whose error names ``param`` and holds ``words``."""
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert all(w in error["message"] for w in words), error


def long_prompt(seed: int) -> list[int]:
    """80 token ids no other test sends (5 full blocks of 16), so the prefix cache holds them only once sent."""
    return np.random.default_rng(seed).integers(3, 500, size=80).tolist()


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


# ---- the reported inputs -----------------------------------------------------------------------------------------


def test_issue25_stream_options_without_stream_is_refused(ready):
    for path, body in [("/v1/completions", dict(prompt=PROMPT)), ("/v1/chat/completions", dict(messages=USER))]:
        refused(ready, path, {**body, "max_tokens": 3, "stream_options": {"include_usage": True}}, "stream_options",
                "stream=true")
        refused(ready, path, {**body, "max_tokens": 3, "stream": False, "stream_options": {"include_usage": True}},
                "stream_options", "stream=true")


def test_issue25_a_request_with_another_cache_salt_reads_0_cached_tokens(ready):
    prompt = long_prompt(25)
    assert cached_tokens(completion(ready, prompt=prompt, max_tokens=1)) == 0
    shared = cached_tokens(completion(ready, prompt=prompt, max_tokens=1))
    assert shared >= 64  # the 4 full blocks before the last token, at least
    assert cached_tokens(completion(ready, prompt=prompt, max_tokens=1, cache_salt="tenant-b")) == 0
    assert cached_tokens(completion(ready, prompt=prompt, max_tokens=1, cache_salt="tenant-b")) == shared
    assert cached_tokens(completion(ready, prompt=prompt, max_tokens=1, cache_salt="tenant-c")) == 0
    # Chat takes it too: the same conversation under a new salt reads nothing.
    messages = [{"role": "user", "content": "Lily and Tom went to the park to play with a big red ball. " * 3}]
    chat(ready, messages=messages, max_tokens=1, cache_salt="tenant-b")
    assert cached_tokens(chat(ready, messages=messages, max_tokens=1, cache_salt="tenant-b")) >= 16
    assert cached_tokens(chat(ready, messages=messages, max_tokens=1, cache_salt="tenant-d")) == 0
    refused(ready, "/v1/completions", dict(prompt=PROMPT, cache_salt=""), "cache_salt", "non-empty string")


def test_issue25_llm_generate_and_chat_take_cache_salt(llm):
    prompt = long_prompt(26)
    once = SamplingParams(temperature=0, max_tokens=1)
    first, again, salted, salted_again = (
        llm.generate(prompt, once, cache_salt=salt, use_tqdm=False)[0].num_cached_tokens
        for salt in (None, None, "tenant-b", ["tenant-b"]))
    assert (first, salted) == (0, 0) and again == salted_again >= 64
    messages = [{"role": "user", "content": "The sun was hot and the dog wanted to swim in the lake. " * 3}]
    runs = [llm.chat(messages, once, chat_template=TEMPLATE, cache_salt=salt, use_tqdm=False)[0].num_cached_tokens
            for salt in ("a", "a", "b")]
    assert runs[0] == 0 and runs[1] >= 16 and runs[2] == 0
    with pytest.raises(ValueError, match="cache_salt has 2 entries for 1 prompts"):
        llm.generate(prompt, once, cache_salt=["a", "b"], use_tqdm=False)


def test_issue25_priority_on_a_priority_server_runs_the_urgent_request_first(ready, llm):
    """Every seat held by a long low-priority request: an urgent one (lower value) takes a seat from it and
    finishes first, where it would otherwise wait for a free seat; its text is the greedy one (preemption
    changes no output)."""
    preemptions = ready.metric("jaxllm:num_preemptions_total")
    long = dict(prompt=PROMPT, n=SEATS, max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True, priority=9, stream=True)
    finished = {}
    with httpx.stream("POST", f"{ready.url}/v1/completions", json=long, timeout=300) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # every seat is taken

        def read_to_the_end():
            for _ in lines:
                pass
            finished["long"] = time.monotonic()

        reader = threading.Thread(target=read_to_the_end)
        reader.start()
        urgent = completion(ready, prompt=PROMPT, max_tokens=12, temperature=0, priority=0)
        finished["urgent"] = time.monotonic()
        reader.join(120)
    assert finished["urgent"] < finished["long"], "the urgent request waited for the long one"
    assert ready.metric("jaxllm:num_preemptions_total") > preemptions
    assert urgent["choices"][0]["text"] == llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text
    wait_until_idle(ready)


# ---- vLLM's extras -----------------------------------------------------------------------------------------------


def test_issue25_prompt_logprobs_equal_llm_generate(ready, llm):
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    got = completion(ready, prompt=PROMPT, max_tokens=2, temperature=0, prompt_logprobs=2)["choices"][0]
    assert got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == len(want.prompt_token_ids) == 5
    for entry, expected in zip(got["prompt_logprobs"][1:], want.prompt_logprobs[1:]):
        assert list(entry) == [str(t) for t in expected]
        np.testing.assert_allclose([e["logprob"] for e in entry.values()], [e.logprob for e in expected.values()],
                                   atol=1e-5)
        assert [(e["rank"], e["decoded_token"]) for e in entry.values()] == \
            [(e.rank, e.decoded_token) for e in expected.values()]
    # Chat: one list for the prompt, beside the choices.
    body = chat(ready, messages=USER, max_tokens=2, temperature=0, prompt_logprobs=1)
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"] and body["prompt_logprobs"][0] is None
    assert all(1 <= len(entry) <= 2 for entry in body["prompt_logprobs"][1:])
    refused(ready, "/v1/completions", dict(prompt=PROMPT, prompt_logprobs=21), "prompt_logprobs", "[0, 20]")
    refused(ready, "/v1/completions", dict(prompt=PROMPT, prompt_logprobs=1, stream=True), "prompt_logprobs",
            "stream=true")


def test_issue25_echo_and_prompt_logprobs_each_keep_their_own_number_of_top_tokens(ready):
    got = completion(ready, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1,
                     prompt_logprobs=3)["choices"][0]
    # The prompt token, then the top 1 (echo) or top 3 (prompt_logprobs): one entry fewer where it is among them.
    assert all(1 <= len(top) <= 2 for top in got["logprobs"]["top_logprobs"][1:])
    assert all(3 <= len(entry) <= 4 for entry in got["prompt_logprobs"][1:])


def test_issue25_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(ready, llm):
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs, and nothing generated."""
    prompts = [[1, 403, 407, 261, 378, 432], llm.tokenizer.encode("One day, Lily saw a big dog")]
    body = completion(ready, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0, seed=1234)
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    for choice, prompt, expected in zip(body["choices"], prompts, want):
        assert choice["text"] == llm.tokenizer.decode(prompt) and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt) and lp["token_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:],
                                   [e[t].logprob for t, e in zip(prompt[1:], expected.prompt_logprobs[1:])],
                                   atol=1e-5)
    refused(ready, "/v1/completions", dict(prompt=PROMPT, max_tokens=0, echo=True, stream=True), "max_tokens",
            "stream=true")
    refused(ready, "/v1/completions", dict(prompt=[5] * (MAX_MODEL_LEN + 1), max_tokens=0, echo=True), "prompt",
            f"longer than max_model_len={MAX_MODEL_LEN}")
    # Without echo, max_tokens=0 asks for nothing and is refused as before.
    refused(ready, "/v1/completions", dict(prompt=PROMPT, max_tokens=0), "max_tokens", ">= 1")


def test_issue25_usage_reports_cached_prompt_tokens_streamed_or_not(ready):
    prompt = long_prompt(27)
    assert cached_tokens(completion(ready, prompt=prompt, max_tokens=2)) == 0
    whole = cached_tokens(completion(ready, prompt=prompt, max_tokens=2))
    assert whole >= 64
    stream = post(ready, "/v1/completions", dict(prompt=prompt, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True})).text
    usage = [e for e in stream.splitlines() if e.startswith("data: {")][-1]
    assert f'"prompt_tokens_details":{{"cached_tokens":{whole}}}' in usage


def test_issue25_return_tokens_as_token_ids_spells_logprob_tokens_as_ids(ready, llm):
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)[0].outputs[0]
    lp = completion(ready, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                    return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in want.token_ids]
    assert all(re.fullmatch(r"token_id:\d+", key) for top in lp["top_logprobs"] for key in top)
    # Offsets still count the text.
    texts = [entry[t].decoded_token for t, entry in zip(want.token_ids, want.logprobs)]
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in texts[:-1]]))
    content = chat(ready, messages=USER, max_tokens=4, temperature=0, logprobs=True, top_logprobs=1,
                   return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["content"]
    assert all(re.fullmatch(r"token_id:\d+", item["token"]) for item in content)
    assert all(item["top_logprobs"][0]["token"] == item["token"] for item in content)  # greedy
    refused(ready, "/v1/completions", dict(prompt=PROMPT, return_tokens_as_token_ids=True),
            "return_tokens_as_token_ids", "needs logprobs")


# ---- chat templates ------------------------------------------------------------------------------------------------


def test_issue25_chat_template_flag_serves_chat_for_a_model_without_one(ready, llm):
    body = chat(ready, messages=USER, max_tokens=12, temperature=0)
    want = llm.chat(USER, GREEDY, chat_template=TEMPLATE, use_tqdm=False)[0]
    assert body["choices"][0]["message"]["content"] == want.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert llm.tokenizer.decode(want.prompt_token_ids) == "user: Tell me a story.\nassistant:"


@pytest.mark.parametrize("value, message", [
    ("missing.jinja", "--chat-template missing.jinja: no such file"),
    ("{% for m in messages %}", "the chat template is not valid jinja2"),
])
def test_issue25_a_bad_chat_template_flag_exits_2_before_the_model_loads(stories_dir, capsys, value, message):
    assert serve_main([str(stories_dir), "--chat-template", value]) == 2
    assert message in capsys.readouterr().err


def test_a_taken_port_exits_2_naming_it_before_the_model_loads(stories_dir, capsys, monkeypatch):
    import jaxllm.frontend.async_llm as async_llm

    def never(*args, **kwargs):
        raise AssertionError("the engine started although the address was taken")

    monkeypatch.setattr(async_llm, "AsyncLLM", never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve_main([str(stories_dir), "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--host 127.0.0.1 --port {port}: cannot listen there (Address already in use)" in err
    assert serve_main([str(stories_dir), "--host", "no-such-host.invalid", "--port", "0"]) == 2
    assert "--host 'no-such-host.invalid': " in capsys.readouterr().err


def test_issue25_add_generation_prompt_false_leaves_out_the_assistant_cue(ready, llm):
    def tokens(flag):
        return post(ready, "/tokenize", dict(messages=USER, add_generation_prompt=flag)).json()["tokens"]

    assert llm.tokenizer.decode(tokens(True)) == "user: Tell me a story.\nassistant:"
    assert llm.tokenizer.decode(tokens(False)) == "user: Tell me a story.\n"
    body = chat(ready, messages=USER, max_tokens=12, temperature=0, add_generation_prompt=False)
    want = llm.chat(USER, GREEDY, chat_template=TEMPLATE, add_generation_prompt=False, use_tqdm=False)[0]
    assert body["usage"]["prompt_tokens"] == len(tokens(False)) == len(want.prompt_token_ids)
    assert body["choices"][0]["message"]["content"] == want.outputs[0].text


def test_issue25_tokenize_add_special_tokens_false_leaves_out_bos(ready):
    assert post(ready, "/tokenize", dict(prompt=PROMPT, add_special_tokens=False)).json()["tokens"] == \
        [403, 407, 261, 378]


def test_issue25_continue_final_message_continues_the_last_message(ready, llm):
    flags = dict(add_generation_prompt=False, continue_final_message=True)
    ids = post(ready, "/tokenize", dict(messages=PREFILLED, **flags)).json()["tokens"]
    assert llm.tokenizer.decode(ids) == "user: Tell me a story.\nassistant: Once upon a time"
    body = chat(ready, messages=PREFILLED, max_tokens=12, temperature=0, **flags)
    want = llm.chat(PREFILLED, GREEDY, chat_template=TEMPLATE, use_tqdm=False, **flags)[0]
    assert want.prompt_token_ids == ids and body["choices"][0]["message"]["content"] == want.outputs[0].text
    # The story goes on from the prefilled words: the greedy sentence's continuation.
    assert want.outputs[0].text.startswith(", there was")
    refused(ready, "/v1/chat/completions", dict(messages=PREFILLED, continue_final_message=True),
            "continue_final_message", "add_generation_prompt")
    refused(ready, "/tokenize", dict(messages=PREFILLED, continue_final_message=True), "continue_final_message",
            "add_generation_prompt")
    refused(ready, "/v1/chat/completions", dict(messages=PREFILLED[:1] + [{"role": "assistant", "content": ""}],
                                                **flags), "continue_final_message", "last message")


# ---- the other fields ----------------------------------------------------------------------------------------------


def test_issue25_skip_special_tokens_and_include_stop_str_in_output_are_honoured(ready, llm):
    eos_forced = dict(prompt=PROMPT, max_tokens=3, temperature=0, ignore_eos=True, logit_bias={"2": 100})
    kept = completion(ready, **eos_forced, skip_special_tokens=False)["choices"][0]["text"]
    assert kept == "</s></s></s>"
    assert completion(ready, **eos_forced)["choices"][0]["text"] == ""
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={2: 100},
                                               skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert kept == want.text
    with_stop = completion(ready, prompt=PROMPT, max_tokens=40, temperature=0, stop=["Lily"],
                           include_stop_str_in_output=True)["choices"][0]
    assert (with_stop["text"], with_stop["stop_reason"]) == (", there was a little girl named Lily", "Lily")


def test_an_explicit_null_takes_the_fields_default(ready):
    # openai-python sends null for an argument given as None; vLLM's fields are Optional for it.
    nulls = dict(n=None, presence_penalty=None, frequency_penalty=None, stream=None, echo=None, ignore_eos=None,
                 min_tokens=None, skip_special_tokens=None, priority=None, return_tokens_as_token_ids=None)
    plain = completion(ready, prompt=PROMPT, max_tokens=8, temperature=0)
    nulled = completion(ready, prompt=PROMPT, max_tokens=8, temperature=0, **nulls)
    assert nulled["choices"] == plain["choices"] and nulled["usage"] == plain["usage"]
    messages = [{"role": "user", "content": "Hello"}]
    plain_chat = chat(ready, messages=messages, max_tokens=6, temperature=0)
    nulled_chat = chat(ready, messages=messages, max_tokens=6, temperature=0, logprobs=None, n=None,
                       continue_final_message=None)
    assert nulled_chat["choices"] == plain_chat["choices"]
    refused(ready, "/v1/completions", dict(prompt=PROMPT, max_tokens=4, bogus=None), "bogus")


def test_completions_max_tokens_null_is_the_room_left_not_sixteen(ready):
    """Issue 55, fault 6 (a regression): ``"max_tokens": null`` generated the default 16."""
    body = completion(ready, prompt=PROMPT, max_tokens=None, temperature=0, ignore_eos=True)
    usage, (choice,) = body["usage"], body["choices"]
    assert usage["completion_tokens"] == MAX_MODEL_LEN - usage["prompt_tokens"] and choice["finish_reason"] == "length"


REQUEST_MODELS = [m for m in vars(protocol).values() if isinstance(m, type) and issubclass(m, protocol._Request)
                  and m is not protocol._Request and m.__module__ == protocol.__name__]
# The required fields' values, by name (ResponseFormat's and ResponsesTextFormat's "type" is "text").
REQUIRED = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "name": "f", "input": "hi",
            "function": {"name": "f"}, "model_path": "m", "tokens": [1], "type": "text", "lora_name": "sql",
            "lora_path": "/adapters/sql"}
OPTIONAL_FIELDS = [(m, f) for m in REQUEST_MODELS for f, info in m.model_fields.items() if not info.is_required()]


def test_the_null_sweep_covers_every_request_model():
    assert {m.__name__ for m, _ in OPTIONAL_FIELDS} >= {"CompletionRequest", "ChatCompletionRequest",
                                                         "ResponsesRequest", "TokenizeRequest"}
    assert (protocol.CompletionRequest, "max_tokens") in OPTIONAL_FIELDS


@pytest.mark.parametrize("model, field", OPTIONAL_FIELDS, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_a_null_is_none_where_the_field_takes_none_and_the_default_elsewhere(model, field):
    """The class of fault 6's regression: every optional field of every request model, sent as null."""
    info = model.model_fields[field]
    body = {k: REQUIRED[k] for k, f in model.model_fields.items() if f.is_required()}
    got = getattr(model.model_validate({**body, info.alias or field: None}), field)
    assert got == (None if protocol._takes_none(info.annotation) else info.get_default(call_default_factory=True))


UNSUPPORTED = [
    # (path, body, param, the field's name as the message spells it)
    # Fields neither vLLM's request models nor field_policy's table name (vLLM drops them unread).
    ("/v1/completions", dict(prompt=PROMPT, best_of=2), "best_of", "best_of"),
    # OpenAI's deprecated predecessor of tools.
    ("/v1/chat/completions", dict(messages=USER, functions=[{"name": "f"}]), "functions", "functions"),
    ("/v1/responses", dict(input="Hi", conversation="conv_1"), "conversation", "conversation"),
    ("/v1/chat/completions", dict(messages=USER, stream=True, stream_options={"obfuscation": True}),
     "stream_options", "stream_options.obfuscation"),
    ("/v1/chat/completions", dict(messages=USER, response_format={"type": "json_object", "schema": {}}),
     "response_format", "response_format.schema"),
    ("/tokenize", dict(prompt=PROMPT, return_token_strs=True), "return_token_strs", "return_token_strs"),
]


@pytest.mark.parametrize("path, body, param, name", UNSUPPORTED, ids=[u[3] for u in UNSUPPORTED])
def test_issue25_a_field_the_server_does_not_support_is_refused_naming_it(ready, path, body, param, name):
    refused(ready, path, body, param, f"{name}: jaxllm does not support this field")


def test_issue25_llm_generate_refuses_a_priority_its_fcfs_engine_ignores(llm):
    with pytest.raises(ValueError, match=r"priority=5 is not honoured by scheduling_policy='fcfs'"):
        llm.generate([PROMPT, "One day"], GREEDY, priority=[0, 5], use_tqdm=False)
    assert not llm.engine.output_processor.requests  # the prompt queued before the refused one was taken back
    assert llm.generate(PROMPT, GREEDY, priority=[0], use_tqdm=False)[0].outputs[0].text.startswith(", there was")


def test_issue25_after_the_refusals_no_request_or_kv_block_is_lost(ready, llm):
    text = completion(ready, prompt=PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]
    assert text == llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text
    wait_until_idle(ready)


def test_issue55_bad_words_and_allowed_token_ids_constrain_the_text_as_llm_generate_does(ready, llm):
    greedy = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text
    assert "Lily" in greedy
    for field, value in [("bad_words", ["Lily"]), ("allowed_token_ids", [261, 378, 403, 407, 2])]:
        want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, **{field: value}),
                            use_tqdm=False)[0].outputs[0]
        got = completion(ready, prompt=PROMPT, max_tokens=12, temperature=0, **{field: value})
        assert got["choices"][0]["text"] == want.text != greedy
        if field == "bad_words":
            assert "Lily" not in want.text
        else:
            assert set(want.token_ids) <= set(value)


def test_issue55_truncate_prompt_tokens_keeps_the_prompts_last_or_first_tokens(ready, llm):
    prompt = long_prompt(55)
    for side, kept in [(None, prompt[-10:]), ("left", prompt[-10:]), ("right", prompt[:10])]:
        body = completion(ready, prompt=prompt, max_tokens=1, temperature=0, echo=True, truncate_prompt_tokens=10,
                          **({} if side is None else {"truncation_side": side}))
        assert body["usage"]["prompt_tokens"] == 10
        assert body["choices"][0]["text"].startswith(llm.tokenizer.decode(kept))
    whole = chat(ready, messages=USER, max_tokens=1)["usage"]["prompt_tokens"]
    assert chat(ready, messages=USER, max_tokens=1, truncate_prompt_tokens=4)["usage"]["prompt_tokens"] == 4 < whole
    assert chat(ready, messages=USER, max_tokens=1, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == whole
    refused(ready, "/v1/completions", dict(prompt=prompt, truncate_prompt_tokens=0), "truncate_prompt_tokens",
            "must be -1 or in [1, max_model_len=512]")


def test_issue55_documents_and_reasoning_effort_are_chat_template_variables():
    documents = [{"title": "Tom", "text": "Tom has a dog."}]
    request = ChatCompletionRequest(messages=USER, documents=documents, reasoning_effort="low")
    assert chat_template_kwargs(request) == {"documents": documents, "reasoning_effort": "low",
                                             "enable_thinking": True}
    assert chat_template_kwargs(ChatCompletionRequest(messages=USER, reasoning_effort="none")) == {
        "reasoning_effort": "none", "enable_thinking": False}
    # The request's own chat_template_kwargs win, as in vLLM.
    assert chat_template_kwargs(ChatCompletionRequest(messages=USER, reasoning_effort="high", chat_template_kwargs={
        "enable_thinking": False}))["enable_thinking"] is False
    assert chat_template_kwargs(ChatCompletionRequest(messages=USER)) is None


# Every field of the request models and the test that shows it honoured (or refused where it cannot be).
FIELD_TESTS = {
    "model": server_tests.test_bad_request_gets_its_status_and_an_openai_error_body,
    "prompt": server_tests.test_token_id_prompts_and_several_prompts_number_their_choices,
    "messages": server_tests.test_greedy_chat_equals_llm_chat,
    "max_tokens": server_tests.test_greedy_completion_equals_llm_generate,
    "max_completion_tokens": server_tests.test_greedy_chat_equals_llm_chat,
    "n": server_tests.test_n_2_gives_two_seeded_choices_equal_to_llm_generate,
    **{name: server_tests.test_every_sampling_field_reaches_sampling_params for name in (
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "seed", "stop_token_ids", "logit_bias", "ignore_eos", "min_tokens")},
    "stop": server_tests.test_stop_string_cuts_the_text_and_is_the_stop_reason,
    "skip_special_tokens": test_issue25_skip_special_tokens_and_include_stop_str_in_output_are_honoured,
    "include_stop_str_in_output": test_issue25_skip_special_tokens_and_include_stop_str_in_output_are_honoured,
    "priority": test_issue25_priority_on_a_priority_server_runs_the_urgent_request_first,
    "cache_salt": test_issue25_a_request_with_another_cache_salt_reads_0_cached_tokens,
    "prompt_logprobs": test_issue25_prompt_logprobs_equal_llm_generate,
    "return_tokens_as_token_ids": test_issue25_return_tokens_as_token_ids_spells_logprob_tokens_as_ids,
    "response_format": server_tests.test_response_format_and_structured_outputs_constrain_chat_as_llm_does,
    "structured_outputs": server_tests.test_response_format_and_structured_outputs_constrain_chat_as_llm_does,
    "stream": server_tests.test_streamed_completion_adds_up_to_the_whole_text_and_ends_with_usage_and_done,
    "stream_options": test_issue25_stream_options_without_stream_is_refused,
    "logprobs": server_tests.test_logprobs_equal_llm_generate,
    "top_logprobs": server_tests.test_logprobs_equal_llm_generate,
    "echo": test_issue25_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing,
    "add_generation_prompt": test_issue25_add_generation_prompt_false_leaves_out_the_assistant_cue,
    "continue_final_message": test_issue25_continue_final_message_continues_the_last_message,
    "add_special_tokens": test_issue25_tokenize_add_special_tokens_false_leaves_out_bos,
    "tools": tools_tests.test_tools_tool_calls_and_tool_results_reach_the_chat_template,
    "tool_choice": tools_tests.test_named_tool_choice_returns_a_call_whose_arguments_validate,
    "parallel_tool_calls": tools_tests.test_required_tool_choice_returns_calls_whose_arguments_validate,
    "chat_template_kwargs": tools_tests.test_chat_template_kwargs_reach_the_template,
    "include_reasoning": tools_tests.test_include_reasoning_false_drops_the_reasoning,
    "bad_words": test_issue55_bad_words_and_allowed_token_ids_constrain_the_text_as_llm_generate_does,
    "allowed_token_ids": test_issue55_bad_words_and_allowed_token_ids_constrain_the_text_as_llm_generate_does,
    "truncate_prompt_tokens": test_issue55_truncate_prompt_tokens_keeps_the_prompts_last_or_first_tokens,
    "truncation_side": test_issue55_truncate_prompt_tokens_keeps_the_prompts_last_or_first_tokens,
    "reasoning_effort": tools_tests.test_issue55_reasoning_effort_reaches_the_chat_template,
    "documents": test_issue55_documents_and_reasoning_effort_are_chat_template_variables,
}


def test_issue25_every_request_field_is_honoured_by_a_named_test():
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | \
        (set(TokenizeRequest.model_fields) - {"model", "prompt", "messages"})
    assert fields == set(FIELD_TESTS)


# ---- issue 55, item 1: a field vLLM accepts, jaxllm accepts ------------------------------------------------------

# The fields of vLLM 0.33.0's request models, in their order there (vllm/entrypoints/openai/completion/protocol.py
# CompletionRequest, chat_completion/protocol.py ChatCompletionRequest, responses/protocol.py ResponsesRequest, from
# the vllm-0.33.0 wheel on PyPI); chat's last five are OpenAI fields vLLM accepts without declaring them.
_VLLM_EXTRAS = ["priority", "request_id", "session_id", "return_tokens_as_token_ids", "return_token_ids",
                "return_weight_versions", "routed_experts_prompt_start", "return_token_offsets"]
VLLM_COMPLETION_FIELDS = [
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
    "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "allowed_token_ids", "logprob_token_ids", "bad_words", "prompt_embeds", "add_special_tokens",
    "response_format", "structured_outputs", *_VLLM_EXTRAS, "mm_payload", "return_mm_kwargs", "cache_salt",
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection", "thinking_token_budget",
    "stream_interval"]
VLLM_CHAT_FIELDS = [
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "thinking_token_budget", "include_reasoning",
    "parallel_tool_calls", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side",
    "prompt_logprobs", "logprob_token_ids", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "media_io_kwargs", "mm_processor_kwargs", "structured_outputs", *_VLLM_EXTRAS, "return_prompt_text",
    "mm_payload", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "stream_interval",
    "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"]
VLLM_RESPONSES_FIELDS = [
    "background", "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model",
    "logit_bias", "parallel_tool_calls", "previous_response_id", "prompt", "reasoning", "include_reasoning",
    "service_tier", "store", "stream", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p",
    "top_k", "min_p", "truncation", "user", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "prompt_cache_key",
    "prompt_cache_options", "prompt_cache_retention", "safety_identifier", "watermarking", "request_id",
    "session_id", "media_io_kwargs", "mm_processor_kwargs", "priority", "mm_payload", "return_mm_kwargs",
    "cache_salt", "enable_response_messages", "previous_input_messages", "structured_outputs", "repetition_penalty",
    "seed", "stop", "stop_token_ids", "ignore_eos", "vllm_xargs", "kv_transfer_params", "ec_transfer_params",
    "chat_template_kwargs"]

RESPONSES_TOOL = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"],
    "additionalProperties": False}}
# A typical value of each field, as the body's fields (with the companions it needs); None: the model's name.
TYPICAL = {
    "model": None, "prompt": {"prompt": "One day"}, "messages": {"messages": PREFILLED[:1]},
    "input": {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]},
    "echo": True, "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"5": 1.0}, "max_tokens": 3,
    "max_completion_tokens": 3, "max_output_tokens": 3, "n": 2, "seed": 7, "stop": ["\n"],
    "stream": True, "stream_options": {"stream": True, "stream_options": {"include_usage": True,
                                                                         "continuous_usage_stats": True}},
    "suffix": " The end.", "temperature": 0.5, "top_p": 0.9, "user": "user-1234", "use_beam_search": True,
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "watermarking": True, "length_penalty": 1.2,
    "stop_token_ids": [2], "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 1,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "truncate_prompt_tokens": 3,
    "truncation_side": "left", "allowed_token_ids": [261, 378, 403, 407], "logprob_token_ids": [5],
    "bad_words": ["Lily"], "prompt_embeds": "AAAAAA==", "add_special_tokens": False,
    "response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["yes", "no"]}, "priority": 1,
    "request_id": "my-request-1", "session_id": "session-1", "return_token_ids": True,
    "return_weight_versions": True, "routed_experts_prompt_start": 0, "return_token_offsets": True,
    "mm_payload": "tensors", "return_mm_kwargs": True, "cache_salt": "tenant-55",
    "kv_transfer_params": {"do_remote_decode": True}, "ec_transfer_params": {"do_remote_encode": True},
    "vllm_xargs": {"my_arg": 1}, "repetition_detection": {"max_pattern_size": 4}, "thinking_token_budget": 64,
    "stream_interval": 2, "reasoning_effort": "low", "include_reasoning": False, "parallel_tool_calls": False,
    "add_generation_prompt": False, "documents": [{"title": "Tom", "text": "Tom has a dog."}],
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": False},
    "media_io_kwargs": {"image": {"num_frames": 1}}, "mm_processor_kwargs": {"num_crops": 4},
    "prompt_logprobs": 1, "return_prompt_text": True, "store": True, "metadata": {"team": "qa"},
    "service_tier": "auto", "prompt_cache_key": "user-1234-session", "safety_identifier": "user-1234",
    "background": True, "instructions": "Be brief.", "max_tool_calls": 2,
    "reasoning": {"effort": "low", "summary": "auto"}, "text": {"format": {"type": "json_object"}},
    "truncation": "auto", "prompt_cache_options": {"enabled": True}, "prompt_cache_retention": "24h",
    "enable_response_messages": True, "previous_input_messages": [{"role": "user", "content": "Hi"}],
}
# Values that need companions, per endpoint.
TYPICAL_BY_ENDPOINT = {
    "completions": {"logprobs": 2, "return_tokens_as_token_ids": {"logprobs": 1, "return_tokens_as_token_ids": True}},
    "chat": {"logprobs": True, "top_logprobs": {"logprobs": True, "top_logprobs": 2},
             "return_tokens_as_token_ids": {"logprobs": True, "return_tokens_as_token_ids": True},
             "tools": {"tools": tools_tests.TOOLS, "tool_choice": "none"},
             "tool_choice": {"tools": tools_tests.TOOLS, "tool_choice": "required"},
             "continue_final_message": {"messages": PREFILLED, "continue_final_message": True,
                                        "add_generation_prompt": False}},
    "responses": {"tools": {"tools": [RESPONSES_TOOL], "tool_choice": "none"},
                  "tool_choice": {"tools": [RESPONSES_TOOL], "tool_choice": "required"},
                  "top_logprobs": {"top_logprobs": 2, "include": ["message.output_text.logprobs"]},
                  "include": [], "stream": True, "previous_response_id": "stored", "prompt": {"id": "pmpt_123"}},
}
# The fields whose typical value is refused (what the table in field_policy must say); field@endpoint: there only.
REFUSED_TYPICAL = {
    "watermarking", "logprob_token_ids", "prompt_embeds", "return_token_ids",
    "return_weight_versions", "return_token_offsets", "return_mm_kwargs", "kv_transfer_params", "ec_transfer_params",
    "vllm_xargs", "repetition_detection", "thinking_token_budget", "suffix", "echo@chat", "chat_template",
    "return_prompt_text", "background", "prompt@responses", "enable_response_messages", "previous_input_messages"}
ENDPOINTS = {"completions": ("/v1/completions", VLLM_COMPLETION_FIELDS, dict(prompt=PROMPT, max_tokens=2)),
             "chat": ("/v1/chat/completions", VLLM_CHAT_FIELDS, dict(messages=USER, max_tokens=2)),
             "responses": ("/v1/responses", VLLM_RESPONSES_FIELDS, dict(input="Tell me a story.",
                                                                        max_output_tokens=2))}
VLLM_FIELDS = [(endpoint, field) for endpoint, (_, fields, _) in ENDPOINTS.items() for field in fields]


def typical(endpoint: str, field: str) -> dict:
    by_endpoint = TYPICAL_BY_ENDPOINT[endpoint]
    value = by_endpoint[field] if field in by_endpoint else TYPICAL[field]
    return value if isinstance(value, dict) and field in value else {field: value}


def test_every_vllm_field_has_a_rule_and_the_refused_ones_are_those_listed():
    for endpoint, field in VLLM_FIELDS:
        assert field in field_policy.TABLE[endpoint], (endpoint, field)
    refused = {(endpoint, field) for endpoint, field in VLLM_FIELDS
               if field_policy.refusal(endpoint, typical(endpoint, field)) is not None}
    assert refused == {(endpoint, field) for endpoint, field in VLLM_FIELDS
                       if field in REFUSED_TYPICAL or f"{field}@{endpoint}" in REFUSED_TYPICAL}


@pytest.mark.parametrize("endpoint, field", VLLM_FIELDS, ids=[f"{e}-{f}" for e, f in VLLM_FIELDS])
def test_issue55_every_vllm_field_is_honoured_accepted_or_refused_naming_it_as_the_table_says(ready, endpoint,
                                                                                              field):
    path, _, base = ENDPOINTS[endpoint]
    body = {**base, **typical(endpoint, field)}
    if field == "model":
        body["model"] = httpx.get(f"{ready.url}/v1/models").json()["data"][0]["id"]
    if field == "previous_response_id":
        body["previous_response_id"] = post(ready, path, base).json()["id"]
    response = post(ready, path, body)
    rule = field_policy.TABLE[endpoint][field]
    if rule.refuses(body[field]):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and error["message"].startswith(f"{field}="), error
    else:
        assert response.status_code == 200, response.text
        if not body.get("stream"):
            assert response.json()["usage"]


def stream_chunks(server, path, body) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", dict(prompt=[PROMPT, "One day, Lily"], n=2, max_tokens=7, temperature=1, seed=3,
                             ignore_eos=True)),
    ("/v1/chat/completions", dict(messages=USER, n=2, max_tokens=7, temperature=1, seed=3, ignore_eos=True)),
], ids=["completions", "chat"])
def test_issue55_continuous_usage_stats_puts_usage_on_every_chunk_adding_up_to_the_final_usage(ready, path, body):
    chunks = stream_chunks(ready, path, {**body, "stream": True,
                                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *deltas, final = chunks
    assert final["choices"] == [] and all(c["usage"] is not None for c in chunks)
    last = {}  # choice index -> the usage on its last chunk
    for chunk in deltas:
        (choice,) = chunk["choices"]
        usage, before = chunk["usage"], last.get(choice["index"])
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert before is None or (usage["prompt_tokens"] == before["prompt_tokens"]
                                  and usage["completion_tokens"] >= before["completion_tokens"])
        last[choice["index"]] = usage
    assert len(last) == (4 if path == "/v1/completions" else 2)
    assert sum(u["completion_tokens"] for u in last.values()) == final["usage"]["completion_tokens"] == 7 * len(last)
    per_prompt = {i // 2: u["prompt_tokens"] for i, u in last.items()}
    assert sum(per_prompt.values()) == final["usage"]["prompt_tokens"]
    # Without include_usage no chunk carries usage (vLLM's should_include_usage).
    plain = stream_chunks(ready, path, {**body, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c or c["usage"] is None for c in plain)


# guidellm 0.8.1's request bodies (guidellm/backends/openai/request_handlers.py: TextCompletionsRequestHandler,
# ChatCompletionsRequestHandler and ResponsesRequestHandler .format, streaming with a fixed output length; the
# model name and texts are ours).
GUIDELLM_BODIES = [
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                         "max_tokens": 8, "stop": None, "ignore_eos": True, "prompt": "Once upon a time there"}),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": True,
                                                                 "continuous_usage_stats": True},
                              "max_completion_tokens": 8, "stop": None, "ignore_eos": True,
                              "messages": [{"role": "system", "content": "A story."},
                                           {"role": "user", "content": [{"type": "text", "text": "Once upon"}]}]}),
    ("/v1/responses", {"stream": True, "max_output_tokens": 8, "stop": None, "ignore_eos": True,
                       "instructions": "A story.",
                       "input": [{"role": "user", "content": [{"type": "input_text", "text": "Once upon"}]}]}),
]


@pytest.mark.parametrize("path, body", GUIDELLM_BODIES, ids=["completions", "chat", "responses"])
def test_issue55_guidellms_request_bodies_are_answered_with_the_tokens_asked_for(ready, path, body):
    body = {"model": httpx.get(f"{ready.url}/v1/models").json()["data"][0]["id"], **body}
    if path == "/v1/responses":
        with httpx.stream("POST", f"{ready.url}{path}", json=body, timeout=300) as response:
            assert response.status_code == 200, response.read()
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["usage"]["output_tokens"] == 8
        return
    chunks = stream_chunks(ready, path, body)
    assert all(c["usage"] is not None for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 8 == chunks[-2]["usage"]["completion_tokens"]


def test_use_beam_search_returns_the_offline_beams_best_first(ready, llm):
    # vLLM's use_beam_search was refused before; n is the beam width.
    body = completion(ready, prompt=PROMPT, max_tokens=8, n=3, use_beam_search=True, length_penalty=1.0,
                      temperature=0)
    [want] = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=8))
    prompt_len = len(llm.engine.encode_prompt(PROMPT)[1])
    texts = [llm.tokenizer.decode(s.tokens[prompt_len:]) for s in want.sequences]
    assert [c["text"] for c in body["choices"]] == texts and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == sum(len(s.tokens) - prompt_len for s in want.sequences)
    # A chat's beams are the offline search's over the rendered prompt.
    answer = chat(ready, messages=USER, max_tokens=4, n=2, use_beam_search=True, temperature=0)
    rendered = llm.chat(USER, GREEDY, chat_template=TEMPLATE, use_tqdm=False)[0].prompt_token_ids
    [offline] = llm.beam_search([rendered], BeamSearchParams(beam_width=2, max_tokens=4))
    assert [c["message"]["content"] for c in answer["choices"]] == \
        [llm.tokenizer.decode(s.tokens[len(rendered):]) for s in offline.sequences]
    assert [c["finish_reason"] for c in answer["choices"]] == ["length", "length"]
    for extra, param in ((dict(logprobs=2), "logprobs"), (dict(n=11), "n"),
                         (dict(length_penalty="x"), "length_penalty"),
                         (dict(allowed_token_ids=[5, 6]), "allowed_token_ids"),
                         (dict(response_format={"type": "json_object"}), "response_format")):
        response = post(ready, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True,
                                                   **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
