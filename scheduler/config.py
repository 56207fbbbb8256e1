"""Scheduler configuration, validated on construction."""

from __future__ import annotations

import dataclasses
from typing import Union

from scheduler.degradation import GracefulDegradation
from scheduler.kv.host_tier import HostTier
from scheduler.kv.kv_cache_manager import KVCacheManager
from scheduler.policy import POLICIES, Policy

_PREEMPTION_MODES = ("recompute", "swap")


@dataclasses.dataclass
class SchedulerConfig:
    """Knobs of the scheduler and its KV cache; names follow vLLM's scheduler and cache configs.

    Attributes:
      block_size: tokens per KV block, >= 1.
      num_blocks: device KV blocks including the null block 0, >= 2. Required.
      max_num_seqs: requests in one batch at most, >= 1.
      max_num_batched_tokens: tokens in one step at most, >= max_num_seqs.
      max_model_len: prompt + output tokens at most (a longer prompt is ignored; reaching it length-caps).
      enable_prefix_caching: reuse computed full blocks across requests.
      enable_chunked_prefill: split long prompts across steps; when off, ``max_num_batched_tokens`` must be
        >= ``max_model_len``.
      long_prefill_token_threshold: cap on one request's prefill tokens per step; 0 (or no chunked prefill): none.
      scheduling_policy: "fcfs", "priority", "sjf", "aging", "load_aware", "predicted", or a ``Policy``.
      preemption_mode: "recompute" or "swap" (blocks to the host pool and back).
      num_host_blocks: host blocks for swap mode, >= 0; a victim that does not fit is recomputed.
      num_offload_blocks: host-tier blocks of the prefix cache (``scheduler.kv.host_tier``), >= 0; needs
        ``enable_prefix_caching``.
      async_scheduling: allow one ``schedule()`` ahead of the last ``update_from_output()``; a prompt's last chunk
        then also reserves its first decode token's slot.
      aging_rate: "aging"'s priority units per second waited, >= 0.
      num_lookahead_tokens: KV slots a running row reserves beyond its tokens (vLLM v1's lookahead, for drafts),
        >= 0, best effort.
      enable_kv_cache_events: record stored and evicted blocks for ``Scheduler.take_kv_events``.
      graceful_degradation: True (default thresholds), a ``GracefulDegradation``, or False (``scheduler.degradation``).
      reserve_predicted_output: admit beside running requests only while the free blocks, less what running ones
        lack for their predicted outputs, hold its prompt and predicted output (``scheduler.predictor``).
      num_pool_blocks: slots of the tier that makes room before a preemption (``KVCacheManager.POOL_TIER``),
        null included: 0 or >= 2; what it cannot run with: that tier's ``refuses``.

    Raises ValueError naming the field, the value and the limit.
    """

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: Union[str, Policy] = "fcfs"
    preemption_mode: str = "recompute"
    num_host_blocks: int = 0
    num_offload_blocks: int = 0
    aging_rate: float = 1.0
    async_scheduling: bool = False
    num_lookahead_tokens: int = 0
    graceful_degradation: Union[bool, GracefulDegradation] = True
    enable_kv_cache_events: bool = False
    reserve_predicted_output: bool = False
    num_pool_blocks: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, limit: str) -> ValueError:
            return ValueError(f"{field}={getattr(self, field)!r} is out of range: must be {limit}")

        for field, low in (("block_size", 1), ("num_blocks", 2), ("max_num_seqs", 1), ("max_model_len", 1)):
            value = getattr(self, field)
            if not isinstance(value, int) or value < low:
                raise bad(field, f"an int >= {low}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < self.max_num_seqs:
            raise bad("max_num_batched_tokens", f"an int >= max_num_seqs={self.max_num_seqs}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise bad(
                "max_num_batched_tokens",
                f">= max_model_len={self.max_model_len} when enable_chunked_prefill is False",
            )
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise bad("long_prefill_token_threshold", "an int >= 0 (0 disables it)")
        if not isinstance(self.scheduling_policy, Policy) and self.scheduling_policy not in POLICIES:
            raise bad("scheduling_policy", f"one of {sorted(POLICIES)} or a Policy instance")
        if self.preemption_mode not in _PREEMPTION_MODES:
            raise bad("preemption_mode", f"one of {list(_PREEMPTION_MODES)}")
        if not isinstance(self.num_host_blocks, int) or self.num_host_blocks < 0:
            raise bad("num_host_blocks", "an int >= 0")
        if not isinstance(self.num_offload_blocks, int) or self.num_offload_blocks < 0:
            raise bad("num_offload_blocks", "an int >= 0")
        refused = self.num_offload_blocks and HostTier.refuses(self)
        if refused:
            raise bad("num_offload_blocks", f"0 with {refused}")
        if not isinstance(self.num_lookahead_tokens, int) or self.num_lookahead_tokens < 0:
            raise bad("num_lookahead_tokens", "an int >= 0")
        if isinstance(self.aging_rate, bool) or not isinstance(self.aging_rate, (int, float)) or not self.aging_rate >= 0:
            raise bad("aging_rate", ">= 0 (priority units per second)")
        if not isinstance(self.reserve_predicted_output, bool):
            raise bad("reserve_predicted_output", "a bool")
        n = self.num_pool_blocks
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n == 1:
            raise bad("num_pool_blocks", "0 (no pool) or an int >= 2 (slot 0 is the null slot)")
        refused = n and KVCacheManager.POOL_TIER.refuses(self)
        if refused:
            raise bad("num_pool_blocks", f"0 with {refused}")
        if not isinstance(self.graceful_degradation, (bool, GracefulDegradation)):
            raise bad("graceful_degradation", "a bool or a GracefulDegradation")

    @property
    def degradation(self) -> "GracefulDegradation | None":
        """The ``GracefulDegradation`` thresholds in force, None when it is off."""
        if self.graceful_degradation is True:
            return GracefulDegradation()
        return self.graceful_degradation or None
