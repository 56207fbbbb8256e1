"""Prompt logprobs in the engine core (vLLM's ``prompt_logprobs``): query position ``p`` gives prompt position
``p + 1``, each recorded once across chunks and preemption; the request skips the prefix cache until done."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from jaxllm.core.messages import SampleLogprobs
from scheduler import ScheduledRequest

if TYPE_CHECKING:
    from jaxllm.sample.sampler import PromptLogprobRows


class PromptLogprobs:
    """One request's prompt logprobs, filled as ``prompt`` is computed; ``rows``: per prompt position from 1,
    token, logprob, rank and the top ``num_top``."""

    def __init__(self, prompt: Sequence[int], num_top: int) -> None:
        self.prompt = np.asarray(prompt, np.int32)
        self.num_top = num_top
        self.rows: list[SampleLogprobs] = []

    @property
    def num_recorded(self) -> int:
        """Prompt positions recorded, position 0 (which has no logprob) included."""
        return len(self.rows) + 1

    @property
    def complete(self) -> bool:
        """Every prompt position is recorded."""
        return self.num_recorded == len(self.prompt)

    def targets(self, start: int, count: int) -> Optional[np.ndarray]:
        """int32[count] target ids of query positions from ``start`` (-1 where recorded), or None when none wanted."""
        first, end = max(start + 1, self.num_recorded), min(start + count + 1, len(self.prompt))
        if first >= end:
            return None
        out = np.full(count, -1, np.int32)
        out[first - start - 1: end - start - 1] = self.prompt[first:end]
        return out

    def record(self, start: int, logprobs: np.ndarray, ranks: np.ndarray, top_ids: np.ndarray,
               top_logprobs: np.ndarray) -> None:
        """Record ``sampler.prompt_logprobs``' rows (``[count]``, top ``[count, K]``) from query position ``start``."""
        k = self.num_top
        for i in range(max(self.num_recorded - 1 - start, 0), min(len(logprobs), len(self.prompt) - 1 - start)):
            pos = start + 1 + i
            if pos != self.num_recorded:
                # Positions arrive in order; never record past a gap.
                break
            self.rows.append(SampleLogprobs(int(self.prompt[pos]), float(logprobs[i]), int(ranks[i]),
                                            top_ids[i, :k].tolist(), top_logprobs[i, :k].tolist()))


def prompt_targets(rows: Sequence[ScheduledRequest], num_slots: int) -> Optional[np.ndarray]:
    """The step's ``prompt_target_ids``: int32[num_slots], -1 where nothing is wanted; None when no row wants any."""
    targets, start = None, 0
    for row in rows:
        tracker = row.request.prompt_logprobs
        wanted = None if tracker is None else tracker.targets(row.num_computed_tokens, row.num_new_tokens)
        if wanted is not None:
            if targets is None:
                targets = np.full(num_slots, -1, np.int32)
            targets[start: start + row.num_new_tokens] = wanted
        start += row.num_new_tokens
    return targets


def record_prompt_logprobs(rows: Sequence[ScheduledRequest], out: PromptLogprobRows) -> int:
    """Record a step's prompt logprobs into the rows' trackers; returns how many trackers completed."""
    start, completed = 0, 0
    for row in rows:
        end = start + row.num_new_tokens
        request = row.request
        tracker = request.prompt_logprobs
        if tracker is not None:
            tracker.record(row.num_computed_tokens, out.logprobs[start:end], out.ranks[start:end],
                           out.top_ids[start:end], out.top_logprobs[start:end])
            if tracker.complete:
                request.prompt_logprobs = None
                request.skip_reading_prefix_cache = False
                completed += 1
        start = end
    return completed
