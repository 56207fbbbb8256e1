"""The OpenAI-compatible server, run as a user runs it (``jaxllm serve`` in a subprocess) and driven by the official
``openai`` client and by raw HTTP (httpx): completions, chat, streaming, n=2, logprobs, stop strings, 64 concurrent
streams, OpenAI-shaped errors, client disconnects, SIGTERM, a killed engine core.

References: ``LLM`` in this process with the same model and engine flags (greedy, or seeded, so its tokens do not
depend on what else is batched). One server serves the module up to the SIGTERM test; a second, with two batch
seats and a waiting limit, serves the queue and crash tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams, StructuredOutputsParams
from tests.conftest import STORIES_SENTENCE
from tests.server_process import Server, alive, small_engine

openai = pytest.importorskip("openai")

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Once upon a time"
# stories260K has no chat template; the test copy gets this one (BOS, then the messages' text).
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def chat_model(stories_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("stories_chat") / "stories260K"
    shutil.copytree(stories_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = Server(chat_model, *small_engine(), "--api-key", KEY, "--served-model-name", "stories", log=log).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(model=chat_model, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=16,
               token_buckets=(16, 64), precompile=False)


def post(server, path, body, headers=AUTH, timeout=300):
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=timeout)


def wait_until_idle(server, seconds=60):
    """Poll /metrics until no request runs or waits and every KV block is free (bounded)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (server.metric("jaxllm:num_requests_running") == 0 and server.metric("jaxllm:num_requests_waiting") == 0
                and server.metric("jaxllm:num_free_kv_blocks") == server.metric("jaxllm:num_kv_blocks") - 1):
            return
        time.sleep(0.1)
    raise AssertionError("the server did not become idle with every KV block free")


def test_models_health_and_version(server, client):
    assert [m.id for m in client.models.list().data] == ["stories"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": "0.1.0"}


def test_greedy_completion_equals_llm_generate(client, llm):
    response = client.completions.create(model="stories", prompt=PROMPT, max_tokens=40, temperature=0)
    want = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    (choice,) = response.choices
    assert choice.text == want.text == STORIES_SENTENCE[len(PROMPT):]
    assert choice.finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (5, 40, 45)


def test_token_id_prompts_and_several_prompts_number_their_choices(client, llm):
    ids = [1, 403, 407, 261, 378]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].text for o in llm.generate([PROMPT, "One day"], greedy, use_tqdm=False)]
    response = client.completions.create(model="stories", prompt=[PROMPT, "One day"], max_tokens=8, temperature=0)
    assert [(c.index, c.text) for c in response.choices] == [(0, want[0]), (1, want[1])]
    assert response.usage.prompt_tokens == 5 + len(llm.tokenizer.encode("One day"))
    by_ids = client.completions.create(model="stories", prompt=[ids, ids[:3]], max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == want[0]
    assert by_ids.choices[1].text == llm.generate([ids[:3]], greedy, use_tqdm=False)[0].outputs[0].text


def test_greedy_chat_equals_llm_chat(client, llm):
    messages = [{"role": "user", "content": PROMPT}]
    response = client.chat.completions.create(model="stories", messages=messages, max_tokens=30, temperature=0)
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=30))[0]
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == want.outputs[0].text and len(want.outputs[0].text) > 20
    assert response.usage.prompt_tokens == len(want.prompt_token_ids)
    # max_completion_tokens is max_tokens' newer name.
    short = client.chat.completions.create(model="stories", messages=messages, max_completion_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


MOOD = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"],
        "additionalProperties": False}


@pytest.mark.parametrize("body, constraint", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "mood", "schema": MOOD, "strict": True}}),
     StructuredOutputsParams(json=MOOD)),
    (dict(response_format={"type": "json_object"}), StructuredOutputsParams(json_object=True)),
    (dict(extra_body={"structured_outputs": {"choice": ["happy", "sad", "tired"]}}),
     StructuredOutputsParams(choice=["happy", "sad", "tired"])),
], ids=["json_schema", "json_object", "structured_outputs"])
def test_response_format_and_structured_outputs_constrain_chat_as_llm_does(client, llm, body, constraint):
    messages = [{"role": "user", "content": PROMPT}]
    response = client.chat.completions.create(model="stories", messages=messages, max_tokens=24, temperature=0,
                                              **body)
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24, structured_outputs=constraint))[0]
    assert response.choices[0].message.content == want.outputs[0].text
    if constraint.choice:
        assert want.outputs[0].text in constraint.choice


def test_streamed_completion_adds_up_to_the_whole_text_and_ends_with_usage_and_done(server, client):
    whole = client.completions.create(model="stories", prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    chunks = list(client.completions.create(model="stories", prompt=PROMPT, max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    raw = post(server, "/v1/completions", dict(prompt=PROMPT, max_tokens=3, stream=True)).text
    events = [line for line in raw.splitlines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_streamed_chat_starts_with_the_role_and_adds_up_to_the_whole_message(client):
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="stories", messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model="stories", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_2_gives_two_seeded_choices_equal_to_llm_generate(client, llm):
    response = client.completions.create(model="stories", prompt=PROMPT, n=2, temperature=1.0, seed=7, max_tokens=12)
    want = llm.generate(PROMPT, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12), use_tqdm=False)[0]
    assert [(c.index, c.text) for c in response.choices] == [(0, want.outputs[0].text), (1, want.outputs[1].text)]
    assert response.usage.completion_tokens == 24


def test_logprobs_equal_llm_generate(client, llm):
    response = client.completions.create(model="stories", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)[0].outputs[0]
    lp = response.choices[0].logprobs
    assert lp.tokens == [entry[t].decoded_token for t, entry in zip(want.token_ids, want.logprobs)]
    np.testing.assert_allclose(lp.token_logprobs, [e[t].logprob for t, e in zip(want.token_ids, want.logprobs)],
                               atol=1e-5)
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    chat = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(item.top_logprobs) == 2 for item in content)
    # Greedy: the chosen token is the most likely one.
    assert all(item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == item.logprob
               for item in content)


def test_stop_string_cuts_the_text_and_is_the_stop_reason(server, client):
    response = client.completions.create(model="stories", prompt=PROMPT, max_tokens=40, temperature=0, stop=["Lily"])
    assert response.choices[0].text == ", there was a little girl named "
    assert response.choices[0].finish_reason == "stop"
    raw = post(server, "/v1/completions", dict(prompt=PROMPT, max_tokens=40, temperature=0, stop="Lily")).json()
    assert raw["choices"][0]["stop_reason"] == "Lily"
    streamed = client.completions.create(model="stories", prompt=PROMPT, max_tokens=40, temperature=0, stop=["Lily"],
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ", there was a little girl named "


def test_64_concurrent_streaming_clients_each_get_their_own_text(server, llm):
    prompts = ["Once upon a time", "One day", "The cat", "Tom had a", "Lily saw", "The sun", "A big dog", "Mom said"]
    want = {p: o.outputs[0].text for p, o in zip(prompts, llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False))}

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model="stories", prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True)
        return prompt, "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=600)
        async with aclient:
            return await asyncio.gather(*(one(aclient, prompts[i % 8]) for i in range(64)))

    results = asyncio.run(all_of_them())
    assert len(results) == 64
    assert all(text == want[prompt] for prompt, text in results)
    wait_until_idle(server)


BAD_REQUESTS = [
    # (name, path, body, status, param, words in the message)
    ("wrong type max_tokens", "/v1/completions", dict(prompt=PROMPT, max_tokens="ten"), 400, "max_tokens", "integer"),
    ("wrong type temperature", "/v1/completions", dict(prompt=PROMPT, temperature="hot"), 400, "temperature", "number"),
    ("wrong type n", "/v1/completions", dict(prompt=PROMPT, n=1.5), 400, "n", "integer"),
    ("wrong type stop", "/v1/completions", dict(prompt=PROMPT, stop=3), 400, "stop", "string"),
    ("prompt missing", "/v1/completions", dict(max_tokens=3), 400, "prompt", "required"),
    ("messages not a list", "/v1/chat/completions", dict(messages="hi"), 400, "messages", "list"),
    ("temperature below 0", "/v1/completions", dict(prompt=PROMPT, temperature=-1), 400, "temperature", ">= 0"),
    ("top_p above 1", "/v1/completions", dict(prompt=PROMPT, top_p=1.5), 400, "top_p", "(0, 1]"),
    ("n of 0", "/v1/completions", dict(prompt=PROMPT, n=0), 400, "n", ">= 1"),
    ("max_tokens of 0", "/v1/completions", dict(prompt=PROMPT, max_tokens=0), 400, "max_tokens", ">= 1"),
    ("logprobs above 20", "/v1/completions", dict(prompt=PROMPT, logprobs=21), 400, "logprobs", "[0, 20]"),
    ("top_logprobs above 20", "/v1/chat/completions",
     dict(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "[0, 20]"),
    ("presence_penalty above 2", "/v1/completions", dict(prompt=PROMPT, presence_penalty=3), 400, "presence_penalty",
     "[-2, 2]"),
    ("prompt over max_model_len", "/v1/completions", dict(prompt=[5] * 129, max_tokens=1), 400, "prompt",
     "longer than max_model_len=128"),
    ("prompt plus max_tokens over max_model_len", "/v1/completions", dict(prompt=PROMPT, max_tokens=200), 400,
     "max_tokens", "maximum context length is 128"),
    ("token id outside the vocabulary", "/v1/completions", dict(prompt=[1, 100000]), 400, "prompt", "vocabulary"),
    ("empty prompt", "/v1/completions", dict(prompt=""), 400, "prompt", "empty"),
    ("logit_bias key not a token id", "/v1/completions", dict(prompt=PROMPT, logit_bias={"x": 1}), 400, "logit_bias",
     "token ids"),
    ("unknown model", "/v1/completions", dict(model="gpt-5", prompt=PROMPT), 404, "model", "gpt-5"),
    ("response_format with an invalid schema", "/v1/chat/completions",
     dict(messages=[{"role": "user", "content": "hi"}],
          response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     400, "response_format", "structured_outputs.json is invalid"),
    ("response_format json_schema without a schema", "/v1/chat/completions",
     dict(messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_schema"}), 400,
     "response_format", "json_schema.schema"),
    ("structured_outputs with an invalid regex", "/v1/completions",
     dict(prompt=PROMPT, structured_outputs={"regex": "[a-"}), 400, "structured_outputs", "unclosed"),
    ("structured_outputs with two constraints", "/v1/completions",
     dict(prompt=PROMPT, structured_outputs={"regex": "a", "choice": ["a"]}), 400, "structured_outputs",
     "exactly one"),
    ("structured_outputs with an unknown field", "/v1/completions",
     dict(prompt=PROMPT, structured_outputs={"regexp": "a"}), 400, "structured_outputs", "regexp"),
]


@pytest.mark.parametrize("name, path, body, status, param, words", BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS])
def test_bad_request_gets_its_status_and_an_openai_error_body(server, name, path, body, status, param, words):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_malformed_json_wrong_key_and_unknown_route(server):
    broken = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "x",', timeout=60,
                        headers={**AUTH, "Content-Type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "json_invalid"
    for headers in ({"Authorization": "Bearer wrong"}, {}):
        response = post(server, "/v1/completions", dict(prompt=PROMPT), headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert post(server, "/v1/nothing", {}).json()["error"]["message"] == "Not Found"


def test_after_every_error_the_server_still_answers_and_no_block_is_lost(server, client):
    for _, path, body, _, _, _ in BAD_REQUESTS:
        post(server, path, body)
    wait_until_idle(server)
    text = client.completions.create(model="stories", prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    assert text == STORIES_SENTENCE[len(PROMPT):]
    wait_until_idle(server)


def test_tokenize_and_detokenize(server, llm):
    tokens = post(server, "/tokenize", dict(prompt=PROMPT)).json()
    assert tokens == {"tokens": [1, 403, 407, 261, 378], "count": 5, "max_model_len": 128}
    chat = post(server, "/tokenize", dict(messages=[{"role": "user", "content": PROMPT}])).json()
    assert chat["tokens"] == llm.chat([{"role": "user", "content": PROMPT}],
                                      SamplingParams(max_tokens=1))[0].prompt_token_ids
    assert post(server, "/detokenize", dict(tokens=[1, 403, 407, 261, 378])).json() == {"prompt": PROMPT}
    assert post(server, "/detokenize", dict(tokens=[100000])).status_code == 400


def test_metrics_endpoint_serves_the_engine_series(server):
    body = httpx.get(f"{server.url}/metrics").text
    for name in ("jaxllm:generation_tokens_total", "jaxllm:time_to_first_token_seconds_count",
                 "jaxllm:num_requests_running", "jaxllm:kv_cache_usage_perc", "jaxllm:num_free_kv_blocks"):
        assert name in body


def test_a_client_that_disconnects_aborts_its_request_and_frees_its_blocks(server):
    before = server.metric("jaxllm:generation_tokens_total")
    body = dict(prompt=PROMPT, max_tokens=120, temperature=0, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    wait_until_idle(server)
    # Aborted, not run to its 120 tokens.
    assert server.metric("jaxllm:generation_tokens_total") - before < 120


def test_a_non_streaming_client_that_disconnects_aborts_its_request(server):
    before = server.metric("jaxllm:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", dict(prompt=PROMPT, max_tokens=120, temperature=0, ignore_eos=True, n=8),
             timeout=0.5)
    wait_until_idle(server)
    assert server.metric("jaxllm:generation_tokens_total") - before < 8 * 120


def test_sigterm_lets_the_request_in_flight_finish_then_exits_0(server):
    got = {}

    def stream():
        body = dict(prompt=PROMPT, max_tokens=100, temperature=0, ignore_eos=True, stream=True)
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            got["events"] = lines

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while server.metric("jaxllm:num_requests_running") == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    server.process.send_signal(signal.SIGTERM)
    reader.join(120)
    assert server.process.wait(120) == 0
    events = got["events"]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")


# ---- a server with two batch seats and a waiting limit of one -------------------------------------------------


@pytest.fixture(scope="module")
def small_server(stories_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("small_server") / "server.log"
    server = Server(stories_dir, *small_engine(max_num_seqs=2), "--max-waiting-requests", "1", log=log).start()
    yield server
    server.stop()


def test_waiting_queue_past_the_limit_answers_503(small_server):
    body = dict(prompt=PROMPT, max_tokens=120, temperature=0, ignore_eos=True, stream=True)
    with httpx.Client(timeout=120) as http:
        streams = [http.stream("POST", f"{small_server.url}/v1/completions", json=body) for _ in range(2)]
        lines = [s.__enter__().iter_lines() for s in streams]
        assert all(next(it).startswith("data: ") for it in lines)  # both seats taken
        with httpx.Client(timeout=120) as other:
            waiting = threading.Thread(target=other.post, args=(f"{small_server.url}/v1/completions",),
                                       kwargs=dict(json={**body, "stream": False}))
            waiting.start()
            deadline = time.monotonic() + 30
            while small_server.metric("jaxllm:num_requests_waiting") < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            refused = httpx.post(f"{small_server.url}/v1/completions", json=dict(prompt=PROMPT, max_tokens=1))
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "queue_full"
            for s in streams:
                s.__exit__(None, None, None)
            waiting.join(120)
    wait_until_idle(small_server)
    assert httpx.post(f"{small_server.url}/v1/completions", json=dict(prompt=PROMPT, max_tokens=2)).status_code == 200


def test_a_killed_engine_core_fails_requests_in_flight_and_health_says_so(small_server):
    results = []

    def request():
        body = dict(prompt=PROMPT, max_tokens=120, temperature=0, ignore_eos=True, min_tokens=120)
        # Bounded: a request the dead core leaves hanging fails the test by this timeout.
        results.append(httpx.post(f"{small_server.url}/v1/completions", json=body, timeout=5 + 30))

    threads = [threading.Thread(target=request) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while small_server.metric("jaxllm:num_requests_running") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    (core,) = small_server.core_pids
    killed_at = time.monotonic()
    os.kill(core, signal.SIGKILL)
    for t in threads:
        t.join(60)
    failed_within = time.monotonic() - killed_at
    assert [r.status_code for r in results] == [500, 500]
    assert all(r.json()["error"]["code"] == "engine_dead" for r in results)
    assert failed_within < 5, f"requests failed {failed_within:.1f} s after the core was killed"
    health = httpx.get(f"{small_server.url}/health")
    assert health.status_code == 503 and "exited" in health.json()["error"]["message"]
    assert httpx.post(f"{small_server.url}/v1/completions", json=dict(prompt=PROMPT)).status_code == 500
    assert small_server.stop() == 0
    assert not alive(core)


@pytest.mark.slow
def test_default_model_server_names_paris(smollm2_gguf, tmp_path):
    server = Server(smollm2_gguf, "--max-model-len", "256", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                    "--token-buckets", "16", "64", "--precompile", "false", log=tmp_path / "server.log").start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
        chat = client.chat.completions.create(model=str(smollm2_gguf), temperature=0, max_tokens=16, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in chat.choices[0].message.content
        text = client.completions.create(model=str(smollm2_gguf), prompt="The capital of France is", max_tokens=8,
                                         temperature=0).choices[0].text
        assert "Paris" in text
    finally:
        assert server.stop() == 0
