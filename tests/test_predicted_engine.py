"""``LLM(..., scheduling_policy="predicted", reserve_predicted_output=True)`` reaches the running scheduler, and its
finished requests teach the predictor, whose record reaches the metrics."""

from __future__ import annotations

from jaxllm import LLM, SamplingParams
from scheduler import PredictedPolicy


def test_predicted_policy_and_reservation_reach_the_running_scheduler_and_learn_from_finishes(stories_dir):
    llm = LLM(model=stories_dir, precompile=False, num_kv_blocks=24, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              scheduling_policy="predicted", reserve_predicted_output=True)
    scheduler = llm.engine.scheduler
    assert isinstance(scheduler.policy, PredictedPolicy) and scheduler.policy.max_num_batched_tokens == 32
    assert scheduler.config.reserve_predicted_output is True
    llm.generate(["Once upon a time", "The cat"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    stats = scheduler.stats
    assert (stats.num_predicted_finished, stats.actual_output_tokens) == (2, 10)
    # The same record on /metrics: ignore_eos without stops makes each prediction exact (5 tokens, no error).
    metric = llm.engine.metrics.registry.get_sample_value
    assert metric("jaxllm:request_output_length_predictions_total") == 2
    assert metric("jaxllm:request_actual_output_tokens_total") == 10
    assert metric("jaxllm:request_predicted_output_tokens_total") == stats.predicted_output_tokens == 10
    assert metric("jaxllm:request_output_length_prediction_abs_error_tokens_total") == 0
