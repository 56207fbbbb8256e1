"""LoRA adapters through ``jaxllm serve`` and the ``openai`` client (vLLM's ``--lora-modules``, ``/v1/models``
with ``parent``, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``), on one stories260K server.

Reference: ``LLM`` in this process with the same engine flags and the same adapters (greedy, exact tokens). The
adapters are PEFT folders made by ``peft`` over stories260K with random A and B (``tests.test_lora.make_adapter``).
"""

from __future__ import annotations

import json
import os
import threading
import types

import httpx
import pytest

from jaxllm import LLM, LoRARequest, SamplingParams
from tests.server_process import ENGINE, Server, engine_flags

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

PROMPT = "Once upon a time"
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
# name: (seed, rank, lora_alpha, use_rslora, target modules)
ADAPTERS = {
    "sql": (1, 4, 8, False, ["q_proj", "v_proj", "down_proj"]),
    "chat": (2, 8, 16, True, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "third": (3, 2, 4, False, ["o_proj", "up_proj"]),
    "wide": (4, 16, 16, False, ["q_proj"]),
    "head": (5, 4, 8, False, ["q_proj", "lm_head"]),
}


@pytest.fixture(scope="module")
def folders(stories_dir, tmp_path_factory):
    from tests.test_lora import make_adapter

    root = tmp_path_factory.mktemp("lora_server")
    for name, (seed, rank, alpha, rslora, targets) in ADAPTERS.items():
        make_adapter(stories_dir, root / name, seed, rank, alpha, rslora, targets)
    return {name: str(root / name) for name in ADAPTERS}


@pytest.fixture(scope="module")
def server(stories_dir, folders, tmp_path_factory):
    """``sql`` given as name=path, ``chat`` as JSON; the load / unload routes switched on. Launched, not waited
    for: ``client`` waits, once the reference engine is built."""
    chat = json.dumps({"name": "chat", "path": folders["chat"], "base_model_name": str(stories_dir)})
    flags = engine_flags() + ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "2",
                              "--chat-template", CHAT_TEMPLATE, "--lora-modules", f"sql={folders['sql']}", chat]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    server = Server(stories_dir, *flags, log=tmp_path_factory.mktemp("server") / "server.log", env=env)
    server.launch()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server, reference):
    return server.wait_ready().openai_client()


@pytest.fixture(scope="module")
def reference(stories_dir, folders):
    """Greedy token ids of the offline engine: ``reference(adapter name or None, max_tokens)``."""
    llm = LLM(model=str(stories_dir), **ENGINE, **LORA)
    ids = {name: i for i, name in enumerate(ADAPTERS, start=1)}

    def tokens(name, max_tokens=12):
        lora = None if name is None else LoRARequest(name, ids[name], folders[name])
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return list(llm.generate(PROMPT, params, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids)

    return tokens


def _complete(client, model, max_tokens=12, prompt=PROMPT):
    """The completion's token ids and its response's ``model``."""
    done = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(t.removeprefix("token_id:")) for t in done.choices[0].logprobs.tokens], done.model


def _post(client, route, body):
    """POST a body to a ``/v1`` route with the ``openai`` client; the raw ``httpx.Response`` (errors raise)."""
    return client.post(route, body=body, cast_to=httpx.Response)


def test_a_request_by_adapter_name_gets_the_offline_engines_tokens(client, server, reference):
    base = str(server.argv[4])
    assert _complete(client, "sql") == (reference("sql"), "sql")
    assert _complete(client, "chat") == (reference("chat"), "chat")
    assert _complete(client, base) == (reference(None), base)
    assert len({tuple(reference(name)) for name in ("sql", "chat", None)}) == 3


def test_chat_and_responses_run_under_the_adapter_their_model_names(client, server):
    messages = [{"role": "user", "content": PROMPT}]
    ids = httpx.post(f"{server.url}/tokenize", json={"model": "sql", "messages": messages}).json()["tokens"]
    want = client.completions.create(model="sql", prompt=ids, max_tokens=12, temperature=0).choices[0].text
    chat = client.chat.completions.create(model="sql", messages=messages, max_tokens=12, temperature=0)
    assert (chat.choices[0].message.content, chat.model) == (want, "sql")
    response = client.responses.create(model="sql", input=PROMPT, max_output_tokens=12, temperature=0)
    assert (response.output_text, response.model) == (want, "sql")
    base = client.chat.completions.create(model=str(server.argv[4]), messages=messages, max_tokens=12,
                                          temperature=0)
    assert base.choices[0].message.content != want


def test_an_unknown_model_is_a_404_naming_it(client):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_models_lists_each_adapter_with_the_base_model_as_parent(client, server, folders):
    base = str(server.argv[4])
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert {name: (c["parent"], c["root"]) for name, c in cards.items() if name != base} == {
        "sql": (base, folders["sql"]), "chat": (base, folders["chat"])}
    assert (cards[base]["parent"], cards[base]["root"]) == (None, base)


def test_load_and_unload_at_run_time_more_adapters_than_max_cpu_loras(client, folders, reference):
    assert _post(client, "/load_lora_adapter", {"lora_name": "third", "lora_path": folders["third"]}).text == \
        "Success: LoRA adapter 'third' added successfully."
    assert "third" in {m.id for m in client.models.list().data}
    # Three adapters over max_cpu_loras=2 host seats and max_loras=2 slots: each still gives its tokens.
    for name in ("third", "sql", "chat", "third"):
        assert _complete(client, name)[0] == reference(name)
    with pytest.raises(openai.BadRequestError, match="The lora adapter 'third' has already been loaded"):
        _post(client, "/load_lora_adapter", {"lora_name": "third", "lora_path": folders["sql"]})
    # load_inplace: the name serves the new folder.
    _post(client, "/load_lora_adapter", {"lora_name": "third", "lora_path": folders["sql"], "load_inplace": True})
    assert _complete(client, "third")[0] == reference("sql")
    assert _post(client, "/unload_lora_adapter", {"lora_name": "third"}).text == \
        "Success: LoRA adapter 'third' removed successfully."
    assert "third" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError, match="The model `third` does not exist"):
        _complete(client, "third")
    with pytest.raises(openai.NotFoundError, match="The lora adapter 'third' cannot be found"):
        _post(client, "/unload_lora_adapter", {"lora_name": "third"})


def test_unloading_an_adapter_in_use_lets_its_requests_finish_under_it(client, server, folders, reference):
    """vLLM's behaviour: running requests keep their adapter; no KV block is lost, nothing is preempted."""
    _post(client, "/load_lora_adapter", {"lora_name": "third", "lora_path": folders["third"]})
    kv = httpx.get(f"{server.url}/debug/kv", params={"block_map": "false"}).json()
    stream = client.completions.create(model="third", prompt=PROMPT, max_tokens=150, temperature=0, logprobs=0,
                                       stream=True, extra_body={"ignore_eos": True,
                                                                "return_tokens_as_token_ids": True})
    tokens, base = [], {}
    worker = threading.Thread(target=lambda: base.update(out=_complete(client, str(server.argv[4]))))
    for chunk in stream:
        tokens += chunk.choices[0].logprobs.tokens if chunk.choices and chunk.choices[0].logprobs else []
        if tokens and worker.ident is None:  # the first token: unload while it runs, and start a base request
            _post(client, "/unload_lora_adapter", {"lora_name": "third"})
            worker.start()
    worker.join()
    assert [int(t.removeprefix("token_id:")) for t in tokens] == reference("third", 150)
    assert base["out"][0] == reference(None)
    after = httpx.get(f"{server.url}/debug/kv", params={"block_map": "false"}).json()
    assert after["num_preemptions"] == kv["num_preemptions"]
    assert (after["num_used_blocks"], after["num_running"], after["num_waiting"]) == (1, 0, 0)


@pytest.mark.parametrize(("body", "error", "message"), [
    ({"lora_name": "wide", "lora_path": "wide"}, openai.BadRequestError,
     r"LoRA adapter 'wide': rank r=16 is above max_lora_rank=8"),
    ({"lora_name": "head", "lora_path": "head"}, openai.BadRequestError,
     r"LoRA adapter 'head': target module 'lm_head' is not supported; the engine adapts \['mlp.down_proj'"),
    ({"lora_name": "gone", "lora_path": "/nonexistent/adapter"}, openai.NotFoundError,
     r"LoRA adapter 'gone': No adapter found at /nonexistent/adapter"),
    ({"lora_name": "sql", "lora_path": "third"}, openai.BadRequestError,
     r"The lora adapter 'sql' has already been loaded"),
    ({"lora_name": "", "lora_path": "third"}, openai.BadRequestError,
     r"Both 'lora_name' and 'lora_path' must be provided"),
])
def test_a_refused_adapter_is_an_error_naming_the_value_and_the_limit(client, folders, body, error, message):
    path = folders.get(body["lora_path"], body["lora_path"])
    names = {m.id for m in client.models.list().data}
    with pytest.raises(error, match=message):
        _post(client, "/load_lora_adapter", {**body, "lora_path": path})
    assert {m.id for m in client.models.list().data} == names


def test_the_load_routes_exist_only_with_the_runtime_switch(monkeypatch):
    """vLLM serves them only when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true: otherwise a 404 (no such route)."""
    from jaxllm.entrypoints.openai.api_server import build_app

    routes = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    for value, served in (("", False), ("0", False), ("false", False), ("1", True), ("TRUE", True)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert (routes <= {r.path for r in build_app(types.SimpleNamespace(engine=None)).routes}) is served


@pytest.mark.parametrize(("argv", "message"), [
    (["--lora-modules", "sql=/x"], "error: --lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "sql"], "'sql' is neither name=path nor JSON"),
    (["--enable-lora", "--lora-modules", '{"name": "sql"}'], "is not a JSON object with 'name' and 'path'"),
])
def test_serve_refuses_a_bad_lora_modules_flag(argv, message, capsys):
    from jaxllm.entrypoints.openai.api_server import main

    try:
        status = main(["model", *argv])
    except SystemExit as e:  # argparse's refusal
        status = e.code
    assert status == 2 and message in capsys.readouterr().err
