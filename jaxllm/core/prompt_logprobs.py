"""Prompt logprobs in the engine core: which token rows of a step want one, and recording what the step returns.

vLLM's ``SamplingParams.prompt_logprobs=k``: for every prompt position a
``{token_id: Logprob}`` dict holding the prompt token's logprob and rank and
the top ``k``, of the raw model distribution (``log_softmax`` of the float32 logits);
position 0 has no logprob (None). The step computes, at each query token,
the logprob of the prompt token that follows it (``prompt_target_ids``,
``sampler.prompt_logprobs``), so query position ``p`` gives prompt position
``p + 1``.

Positions are recorded as each prefill chunk is computed, each once: a
request recomputed after preemption asks only for positions not recorded
yet, and a step that was in flight when its request was preempted (async
scheduling) is not recorded twice. The request that computes them skips the
prefix cache (``Request.skip_reading_prefix_cache``), as in vLLM, until they
are all recorded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from jaxllm.core.messages import SampleLogprobs
from scheduler import ScheduledRequest

if TYPE_CHECKING:
    from jaxllm.sample.sampler import PromptLogprobRows


class PromptLogprobs:
    """One request's prompt logprobs, filled in as its prompt is computed.

    Args:
      prompt: the prompt's token ids.
      num_top: top logprobs kept per position (``SamplingParams.prompt_logprobs``).

    Attributes:
      rows: per prompt position recorded so far, from position 1 (position 0
        has none): the prompt token, its logprob and rank, and the top
        ``num_top`` (the front end's ``output_processor.logprob_entry`` makes
        vLLM's dicts of them).
    """

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
        """Target ids of ``count`` query tokens at positions ``start, start + 1, ...``.

        Returns:
          int32[count]: the prompt token at ``p + 1`` for query position ``p``
          where that prompt position is not recorded yet, -1 elsewhere; None
          when no position is wanted.
        """
        first, end = max(start + 1, self.num_recorded), min(start + count + 1, len(self.prompt))
        if first >= end:
            return None
        out = np.full(count, -1, np.int32)
        out[first - start - 1: end - start - 1] = self.prompt[first:end]
        return out

    def record(self, start: int, logprobs: np.ndarray, ranks: np.ndarray, top_ids: np.ndarray,
               top_logprobs: np.ndarray) -> None:
        """Record the step's outputs for query positions ``start, start + 1, ...``.

        Args:
          start: the first query token's position.
          logprobs: float32[count]; ranks: int32[count]; top_ids:
            int32[count, K]; top_logprobs: float32[count, K]
            (``sampler.prompt_logprobs``'s rows of these tokens).

        Only prompt positions not recorded yet are taken, in order.
        """
        k = self.num_top
        for i in range(max(self.num_recorded - 1 - start, 0), min(len(logprobs), len(self.prompt) - 1 - start)):
            pos = start + 1 + i
            if pos != self.num_recorded:
                # Positions arrive in order; never record past a gap.
                break
            self.rows.append(SampleLogprobs(int(self.prompt[pos]), float(logprobs[i]), int(ranks[i]),
                                            top_ids[i, :k].tolist(), top_logprobs[i, :k].tolist()))


def prompt_targets(rows: Sequence[ScheduledRequest], num_slots: int) -> Optional[np.ndarray]:
    """The step's ``prompt_target_ids``: int32[num_slots] (the T bucket), -1
    where nothing is wanted; None when no row wants any. A row wants them while
    its request (a ``CoreSequence``) holds a ``prompt_logprobs`` tracker."""
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
    """Record a step's prompt logprobs (``out``, one row per token, on the
    host) into the rows' trackers; a tracker complete now leaves its
    sequence, which may read the prefix cache again.

    Returns:
      the number of trackers completed (left their sequences) by this step.
    """
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
