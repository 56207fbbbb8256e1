"""OutputLengthPredictor: per-prefix and per-salt history of output lengths, a global prior, the request's bounds."""

from __future__ import annotations

import pytest

from scheduler import OutputLengthPredictor, Request, SamplingParams
from scheduler.block_hash import extend_block_hashes

BS = 4
HEADER = [1, 2, 3, 4]
SYSTEM_A = HEADER + [11, 12, 13, 14]
SYSTEM_B = HEADER + [21, 22, 23, 24]


def request(prompt, max_tokens=1000, length_limit=None, **kw) -> Request:
    params = kw.pop("params", None) or SamplingParams(max_tokens=max_tokens)
    req = Request(f"r{id(prompt)}", list(prompt), params, **kw)
    req.length_limit = length_limit or len(prompt) + (params.max_tokens or 1000)
    return req


def finish(predictor: OutputLengthPredictor, prompt, num_output: int, **kw) -> None:
    """Learn that a request with ``prompt`` generated ``num_output`` tokens."""
    req = request(prompt, **kw)
    req.predicted_output_tokens = predictor.predict(req)
    for _ in range(num_output):
        req.append_output_token(7)
    predictor.observe(req)


def test_with_no_history_the_prior_is_predicted():
    assert OutputLengthPredictor(BS, prior_tokens=128).predict(request(SYSTEM_A + [5])) == 128


def test_prediction_never_exceeds_max_tokens():
    assert OutputLengthPredictor(BS, prior_tokens=128).predict(request(SYSTEM_A + [5], max_tokens=50)) == 50


def test_prediction_never_exceeds_what_max_model_len_leaves():
    req = request(SYSTEM_A + [5], max_tokens=None, length_limit=40)
    assert OutputLengthPredictor(BS, prior_tokens=128).predict(req) == 40 - 9


def test_min_tokens_floors_the_prediction():
    req = request(SYSTEM_A, params=SamplingParams(max_tokens=1000, min_tokens=300))
    assert OutputLengthPredictor(BS, prior_tokens=128).predict(req) == 300


def test_request_that_cannot_stop_early_is_predicted_its_max_tokens():
    predictor = OutputLengthPredictor(BS)
    finish(predictor, SYSTEM_A, 3)
    assert predictor.predict(request(SYSTEM_A, params=SamplingParams(max_tokens=90, ignore_eos=True))) == 90


def test_a_stop_token_lets_an_ignore_eos_request_stop_early_so_history_is_used():
    predictor = OutputLengthPredictor(BS)
    finish(predictor, SYSTEM_A, 3)
    params = SamplingParams(max_tokens=90, ignore_eos=True, stop_token_ids=[9])
    assert predictor.predict(request(SYSTEM_A, params=params)) == 3


def test_a_template_is_predicted_its_own_moving_average():
    predictor = OutputLengthPredictor(BS, alpha=0.5)
    finish(predictor, SYSTEM_A + [5, 6], 10)
    finish(predictor, SYSTEM_A + [7, 8, 9], 30)
    assert predictor.predict(request(SYSTEM_A + [1, 2])) == 20


def test_the_deepest_prefix_seen_wins_over_a_header_every_template_shares():
    predictor = OutputLengthPredictor(BS)
    finish(predictor, SYSTEM_A + [5], 10)
    finish(predictor, SYSTEM_B + [5], 500)
    assert (predictor.predict(request(SYSTEM_A + [6])), predictor.predict(request(SYSTEM_B + [6]))) == (10, 500)


def test_an_unseen_template_after_a_shared_header_gets_the_headers_history():
    predictor = OutputLengthPredictor(BS, alpha=0.5)
    finish(predictor, SYSTEM_A, 10)
    finish(predictor, SYSTEM_B, 30)
    assert predictor.predict(request(HEADER + [31, 32, 33, 34])) == 20


def test_a_prompt_shorter_than_a_block_is_keyed_by_its_cache_salt():
    predictor = OutputLengthPredictor(BS)
    finish(predictor, [5, 6], 40, cache_salt="tenant-a")
    assert (predictor.predict(request([7], cache_salt="tenant-a")), predictor.predict(request([7]))) == (40, 106)


def test_without_history_for_key_or_salt_the_global_average_moves_toward_every_finish():
    predictor = OutputLengthPredictor(BS, alpha=0.25, prior_tokens=100)
    finish(predictor, SYSTEM_A, 20)
    assert predictor.predict(request([90] * 8)) == 80


def test_keys_are_the_prefix_cache_hashes_whether_or_not_the_request_has_them():
    predictor = OutputLengthPredictor(BS)
    finish(predictor, SYSTEM_A, 10)
    hashed = request(SYSTEM_A + [5])
    extend_block_hashes(hashed.block_hashes, hashed.all_token_ids, 2, BS, None, hashed.prompt_array)
    assert predictor.predict(hashed) == predictor.predict(request(SYSTEM_A + [5])) == 10


def test_only_max_keys_are_kept_least_recently_used_first_out():
    predictor = OutputLengthPredictor(BS, key_blocks=1, max_keys=2, alpha=1.0)
    for i, n in enumerate((10, 20, 30)):
        finish(predictor, [40 + i] * BS, n)
    # The first prefix was dropped: it gets the global average (the last finish, with alpha 1).
    assert [predictor.predict(request([40 + i] * BS)) for i in range(3)] == [30, 20, 30]


def test_error_counters_sum_predictions_outputs_and_absolute_errors():
    predictor = OutputLengthPredictor(BS, prior_tokens=100, alpha=1.0)
    finish(predictor, SYSTEM_A, 40)  # predicted 100
    finish(predictor, SYSTEM_A, 50)  # predicted 40
    assert (predictor.num_observed, predictor.predicted_output_tokens, predictor.actual_output_tokens,
            predictor.abs_error_tokens) == (2, 140, 90, 70)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size=0 must be an int >= 1"),
    (dict(block_size=BS, key_blocks=0), "key_blocks=0 must be an int >= 1"),
    (dict(block_size=BS, max_keys=0), "max_keys=0 must be an int >= 1"),
    (dict(block_size=BS, alpha=0.0), r"alpha=0.0 must be in \(0, 1\]"),
    (dict(block_size=BS, alpha=1.5), r"alpha=1.5 must be in \(0, 1\]"),
    (dict(block_size=BS, prior_tokens=0.5), "prior_tokens=0.5 must be >= 1"),
])
def test_out_of_range_arguments_are_refused_naming_the_value_and_the_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OutputLengthPredictor(**kwargs)
