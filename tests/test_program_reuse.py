"""Engines of one process share their programs (``programs.shared_jit``): a second engine of the same
configuration and shapes builds every program from memory, with no trace and no XLA compile, and gives the same
tokens; an engine differing in a static setting or in a shape compiles its own step programs."""

from __future__ import annotations

import pytest

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
