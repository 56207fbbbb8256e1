"""Host bookkeeping of prompt logprobs: which positions a step asks for, and recording each once."""

from __future__ import annotations

import numpy as np

from jaxllm.core.messages import SampleLogprobs
from jaxllm.core.prompt_logprobs import PromptLogprobs

PROMPT = [10, 11, 12, 13, 14, 15]


def step_outputs(start, count, k=2):
    """Fake step rows for query positions start..: logprob -position, rank position + 3, top ids 100+i."""
    positions = np.arange(start, start + count)
    top_ids = np.stack([100 + positions] * k, axis=1).astype(np.int32) + np.arange(k)
    return -positions.astype(np.float32), positions + 3, top_ids, np.full((count, k), -0.5, np.float32)


def test_targets_are_the_next_prompt_tokens_up_to_the_prompt_end():
    tracker = PromptLogprobs(PROMPT, 2)
    np.testing.assert_array_equal(tracker.targets(0, 4), [11, 12, 13, 14])
    np.testing.assert_array_equal(tracker.targets(4, 3), [15, -1, -1])
    assert tracker.targets(5, 1) is None


def test_recorded_positions_are_not_asked_for_again():
    tracker = PromptLogprobs(PROMPT, 2)
    tracker.record(0, *step_outputs(0, 3))
    np.testing.assert_array_equal(tracker.targets(0, 5), [-1, -1, -1, 14, 15])


def test_a_recomputed_chunk_records_only_positions_not_recorded_yet():
    tracker = PromptLogprobs(PROMPT, 1)
    tracker.record(0, *step_outputs(0, 3))
    tracker.record(0, *step_outputs(0, 6))
    assert tracker.complete
    assert tracker.rows == [SampleLogprobs(PROMPT[p], -float(p - 1), p + 2, [99 + p], [-0.5]) for p in range(1, 6)]


def test_positions_past_a_gap_are_not_recorded():
    tracker = PromptLogprobs(PROMPT, 1)
    tracker.record(2, *step_outputs(2, 3))
    assert tracker.rows == [] and tracker.num_recorded == 1
