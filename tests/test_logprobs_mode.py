"""EngineConfig.logprobs_mode and SamplingParams.detokenize (vLLM's; issue 56 gaps 2 and 3) on stories260K.

Reference: the float32 logits of every position from ``jaxllm.models.dense.dense_forward`` over the engine's own
weights, for the prompt and the tokens the engine generated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.models.dense import dense_forward

BASE = dict(max_num_seqs=2, max_model_len=64, block_size=16, num_kv_blocks=12, max_num_batched_tokens=64,
            dtype="float32")
PROMPT = "Once upon a time"
TEMPERATURE = 0.9
SEEDS = (0, 7)


def sampled(llm: LLM, params: SamplingParams) -> tuple[list[int], list[int], np.ndarray]:
    """(prompt ids, generated ids, the value the engine returned for each generated token)."""
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    completion = out.outputs[0]
    values = np.array([entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)], np.float32)
    return list(out.prompt_token_ids), list(completion.token_ids), values


def reference_logits(llm: LLM, prompt_ids: list[int], token_ids: list[int]) -> np.ndarray:
    """float32 [len(token_ids), V]: the raw logits each generated token was drawn from."""
    ids = jnp.asarray([prompt_ids + token_ids], jnp.int32)
    logits = np.asarray(dense_forward(llm.get_params(), ids, cfg=llm.engine.core.model_config))[0]
    return logits[len(prompt_ids) - 1:-1]


def chosen(rows: np.ndarray, token_ids: list[int]) -> np.ndarray:
    return rows[np.arange(len(token_ids)), token_ids]


@pytest.fixture(scope="module")
def raw_logits_llm(stories_dir):
    return LLM(model=stories_dir, precompile=False, logprobs_mode="raw_logits", **BASE)


@pytest.fixture(scope="module")
def processed_llm(stories_dir):
    # Two token buckets (a decode and a prefill one) are enough to show the mode adds no program after warm-up;
    # warming and serving the default ladder is tests/test_compilation.py's.
    return LLM(model=stories_dir, precompile=True, logprobs_mode="processed_logprobs", token_buckets=(8, 64),
               **BASE)


@pytest.fixture(scope="module")
def default_llm(stories_dir):
    return LLM(model=stories_dir, precompile=False, **BASE)


def test_logprobs_mode_is_one_of_vllms_values():
    from jaxllm.config import EngineConfig
    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineConfig(logprobs_mode="logits")


@pytest.mark.parametrize("seed", SEEDS)
def test_processed_logprobs_are_the_log_softmax_of_the_tempered_logits_and_compile_nothing(processed_llm, seed,
                                                                                           raw_logits_llm):
    llm = processed_llm
    compiled = llm.engine.runner.compile_stats.num_compilations
    params = SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=12, logprobs=1, ignore_eos=True)
    prompt_ids, token_ids, processed = sampled(llm, params)
    assert llm.engine.runner.compile_stats.num_compilations == compiled
    rows = reference_logits(llm, prompt_ids, token_ids)
    expected = chosen(np.asarray(jax.nn.log_softmax(jnp.asarray(rows) / np.float32(TEMPERATURE), axis=-1)),
                      token_ids)
    np.testing.assert_allclose(processed, expected, atol=1e-5, rtol=0)
    # The mode changes what is reported, never what is drawn; raw_logits reports the model's logits.
    _, raw_ids, raw = sampled(raw_logits_llm, params)
    assert raw_ids == token_ids
    np.testing.assert_allclose(raw, chosen(rows, token_ids), atol=1e-4, rtol=0)


def test_raw_logprobs_stay_the_log_softmax_of_the_model_logits(default_llm):
    params = SamplingParams(temperature=TEMPERATURE, seed=SEEDS[0], max_tokens=12, logprobs=1, ignore_eos=True)
    prompt_ids, token_ids, raw = sampled(default_llm, params)
    rows = reference_logits(default_llm, prompt_ids, token_ids)
    expected = chosen(np.asarray(jax.nn.log_softmax(jnp.asarray(rows), axis=-1)), token_ids)
    np.testing.assert_allclose(raw, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, TEMPERATURE])
def test_detokenize_false_returns_the_same_token_ids_and_no_text(default_llm, temperature):
    params = dict(temperature=temperature, seed=3, max_tokens=10, ignore_eos=True)
    (with_text,) = default_llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)
    (without,) = default_llm.generate([PROMPT], SamplingParams(**params, detokenize=False), use_tqdm=False)
    assert with_text.outputs[0].text != ""
    assert without.outputs[0].token_ids == with_text.outputs[0].token_ids
    assert without.outputs[0].text == ""


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["."], detokenize=False)
