"""The jitted sampler against plain numpy references of each transform (vLLM v1 semantics)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.sample.sampler import (
    MAX_BANNED_IDS,
    PROMPT_LOGPROBS_CHUNK,
    SamplingArrays,
    apply_logit_processors,
    apply_token_bitmask,
    apply_top_k_top_p_min_p,
    argmax_rows,
    fill_slot,
    init_tables,
    prompt_logprobs,
    sample,
    seed_words,
    set_slot_rows,
)
from jaxllm.structured_output import bitmask_words
from scheduler import SamplingParams

V = 8
LOGITS = np.array([2.0, 1.5, 0.7, 0.3, -0.2, -1.0, 1.1, 0.05], np.float32)
PROMPT = [0, 3, 3]
OUTPUT = [1, 1, 6, 3]
N_DRAWS = 20_000

_sample = jax.jit(sample)


_argmax_rows = jax.jit(argmax_rows)
SPECIAL = (np.inf, -np.inf, np.nan)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(1, 50), (3, 96), (3, 384), (2, 4096)]), st.integers(0, 2**32 - 1),
       st.lists(st.tuples(st.integers(0, 4), st.sampled_from(SPECIAL)), max_size=4))
def test_argmax_rows_is_numpy_argmax_with_ties_infinities_and_nan(shape, seed, specials):
    """The two-pass argmax returns np.argmax's index exactly: the first of tied maxima (small integer logits tie
    within and across chunks), -inf and +inf entries, rows of all -inf, NaN (np.argmax: its first NaN) and
    +inf beside -inf (a NaN row sum: the plain argmax path). Vocabularies: no chunk width divides 50; 96 takes
    32-token chunks, 384 and 4096 128-token ones (from about 4096 tokens XLA's vectorized max skips NaN)."""
    rows, vocab = shape
    rng = np.random.default_rng(seed)
    logits = rng.integers(-3, 3, (rows, vocab)).astype(np.float32)
    for row, value in specials:
        if row < rows:
            logits[row, rng.integers(0, vocab, 2)] = value
    if seed % 5 == 0:
        logits[0] = -np.inf
    np.testing.assert_array_equal(np.asarray(_argmax_rows(logits)), np.argmax(logits, axis=-1))


def test_argmax_rows_takes_the_first_nan_of_a_48_row_step_of_the_default_vocabulary():
    """Regression: the chunked maxima of 48 x 49152 logits skip a NaN at [3, 100] (they gave token 25794)."""
    logits = np.random.default_rng(0).standard_normal((48, 49152)).astype(np.float32)
    logits[3, 100] = np.nan
    expected = np.argmax(logits, axis=-1)
    assert expected[3] == 100
    np.testing.assert_array_equal(np.asarray(_argmax_rows(logits)), expected)


# ------------------------------------------------------------ numpy references


def ref_processors(logits, params: SamplingParams, prompt, output, banned=(), stop_ids=()):
    """vLLM v1 order: allowed ids, bad words (given as banned ids), min_tokens, logit_bias, penalties."""
    x = logits.astype(np.float64).copy()
    if params.allowed_token_ids is not None:
        mask = np.ones(V, bool)
        mask[list(params.allowed_token_ids)] = False
        x[mask] = -np.inf
    x[list(banned)] = -np.inf
    if len(output) < params.min_tokens:
        x[list(stop_ids)] = -np.inf
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    counts = np.bincount(output, minlength=V)
    seen = (counts > 0) | np.isin(np.arange(V), prompt)
    r = params.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def ref_distribution(logits, params: SamplingParams):
    """Temperature, then min-p, top-k, top-p (on the renormalised survivors), as vLLM."""
    x = logits / params.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= params.min_p * p.max()
    order = np.argsort(-p, kind="stable")
    if params.top_k > 0:
        keep[order[params.top_k:]] = False
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    mass_before = np.cumsum(q[order]) - q[order]
    keep[order[mass_before >= params.top_p]] = False
    keep[order[0]] = True
    out = np.where(keep, p, 0.0)
    return out / out.sum()


# --------------------------------------------------------------- helpers


def _tables(params: SamplingParams, prompt=PROMPT, output=OUTPUT, stop_ids=()):
    tables = init_tables(3, V)
    tokens = np.zeros(32, np.int32)
    tokens[: len(prompt) + len(output)] = prompt + output
    tables = fill_slot(tables, np.int32(1), tokens, np.int32(len(prompt)), np.int32(len(prompt) + len(output)))
    bias = np.zeros(V, np.float32)
    if params.allowed_token_ids is not None:
        bias[:] = -np.inf
        bias[list(params.allowed_token_ids)] = 0.0
    for t, b in (params.logit_bias or {}).items():
        bias[t] += b
    stop = np.zeros(V, bool)
    stop[list(stop_ids)] = True
    return set_slot_rows(tables, np.int32(1), bias, stop)


def _arrays(params: SamplingParams, rows: int, num_generated, seed: int = 0, banned=()):
    arrays = SamplingArrays.empty(rows)
    uses_bias = bool(params.logit_bias) or params.allowed_token_ids is not None
    values = np.array([SamplingArrays.row_values(params, seed, uses_bias)] * rows, np.float64)
    arrays.set_rows(np.arange(rows), values, slot=[1] * rows, num_generated=num_generated, sample=[True] * rows)
    for i in range(rows):
        arrays.set_banned(i, banned)
    return arrays


def _frequencies(params: SamplingParams, logits=LOGITS, **kw):
    arrays = _arrays(params, N_DRAWS, np.arange(N_DRAWS), seed=1234)
    batch = np.broadcast_to(logits, (N_DRAWS, V))
    out, _ = _sample(batch, arrays, _tables(params, **kw))
    return np.bincount(np.asarray(out.token_ids), minlength=V) / N_DRAWS


def _assert_within_3_standard_errors(freq, p):
    se = np.sqrt(p * (1 - p) / N_DRAWS)
    assert np.all(np.abs(freq - p) <= 3 * se + 1e-12), (freq, p)


# ----------------------------------------------------------------- tests


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.7), dict(repetition_penalty=0.6), dict(presence_penalty=0.8),
    dict(frequency_penalty=-0.5), dict(logit_bias={2: 3.0, 5: -1.5}), dict(allowed_token_ids=[2, 4, 5]),
    dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={7: 2.0}),
])
def test_processors_match_numpy_reference(kw):
    params = SamplingParams(**kw)
    arrays = _arrays(params, 1, len(OUTPUT))
    got = apply_logit_processors(LOGITS[None], arrays, _tables(params))[0]
    np.testing.assert_allclose(got, ref_processors(LOGITS, params, PROMPT, OUTPUT), rtol=1e-6)


def test_banned_bad_word_ids_are_masked():
    params = SamplingParams()
    arrays = _arrays(params, 1, len(OUTPUT), banned=[0, 6])
    got = apply_logit_processors(LOGITS[None], arrays, _tables(params))[0]
    np.testing.assert_allclose(got, ref_processors(LOGITS, params, PROMPT, OUTPUT, banned=[0, 6]))


def test_min_tokens_bans_stop_ids_only_before_min_tokens():
    params = SamplingParams(min_tokens=5)
    tables = _tables(params, stop_ids=[0, 2])
    before = apply_logit_processors(LOGITS[None], _arrays(params, 1, 4), tables)[0]
    after = apply_logit_processors(LOGITS[None], _arrays(params, 1, 5), tables)[0]
    np.testing.assert_allclose(before, ref_processors(LOGITS, params, PROMPT, OUTPUT, stop_ids=[0, 2]))
    np.testing.assert_allclose(after, LOGITS)


@pytest.mark.parametrize("kw", [
    dict(top_k=3), dict(top_p=0.6), dict(min_p=0.3), dict(top_k=4, top_p=0.7), dict(top_k=5, top_p=0.8, min_p=0.2),
])
def test_top_k_top_p_min_p_keep_the_reference_set(kw):
    params = SamplingParams(**kw)
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=V).astype(np.float32) * 2
        got = apply_top_k_top_p_min_p(logits[None], np.array([params.top_k], np.int32),
                                      np.array([params.top_p], np.float32), np.array([params.min_p], np.float32))[0]
        expected = ref_distribution(logits, params) > 0
        np.testing.assert_array_equal(np.isfinite(got), expected)


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0), dict(temperature=0.5), dict(temperature=1.8), dict(temperature=1.0, top_k=3),
    dict(temperature=0.9, top_p=0.7), dict(temperature=1.2, min_p=0.2), dict(temperature=1.0, top_k=5, top_p=0.85),
])
def test_sampled_frequencies_match_reference_distribution(kw):
    params = SamplingParams(**kw)
    _assert_within_3_standard_errors(_frequencies(params), ref_distribution(LOGITS.astype(np.float64), params))


def test_sampled_frequencies_with_penalties_and_bias_match_reference():
    params = SamplingParams(temperature=0.8, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2,
                            logit_bias={4: 1.0}, top_p=0.95)
    processed = ref_processors(LOGITS, params, PROMPT, OUTPUT)
    _assert_within_3_standard_errors(_frequencies(params), ref_distribution(processed, params))


def test_top_k_1_and_temperature_0_equal_greedy():
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    processed = ref_processors(LOGITS, params, PROMPT, OUTPUT)
    for p in (params, SamplingParams(temperature=1.3, top_k=1, repetition_penalty=1.5)):
        out, _ = _sample(np.broadcast_to(LOGITS, (64, V)), _arrays(p, 64, np.arange(64), seed=5), _tables(p))
        assert np.all(np.asarray(out.token_ids) == np.argmax(processed))


def test_seeded_row_draws_the_same_token_in_any_batch_position_or_bucket():
    params = SamplingParams(temperature=1.0, seed=99)
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(16, V)).astype(np.float32)
    logits[5] = LOGITS
    alone, _ = _sample(LOGITS[None], _arrays(params, 1, 7, seed=99), _tables(params))
    arrays = _arrays(params, 16, 7, seed=99)
    arrays.seed[:] = [seed_words(s) for s in range(16)]
    arrays.seed[5] = seed_words(99)
    batched, _ = _sample(logits, arrays, _tables(params))
    assert int(batched.token_ids[5]) == int(alone.token_ids[0])


def test_used_samples_are_counted_in_their_slot():
    params = SamplingParams(temperature=0.0)
    arrays = _arrays(params, 3, 4)
    arrays.slot[:] = [1, 2, 0]
    arrays.sample_mask[:] = [True, False, True]
    out, tables = _sample(np.broadcast_to(LOGITS, (3, V)), arrays, _tables(params))
    counts = np.asarray(tables.counts)
    expected = np.bincount(OUTPUT, minlength=V)
    expected[0] += 1  # argmax of LOGITS
    np.testing.assert_array_equal(counts[1], expected)
    assert not counts[2].any() and not counts[0].any()


def test_refilling_a_slot_recounts_instead_of_adding():
    params = SamplingParams()
    tables = _tables(params)
    tables = _tables(params)  # the same sequence readmitted after preemption
    np.testing.assert_array_equal(np.asarray(tables.counts)[1], np.bincount(OUTPUT, minlength=V))
    np.testing.assert_array_equal(np.asarray(tables.prompt)[1], np.isin(np.arange(V), PROMPT))


def test_logprobs_are_raw_log_softmax_with_top_k_descending():
    params = SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=2.0)
    out, _ = _sample(LOGITS[None], _arrays(params, 1, 4), _tables(params))
    raw = LOGITS - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    token = int(out.token_ids[0])
    np.testing.assert_allclose(out.logprobs[0], raw[token], atol=1e-6)
    assert out.ranks[0] == 1 + np.sum(LOGITS > LOGITS[token])  # LOGITS has no ties
    np.testing.assert_array_equal(out.top_ids[0, :3], np.argsort(-LOGITS)[:3])
    np.testing.assert_allclose(out.top_logprobs[0, :3], np.sort(raw)[::-1][:3], atol=1e-6)


def test_prompt_logprobs_are_raw_log_softmax_of_every_wanted_row_over_several_chunks():
    rng = np.random.default_rng(0)
    rows, embed, vocab = PROMPT_LOGPROBS_CHUNK + 37, 8, 40
    hidden, head = rng.normal(size=(rows, embed)).astype(np.float32), rng.normal(size=(embed, vocab)).astype(np.float32)
    targets = np.where(rng.random(rows) < 0.7, rng.integers(0, vocab, rows), -1).astype(np.int32)
    out = jax.jit(lambda h, t: prompt_logprobs(lambda x: x @ head, h, t))(hidden, targets)
    logits = hidden.astype(np.float64) @ head
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    wanted = targets >= 0
    np.testing.assert_allclose(out.logprobs[wanted], raw[wanted, targets[wanted]], atol=1e-5)
    ref_ranks = (raw >= raw[np.arange(rows), targets][:, None]).sum(-1)
    np.testing.assert_array_equal(out.ranks[wanted], ref_ranks[wanted])
    np.testing.assert_array_equal(out.top_ids[wanted], np.argsort(-raw, axis=-1)[wanted, :20])
    np.testing.assert_allclose(out.top_logprobs[wanted], -np.sort(-raw, axis=-1)[wanted, :20], atol=1e-5)
    assert not out.logprobs[~wanted].any() and not out.top_ids[~wanted].any()
    assert not out.ranks[~wanted].any()


def test_prompt_logprobs_are_zeros_of_the_same_shapes_when_no_row_wants_them():
    head = np.eye(4, 30, dtype=np.float32)
    out = jax.jit(lambda h, t: prompt_logprobs(lambda x: x @ head, h, t))(np.ones((16, 4), np.float32),
                                                                          np.full(16, -1, np.int32))
    assert {k: (v.shape, v.dtype) for k, v in vars(out).items()} == {
        "logprobs": ((16,), np.float32), "ranks": ((16,), np.int32),
        "top_ids": ((16, 20), np.int32), "top_logprobs": ((16, 20), np.float32)}
    assert not any(np.asarray(v).any() for v in vars(out).values())


def _bitmask(rows_allowed, vocab=V):
    """Pack per-row allowed-id lists (None: all) into int32[rows, ceil(vocab/32)], llguidance's layout."""
    bits = np.zeros((len(rows_allowed), bitmask_words(vocab) * 32), np.uint8)
    for i, allowed in enumerate(rows_allowed):
        bits[i, list(range(bits.shape[1])) if allowed is None else allowed] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


@pytest.mark.parametrize("vocab", [8, 32, 45])
def test_token_bitmask_keeps_exactly_the_set_bits_and_ignores_bits_past_the_vocabulary(vocab):
    rng = np.random.default_rng(vocab)
    allowed = [np.flatnonzero(rng.random(bitmask_words(vocab) * 32) < 0.4).tolist() for _ in range(5)]
    allowed.append([vocab - 1, bitmask_words(vocab) * 32 - 1])  # the last id, and a bit 31 past the vocabulary
    logits = rng.normal(size=(len(allowed), vocab)).astype(np.float32)
    got = np.asarray(apply_token_bitmask(logits, _bitmask(allowed, vocab)))
    for row, ids in enumerate(allowed):
        keep = np.isin(np.arange(vocab), ids)
        np.testing.assert_array_equal(got[row], np.where(keep, logits[row], -np.inf))


def test_bitmask_limits_greedy_and_sampled_tokens_and_the_logprobs_are_of_the_masked_distribution():
    params = SamplingParams(temperature=1.0, logprobs=2)
    allowed = [3, 5, 6]
    arrays = _arrays(params, N_DRAWS, np.arange(N_DRAWS), seed=7)
    out, _ = _sample(np.broadcast_to(LOGITS, (N_DRAWS, V)), arrays, _tables(params),
                     np.broadcast_to(_bitmask([allowed]), (N_DRAWS, 1)))
    masked = np.where(np.isin(np.arange(V), allowed), LOGITS, -np.inf)
    p = np.exp(masked - masked.max()) / np.exp(masked - masked.max()).sum()
    _assert_within_3_standard_errors(np.bincount(np.asarray(out.token_ids), minlength=V) / N_DRAWS, p)
    np.testing.assert_allclose(np.asarray(out.logprobs), np.log(p[np.asarray(out.token_ids)]), atol=1e-5)
    np.testing.assert_array_equal(out.top_ids[0, :2], [6, 3])
    greedy = SamplingParams(temperature=0)
    out, _ = _sample(np.broadcast_to(LOGITS, (2, V)), _arrays(greedy, 2, 0), _tables(greedy),
                     _bitmask([allowed, None]))
    assert out.token_ids.tolist() == [6, 0]


def test_a_row_whose_bans_leave_nothing_its_bitmask_allows_takes_an_allowed_token():
    params = SamplingParams(temperature=0, allowed_token_ids=[0, 1])
    out, _ = _sample(LOGITS[None], _arrays(params, 1, 0), _tables(params), _bitmask([[3, 5]]))
    assert out.token_ids.tolist() == [3]
    # Where bans and the bitmask agree on something, both hold.
    out, _ = _sample(LOGITS[None], _arrays(params, 1, 0), _tables(params), _bitmask([[1, 3]]))
    assert out.token_ids.tolist() == [1]


def test_too_many_banned_ids_are_rejected():
    with pytest.raises(ValueError, match=str(MAX_BANNED_IDS)):
        SamplingArrays.empty(1).set_banned(0, list(range(MAX_BANNED_IDS + 1)))


# ------------------------------------------- issue 25 item 6: every int64 seed its own stream

# The reported aliases (5 and 5 + 2**32, 7 and 7 - 2**32, 0 and 2**40), the 32-bit boundaries and int64's edges.
EDGE_SEEDS = [0, 1, -1, 5, 5 + 2**32, 7, 7 - 2**32, 2**40, 2**31 - 1, 2**31, 2**32 - 1, 2**32, -(2**31), -(2**32),
              2**63 - 1, 2**63 - 2, -(2**63), -(2**63) + 1]
STREAM = 256  # draws per seed, over 8 equally likely tokens: two independent streams agree on about 1/8 of them


def _streams(seeds) -> np.ndarray:
    """``STREAM`` draws of each seed (positions 0..STREAM-1) from uniform logits: int[len(seeds), STREAM]."""
    params = SamplingParams(temperature=1.0)
    arrays = _arrays(params, len(seeds) * STREAM, np.tile(np.arange(STREAM), len(seeds)))
    arrays.seed[:] = np.repeat([seed_words(s) for s in seeds], STREAM, axis=0)
    out, _ = _sample(np.zeros((len(seeds) * STREAM, V), np.float32), arrays, _tables(params))
    return np.asarray(out.token_ids).reshape(len(seeds), STREAM)


def _assert_independent(streams: np.ndarray) -> None:
    # Agreements of two independent streams ~ Binomial(STREAM, 1/8): mean 32, sd 5.3; one seed aliased onto
    # another agrees everywhere.
    for i in range(len(streams)):
        for j in range(i):
            assert (streams[i] == streams[j]).sum() < 32 + 6 * 5.3, (i, j)


def test_issue25_item6_seeds_beyond_32_bits_draw_their_own_streams():
    _assert_independent(_streams(EDGE_SEEDS))


@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=2, max_size=4, unique=True),
       st.integers(-(2**31), 2**31 - 1))
@settings(max_examples=25, deadline=None)
def test_issue25_item6_distinct_int64_seeds_draw_independent_streams(seeds, shift):
    # Any distinct seeds, and each shifted by a multiple of 2**32 (the aliases of a 32-bit seed), where in range.
    shifted = [s + shift * 2**32 for s in seeds if -(2**63) <= s + shift * 2**32 < 2**63]
    _assert_independent(_streams(list(dict.fromkeys(seeds + shifted))))


@given(st.integers(-(2**63), 2**63 - 1))
def test_issue25_item6_seed_words_are_the_seeds_64_bits_and_keep_32_bit_seeds_streams(seed):
    high, low = seed_words(seed)
    assert 0 <= high < 2**32 and 0 <= low < 2**32
    assert ((high << 32) | low) - (2**64 if high >= 2**31 else 0) == seed  # one-to-one on int64
    if 0 <= seed < 2**32:  # jax.random.key(seed)'s own key, so these seeds' tokens do not change
        assert (high, low) == tuple(np.asarray(jax.random.key_data(jax.random.key(seed))).tolist())


def test_issue25_item6_a_large_seeded_row_draws_the_same_tokens_in_any_batch_position():
    target = 2**40 + 99
    alone = _streams([target])[0]
    for position in (0, 5, len(EDGE_SEEDS) - 1):
        seeds = list(EDGE_SEEDS)
        seeds[position] = target
        assert (_streams(seeds)[position] == alone).all()


@pytest.mark.parametrize("seed, n", [(2**63, 1), (2**64, 1), (-(2**63) - 1, 1), (2**63 - 1, 2), (2**100, 1)])
def test_issue25_item6_a_seed_outside_int64_is_refused_naming_it_and_the_range(seed, n):
    top = 2**63 - n
    with pytest.raises(ValueError, match=rf"SamplingParams\.seed={seed} is out of range: must be an int in "
                                         rf"\[-9223372036854775808, {top}\]"):
        SamplingParams(seed=seed, n=n)
    SamplingParams(seed=top, n=n)
    SamplingParams(seed=-(2**63), n=n)


def test_top_k_and_min_tokens_past_int32_keep_their_meaning():
    """Validation bounds neither (vLLM's does not): a top_k past the vocabulary keeps every token, a min_tokens
    past any reachable length bans the stop ids throughout; each is held as int32's largest, with no overflow."""
    import warnings

    params = SamplingParams(top_k=2**40, min_tokens=2**40, max_tokens=None, temperature=1.0)
    arrays = SamplingArrays.empty(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        arrays.set_rows([1], np.array([SamplingArrays.row_values(params, 3)]), slot=[1], num_generated=[0],
                        sample=[True])
    assert (arrays.top_k[1], arrays.min_tokens[1]) == (2**31 - 1, 2**31 - 1)
    assert (arrays.top_k[0], arrays.min_tokens[0], arrays.slot[0]) == (0, 0, 0)  # the other row untouched
