"""Verification of draft tokens in the sampler (``sampler.verify``): greedy acceptance, rejection sampling.

The distribution test draws 20,000 rows at once (each its own seed) from stories260K's next-token logits at two
positions and checks, token by token within 3 standard errors, that the first emitted token follows the target
distribution, that the first draft is accepted with its target probability, and that the token after an accepted
draft follows the target distribution there: what sampling without speculation draws from. The other tests check
that every sampling control applies at every verified position as it does without speculation, and that seeded
rows emit exactly the tokens sampling without speculation draws.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm.loader import load_model
from jaxllm.sample.sampler import SamplingArrays, init_tables, sample, seed_words, verify
from jaxllm.tokenizer import load_tokenizer
from scheduler import SamplingParams
from tests.test_model_parity import SingleSequence
from tests.test_sampling import LOGITS, OUTPUT, V, _arrays, _tables, ref_distribution, ref_processors

N_DRAWS = 20_000

_verify = jax.jit(verify)
_sample = jax.jit(sample)


def _wide(params: SamplingParams, rows: int, positions: int, num_generated: int, seed: int = 0) -> SamplingArrays:
    """Sampling arrays of ``rows`` rows (row i seeded ``seed + i``), repeated for ``positions`` positions."""
    arrays = _arrays(params, rows, num_generated)
    arrays.seed = np.array([seed_words(s) for s in range(seed, seed + rows)], np.uint32)
    return arrays.repeat(positions)


def _within_3_standard_errors(counts: np.ndarray, n: int, p: np.ndarray) -> None:
    se = np.sqrt(p * (1 - p) / n)
    freq = counts / n
    assert np.all(np.abs(freq - p) <= 3 * se + 1e-12), (freq, p)


@pytest.fixture(scope="module")
def stories_logits(stories_dir):
    """stories260K's logits after a context and after the context plus its second likeliest next token."""
    cfg, params, _ = load_model(stories_dir, np.float32)
    context = load_tokenizer(stories_dir).encode("Once upon a time, there was a")
    first = SingleSequence(cfg, params).run(context)[-1]
    draft = int(np.argsort(-first)[1])
    second = SingleSequence(cfg, params).run(context + [draft])[-1]
    return first.astype(np.float32), draft, second.astype(np.float32)


def test_rejection_sampling_draws_the_target_distribution(stories_logits):
    """Temperature 1, over the model's 6 likeliest tokens at each position (so that every token has a probability
    20,000 draws can check)."""
    first, draft, second = stories_logits
    first, second = (np.where(x >= np.sort(x)[-6], x, -np.inf).astype(np.float32) for x in (first, second))
    params = SamplingParams(temperature=1.0)
    target0, target1 = ref_distribution(first.astype(np.float64), params), ref_distribution(second.astype(np.float64), params)
    second_draft = int(np.argmax(target1))
    logits = np.tile(np.stack([first, second, second]), (N_DRAWS, 1))
    drafts = np.tile(np.array([[draft, second_draft, -1]], np.int32), (N_DRAWS, 1))
    vocab = len(first)
    out, _ = _verify(logits, drafts, _wide(params, N_DRAWS, 3, 0), init_tables(2, vocab))
    tokens, emitted = np.asarray(out.token_ids), np.asarray(out.num_emitted)
    _within_3_standard_errors(np.bincount(tokens[:, 0], minlength=vocab), N_DRAWS, target0)
    accepted = emitted >= 2
    p_accept = np.array([target0[draft]])
    _within_3_standard_errors(np.array([accepted.sum()]), N_DRAWS, p_accept)
    assert 0.05 < p_accept[0] < 0.95  # both branches of the rule are exercised
    _within_3_standard_errors(np.bincount(tokens[accepted, 1], minlength=vocab), int(accepted.sum()), target1)
    # Emitted drafts are the drafts; nothing is emitted past the first rejection.
    assert np.all(tokens[accepted, 0] == draft) and np.all((emitted >= 1) & (emitted <= 3))


def _greedy_tokens(logits: np.ndarray, params: SamplingParams, stop_ids) -> list[int]:
    """Greedy tokens without speculation: one ``sample`` per position, each seeing the tokens before it as outputs."""
    tokens = []
    for j in range(len(logits)):
        tables = _tables(params, output=OUTPUT + tokens, stop_ids=stop_ids)
        out, _ = _sample(logits[j][None], _arrays(params, 1, len(OUTPUT) + j), tables)
        tokens.append(int(out.token_ids[0]))
    return tokens


@pytest.mark.parametrize("kw", [
    dict(), dict(repetition_penalty=1.8), dict(presence_penalty=1.5, frequency_penalty=0.7),
    dict(logit_bias={3: 2.5}, presence_penalty=2.0), dict(min_tokens=len(OUTPUT) + 2),
])
def test_greedy_verification_applies_every_control_at_every_position(kw):
    """Each position sees the drafts before it as outputs (penalties) and its own num_generated (min_tokens):
    verification emits the tokens sampling one by one would, up to and including the first wrong draft's."""
    params = SamplingParams(temperature=0.0, **kw)
    rng = np.random.default_rng(0)
    stop_ids = [int(np.argmax(LOGITS))]
    for wrong in (None, 0, 1, 2):
        logits = (LOGITS + rng.normal(size=(4, V)) * 0.6).astype(np.float32)
        tokens = _greedy_tokens(logits, params, stop_ids)
        drafts = tokens[:3]
        if wrong is not None:
            drafts[wrong] = (drafts[wrong] + 1) % V
        expected = tokens if wrong is None else tokens[: wrong + 1]
        tables = _tables(params, output=OUTPUT, stop_ids=stop_ids)
        out, new_tables = _verify(logits, np.array([drafts + [-1]], np.int32), _wide(params, 1, 4, len(OUTPUT)),
                                  tables)
        num = int(out.num_emitted[0])
        assert np.asarray(out.token_ids)[0, :num].tolist() == expected
        np.testing.assert_array_equal(np.asarray(new_tables.counts)[1], np.bincount(OUTPUT + expected, minlength=V))


def test_processors_see_the_drafts_before_each_position():
    """The reference processors of position j, given the first j drafts as outputs, give verify's argmax."""
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.4)
    logits = np.tile(LOGITS, (4, 1))
    processed0 = ref_processors(LOGITS, params, [0, 3, 3], OUTPUT)
    d0 = int(np.argmax(processed0))
    processed1 = ref_processors(LOGITS, params, [0, 3, 3], OUTPUT + [d0])
    d1 = int(np.argmax(processed1))
    assert d0 != d1  # the penalty on the first draft moves the argmax
    processed2 = ref_processors(LOGITS, params, [0, 3, 3], OUTPUT + [d0, d1])
    d2 = int(np.argmax(processed2))
    out, _ = _verify(logits, np.array([[d0, d1, (d2 + 1) % V, -1]], np.int32), _wide(params, 1, 4, len(OUTPUT)),
                     _tables(params))
    assert np.asarray(out.token_ids)[0, :3].tolist() == [d0, d1, d2]
    assert int(out.num_emitted[0]) == 3


def test_seeded_positions_draw_exactly_the_tokens_sampling_without_speculation_draws():
    """The coupling: a position's token is the row's own seeded draw whatever the draft, which is accepted iff equal."""
    params = SamplingParams(temperature=1.0, top_p=0.9)
    logits = np.tile(LOGITS, (4, 1))
    plain_tokens = set()
    for seed in range(24):
        expected = [int(_sample(LOGITS[None], _arrays(params, 1, 5 + j, seed=seed), _tables(params))[0].token_ids[0])
                    for j in range(4)]
        drafts = [expected[0] if seed % 3 else (expected[0] + 1) % V, expected[1] if seed % 2 else 0, -1, -1]
        out, _ = _verify(logits, np.array([drafts], np.int32), _wide(params, 1, 4, 5, seed=seed), _tables(params))
        num = int(out.num_emitted[0])
        accepted = 0
        while accepted < 2 and drafts[accepted] == expected[accepted]:
            accepted += 1
        assert num == accepted + 1
        assert np.asarray(out.token_ids)[0, :num].tolist() == expected[:num]
        plain_tokens.add(expected[0])
    assert len(plain_tokens) > 1


def test_logprobs_are_those_of_each_emitted_token():
    params = SamplingParams(temperature=0.0, logprobs=2)
    logits = np.stack([np.roll(LOGITS, i) for i in range(4)]).astype(np.float32)
    drafts = [int(np.argmax(logits[i])) for i in range(3)]
    out, _ = _verify(logits, np.array([drafts + [-1]], np.int32), _wide(params, 1, 4, 0), _tables(params, output=[]))
    raw = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    tokens = np.asarray(out.token_ids)[0]
    assert int(out.num_emitted[0]) == 4
    np.testing.assert_allclose(np.asarray(out.logprobs)[0], raw[np.arange(4), tokens], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.top_ids)[0, :, 0], np.argmax(logits, axis=-1))
