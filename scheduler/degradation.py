"""Graceful degradation under KV pressure: back the batch off instead of thrashing, restore it when calm.

Lowering the seats never preempts; admissions wait. Rationale and the operator moves it mirrors:
``docs/design/scheduler.md``.
"""

from __future__ import annotations

import collections
import dataclasses
import math


@dataclasses.dataclass
class GracefulDegradation:
    """When and how far to back off (``SchedulerConfig(graceful_degradation=...)``; ``True`` means these defaults).

    A step is under pressure when fewer than ``low_free_fraction`` of the usable blocks are free after it (cached
    free blocks and what tiers could free count as free), or more than ``max_preemptions`` happened over the last
    ``window`` steps since the last back-off. Each trigger lowers the limits by ``step_fraction`` of the configured
    values, at most once per ``cooldown`` steps, down to ``min_fraction``; each ``recover_steps`` calm steps raise
    them one step. An empty scheduler returns to the configured limits at once.

    Ranges: low_free_fraction in [0, 1); max_preemptions >= 0; window, cooldown, recover_steps >= 1;
    step_fraction, min_fraction in (0, 1]. Raises ValueError naming a field out of range.
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
      max_num_seqs, max_num_batched_tokens: the configured limits.
      num_usable_blocks: device KV blocks without the null block.
      lower_token_budget: whether the token budget may go down (False without chunked prefill).

    Attributes:
      low_water: free blocks under which a step is under pressure.
      level: back-offs in force (0: configured limits); ``f = max(1 - level * step_fraction, min_fraction)``.
      max_num_seqs: ``ceil(configured * f)``, >= 1.
      max_num_batched_tokens: configured seats + ``ceil(f * (configured budget - configured seats))``.
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
        """Record one step (free blocks after it, its preemptions, whether now empty); True when it made the first
        back-off (the caller then releases pinned prefixes)."""
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
