"""EngineConfig composes the scheduler's configuration: every scheduler knob is reachable from LLM(...), the CLI and
``jaxllm serve``, each is checked once, and async scheduling is decided in one place."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from jaxllm.config import SCHEDULER_FIELDS_FROM_START_UP, SUB_CONFIGS, EngineConfig, KVEventsConfig, SpeculativeConfig
from jaxllm.config import field_docs
from jaxllm.entrypoints.engine_args import add_engine_args, check_engine_args, engine_kwargs
from scheduler import AgingPolicy, SchedulerConfig
from scheduler.degradation import GracefulDegradation

THRESHOLDS = {"low_free_fraction": 0.3, "max_preemptions": 2, "window": 4, "recover_steps": 3}


def test_every_scheduler_field_is_an_engine_field_or_known_only_at_start_up():
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    for field in dataclasses.fields(SchedulerConfig):
        assert field.name in engine_fields or field.name in SCHEDULER_FIELDS_FROM_START_UP, field.name
    # max_model_len is both: the engine's may be None (the model's length), the scheduler's is resolved.
    assert engine_fields & set(SCHEDULER_FIELDS_FROM_START_UP) == {"max_model_len"}
    config = EngineConfig(max_num_seqs=8, aging_rate=0.25, scheduling_policy="aging", graceful_degradation=False)
    built = config.scheduler_config(num_blocks=40, max_model_len=96)
    for name in engine_fields & {f.name for f in dataclasses.fields(SchedulerConfig)} - {"max_model_len"}:
        assert getattr(built, name) == getattr(config, name), name
    assert (built.num_blocks, built.max_model_len, built.num_lookahead_tokens) == (40, 96, 0)


def test_aging_rate_and_degradation_thresholds_reach_the_running_scheduler(stories_dir):
    from jaxllm import LLM  # here, not at the top: this file collects without JAX (tests/test_layout.py)

    llm = LLM(model=stories_dir, precompile=False, num_kv_blocks=24, max_model_len=64, scheduling_policy="aging",
              aging_rate=2.5, graceful_degradation=dict(THRESHOLDS))
    scheduler = llm.engine.scheduler
    assert isinstance(scheduler.policy, AgingPolicy) and scheduler.policy.aging_rate == 2.5
    assert scheduler.config.aging_rate == 2.5
    assert scheduler.degradation.settings == GracefulDegradation(**THRESHOLDS)
    # One back-off level per low-water trigger: 0.3 of the 23 usable blocks.
    assert scheduler.degradation.low_water == pytest.approx(0.3 * 23)


def test_degradation_thresholds_as_json_text_and_true_false_words():
    assert EngineConfig(graceful_degradation=json.dumps(THRESHOLDS)).graceful_degradation == GracefulDegradation(
        **THRESHOLDS)
    assert EngineConfig(graceful_degradation="false").graceful_degradation is False
    assert EngineConfig(graceful_degradation="True").graceful_degradation is True
    assert EngineConfig().scheduler_config(num_blocks=2, max_model_len=8).degradation == GracefulDegradation()


@pytest.mark.parametrize("kwargs, message", [
    (dict(aging_rate=-1.0), "aging_rate=-1.0 is out of range: must be >= 0"),
    (dict(graceful_degradation={"windw": 3}), "graceful_degradation has unknown field 'windw'; the fields are "
                                              "['low_free_fraction'"),
    (dict(graceful_degradation="maybe"), "graceful_degradation='maybe' must be true, false or a JSON object"),
    (dict(graceful_degradation=3), "graceful_degradation=3 must be a bool, a dict"),
    (dict(graceful_degradation={"window": 0}), "GracefulDegradation.window=0 is out of range: must be an int >= 1"),
    (dict(scheduling_policy="lifo"), "scheduling_policy='lifo' is out of range"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens=32 is out of range: must be an int "
                                                       ">= max_num_seqs=64"),
    (dict(enable_chunked_prefill=False, max_model_len=1024), "max_num_batched_tokens=512 is out of range: must be "
                                                             ">= max_model_len=1024"),
])
def test_a_bad_scheduler_knob_is_refused_when_the_engine_config_is_made(kwargs, message):
    with pytest.raises(ValueError) as error:
        EngineConfig(**kwargs)
    assert message in str(error.value)


def test_async_scheduling_true_with_speculation_is_refused_and_none_resolves_once():
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="async_scheduling=True cannot be used with speculative_config"):
        EngineConfig(async_scheduling=True, speculative_config=spec)
    assert EngineConfig(speculative_config=spec).async_scheduling is False
    assert EngineConfig().async_scheduling is True
    assert EngineConfig(async_scheduling=False).scheduler_config(num_blocks=2, max_model_len=8).async_scheduling is False


def test_serve_help_lists_the_scheduler_knobs_and_their_flags_parse():
    helped = subprocess.run([sys.executable, "-m", "jaxllm.entrypoints.cli", "serve", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    for flag in ("--aging-rate", "--graceful-degradation", "--scheduling-policy", "--long-prefill-token-threshold"):
        assert flag in helped.stdout, flag
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--aging-rate", "0.5", "--scheduling-policy", "aging",
                              "--graceful-degradation", json.dumps({"window": 4, "cooldown": 3})])
    config = EngineConfig(**engine_kwargs(args))
    assert config.aging_rate == 0.5 and config.graceful_degradation == GracefulDegradation(window=4, cooldown=3)
    bad = parser.parse_args(["--aging-rate", "-2"])
    assert check_engine_args(bad) == "--aging-rate -2.0 is out of range: must be >= 0 (priority units per second)"


def test_field_docs_gives_every_field_its_name_type_default_and_description():
    docs = field_docs(EngineConfig)
    assert [d.name for d in docs] == [f.name for f in dataclasses.fields(EngineConfig)]
    assert docs[0] == ("block_size", "int", 16, "Tokens per KV block, a power of two.")
    assert [d for d in docs if not d.description] == []
    assert {d.name: (d.type, d.default) for d in docs}["max_model_len"] == ("Optional[int]", None)
    assert [d.name for d in field_docs(SpeculativeConfig) if not d.description] == []
    assert [d.name for d in field_docs(KVEventsConfig) if not d.description] == []
    assert field_docs(SpeculativeConfig)[0].default is dataclasses.MISSING  # method is required


def test_sub_configs_are_frozen_views_of_the_engine_fields_of_their_names():
    config = EngineConfig(block_size=8, kv_cache_dtype="int8", token_buckets=[8, 512], tensor_parallel_size=2,
                          metrics_port=9100, kv_events_config={"enable_kv_cache_events": True})
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    seen: set[str] = set()
    for name, cls in SUB_CONFIGS.items():
        view = getattr(config, name)
        assert isinstance(view, cls)
        names = {f.name for f in dataclasses.fields(cls)}
        assert names <= engine_fields and not names & seen, name
        seen |= names
        assert {n: getattr(view, n) for n in names} == {n: getattr(config, n) for n in names}
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(view, next(iter(names)), None)
    assert (config.cache.block_size, config.cache.kv_cache_dtype) == (8, "int8")
    assert config.compilation.token_buckets == [8, 512] and config.parallel.tensor_parallel_size == 2
    assert config.observability.kv_events_config == KVEventsConfig(enable_kv_cache_events=True)
    assert config.scheduler.max_num_seqs == 64 and config.scheduler.async_scheduling is True
    assert config.speculative is None
    spec = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).speculative
    assert spec == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
