"""Background warm-up: serving starts after two programs; no step waits on a compile."""

from __future__ import annotations

import threading

import numpy as np

from jaxllm import SamplingParams
from jaxllm.frontend.llm_engine import LLMEngine

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96, block_size=8, num_kv_blocks=48,
              compilation_cache=None)


def _record_builds(engine: LLMEngine) -> list[tuple[str, int]]:
    """(thread name, token bucket) of every step program the runner builds from now on."""
    builds = []
    runner = engine.runner
    compile_step = runner.compile_step

    def recording(shape):
        if shape not in runner._steps:
            builds.append((threading.current_thread().name, shape[0]))
        return compile_step(shape)

    runner.compile_step = recording
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


def test_background_warmup_builds_two_buckets_first_and_never_compiles_on_the_serving_thread(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, **ENGINE)  # precompile="background" is the default
    tokens = engine.buckets.token_buckets
    assert engine.runner.serving_buckets().token_buckets[-1] == tokens[-1]
    # The largest and the smallest of at least 16 tokens come first; 4 and 8 follow in the background.
    assert {next(t for t in tokens if t >= 16), tokens[-1]} <= set(engine.runner.serving_buckets().token_buckets)
    builds = _record_builds(engine)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=int(n)).tolist() for n in rng.integers(1, 60, size=12)]
    during = _serve(engine, prompts, 0)
    assert all(name == "jaxllm-warmup" for name, _ in builds), builds
    assert engine.wait_for_warmup(timeout=600)
    assert engine.runner.num_pending_programs() == 0
    assert engine.runner.serving_buckets() is engine.buckets
    built_in_background = len(builds)
    assert built_in_background <= len(tokens) - 2

    after = _serve(engine, prompts, 100)
    assert len(builds) == built_in_background  # warm: nothing more is built
    assert engine.runner.num_compilations == len(engine.buckets) + 3  # + block copy, slot fill, slot rows

    reference = LLMEngine(tiny_llama_dir, precompile=True, **ENGINE)
    want = _serve(reference, prompts, 0)
    assert during == want and after == want


def test_lazy_mode_builds_only_the_buckets_steps_use(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, precompile=False, **ENGINE)
    builds = _record_builds(engine)
    _serve(engine, [[5, 6, 7]], 0)  # a 3-token prompt, then one-token decode steps: the smallest bucket only
    assert builds == [("MainThread", engine.buckets.token_buckets[0])]
