"""Engines of one process share their programs (``programs.shared_jit``): a second engine of the same
configuration and shapes builds every program from memory, with no trace and no XLA compile, and gives the same
tokens; an engine differing in a static setting or in a shape compiles its own step programs. What is kept stays
under Linux's cap on memory mappings (``programs._MapGuard``)."""

from __future__ import annotations

import collections
import gc
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxllm import SamplingParams
from jaxllm.frontend.llm_engine import LLMEngine

# A block count no other test uses, so no earlier test of this process has built these shapes; no persistent
# cache, so every program not reused is compiled.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=8, num_kv_blocks=27,
              token_buckets=[16], compilation_cache=None, precompile=True)
# Programs besides the steps: block copy, slot fill, slot rows.
NUM_OTHER_PROGRAMS = 3


def _tokens(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=6, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate([[5, 6, 7], [9] * 12]):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done["r0"], done["r1"]]


@pytest.fixture(scope="module")
def first(stories_dir) -> LLMEngine:
    return LLMEngine(stories_dir, **ENGINE)


def test_a_second_engine_of_the_same_configuration_builds_every_program_from_memory(first, stories_dir):
    second = LLMEngine(stories_dir, **ENGINE)
    stats = second.runner.compile_stats
    assert stats.num_compilations == len(second.buckets) + NUM_OTHER_PROGRAMS
    assert stats.num_reused == stats.num_compilations and stats.compile_seconds == 0.0
    assert _tokens(second) == _tokens(first)
    assert second.runner.compile_stats.num_compilations == len(second.buckets) + NUM_OTHER_PROGRAMS


@pytest.mark.parametrize("change", [dict(logprobs_mode="processed_logprobs"), dict(num_kv_blocks=28)],
                         ids=["static-setting", "kv-shape"])
def test_an_engine_differing_in_a_static_setting_or_a_shape_compiles_its_own_step_programs(first, stories_dir,
                                                                                         change):
    engine = LLMEngine(stories_dir, **{**ENGINE, **change})
    stats = engine.runner.compile_stats
    assert stats.num_compilations == len(engine.buckets) + NUM_OTHER_PROGRAMS
    # The slot programs do not depend on either change; a new KV shape rebuilds the block copy too.
    assert stats.num_reused == (NUM_OTHER_PROGRAMS if "logprobs_mode" in change else NUM_OTHER_PROGRAMS - 1)
    # Built, not reused: compiled, or loaded from a persistent cache an earlier test process filled.
    assert stats.compile_seconds + stats.cache_load_seconds > 0.0
    if "num_kv_blocks" in change:
        assert _tokens(engine) == _tokens(first)


def test_a_family_registered_again_under_the_same_name_gets_its_own_step_function():
    import dataclasses

    from jaxllm.models import FAMILIES
    from jaxllm.worker.programs import shared_jit

    llama = FAMILIES["llama"]
    again = dataclasses.replace(llama)  # equal fields, another object: what a second registration makes

    def step(x, *, scale):
        return x * scale

    assert shared_jit(step, traced_from=llama, scale=2) is shared_jit(step, traced_from=llama, scale=2)
    assert shared_jit(step, traced_from=again, scale=2) is not shared_jit(step, traced_from=llama, scale=2)
    assert shared_jit(step, traced_from=llama, scale=3) is not shared_jit(step, traced_from=llama, scale=2)


def _map_count() -> int:
    from jaxllm.worker.programs import memory_maps

    maps = memory_maps()
    if maps is None:
        pytest.skip("/proc does not count this process's memory mappings")
    return maps[0]


def test_past_the_release_fraction_a_compile_frees_the_programs_of_engines_gone_and_keeps_live_ones(
        first, stories_dir, monkeypatch, caplog):
    from jaxllm.worker import programs

    gc.collect()
    start = _map_count()
    gone = LLMEngine(stories_dir, **{**ENGINE, "logprobs_mode": "raw_logits"})
    held = _map_count() - start  # its programs' code and data (XLA's CPU backend maps each apart)
    assert held > 10 * gone.runner.compile_stats.num_compilations
    del gone
    gc.collect()
    kept = _map_count()
    assert kept > start + held / 2  # the step function is kept for an engine of the same configuration

    caplog.set_level(logging.WARNING, logger="jaxllm")
    logging.getLogger("jaxllm").addHandler(caplog.handler)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(programs, "RELEASE_FRACTION", (kept - held / 2) / programs.memory_maps()[1])
            programs._MapGuard().before_compile()  # a guard of its own: its first compile reads
    finally:
        logging.getLogger("jaxllm").removeHandler(caplog.handler)
    assert _map_count() < kept - held / 2
    [line] = [r.getMessage() for r in caplog.records if "memory mappings" in r.getMessage()]
    assert f"Linux's cap of {programs.memory_maps()[1]} (vm.max_map_count)" in line
    assert "JAX's in-memory caches" not in line  # dropping the kept functions was enough

    # The live engine's configuration is still shared: a new engine of it compiles nothing.
    again = LLMEngine(stories_dir, **ENGINE)
    stats = again.runner.compile_stats
    assert stats.num_reused == stats.num_compilations == len(again.buckets) + NUM_OTHER_PROGRAMS
    assert _tokens(again) == _tokens(first)


@given(cap=st.integers(1_000, 10_000_000),
       readings=st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)), min_size=1, max_size=6))
def test_the_guard_releases_past_half_the_cap_refuses_past_nine_tenths_and_does_not_release_again_at_once(
        cap, readings):
    """Any sequence of readings (count, and what a release would leave, as fractions of the cap): a release when a
    count is past RELEASE_FRACTION, and, after a release that left the count past it, only once the count has grown
    by RELEASE_STEP of the cap or is past REFUSE_FRACTION; an error naming the count and the cap exactly when what
    is left is past REFUSE_FRACTION; and each reading exactly at the compile when MAPS_PER_COMPILE_BOUND mappings
    per compile could have reached the next threshold (a reading not scripted raises IndexError)."""
    from jaxllm.worker import programs

    release, refuse, step = (f * cap for f in (programs.RELEASE_FRACTION, programs.REFUSE_FRACTION,
                                                programs.RELEASE_STEP))
    script = collections.deque()
    released = []
    guard = programs._MapGuard(read=lambda: (script.popleft(), cap),
                               release=lambda count, _: released.append(count) or script.popleft())
    left_by_release = None  # what a release left past RELEASE_FRACTION, while every reading since is past it too
    for at, after in readings:
        count = int(at * cap)
        left = int(after * count)
        if count < release:
            left_by_release = None
        releases = count >= release and (left_by_release is None or count >= left_by_release + step
                                         or count >= refuse)
        script.extend([count, left] if releases else [count])
        now = left if releases else count
        if releases:
            left_by_release = left if left >= release else None
        if now >= refuse:
            with pytest.raises(RuntimeError, match=rf"holds {now} memory mappings.*vm.max_map_count={cap}\b"):
                guard.before_compile()
        else:
            guard.before_compile()
            due = guard._compiles_until_reading
            threshold = min(release if left_by_release is None else max(release, left_by_release + step), refuse)
            assert due >= 1
            assert due == 1 or now + due * programs.MAPS_PER_COMPILE_BOUND <= threshold
            for _ in range(due - 1):  # compiles without a reading; the next one reads
                guard.before_compile()
        assert not script and released == ([count] if releases else [])
        released.clear()


def test_a_release_that_raises_leaves_the_guard_reading_at_the_next_compile():
    from jaxllm.worker import programs

    readings = collections.deque([(60, 100), (10, 100)])

    def failing(count, cap):
        raise OSError("/proc went away")

    guard = programs._MapGuard(read=readings.popleft, release=failing)
    with pytest.raises(OSError, match="/proc went away"):
        guard.before_compile()
    guard.before_compile()  # reads (10 of 100): nothing to release
    assert not readings and guard._compiles_until_reading == 1  # 40 mappings short of half the cap: read again next
