"""Two ``jaxllm serve`` replicas behind the real ``vllm-router`` binary (PyPI ``vllm-router``) on loopback.

One module, two replicas for all of it (started side by side once); each test starts its own router (about a
second) and always stops it. Which replica served a request is read from the replicas' own ``/metrics`` (vLLM's
names, ``--metrics-namespace vllm``), never from the router. The last test kills a replica.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import msgspec
import pytest
import zmq

from tests.server_process import Server, engine_flags, free_port
from tests.test_kv_events import DECODER, BlockStored, vllm_hashes

pytestmark = [pytest.mark.router,
              pytest.mark.skipif(shutil.which("vllm-router") is None, reason="vllm-router is not installed")]

MODEL = "stories"
ROUTER_STARTUP_SECONDS = 60
# Long enough to be caught running, short enough for max_model_len 512.
LONG = 480
# stories260K has no chat template of its own.
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


class Replica(Server):
    """A ``jaxllm serve`` replica publishing its KV events on ``tcp://*:{event_port}``."""

    def __init__(self, model: Path, log: Path) -> None:
        self.event_port = free_port()
        # vLLM's default topic, the empty one: vllm-router's --kv-event-source subscribes to no other.
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.event_port}",
                  "topic": ""}
        super().__init__(model, *engine_flags(), "--served-model-name", MODEL, "--metrics-namespace", "vllm",
                         "--enable-tokenizer-info-endpoint", "--kv-events-config", json.dumps(events),
                         "--chat-template", CHAT_TEMPLATE, log=log)

    def series(self, name: str, **labels: str) -> float:
        """One series of ``/metrics`` with ``model_name`` and ``labels``."""
        want = {"model_name": MODEL, **labels}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{"):
                got = dict(part.split("=", 1) for part in line[len(name) + 1:line.index("}")].split(","))
                if {k: v.strip('"') for k, v in got.items()} == want:
                    return float(line.split()[-1])
        raise KeyError(f"{name}{want}")

    def served(self) -> float:
        """Requests this replica finished (every request here ends by length)."""
        return self.series("vllm:request_success_total", finished_reason="length")


@pytest.fixture(scope="module")
def replicas(stories_dir, tmp_path_factory) -> Iterator[list[Replica]]:
    logs = tmp_path_factory.mktemp("replicas")
    both = [Replica(stories_dir, logs / f"replica{i}.log") for i in range(2)]
    try:
        for r in both:
            r.launch()
        yield [r.wait_ready() for r in both]
    finally:
        for r in both:
            if r.process is not None:
                r.stop()


@contextlib.contextmanager
def router(replicas: list[Replica], tmp_path: Path, policy: str, *flags: str) -> Iterator[str]:
    """``vllm-router`` over the replicas on a free port; yields its URL once ``/health`` answers, and always ends it."""
    port = free_port()
    argv = ["vllm-router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--worker-urls", *[r.url for r in replicas], "--prometheus-port", str(free_port()),
            "--log-level", "info", *flags]
    log = open(tmp_path / f"router-{policy}.log", "w")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_STARTUP_SECONDS
        while not _answers(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not start: {(tmp_path / f'router-{policy}.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        process.kill()
        process.wait(30)
        log.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def complete(url: str, prompt, max_tokens: int = 2) -> dict:
    """A greedy completion through ``url``; the response body (the status must be 200)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def ask(url: str, route: str, text: str) -> dict:
    """``text`` as a greedy completion's prompt or a chat's user message, through ``url``; the response body."""
    if route == "completions":
        return complete(url, text)
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def counts(replicas: list[Replica]) -> list[tuple[float, float]]:
    """Each replica's (finished requests, prefix-cache hit tokens)."""
    return [(r.served(), r.series("vllm:prefix_cache_hits_total")) for r in replicas]


def delta(before, after) -> list[tuple[float, float]]:
    return [(a[0] - b[0], a[1] - b[1]) for b, a in zip(before, after)]


def test_replicas_answer_what_the_router_probes_as_vllm_does(replicas):
    for r in replicas:
        assert httpx.get(f"{r.url}/health", timeout=10).status_code == 200
        assert [m["id"] for m in httpx.get(f"{r.url}/v1/models", timeout=10).json()["data"]] == [MODEL]
        info = httpx.get(f"{r.url}/tokenizer_info", timeout=10).json()
        assert (info["tokenizer_class"], info["bos_token"], info["model_max_length"]) == ("LlamaTokenizer", "<s>", 512)
        assert r.series("vllm:num_requests_running") == 0


def test_round_robin_sends_every_other_request_to_each_replica(replicas, tmp_path):
    before = counts(replicas)
    with router(replicas, tmp_path, "round_robin") as url:
        for i in range(4):
            complete(url, f"Once upon a time, a cat named Tom {i}")
    assert [served for served, _ in delta(before, counts(replicas))] == [2, 2]


def test_cache_aware_sends_prefix_sharing_requests_to_the_replica_holding_the_blocks(replicas, tmp_path):
    prefix = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
              "One day, she saw a big, red ball.")
    followers = [" She ran to it.", " It was shiny.", " Her mom smiled."]
    with router(replicas, tmp_path, "cache_aware") as url:
        before = counts(replicas)
        complete(url, prefix)
        first = delta(before, counts(replicas))
        holder = [served for served, _ in first].index(1)
        cached = [complete(url, prefix + f)["usage"]["prompt_tokens_details"]["cached_tokens"] for f in followers]
    moved = delta(before, counts(replicas))
    assert moved[holder] == (4, sum(cached)) and moved[1 - holder] == (0, 0)
    assert cached == [32, 32, 32]  # the prefix's 45 tokens fill 2 blocks; each follower hit both


def test_kv_aware_router_reads_the_replicas_events_and_each_replica_publishes_the_blocks_it_computed(
        replicas, tmp_path):
    ctx = zmq.Context()
    subs = []
    for r in replicas:
        sub = ctx.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{r.event_port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        subs.append(sub)
    time.sleep(0.5)  # ZMQ's slow joiner
    prompt = [3 + (i * 37) % 500 for i in range(64)]
    sources = [f"--kv-event-source={r.url}=tcp://127.0.0.1:{r.event_port}" for r in replicas]
    before = counts(replicas)
    try:
        with router(replicas, tmp_path, "kv_aware", *sources, "--kv-event-model", MODEL) as url:
            complete(url, prompt)
        holder = [served for served, _ in delta(before, counts(replicas))].index(1)
        stored = [[e for e in _batches(sub) if isinstance(e, BlockStored)] for sub in subs]
    finally:
        ctx.destroy(linger=0)
    assert [h for e in stored[holder] for h in e.block_hashes] == vllm_hashes(prompt)
    assert stored[1 - holder] == []


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_kv_aware_sends_prefix_sharing_requests_to_the_replica_whose_events_hold_the_blocks(
        replicas, tmp_path, route):
    # One prefix computed on each replica, each behind the router's back: only the replicas' events (and the
    # render route, which gives the router each request's token ids) tell it where the blocks are. Without
    # them every request here would go to the same replica (kv_aware's fallback breaks ties the same way).
    prefixes = [f"One sunny morning ({route}), a small brown dog named Max found a shiny key under the old oak "
                "tree. He picked it up and",
                f"Sara had a red kite ({route}) with a long tail. Every day after school she ran to the big hill "
                "near her house and"]
    followers = [" ran home.", " looked around.", " smiled."]
    sources = [f"--kv-event-source={r.url}=tcp://127.0.0.1:{r.event_port}" for r in replicas]
    with router(replicas, tmp_path, "kv_aware", *sources, "--kv-event-model", MODEL) as url:
        time.sleep(0.5)  # ZMQ's slow joiner: the router's subscriptions take effect a moment after it answers
        for replica, prefix in zip(replicas, prefixes):
            ask(replica.url, route, prefix)
        time.sleep(1.0)  # the router reads the events from its subscriptions asynchronously
        before = counts(replicas)
        cached = [[ask(url, route, prefix + f)["usage"]["prompt_tokens_details"]["cached_tokens"]
                   for prefix in prefixes] for f in followers]
    per_prefix = [[row[i] for row in cached] for i in range(2)]
    assert delta(before, counts(replicas)) == [(3, sum(per_prefix[0])), (3, sum(per_prefix[1]))]
    assert per_prefix == [[64] * 3, [48] * 3]  # the prefixes fill 4 and 3 blocks; every follower hit them all


def _batches(sub: zmq.Socket) -> list:
    events = []
    while sub.poll(1000):
        _, _, payload = sub.recv_multipart()
        assert isinstance(msgspec.msgpack.decode(payload), list)  # vLLM's array-like batch, as routers read it
        events += DECODER.decode(payload).events
    return events


def test_a_killed_replica_fails_over_its_request_in_flight_and_the_next_ones(replicas, tmp_path):
    with router(replicas, tmp_path, "round_robin") as url:
        before = [r.served() for r in replicas]
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(complete(url, "Once upon a time", LONG)))
        thread.start()
        deadline = time.monotonic() + 60
        running = []
        while not running and time.monotonic() < deadline:
            running = [r for r in replicas if r.series("vllm:num_requests_running") == 1]
        victim = running[0]
        survivor = replicas[1 - replicas.index(victim)]
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(30)
        thread.join(300)
        assert result["usage"]["completion_tokens"] == LONG  # retried on the survivor, whole
        for i in range(3):
            complete(url, f"The dog ran {i}")
        assert survivor.served() - before[replicas.index(survivor)] == 4
