"""KV cache diagnostics: exact counts of a scripted scheduler state, LLM.kv_cache_report on a running engine, the
PNG, and the ``jaxllm diag`` command (its run against a live server is in tests/test_openai_server.py)."""

from __future__ import annotations

import json

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.entrypoints.cli import main as jaxllm_main
from jaxllm.entrypoints.diag import block_codes, render_kv_report, summarize
from scheduler import Scheduler, SchedulerConfig, kv_cache_report
from tests._scheduler_harness import FakeClock, FakeRunner, make_request, step

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _finish(sched, runner, req):
    sched.add_request(req)
    while sched.has_unfinished_requests():
        step(sched, runner)


def test_report_of_a_scripted_state_counts_every_block_once():
    config = SchedulerConfig(num_blocks=17, block_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    sched, runner = Scheduler(config, clock=FakeClock()), FakeRunner(config)
    system = list(range(10, 18))
    _finish(sched, runner, make_request("a", system + [1, 2], max_tokens=1))  # caches 2 blocks, frees a partial one
    _finish(sched, runner, make_request("e", list(range(30, 38)), max_tokens=1))  # 2 more cached blocks
    assert sched.pin_prefix(system) == 2
    sched.add_request(make_request("b", system + [5, 6, 7, 8, 9], max_tokens=8))  # hits the 2 pinned blocks
    sched.add_request(make_request("c", [40, 41, 42, 43, 44, 45], max_tokens=8))
    sched.add_request(make_request("d", [46, 47], max_tokens=8))  # no seat left: waits
    step(sched, runner)
    report = kv_cache_report(sched)
    # used: the null block, 2 pinned (shared with b), b's 2 fresh, c's 2; cached free: e's 2.
    assert {k: report[k] for k in ("num_blocks", "num_used_blocks", "num_cached_free_blocks", "num_free_blocks",
                                   "num_pinned_blocks", "num_shared_blocks")} == dict(
        num_blocks=17, num_used_blocks=7, num_cached_free_blocks=2, num_free_blocks=8, num_pinned_blocks=2,
        num_shared_blocks=2)
    # b computed 13 tokens in 4 blocks (3 slots empty), c 6 in 2 (2 empty); 6 used blocks of 4 slots.
    assert (report["allocated_slots"], report["empty_allocated_slots"]) == (24, 5)
    assert report["fragmentation"] == pytest.approx(5 / 24) and report["cache_crowding"] == pytest.approx(2 / 10)
    assert report["request_blocks"] == {"b": 4, "c": 2}
    assert report["largest_request"] == {"request_id": "b", "num_blocks": 4, "num_tokens": 14}
    assert (report["num_running"], report["num_waiting"], report["num_preempted_waiting"]) == (2, 1, 0)
    blocks = report["blocks"]
    assert len(blocks) == 17 and blocks[0] == {"state": "null", "ref_cnt": 0, "holders": []}
    pinned = [b.block_id for b in sched.kv_cache_manager.pinned_blocks]
    assert all(blocks[i] == {"state": "used", "ref_cnt": 2, "holders": ["b", "<pinned>"]} for i in pinned)
    assert sorted(block_codes(report)) == [0] + [1] * 4 + [3] * 2 + [4] * 2 + [5] * 8
    assert json.loads(json.dumps(report)) == report
    assert "largest request: b (4 blocks, 14 tokens)" in summarize(report)


ENGINE = dict(max_model_len=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, num_kv_blocks=17,
              precompile=False, token_buckets=[32])


def test_llm_report_on_a_running_engine_agrees_with_the_pool_and_the_metric_and_draws_a_png(stories_dir, tmp_path):
    llm = LLM(model=stories_dir, **ENGINE)
    engine = llm.engine
    for i in range(8):
        engine.add_request(str(i), [3 + (5 * i + j) % 300 for j in range(7)], SamplingParams(max_tokens=9))
    for _ in range(4):
        engine.step()
    report = llm.kv_cache_report()
    pool = engine.scheduler.block_pool
    assert report["num_used_blocks"] + report["num_cached_free_blocks"] + report["num_free_blocks"] == 17
    assert report["num_cached_free_blocks"] + report["num_free_blocks"] == pool.num_free_blocks
    sched = engine.scheduler
    assert (report["num_running"], report["num_waiting"]) == (len(sched.running), len(sched.waiting))
    assert report["num_running"] + report["num_waiting"] == 8 and report["core_index"] == 0
    assert report["num_preemptions"] == sched.num_preemptions
    assert sum(report["request_blocks"].values()) == report["num_used_blocks"] - 1 - report["num_shared_blocks"]
    ratio = engine.metrics.registry.get_sample_value("jaxllm:kv_cache_fragmentation_ratio")
    assert report["fragmentation"] == pytest.approx(ratio)
    png = render_kv_report(report, tmp_path / "kv.png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "blocks" not in llm.kv_cache_report(block_map=False)
    with pytest.raises(ValueError, match="no block map"):
        render_kv_report(llm.kv_cache_report(block_map=False), tmp_path / "no.png")


def test_diag_command_says_when_the_server_cannot_be_reached(capsys):
    assert jaxllm_main(["diag", "--url", "http://127.0.0.1:9", "--timeout", "5"]) == 1
    assert "error:" in capsys.readouterr().err


class _FakeServer:
    """A loopback HTTP server answering ``jaxllm diag``'s calls: a scheduler's report on ``GET /debug/kv``, and on
    ``POST /kv_cache/...`` either a one-core report or, with ``dev_mode`` off, 404."""

    def __init__(self, dev_mode: bool) -> None:
        import http.server
        import threading

        report = kv_cache_report(Scheduler(SchedulerConfig(num_blocks=8, block_size=4)))
        self.posts = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, report)

            def do_POST(self):
                outer.posts.append(self.path)
                done = {"num_moved_blocks": 3, "num_blocks": 8, "num_used_blocks": 1, "seconds": 0.002}
                if "resize" in self.path:
                    done["num_compilations"] = 3
                self._send(200, {"cores": [done]}) if dev_mode else self._send(404, {"detail": "Not Found"})

            def log_message(self, *args):
                pass

        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_diag_compact_and_resize_post_to_the_pool_routes_and_keep_json_output_clean(capsys):
    server = _FakeServer(dev_mode=True)
    try:
        assert jaxllm_main(["diag", "--url", server.url, "--compact", "--resize", "8", "--json"]) == 0
    finally:
        server.stop()
    assert server.posts == ["/kv_cache/compact", "/kv_cache/resize?num_blocks=8"]
    captured = capsys.readouterr()
    assert json.loads(captured.out)["num_blocks"] == 8
    assert "core 0: compact: moved 3 blocks in 2.0 ms; now 8 blocks, 1 used" in captured.err
    assert "core 0: resize: moved 3 blocks in 2.0 ms; now 8 blocks, 1 used; 3 programs rebuilt" in captured.err


def test_diag_compact_on_a_server_without_dev_mode_says_how_to_enable_it(capsys):
    server = _FakeServer(dev_mode=False)
    try:
        assert jaxllm_main(["diag", "--url", server.url, "--compact"]) == 1
    finally:
        server.stop()
    assert "answered 404 (start the server with JAXLLM_SERVER_DEV_MODE=1)" in capsys.readouterr().err
