"""``jaxllm serve``'s weight and sleep routes (``JAXLLM_SERVER_DEV_MODE=1``, as vLLM's dev mode): ``/sleep``,
``/wake_up``, ``/is_sleeping``, ``/reset_prefix_cache``, SGLang's ``/update_weights_from_disk``, and vLLM's RL routes
``/pause`` (modes abort, wait, keep), ``/resume``, ``/is_paused``, ``/abort_requests``, ``/get_world_size``, on a real
server over stories260K, against the in-process engine."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import threading
import time
import types

import httpx
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from tests.server_process import ENGINE, Server, engine_flags

PROMPT = "Once upon a time"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def scaled_checkpoint(stories_dir, tmp_path_factory):
    """stories260K with every MLP down projection scaled by 8: other greedy tokens."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path_factory.mktemp("scaled") / "stories260K"
    shutil.copytree(stories_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors = {k: v * np.float32(8.0) if "down_proj" in k else v for k, v in tensors.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    os.environ["JAXLLM_SERVER_DEV_MODE"] = "1"
    try:
        server = Server(stories_dir, *engine_flags(), "--enable-sleep-mode",
                        log=tmp_path_factory.mktemp("server") / "server.log").launch()
    finally:
        del os.environ["JAXLLM_SERVER_DEV_MODE"]
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _reference(model):
    llm = LLM(model=model, **ENGINE)
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text


def _complete(server):
    return httpx.post(f"{server.url}/v1/completions", timeout=300,
                      json={"model": str(server.argv[4]), "prompt": PROMPT, "max_tokens": 12, "temperature": 0})


def test_sleep_refuses_requests_with_503_until_wake_up_and_then_serves_the_same_text(server, stories_dir):
    text = _reference(stories_dir)
    assert _complete(server).json()["choices"][0]["text"] == text
    slept = httpx.post(f"{server.url}/sleep", params={"level": 1}, timeout=60)
    assert slept.status_code == 200 and slept.json()["cores"][0]["freed_bytes"] > 0
    assert (slept.json()["status"], slept.json()["level"]) == ("sleeping", 1)  # vLLM's body
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": True}
    refused = _complete(server)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_sleeping"
    awake = httpx.post(f"{server.url}/wake_up", params={"tags": ["weights", "kv_cache"]}, timeout=60)
    assert awake.json() == {"status": "awake", "tags": ["weights", "kv_cache"]}
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": False}
    assert _complete(server).json()["choices"][0]["text"] == text


def test_update_weights_from_disk_serves_the_checkpoints_tokens(server, stories_dir, scaled_checkpoint):
    scaled = _reference(scaled_checkpoint)
    done = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": str(scaled_checkpoint)},
                      timeout=300)
    assert done.status_code == 200 and done.json()["success"] is True and done.json()["num_leaves"] == 11
    assert _complete(server).json()["choices"][0]["text"] == scaled != _reference(stories_dir)
    httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": str(stories_dir)}, timeout=300)
    assert httpx.post(f"{server.url}/reset_prefix_cache").json() == {"success": True}
    # vLLM's query flags: the running requests start over (none run now), an external cache (none here).
    assert httpx.post(f"{server.url}/reset_prefix_cache", params={"reset_running_requests": "true",
                                                                  "reset_external": "true"}).json() == {"success": True}
    assert _complete(server).json()["choices"][0]["text"] == _reference(stories_dir)


@pytest.mark.parametrize(("path", "params", "body", "status", "message"), [
    ("/sleep", {"level": 3}, None, 400, "level must be 0, 1 or 2"),
    ("/sleep", {"mode": "drain"}, None, 400, "mode='drain'"),
    ("/wake_up", {"tags": "weigths"}, None, 400, "unknown tags"),
    ("/update_weights_from_disk", None, {"model_path": "/nonexistent"}, 400, "/nonexistent"),
    ("/update_weights_from_disk", None, {"path": "x"}, 400, "path"),
])
def test_a_bad_weight_or_sleep_call_is_refused_naming_why(server, path, params, body, status, message):
    got = httpx.post(f"{server.url}{path}", params=params, json=body, timeout=60)
    assert got.status_code == status and message in got.json()["error"]["message"]
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": False}


def test_the_weight_routes_exist_only_in_dev_mode(monkeypatch):
    from jaxllm.entrypoints.openai.api_server import build_app

    routes = {"/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/update_weights_from_disk",
              "/kv_cache/compact", "/kv_cache/resize", "/release_kv_cache_memory", "/pause", "/resume", "/is_paused",
              "/abort_requests",
              "/get_world_size"}
    monkeypatch.delenv("JAXLLM_SERVER_DEV_MODE", raising=False)
    assert not routes & {r.path for r in build_app(types.SimpleNamespace(engine=None)).routes}
    monkeypatch.setenv("JAXLLM_SERVER_DEV_MODE", "1")
    assert routes <= {r.path for r in build_app(types.SimpleNamespace(engine=None)).routes}


def test_diag_compacts_and_resizes_a_running_servers_pool_while_a_request_decodes(server, stories_dir, capsys):
    """``jaxllm diag --compact --resize N`` between the core's steps while a long completion runs: its text is the
    in-process engine's, and the pool ends at N blocks with every block back."""
    import threading
    import time

    from jaxllm.entrypoints.cli import main as jaxllm_main

    params = SamplingParams(temperature=0.0, max_tokens=200)
    text = LLM(model=stories_dir, **ENGINE).generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    got = {}
    body = {"model": str(server.argv[4]), "prompt": PROMPT, "max_tokens": 200, "temperature": 0}
    worker = threading.Thread(target=lambda: got.update(
        httpx.post(f"{server.url}/v1/completions", timeout=300, json=body).json()))
    worker.start()
    while httpx.get(f"{server.url}/debug/kv", params={"block_map": "false"}).json()["num_running"] == 0:
        time.sleep(0.01)
    assert jaxllm_main(["diag", "--url", server.url, "--compact", "--resize", "64", "--timeout", "300"]) == 0
    printed = capsys.readouterr().out
    assert "core 0: compact: moved" in printed and "core 0: resize:" in printed and "now 64 blocks" in printed
    worker.join()
    assert got["choices"][0]["text"] == text
    report = httpx.get(f"{server.url}/debug/kv", params={"block_map": "false"}).json()
    assert report["num_blocks"] == 64 and report["num_used_blocks"] + report["num_cached_free_blocks"] + \
        report["num_free_blocks"] == 64 and report["num_running"] == 0


def test_a_resize_below_the_blocks_in_use_answers_400_naming_the_value(server):
    got = httpx.post(f"{server.url}/kv_cache/resize", params={"num_blocks": 1}, timeout=60)
    assert got.status_code == 400 and "num_blocks=1 must be an int >= 2" in got.json()["error"]["message"]


def _stream(server, max_tokens):
    """A greedy streamed completion of ``PROMPT``; the open response, and an iterator of its chunks' dicts."""
    response = httpx.stream("POST", f"{server.url}/v1/completions", timeout=300, json={
        "model": str(server.argv[4]), "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    opened = response.__enter__()
    chunks = (json.loads(line[6:]) for line in opened.iter_lines() if line.startswith("data: {"))
    return response, chunks


def _pause(server, **params):
    return httpx.post(f"{server.url}/pause", params=params, timeout=120)


def _all_blocks_free(server):
    report = httpx.get(f"{server.url}/debug/kv", params={"block_map": "false"}, timeout=60).json()
    return report["num_used_blocks"] == 1 and report["num_running"] == report["num_waiting"] == 0  # the null block


def test_pause_abort_finishes_a_running_request_with_abort_and_refuses_new_ones_until_resume(server, stories_dir):
    response, chunks = _stream(server, 400)
    first = next(chunks)
    assert _pause(server).json() == {"status": "paused"}
    rest = list(chunks)
    response.__exit__(None, None, None)
    texts = [first["choices"][0]["text"]] + [c["choices"][0]["text"] for c in rest if c["choices"]]
    assert rest[-1]["choices"][0]["finish_reason"] == "abort" and len(texts) < 400
    assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": True}
    refused = _complete(server)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_paused"
    assert _all_blocks_free(server)
    assert httpx.post(f"{server.url}/resume").json() == {"status": "resumed"}
    assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": False}
    assert _complete(server).json()["choices"][0]["text"] == _reference(stories_dir)


def test_pause_keep_freezes_running_requests_queues_new_ones_and_resume_finishes_both_unchanged(server, stories_dir):
    llm = LLM(model=stories_dir, **ENGINE)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0].text
    response, chunks = _stream(server, 60)
    got = [next(chunks)["choices"][0]["text"]]
    assert _pause(server, mode="keep").json() == {"status": "paused"}
    reader = threading.Thread(target=lambda: got.extend(c["choices"][0]["text"] for c in chunks if c["choices"]))
    reader.start()
    queued = concurrent.futures.ThreadPoolExecutor(1).submit(_complete, server)
    time.sleep(0.3)
    frozen = len(got)
    time.sleep(0.7)
    assert len(got) == frozen and not queued.done() and reader.is_alive()
    httpx.post(f"{server.url}/resume")
    reader.join(120)
    response.__exit__(None, None, None)
    assert "".join(got) == want
    assert queued.result(120).json()["choices"][0]["text"] == _reference(stories_dir)


def test_pause_wait_returns_once_running_requests_finished_whole(server):
    response, chunks = _stream(server, 40)
    first = next(chunks)
    pausing = concurrent.futures.ThreadPoolExecutor(1).submit(_pause, server, mode="wait")
    rest = list(chunks)
    response.__exit__(None, None, None)
    assert pausing.result(120).json() == {"status": "paused"}
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in [first, *rest] if c["choices"] and c["choices"][0]["text"]) > 1
    assert _complete(server).status_code == 503 and _all_blocks_free(server)
    # older vLLM's switch is the same as mode=wait; a mode vLLM lacks is refused, naming it
    assert _pause(server, wait_for_inflight_requests="true").status_code == 200
    bad = _pause(server, mode="drain")
    assert bad.status_code == 400 and "mode='drain'" in bad.json()["error"]["message"]
    httpx.post(f"{server.url}/resume")
    assert _complete(server).status_code == 200


def test_abort_requests_finishes_the_named_response_and_get_world_size(server):
    response, chunks = _stream(server, 400)
    first = next(chunks)
    aborted = httpx.post(f"{server.url}/abort_requests", json={"request_ids": [first["id"]], "other": 1}, timeout=60)
    rest = list(chunks)
    response.__exit__(None, None, None)
    assert aborted.json() == {"status": "aborted", "aborted": 1}
    assert rest[-1]["choices"][0]["finish_reason"] == "abort"
    assert httpx.post(f"{server.url}/abort_requests", json={}, timeout=60).json() == {"status": "aborted",
                                                                                     "aborted": 0}
    assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": False} and _all_blocks_free(server)
    assert httpx.get(f"{server.url}/get_world_size").json() == {"world_size": 1}
    # without --profiler-config, as vLLM: no profiling routes
    assert httpx.post(f"{server.url}/start_profile").status_code == 404
    assert httpx.get(f"{server.url}/get_world_size", params={"include_dp": "false"}).json() == {"world_size": 1}


def test_sleep_aborts_a_running_request_by_default_and_keep_resumes_it_unchanged(server, stories_dir):
    response, chunks = _stream(server, 400)
    next(chunks)
    assert httpx.post(f"{server.url}/sleep", params={"level": 1}, timeout=60).json()["status"] == "sleeping"
    rest = list(chunks)
    response.__exit__(None, None, None)
    assert rest[-1]["choices"][0]["finish_reason"] == "abort"
    assert httpx.post(f"{server.url}/wake_up", timeout=60).json() == {"status": "awake", "tags": None}
    llm = LLM(model=stories_dir, **ENGINE)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0].text
    response, chunks = _stream(server, 60)
    got = [next(chunks)["choices"][0]["text"]]
    assert httpx.post(f"{server.url}/sleep", params={"level": 1, "mode": "keep"}, timeout=60).status_code == 200
    reader = threading.Thread(target=lambda: got.extend(c["choices"][0]["text"] for c in chunks if c["choices"]))
    reader.start()
    time.sleep(0.5)
    assert reader.is_alive()
    httpx.post(f"{server.url}/wake_up", timeout=60)
    reader.join(120)
    response.__exit__(None, None, None)
    assert "".join(got) == want and _all_blocks_free(server)
    # vLLM's: after a level-0 sleep, free the KV cache alone, then bring it back
    httpx.post(f"{server.url}/sleep", params={"level": 0}, timeout=60)
    released = httpx.post(f"{server.url}/release_kv_cache_memory", timeout=60)
    assert released.json() == {"status": "kv_cache_released"}
    assert httpx.post(f"{server.url}/wake_up", params={"tags": "kv_cache"}, timeout=60).json()["status"] == "awake"
    assert _complete(server).json()["choices"][0]["text"] == _reference(stories_dir)
