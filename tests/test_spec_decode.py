"""Speculative decoding end to end: outputs token for token those of the engine without it.

One workload on stories260K mixes greedy and seeded sampling, a stop string, ``max_tokens``, logprobs, penalties,
``n > 1`` and a repeated prompt (prefix-cache hits) in a cache small enough to preempt; it runs once without
speculation and once per (method, k, preemption mode / async scheduling). Verification samples every position
with its own seeded key (``sampler.verify``), so even the sampled requests must match exactly. Each run must
also have preempted, hit the prefix cache, accepted and rejected drafts, and given back every block.
"""

from __future__ import annotations

import jax
import pytest

from jaxllm import LLM, SamplingParams
from scripts.convert_checkpoint import convert
from tests.helpers import counted_dispatches
from tests.test_compilation import _EVENTS

STORIES_KW = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=8, num_kv_blocks=16,
                  token_buckets=[64], precompile=False)
NGRAM = dict(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3)
TEXTS = [
    "Once upon a time",
    "Tom had a big red ball. Tom had a big red ball. Tom had",
    "Lily went to the park with her mom. She saw a dog.",
    "One day, a little bird",
    "The sun was hot. The sun was hot. The",
    "Once upon a time, there was a girl named Sue. Sue liked to sing.",
    "Tom had a big red ball. Tom had a big red ball. Tom had",
    "A cat sat on the mat.",
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=48),
    SamplingParams(temperature=0, max_tokens=40, logprobs=2),
    SamplingParams(temperature=0, max_tokens=30, stop=["play"]),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=40),
    SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24),
    SamplingParams(temperature=0, max_tokens=36, presence_penalty=0.5, repetition_penalty=1.2),
    SamplingParams(temperature=0, max_tokens=7),
    SamplingParams(temperature=0, max_tokens=40, min_tokens=10),
]


def _run(llm: LLM) -> list:
    outs = llm.generate(TEXTS, PARAMS, use_tqdm=False)
    return [(c.token_ids, c.text, c.finish_reason, c.logprobs) for o in outs for c in o.outputs]


def _assert_same(got: list, expected: list) -> None:
    for (tokens, text, reason, logprobs), (ref_tokens, ref_text, ref_reason, ref_logprobs) in zip(got, expected):
        assert (tokens, text, reason) == (ref_tokens, ref_text, ref_reason)
        if ref_logprobs is not None:
            assert [sorted(e) for e in logprobs] == [sorted(e) for e in ref_logprobs]
            for entry, ref_entry in zip(logprobs, ref_logprobs):
                for t, lp in entry.items():
                    assert lp.logprob == pytest.approx(ref_entry[t].logprob, abs=1e-4) and lp.rank == ref_entry[t].rank


@pytest.fixture(scope="module")
def stories_reference(stories_dir):
    outs = _run(LLM(model=stories_dir, **STORIES_KW))
    assert any(reason == "stop" for _, text, reason, _ in outs)
    return outs


def _check_run(llm: LLM) -> dict:
    """Preemption, prefix hits, drafts accepted and rejected, counters and metrics consistent, every block back."""
    engine = llm.engine
    stats = engine.core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    per_position = stats.spec_accepted_per_position
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert sum(per_position) == stats.spec_num_accepted_tokens
    assert all(a >= b for a, b in zip(per_position, per_position[1:])) and per_position[0] <= stats.spec_num_drafts
    value = engine.metrics.registry.get_sample_value
    assert value("jaxllm:spec_decode_num_drafts_total") == stats.spec_num_drafts
    assert value("jaxllm:spec_decode_num_draft_tokens_total") == stats.spec_num_draft_tokens
    assert value("jaxllm:spec_decode_num_accepted_tokens_total") == stats.spec_num_accepted_tokens
    for i, n in enumerate(per_position):
        assert (value("jaxllm:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(i)}) or 0) == n
    # get_metrics (vLLM's reader) gives the per-position counters as one Vector.
    [vector] = [m for m in llm.get_metrics() if m.name == "jaxllm:spec_decode_num_accepted_tokens_per_pos"]
    assert type(vector).__name__ == "Vector" and vector.values == per_position[:len(vector.values)]
    assert sum(vector.values) == sum(per_position)
    run = engine.metrics.run_summary()
    assert run["spec_acceptance_rate"] == stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
    assert run["spec_mean_accepted_length"] == 1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
    assert stats.num_free_blocks == engine.num_blocks - 1
    return stats


@pytest.fixture(scope="module")
def stories_draft(stories_dir, tmp_path_factory):
    """stories260K's first 4 of 5 layers: a draft model that agrees with it about half the time."""
    folder = tmp_path_factory.mktemp("draft") / "stories260K-4-layers"
    convert(stories_dir, folder, num_layers=4)
    return folder


@pytest.mark.parametrize("method, k, extra", [
    ("ngram", 1, dict()),
    ("ngram", 3, dict(preemption_mode="swap", num_host_blocks=64, precompile=True)),
    ("ngram", 5, dict(async_scheduling=False)),
    ("draft_model", 1, dict()),
    ("draft_model", 3, dict(preemption_mode="swap", num_host_blocks=64, precompile=True)),
    ("draft_model", 5, dict(async_scheduling=False)),
], ids=["ngram-k1-recompute", "ngram-k3-swap-precompiled", "ngram-k5-sync",
        "draft-k1-recompute", "draft-k3-swap-precompiled", "draft-k5-sync"])
def test_outputs_equal_those_without_speculation(stories_dir, stories_draft, stories_reference, method, k, extra,
                                                 monkeypatch):
    spec = dict(NGRAM) if method == "ngram" else dict(method=method, model=str(stories_draft))
    llm = LLM(model=stories_dir, **{**STORIES_KW, **extra}, speculative_config=dict(spec, num_speculative_tokens=k))
    core = llm.engine.core
    built, events = core.stats().compilations, len(_EVENTS)
    if extra.get("precompile"):
        # Per runner: one step program (one token bucket), the block copy and swap out/in (the target's runner
        # also fills sampling slots and their rows).
        assert built == (6 if method == "ngram" else 10)
    if method == "draft_model":
        # The draft step reads the target step's inputs where they already are: it refuses every transfer.
        propose_async, drafts = core.drafter.propose_async, []

        def no_transfer(*args):
            with jax.transfer_guard_host_to_device("disallow_explicit"):
                drafts.append(propose_async(*args))
            return drafts[-1]

        monkeypatch.setattr(core.drafter, "propose_async", no_transfer)
    with counted_dispatches(llm.engine.runner) as records:
        outs = _run(llm)
    assert records and all(puts == 1 + bitmask for _, bitmask, _, _, puts in records)
    if method == "draft_model":
        assert len(drafts) == len(records)
    _assert_same(outs, stories_reference)
    _check_run(llm)
    if extra.get("precompile"):
        assert core.stats().compilations == built and _EVENTS[events:] == []


SMOL_KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=8, num_kv_blocks=11,
               token_buckets=[32], precompile=False)
SMOL_PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef add(a, b):\n",
    "Repeat after me: I like green apples and red cherries.\nI like green",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
]
SMOL_PARAMS = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0.7, seed=1, max_tokens=8),
               SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0, max_tokens=8, logprobs=1)]


def _smol_run(llm: LLM) -> list:
    outs = llm.generate(SMOL_PROMPTS, SMOL_PARAMS, use_tqdm=False)
    return [(c.token_ids, c.text, c.finish_reason, c.logprobs) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def smol_reference(smollm2_gguf):
    return _smol_run(LLM(model=smollm2_gguf, **SMOL_KW))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_outputs_equal_those_without_speculation_on_the_default_model(smollm2_gguf, smol_reference, method):
    """Both methods on the real model. The draft model is the target itself (the only same-vocabulary model
    shipped offline that drafts well): greedy rows accept their drafts, the sampled row rejects some."""
    spec = dict(NGRAM) if method == "ngram" else dict(method=method, model=str(smollm2_gguf))
    llm = LLM(model=smollm2_gguf, **SMOL_KW, speculative_config=dict(spec, num_speculative_tokens=3))
    _assert_same(_smol_run(llm), smol_reference)
    _check_run(llm)


@pytest.mark.parametrize("config, match", [
    (dict(method="eagle", num_speculative_tokens=2), "method='eagle'"),
    (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens=0"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2), "exceeds"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_max=0), "prompt_lookup_max=0"),
    (dict(method="ngram", num_speculative_tokens=2, model="x"), "model='x'"),
    (dict(method="draft_model", num_speculative_tokens=2), "needs model"),
    (dict(method="ngram", num_speculative_tokens=2, lookahead=1), "unknown field 'lookahead'"),
    (dict(method="ngram"), "needs 'method' and 'num_speculative_tokens'"),
    ("{not json", "is not JSON"),
    (dict(method="ngram", num_speculative_tokens=64), "below max_num_batched_tokens=64"),
])
def test_bad_speculative_config_is_a_value_error_naming_it(config, match):
    from jaxllm.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, speculative_config=config)


def test_speculative_config_as_a_cli_flag():
    import argparse

    from jaxllm.entrypoints.engine_args import add_engine_args, check_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert check_engine_args(args) is None
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'])
    assert "num_speculative_tokens=-1" in check_engine_args(args)


def test_a_draft_model_with_another_vocabulary_is_refused(stories_dir, tiny_llama_dir):
    with pytest.raises(ValueError, match="vocab_size=256; the target has 512"):
        LLM(model=stories_dir, **STORIES_KW, speculative_config=dict(method="draft_model", model=str(tiny_llama_dir),
                                                                      num_speculative_tokens=2))


@pytest.fixture(scope="module")
def fp8_reference(stories_dir):
    return _run(LLM(model=stories_dir, **FP8_KW))


FP8_KW = dict(STORIES_KW, quantization="fp8", kv_cache_dtype="fp8_e4m3")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_over_fp8_weights_and_an_fp8_kv_cache_equals_the_same_engine_without_it(
        stories_dir, stories_draft, fp8_reference, method):
    """Speculation composes with quantization: verification reads the same fp8 cache entries (with their
    calibrated scales) that one-token decode steps write and read, so the quantized engine's outputs do not change.
    The draft model keeps its own float32 weights and cache."""
    spec = dict(NGRAM) if method == "ngram" else dict(method=method, model=str(stories_draft))
    llm = LLM(model=stories_dir, **FP8_KW, speculative_config=dict(spec, num_speculative_tokens=3))
    reference = fp8_reference
    assert str(llm.engine.kv_cache_dtype) == "float8_e4m3fn"
    _assert_same(_run(llm), reference)
    _check_run(llm)
