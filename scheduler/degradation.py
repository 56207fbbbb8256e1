"""Graceful degradation under KV pressure: back the batch off instead of thrashing, restore it when calm.

A paged KV cache admits a request as soon as its prompt fits; decode then
grows every running request by a block every ``block_size`` tokens, and when
the free blocks run out the scheduler preempts (recompute: frees the victim's
blocks, which it re-prefills later). Under a burst this thrashes: the victim
is re-admitted the next step because its own blocks are free again, grows,
and is preempted again. The operator's moves when memory runs short are to
release idle prompts, back off the batch, and shed load; here:

* *make room*: before any preemption a KV tier may free device blocks
  (``KVTier.make_room``); the blocks the tiers could still free count as free
  for the low-water mark, so the batch backs off only once they can no longer
  cover the shortage;
* *release idle prompts*: prefixes pinned by the prefix-cache warm-up
  (``Scheduler.pin_prefix``) are unpinned on the first back-off and become
  ordinary LRU cache entries (revivable while not evicted);
* *back off the batch*: :class:`DegradationController` lowers the effective
  ``max_num_seqs`` and the prefill share of ``max_num_batched_tokens`` by one
  ``step_fraction`` of the configured values per trigger, and restores them
  one step per ``recover_steps`` calm steps;
* *shed load*: the front ends refuse new requests past
  ``max_waiting_requests`` (``jaxllm.core.client.QueueFullError``, 503 at the
  server); nothing is dropped silently.

Lowering the seats never preempts: running requests keep their seats and
finish; only admissions wait until the running count is under the new
limit. That is what stops the thrash: a preempted request is not re-admitted
into a batch that cannot hold it.
"""

from __future__ import annotations

import collections
import dataclasses
import math


@dataclasses.dataclass
class GracefulDegradation:
    """When and how far to back off (pass as ``SchedulerConfig(graceful_degradation=...)``; ``True`` means these
    defaults).

    A step is under *pressure* when, after it, fewer than
    ``low_free_fraction`` of the usable KV blocks are free (cached-but-free
    blocks count as free: allocation reclaims them), or when more than
    ``max_preemptions`` preemptions happened over the last ``window`` steps
    (since the last back-off: each preemption counts towards one).
    Each trigger lowers the limits by one more ``step_fraction`` of their
    configured values, at most once per ``cooldown`` steps, down to
    ``min_fraction``; after ``recover_steps`` consecutive calm steps the
    limits go up by one step (and again after as many more). A scheduler left
    with no request at all is calm by definition: its limits return to the
    configured values at once.

    Attributes:
      low_free_fraction: the low-water mark, a fraction of the usable blocks in [0, 1).
      max_preemptions: preemptions tolerated over ``window`` steps, >= 0.
      window: steps over which preemptions are counted, >= 1.
      step_fraction: how much one trigger lowers (and one recovery raises) the limits, in (0, 1].
      min_fraction: the floor, as a fraction of the configured limits, in (0, 1].
      cooldown: steps between two back-offs, >= 1 (time for the last one to show).
      recover_steps: consecutive calm steps before each restore step, >= 1.

    Raises:
      ValueError: a field out of range, named with its limit.
    """

    low_free_fraction: float = 0.1
    max_preemptions: int = 0
    window: int = 8
    step_fraction: float = 0.1
    min_fraction: float = 0.2
    cooldown: int = 2
    recover_steps: int = 8

    def __post_init__(self) -> None:
        checks = (
            ("low_free_fraction", 0 <= self.low_free_fraction < 1, "in [0, 1)"),
            ("max_preemptions", isinstance(self.max_preemptions, int) and self.max_preemptions >= 0, "an int >= 0"),
            ("window", isinstance(self.window, int) and self.window >= 1, "an int >= 1"),
            ("step_fraction", 0 < self.step_fraction <= 1, "in (0, 1]"),
            ("min_fraction", 0 < self.min_fraction <= 1, "in (0, 1]"),
            ("cooldown", isinstance(self.cooldown, int) and self.cooldown >= 1, "an int >= 1"),
            ("recover_steps", isinstance(self.recover_steps, int) and self.recover_steps >= 1, "an int >= 1"),
        )
        for name, ok, limit in checks:
            if not ok:
                raise ValueError(f"GracefulDegradation.{name}={getattr(self, name)!r} is out of range: must be {limit}")


class DegradationController:
    """The effective batch limits of one scheduler, lowered under KV pressure and restored when calm.

    Args:
      settings: the ``GracefulDegradation`` thresholds.
      max_num_seqs, max_num_batched_tokens: the configured limits (seats, tokens per step).
      num_usable_blocks: device KV blocks without the null block.
      lower_token_budget: whether the token budget may go down (False without
        chunked prefill, where a prompt must fit one step's budget whole).

    Attributes:
      low_water: the free blocks under which a step is under pressure (``low_free_fraction`` of the usable ones).
      level: back-offs in force (0: the configured limits).
      max_num_seqs: the effective seats: ``ceil(configured * f)``, at least 1,
        with ``f = max(1 - level * step_fraction, min_fraction)``.
      max_num_batched_tokens: the effective token budget: the configured seats
        (one decode token each, so running requests are never starved) plus
        ``ceil(f * (configured budget - configured seats))`` for prefill.
      num_backoffs, num_restores: triggers and restore steps so far.
    """

    def __init__(self, settings: GracefulDegradation, max_num_seqs: int, max_num_batched_tokens: int,
                 num_usable_blocks: int, lower_token_budget: bool = True) -> None:
        self.settings = settings
        self.configured_max_num_seqs = max_num_seqs
        self.configured_max_num_batched_tokens = max_num_batched_tokens
        self.low_water = settings.low_free_fraction * num_usable_blocks
        self._lower_tokens = lower_token_budget
        self._max_level = math.ceil(round((1 - settings.min_fraction) / settings.step_fraction, 9))
        self._recent: collections.deque[int] = collections.deque(maxlen=settings.window)
        self._since_backoff = settings.cooldown
        self._calm = 0
        self.level = 0
        self.num_backoffs = 0
        self.num_restores = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    def resize(self, num_usable_blocks: int) -> None:
        """Follow a resized KV pool (``Scheduler.resize_kv_cache``): the low-water mark is a fraction of it."""
        self.low_water = self.settings.low_free_fraction * num_usable_blocks

    def observe(self, num_free_blocks: int, num_preemptions: int, idle: bool) -> bool:
        """Record one step: free blocks after it, preemptions in it, and whether the scheduler is now empty.

        Returns:
          True when this step lowered the limits from the configured values
          (the first back-off: the caller releases pinned prefixes then).
        """
        s = self.settings
        self._recent.append(num_preemptions)
        self._since_backoff += 1
        if idle:
            self._recent.clear()
            self._calm = 0
            self._set_level(0)
            return False
        pressure = num_free_blocks < self.low_water or sum(self._recent) > s.max_preemptions
        if not pressure:
            self._calm += 1
            if self.level and self._calm >= s.recover_steps:
                self._calm = 0
                self.num_restores += 1
                self._set_level(self.level - 1)
            return False
        self._calm = 0
        if self._since_backoff < s.cooldown or self.level >= self._max_level:
            return False
        self._since_backoff = 0
        # Each preemption counts towards one back-off only.
        self._recent.clear()
        self.num_backoffs += 1
        self._set_level(self.level + 1)
        return self.level == 1

    def _set_level(self, level: int) -> None:
        self.level = level
        f = max(1.0 - level * self.settings.step_fraction, self.settings.min_fraction)
        seqs, tokens = self.configured_max_num_seqs, self.configured_max_num_batched_tokens
        self.max_num_seqs = max(math.ceil(round(seqs * f, 9)), 1)
        if self._lower_tokens:
            self.max_num_batched_tokens = seqs + math.ceil(round((tokens - seqs) * f, 9))
