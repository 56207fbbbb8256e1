"""Scheduling policies: who runs first, who is preempted, who may preempt."""

from __future__ import annotations

from typing import Any, Sequence, Union

from scheduler.request import Request


class Policy:
    """Orders requests and chooses preemption victims.

    The scheduler asks a policy three things each step:

    * :meth:`key` -- a sort key; lower runs first. Running requests are
      scheduled in key order, then waiting requests are admitted in key
      order, stopping at the first that cannot be admitted (head-of-line, so
      no request is overtaken for lack of memory).
    * :meth:`select_victim` -- when a request cannot get a block (or a seat),
      which running request to preempt. The default picks the largest key,
      which may be the requester itself.
    * :meth:`may_preempt` -- whether a *waiting* request may preempt a
      running one to get a seat, tokens or blocks. The default is never.

    Writing your own: subclass, override :meth:`key` (and, if you like,
    :meth:`select_victim` / :meth:`may_preempt`), and pass an instance as
    ``SchedulerConfig(scheduling_policy=MyPolicy())``::

        class LongestWaitFirst(Policy):
            name = "longest_wait"
            def key(self, request, now):
                return (request.arrival_time, request._seq)

    Rules a policy must keep so the scheduler can promise progress:

    * ``key`` is a total order: end the tuple with ``request._seq`` (a unique
      admission counter) to break ties.
    * ``may_preempt(w, v, now)`` must only be True when ``key(w) < key(v)``;
      otherwise two requests can preempt each other forever.
    * Set ``keys_change_over_time = True`` if the relative order of two
      requests can change while neither is scheduled (the scheduler then
      re-sorts every step instead of only after changes).

    Attributes:
      name: the string ``get_policy`` knows it by.
      keys_change_over_time: see above.
      preempts_for_waiting: True in any class that defines ``may_preempt``
        (set automatically); the scheduler skips the victim search otherwise.
    """

    name = "base"
    keys_change_over_time = True
    preempts_for_waiting = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Lets the scheduler skip the victim search for policies that never
        # preempt for a waiting request, without a flag users must remember.
        if "may_preempt" in cls.__dict__:
            cls.preempts_for_waiting = True

    def key(self, request: Request, now: float) -> Any:
        """Sort key at clock time ``now`` (seconds); lower = more urgent."""
        raise NotImplementedError(f"{type(self).__name__} must define key(request, now)")

    def select_victim(self, candidates: Sequence[Request], now: float) -> Request:
        """The running request to preempt among ``candidates`` (non-empty): the least urgent."""
        return max(candidates, key=lambda r: self.key(r, now))

    def may_preempt(self, waiting: Request, victim: Request, now: float) -> bool:
        """Whether ``waiting`` may take ``victim``'s place. Default: never."""
        return False

    def sort(self, requests: list[Request], now: float) -> None:
        """Sort ``requests`` in place by :meth:`key`."""
        requests.sort(key=lambda r: self.key(r, now))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FCFSPolicy(Policy):
    """First come, first served: arrival order; the latest arrival is preempted first (vLLM ``fcfs``)."""

    name = "fcfs"
    keys_change_over_time = False

    def key(self, request: Request, now: float) -> tuple:
        return (request.arrival_time, request._seq)

    def sort(self, requests: list[Request], now: float) -> None:
        requests.sort(key=_arrival_key)


class PriorityPolicy(Policy):
    """Priority (lower value first), then arrival (vLLM ``priority``).

    A waiting request strictly more urgent than a running one may preempt it
    when the batch is full, the token budget is spent, or blocks are short.
    """

    name = "priority"
    keys_change_over_time = False

    def key(self, request: Request, now: float) -> tuple:
        return (request.priority, request.arrival_time, request._seq)

    def may_preempt(self, waiting: Request, victim: Request, now: float) -> bool:
        return self.key(waiting, now) < self.key(victim, now)

    def sort(self, requests: list[Request], now: float) -> None:
        requests.sort(key=_priority_key)


class SJFPolicy(Policy):
    """Shortest job first: fewest remaining tokens (prompt left to compute + outputs left) first.

    Outputs left is ``max_tokens - num_output_tokens``; a request without
    ``max_tokens`` counts as ``max_model_len`` long. Never preempts for a
    waiting request (preempting running work to start shorter work wastes the
    victim's computed KV under recompute). Long jobs can starve under a
    steady stream of short ones; use ``aging`` if that matters.
    """

    name = "sjf"
    keys_change_over_time = True

    def __init__(self, max_model_len: int = 1 << 30) -> None:
        self.max_model_len = max_model_len

    def key(self, request: Request, now: float) -> tuple:
        max_tokens = request.max_tokens if request.max_tokens is not None else self.max_model_len
        remaining = (
            max(request.num_prompt_tokens - request.num_computed_tokens, 0)
            + max_tokens
            - request.num_output_tokens
        )
        return (remaining, request.arrival_time, request._seq)


class AgingPolicy(Policy):
    """Priority whose effective value improves with time waited, so nothing starves.

    Effective priority = ``priority - aging_rate * (now - arrival_time)``,
    with ``aging_rate`` in priority units per second. Every request ages at
    the same rate, so the order of two requests never changes over time: a
    request of priority p+d that arrived d/aging_rate seconds before one of
    priority p ranks level with it. Like ``priority``, a more urgent waiting
    request may preempt a running one.
    """

    name = "aging"
    keys_change_over_time = False

    def __init__(self, aging_rate: float = 1.0) -> None:
        if not aging_rate >= 0:
            raise ValueError(f"AgingPolicy: aging_rate={aging_rate!r} must be >= 0 (priority units per second)")
        self.aging_rate = aging_rate

    def key(self, request: Request, now: float) -> tuple:
        effective = request.priority - self.aging_rate * (now - request.arrival_time)
        return (effective, request.arrival_time, request._seq)

    def may_preempt(self, waiting: Request, victim: Request, now: float) -> bool:
        return self.key(waiting, now) < self.key(victim, now)

    def __repr__(self) -> str:
        return f"AgingPolicy(aging_rate={self.aging_rate})"


def _arrival_key(r: Request) -> tuple:
    return (r.arrival_time, r._seq)


def _priority_key(r: Request) -> tuple:
    return (r.priority, r.arrival_time, r._seq)


POLICIES = {p.name: p for p in (FCFSPolicy, PriorityPolicy, SJFPolicy, AgingPolicy)}


def get_policy(name_or_instance: Union[str, Policy], *, aging_rate: float = 1.0, max_model_len: int = 1 << 30) -> Policy:
    """A ``Policy`` from its name ("fcfs", "priority", "sjf", "aging") or an instance (returned as is).

    ``aging_rate`` (priority units per second) configures "aging";
    ``max_model_len`` bounds "sjf"'s length of a request without max_tokens.

    Raises:
      ValueError: an unknown name, or something that is neither str nor Policy.
    """
    if isinstance(name_or_instance, Policy):
        return name_or_instance
    if not isinstance(name_or_instance, str) or name_or_instance not in POLICIES:
        raise ValueError(f"scheduling_policy={name_or_instance!r} is unknown; expected one of {sorted(POLICIES)} or a Policy")
    if name_or_instance == "aging":
        return AgingPolicy(aging_rate)
    if name_or_instance == "sjf":
        return SJFPolicy(max_model_len)
    return POLICIES[name_or_instance]()
