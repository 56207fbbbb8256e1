"""Bad input gets a ValueError naming the value and the limit; other requests keep running."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.frontend.llm_engine import LLMEngine
from tests.conftest import STORIES_SENTENCE


@pytest.fixture(scope="module")
def engine(stories_dir):
    return LLMEngine(stories_dir, max_model_len=64, precompile=False)


def test_empty_prompt_is_rejected(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("e1", "", SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("e2", [], SamplingParams())


def test_prompt_longer_than_max_model_len_names_both_numbers(engine):
    with pytest.raises(ValueError, match=r"prompt of 65 tokens is longer than max_model_len=64"):
        engine.add_request("long", [5] * 65, SamplingParams())


def test_out_of_vocab_token_id_is_rejected(engine):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 512\)"):
        engine.add_request("oov", [1, 600], SamplingParams())


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), r"max_tokens=0 .* >= 1"),
    (dict(temperature=-0.5), r"temperature=-0.5 .* >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 .* \(0, 1\]"),
])
def test_sampling_params_out_of_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_missing_model_path_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=tmp_path / "nope")


def test_model_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(model=tmp_path)


def test_engine_keeps_serving_after_bad_requests(engine):
    engine.add_request("good", "Once upon a time", SamplingParams(temperature=0, max_tokens=40))
    for bad in ("", [9] * 100):
        with pytest.raises(ValueError):
            engine.add_request("bad", bad, SamplingParams())
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert set(outs) == {"good"}
    assert "Once upon a time" + outs["good"].outputs[0].text == STORIES_SENTENCE
    assert engine.scheduler.stats.num_free_blocks == engine.num_blocks - 1


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("dup", "Once", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "Once", SamplingParams(max_tokens=1))
    engine.abort_request("dup")
    assert engine.step() == []
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.stats.num_free_blocks == engine.num_blocks - 1


def test_bucket_ladder_short_of_its_limit_is_rejected(stories_dir):
    with pytest.raises(ValueError, match=r"token_buckets=\[16\] must reach max_num_batched_tokens=64"):
        LLMEngine(stories_dir, token_buckets=(16,), max_num_seqs=8, max_num_batched_tokens=64, precompile=False)


def test_a_failed_step_leaves_the_engine_usable(stories_dir, monkeypatch):
    engine = LLMEngine(stories_dir, max_model_len=64, precompile=False)
    engine.add_request("a", "Once upon a time", SamplingParams(temperature=0, max_tokens=40))

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    with monkeypatch.context() as m:
        m.setattr(engine.runner, "dispatch", broken)
        with pytest.raises(RuntimeError, match="device lost"):
            engine.step()
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert "Once upon a time" + outs["a"].outputs[0].text == STORIES_SENTENCE
    assert engine.scheduler.stats.num_free_blocks == engine.num_blocks - 1


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={3: float("nan")}), "logit_bias"),
])
def test_non_finite_sampling_values_are_rejected(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.* must be (a )?finite"):
        SamplingParams(**kwargs)


def test_swap_preemption_without_host_blocks_is_rejected(stories_dir):
    with pytest.raises(ValueError, match="num_host_blocks=0 must be >= 1"):
        LLMEngine(stories_dir, preemption_mode="swap", precompile=False)


def test_stopping_a_stream_early_aborts_its_requests(stories_dir):
    llm = LLM(model=stories_dir, precompile=False)
    stream = llm.generate_stream(["Once upon a time", "One day"], SamplingParams(temperature=0, max_tokens=30))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests() or llm.engine.step() == []
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.stats.num_free_blocks == llm.engine.num_blocks - 1
