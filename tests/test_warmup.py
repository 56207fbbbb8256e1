"""Background warm-up: serving starts after two programs; no step waits on a compile; the background builds while
the engine is idle (or busy past a grace time), never beside a short run, and never holds the process at exit."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np

from jaxllm import SamplingParams
from jaxllm.frontend.llm_engine import LLMEngine
from jaxllm.worker import programs
from tests.conftest import STORIES

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96, block_size=8, num_kv_blocks=48,
              compilation_cache=None)


def _record_builds(engine: LLMEngine, times: list[float] | None = None) -> list[tuple[str, int]]:
    """(thread name, token bucket) of every step program the runner builds from now on (and, into ``times``, the
    monotonic second each build starts)."""
    builds = []
    runner = engine.runner
    compile_step = runner.programs.compile_step

    def recording(shape, **kwargs):
        if shape not in runner.programs._steps:
            builds.append((threading.current_thread().name, shape[0]))
            if times is not None:
                times.append(time.monotonic())
        return compile_step(shape, **kwargs)

    runner.programs.compile_step = recording
    return builds


def _serve(engine: LLMEngine, prompts: list[list[int]], start: int) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{start + i}", prompt, SamplingParams(temperature=0, max_tokens=6))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{start + i}"] for i in range(len(prompts))]


def test_background_warmup_builds_two_buckets_first_and_never_compiles_on_the_serving_thread(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="jaxllm")
    logging.getLogger("jaxllm").addHandler(caplog.handler)
    engine = LLMEngine(tiny_llama_dir, **ENGINE)  # precompile="background" is the default
    tokens = engine.buckets.token_buckets
    # The start-up lines' counts add up: every step program is built now or in the background, beside the block
    # copy, slot fill and slot rows programs; the xla backend has no decode-only programs.
    lines = [r.getMessage() for r in caplog.records]
    n = len(engine.buckets)
    assert n == len(tokens) > 2
    assert any(line.startswith(f"{n} step programs (") and "decode-only steps run these too" in line
               for line in lines)
    assert any(line.startswith(f"built 2 of {n} step programs and 3 other programs ") and
               line.endswith(f"the other {n - 2} step programs are building in the background, and until each is "
                             "ready, steps are padded to a built one") for line in lines), lines
    assert engine.runner.programs.serving_buckets().token_buckets[-1] == tokens[-1]
    # The largest and the smallest of at least 16 tokens come first; 4 and 8 follow in the background.
    assert {next(t for t in tokens if t >= 16), tokens[-1]} <= set(engine.runner.programs.serving_buckets().token_buckets)
    builds = _record_builds(engine)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=int(n)).tolist() for n in rng.integers(1, 60, size=12)]
    during = _serve(engine, prompts, 0)
    assert all(name == "jaxllm-warmup" for name, _ in builds), builds
    assert engine.wait_for_warmup(timeout=600)
    logging.getLogger("jaxllm").removeHandler(caplog.handler)
    assert engine.runner.programs.num_pending_programs() == 0
    assert [r.getMessage().split(" in ")[0] for r in caplog.records if "background warm-up done" in r.getMessage()] \
        == [f"background warm-up done: built the other {n - 2} step programs"]
    assert engine.runner.programs.serving_buckets() is engine.buckets
    built_in_background = len(builds)
    assert built_in_background <= len(tokens) - 2

    after = _serve(engine, prompts, 100)
    assert len(builds) == built_in_background  # warm: nothing more is built
    assert engine.runner.compile_stats.num_compilations == len(engine.buckets) + 3  # + block copy, slot fill, slot rows

    # The reference builds its programs on this thread, on first use: only the buckets these prompts take.
    reference = LLMEngine(tiny_llama_dir, precompile=False, **ENGINE)
    want = _serve(reference, prompts, 0)
    assert during == want and after == want


def test_lazy_mode_builds_only_the_buckets_steps_use_and_says_so_while_the_step_waits(tiny_llama_dir, capsys):
    engine = LLMEngine(tiny_llama_dir, precompile=False, **ENGINE)
    builds = _record_builds(engine)
    capsys.readouterr()
    _serve(engine, [[5, 6, 7]], 0)  # a 3-token prompt, then one-token decode steps: the smallest bucket only
    assert builds == [("MainThread", engine.buckets.token_buckets[0])]
    t, s, _ = engine.buckets.pick(3, 1, 1)
    err = capsys.readouterr().err
    assert f"building the step program for {t} tokens x {s} rows (first use)..." in err
    assert err.count("building the step program") == 1 and "built it in" in err


def test_background_warmup_builds_nothing_while_steps_run_and_the_rest_once_idle(tiny_llama_dir, monkeypatch):
    # Idle means no step for 2 s here (1 s by default): wide enough that no gap between this test's steps counts.
    monkeypatch.setattr(programs, "IDLE_SECONDS", 2.0)
    engine = LLMEngine(tiny_llama_dir, **ENGINE)
    times: list[float] = []
    builds = _record_builds(engine, times)
    pending = engine.runner.programs.num_pending_programs()
    assert pending > 0
    prompts = [[5 + i] * (4 + 5 * i) for i in range(10)]
    start = time.monotonic()
    for round_ in range(3):
        _serve(engine, prompts, 100 * round_)
    served = time.monotonic()
    assert [t for t in times if t < served] == [] and engine.runner.programs.num_pending_programs() == pending
    assert engine.wait_for_warmup(timeout=600)
    assert len(builds) == pending and all(name == "jaxllm-warmup" for name, _ in builds)
    assert times[0] - served >= 2.0 - 0.1 and served > start


def test_a_background_build_refused_near_the_mapping_cap_stops_the_warmup_with_a_logged_error(
        tiny_llama_dir, monkeypatch, caplog):
    """A program the background warm-up cannot build (here: the process past 90% of Linux's cap on memory
    mappings) ends the warm-up with an error in the log, leaves its buckets unbuilt, and steps keep to the buckets
    built (the same greedy tokens as a fully warmed engine's)."""
    monkeypatch.setattr(programs, "IDLE_SECONDS", 0.2)
    engine = LLMEngine(tiny_llama_dir, **ENGINE)
    pending = engine.runner.programs.num_pending_programs()
    assert pending > 0
    monkeypatch.setattr(programs, "_map_guard", programs._MapGuard(read=lambda: (95_000, 100_000),
                                                                   release=lambda count, _: count))
    caplog.set_level(logging.ERROR, logger="jaxllm")
    logging.getLogger("jaxllm").addHandler(caplog.handler)
    try:
        assert engine.wait_for_warmup(timeout=600)
    finally:
        logging.getLogger("jaxllm").removeHandler(caplog.handler)
    assert engine.runner.programs.num_pending_programs() == pending
    [line] = [r.getMessage() for r in caplog.records if "background warm-up stopped" in r.getMessage()]
    assert "holds 95000 memory mappings" in line and f"{pending} programs unbuilt" in line
    prompts = [[5 + i] * (4 + 5 * i) for i in range(6)]
    monkeypatch.setattr(programs, "_map_guard", programs._MapGuard())
    warm = LLMEngine(tiny_llama_dir, **{**ENGINE, "precompile": True})
    assert _serve(engine, prompts, 0) == _serve(warm, prompts, 0)
    assert engine.runner.programs.num_pending_programs() == pending  # served from the buckets built


def test_background_warmup_builds_beside_an_engine_busy_past_the_grace_time(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(programs, "IDLE_SECONDS", 600.0)
    monkeypatch.setattr(programs, "BUSY_GRACE_SECONDS", 0.0)
    engine = LLMEngine(tiny_llama_dir, **ENGINE)
    builds = _record_builds(engine)
    deadline = time.monotonic() + 600
    while engine.runner.programs.num_pending_programs() and time.monotonic() < deadline:
        _serve(engine, [[5, 6, 7, 8]], len(builds) * 10)
    assert engine.runner.programs.num_pending_programs() == 0
    assert builds and all(name == "jaxllm-warmup" for name, _ in builds)


def test_process_with_a_background_warmup_in_progress_exits_within_2_s_of_its_last_call():
    # Each background program takes 5 s more here, as a large model's do on a slow CPU: a process that waited for
    # the program in progress at exit would take that long.
    script = textwrap.dedent(f"""
        import threading, time
        from jaxllm import LLM, SamplingParams
        from jaxllm.worker.programs import CompileStats
        compiled = CompileStats.compile
        def slow(self, *args):
            if threading.current_thread().name == "jaxllm-warmup":
                time.sleep(5)
            return compiled(self, *args)
        CompileStats.compile = slow
        llm = LLM({str(STORIES)!r}, compilation_cache=None, max_model_len=96, max_num_seqs=8,
                  max_num_batched_tokens=64, block_size=8, num_kv_blocks=48)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        print(llm.engine.runner.programs.num_pending_programs(), len(out[0].outputs[0].token_ids), time.time(), flush=True)
        time.sleep(0.5)  # a script's own work after its last call
        print(time.time(), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    ended = time.time()
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, second = proc.stdout.split("\n")[:2]
    pending, tokens, _ = first.split()
    assert int(pending) > 0 and int(tokens) == 8
    assert ended - float(second) < 2.0
