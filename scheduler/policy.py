"""Scheduling policies: who runs first, who is preempted, who may preempt."""

from __future__ import annotations

from typing import Any, Sequence, Union

from scheduler.request import Request


class Policy:
    """Orders requests and chooses preemption victims; subclass it and pass an instance as
    ``SchedulerConfig(scheduling_policy=...)`` (example: ``docs/design/scheduler.md``).

    Running requests are scheduled in :meth:`key` order, then waiting ones admitted in key order up to the first
    that cannot be (head-of-line). :meth:`select_victim` picks whom to preempt; :meth:`may_preempt` says whether a
    waiting request may preempt a running one; :meth:`observe_load`, where defined, sees the queue each step.

    Rules: ``key`` is a total order (end it with ``request._seq``); ``may_preempt(w, v, now)`` only when
    ``key(w) < key(v)``; set ``keys_change_over_time = True`` if two requests' order can change while neither is
    scheduled (the scheduler then re-sorts every step).

    Attributes:
      name: the string ``get_policy`` knows it by.
      keys_change_over_time: see above.
      preempts_for_waiting, observes_load: set automatically in a class defining ``may_preempt``/``observe_load``.
      reads_priority: whether ``Request.priority`` can change the order (else the front end refuses a non-zero
        priority, vLLM's rule); True unless a class says otherwise.
    """

    name = "base"
    keys_change_over_time = True
    reads_priority = True
    preempts_for_waiting = False
    observes_load = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Lets the scheduler skip the victim search (and the load report) for
        # policies that do not use them, without a flag users must remember.
        if "may_preempt" in cls.__dict__:
            cls.preempts_for_waiting = True
        if "observe_load" in cls.__dict__:
            cls.observes_load = True

    def key(self, request: Request, now: float) -> Any:
        """Sort key at clock time ``now`` (seconds); lower = more urgent."""
        raise NotImplementedError(f"{type(self).__name__} must define key(request, now)")

    def select_victim(self, candidates: Sequence[Request], now: float) -> Request:
        """The running request to preempt among ``candidates`` (non-empty): the least urgent."""
        return max(candidates, key=lambda r: self.key(r, now))

    def may_preempt(self, waiting: Request, victim: Request, now: float) -> bool:
        """Whether ``waiting`` may take ``victim``'s place. Default: never."""
        return False

    def observe_load(self, num_waiting: int, num_running: int, now: float) -> bool:
        """The queue before a step (waiting, preempted included, and running); returns whether the order changed
        (the scheduler then re-sorts). Default: ignore it."""
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
    reads_priority = False

    def key(self, request: Request, now: float) -> tuple:
        return (request.arrival_time, request._seq)

    def sort(self, requests: list[Request], now: float) -> None:
        requests.sort(key=_arrival_key)


class PriorityPolicy(Policy):
    """Priority (lower value first), then arrival (vLLM ``priority``); a strictly more urgent waiting request may
    preempt a running one when seats, tokens or blocks are short."""

    name = "priority"
    keys_change_over_time = False

    def key(self, request: Request, now: float) -> tuple:
        return (request.priority, request.arrival_time, request._seq)

    def may_preempt(self, waiting: Request, victim: Request, now: float) -> bool:
        return self.key(waiting, now) < self.key(victim, now)

    def sort(self, requests: list[Request], now: float) -> None:
        requests.sort(key=_priority_key)


class SJFPolicy(Policy):
    """Shortest job first: fewest remaining tokens (prompt left + ``max_tokens - num_output_tokens``; no
    ``max_tokens``: ``max_model_len`` long) first. Never preempts for a waiting request; long jobs can starve."""

    name = "sjf"
    keys_change_over_time = True
    reads_priority = False

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
    """Priority improved by time waited: ``priority - aging_rate * (now - arrival_time)``, ``aging_rate`` in
    priority units per second; a more urgent waiting request may preempt a running one."""

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


class LoadAwarePolicy(Policy):
    """``fcfs`` until ``high_watermark`` (>= 1) or more requests wait (preempted included), then ``priority``
    until ``low_watermark`` (in [0, high_watermark)) or fewer wait; the example of :meth:`observe_load`.

    Attributes: mode ("fcfs" or "priority"), num_switches. Raises ValueError naming a mark out of range.
    """

    name = "load_aware"
    keys_change_over_time = False

    def __init__(self, high_watermark: int = 16, low_watermark: int = 4) -> None:
        if not (isinstance(high_watermark, int) and isinstance(low_watermark, int)
                and 0 <= low_watermark < high_watermark):
            raise ValueError(f"LoadAwarePolicy: high_watermark={high_watermark!r} and low_watermark="
                             f"{low_watermark!r} must be ints with 0 <= low_watermark < high_watermark")
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.mode = "fcfs"
        self.num_switches = 0

    def observe_load(self, num_waiting: int, num_running: int, now: float) -> bool:
        heavy = num_waiting >= self.high_watermark if self.mode == "fcfs" else num_waiting > self.low_watermark
        mode = "priority" if heavy else "fcfs"
        if mode == self.mode:
            return False
        self.mode = mode
        self.num_switches += 1
        return True

    def key(self, request: Request, now: float) -> tuple:
        if self.mode == "fcfs":
            return (request.arrival_time, request._seq)
        return (request.priority, request.arrival_time, request._seq)

    def may_preempt(self, waiting: Request, victim: Request, now: float) -> bool:
        return self.mode == "priority" and self.key(waiting, now) < self.key(victim, now)

    def sort(self, requests: list[Request], now: float) -> None:
        requests.sort(key=_arrival_key if self.mode == "fcfs" else _priority_key)

    def __repr__(self) -> str:
        return f"LoadAwarePolicy(high_watermark={self.high_watermark}, low_watermark={self.low_watermark})"


class PredictedPolicy(Policy):
    """Shortest predicted remaining work first, aged by arrival rank so no request starves.

    Key ``W + beta * seq``: ``W`` is the predicted output tokens left (``scheduler.predictor``, within
    ``[1, length limit left]``) plus the prompt tokens left over ``max_num_batched_tokens``; ``seq`` counts
    ``add_request`` calls; ``beta`` is ``aging_per_arrival``. At most ``ceil((W(r) - 1) / beta) - 1`` later arrivals
    are admitted before a waiting ``r`` (proof: ``docs/design/scheduler.md``). Never preempts for a waiting request;
    ignores ``priority``.

    Args:
      aging_per_arrival: ``beta``, steps of work, > 0.
      max_num_batched_tokens: the scheduler's token budget, >= 1.

    Raises ValueError naming an argument out of range.
    """

    name = "predicted"
    # A waiting request's key is fixed (see the proof), and running requests are scheduled, so the waiting
    # queue needs a re-sort only after it changes.
    keys_change_over_time = False
    reads_priority = False

    def __init__(self, aging_per_arrival: float = 4.0, max_num_batched_tokens: int = 512) -> None:
        beta, budget = aging_per_arrival, max_num_batched_tokens
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
            raise ValueError(f"PredictedPolicy: aging_per_arrival={beta!r} must be > 0 (steps per arrival)")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"PredictedPolicy: max_num_batched_tokens={max_num_batched_tokens!r} must be an int >= 1")
        self.aging_per_arrival = aging_per_arrival
        self.max_num_batched_tokens = max_num_batched_tokens

    def remaining_work(self, request: Request) -> float:
        """``W(request)``: predicted steps of work left, >= 1 (see the class docstring)."""
        outputs = min(request.predicted_output_tokens - request.num_output_tokens,
                      request.length_limit - request.num_tokens)
        prompt = max(request.num_prompt_tokens - request.num_computed_tokens, 0)
        return max(outputs, 1) + prompt / self.max_num_batched_tokens

    def key(self, request: Request, now: float) -> tuple:
        return (self.remaining_work(request) + self.aging_per_arrival * request._seq, request._seq)

    def __repr__(self) -> str:
        return (f"PredictedPolicy(aging_per_arrival={self.aging_per_arrival}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens})")


def _arrival_key(r: Request) -> tuple:
    return (r.arrival_time, r._seq)


def _priority_key(r: Request) -> tuple:
    return (r.priority, r.arrival_time, r._seq)


POLICIES = {p.name: p for p in (FCFSPolicy, PriorityPolicy, SJFPolicy, AgingPolicy, LoadAwarePolicy, PredictedPolicy)}


def get_policy(name_or_instance: Union[str, Policy], *, aging_rate: float = 1.0, max_model_len: int = 1 << 30,
               max_num_batched_tokens: int = 512) -> Policy:
    """A ``Policy`` from its name ("fcfs", "priority", "sjf", "aging", "load_aware", "predicted"; a fresh instance)
    or an instance (returned as is). ``aging_rate``: "aging"'s priority units per second; ``max_model_len``: "sjf"'s
    length without max_tokens; ``max_num_batched_tokens``: "predicted"'s prompt unit. Raises ValueError otherwise."""
    if isinstance(name_or_instance, Policy):
        return name_or_instance
    if not isinstance(name_or_instance, str) or name_or_instance not in POLICIES:
        raise ValueError(f"scheduling_policy={name_or_instance!r} is unknown; expected one of {sorted(POLICIES)} or a Policy")
    if name_or_instance == "aging":
        return AgingPolicy(aging_rate)
    if name_or_instance == "sjf":
        return SJFPolicy(max_model_len)
    if name_or_instance == "predicted":
        return PredictedPolicy(max_num_batched_tokens=max_num_batched_tokens)
    return POLICIES[name_or_instance]()
