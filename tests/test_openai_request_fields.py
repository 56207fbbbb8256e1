"""Issue 25, item 4: no request field is silently ignored. Each field the server accepts is honoured (checked here
against ``LLM`` in this process, or by what it changes); every other field, and every combination that cannot be
honoured, is a 400 naming the field; after the refusals no request or KV block is lost.

The server is a real ``jaxllm serve`` on stories260K, which ships no chat template: it gets one with
``--chat-template`` (a file holding ``TEMPLATE``), and runs the ``priority`` scheduling policy. The fcfs refusal of
``priority`` is in ``test_openai_server.py``, whose server runs fcfs.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import numpy as np
import pytest

import tests.test_openai_server as server_tests
import tests.test_openai_tools as tools_tests
from jaxllm import LLM, SamplingParams
from jaxllm.entrypoints.openai.api_server import main as serve_main
from jaxllm.entrypoints.openai import protocol
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
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
            "function": {"name": "f"}, "model_path": "m", "tokens": [1], "type": "text"}
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
    ("/v1/completions", dict(prompt=PROMPT, user="alice"), "user", "user"),
    ("/v1/completions", dict(prompt=PROMPT, suffix="The end."), "suffix", "suffix"),
    ("/v1/completions", dict(prompt=PROMPT, best_of=2), "best_of", "best_of"),
    ("/v1/completions", dict(prompt=PROMPT, add_special_tokens=False), "add_special_tokens", "add_special_tokens"),
    # OpenAI's deprecated predecessor of tools.
    ("/v1/chat/completions", dict(messages=USER, functions=[{"name": "f"}]), "functions", "functions"),
    ("/v1/chat/completions", dict(messages=USER, echo=True), "echo", "echo"),
    ("/v1/chat/completions", dict(messages=USER, chat_template="{{ messages }}"), "chat_template", "chat_template"),
    ("/v1/chat/completions", dict(messages=USER, stream=True, stream_options={"continuous_usage_stats": True}),
     "stream_options", "stream_options.continuous_usage_stats"),
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
}


def test_issue25_every_request_field_is_honoured_by_a_named_test():
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | \
        (set(TokenizeRequest.model_fields) - {"model", "prompt", "messages"})
    assert fields == set(FIELD_TESTS)
