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

    And, before each step, :meth:`observe_load` tells it the queue (only
    called in classes that define it): a policy whose order depends on the
    load returns True when its order changed, and the scheduler re-sorts.
    ``LoadAwarePolicy`` is the example.

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
      observes_load: True in any class that defines ``observe_load`` (set
        automatically).
      reads_priority: whether ``Request.priority`` can change the order; the
        front end refuses a non-zero priority where it cannot (vLLM's rule).
        True unless a class says otherwise (a custom key may read it).
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
        """The queue before a step: requests waiting (preempted ones included) and running. Returns whether
        the policy's order changed (the scheduler then re-sorts its lists). Default: ignore it."""
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


class LoadAwarePolicy(Policy):
    """FCFS under light load, priority order under heavy load, with hysteresis so it does not flap.

    The load is the waiting queue (requests waiting or preempted). It runs
    as ``fcfs`` until ``high_watermark`` or more wait, then as ``priority``
    (urgent requests first, and they may preempt less urgent running ones)
    until no more than ``low_watermark`` wait. The gap between the two marks
    is the hysteresis: a queue that hovers around one mark does not switch
    back and forth. While light, arrival order is fair and nothing is
    preempted for priority; while heavy, priorities decide who waits.

    It is also the example of a custom policy that follows the load: it
    defines :meth:`observe_load`, and returns True when it switched so the
    scheduler re-sorts. Use it by name (``scheduling_policy="load_aware"``,
    the default marks) or as ``LoadAwarePolicy(high_watermark=..., low_watermark=...)``.

    Args:
      high_watermark: waiting requests at which it switches to priority, >= 1.
      low_watermark: waiting requests at or under which it switches back to
        fcfs, in [0, high_watermark).

    Attributes:
      mode: "fcfs" or "priority".
      num_switches: mode changes so far.

    Raises:
      ValueError: marks out of range, naming them.
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
    """Shortest predicted remaining work first, aged by arrival rank so that no request starves.

    A request's remaining work ``W``, in steps, is its predicted output
    tokens left -- ``predicted_output_tokens - num_output_tokens``
    (``scheduler.predictor``), at least 1 and at most what its length limit
    leaves -- plus its prompt tokens left to compute in units of
    ``max_num_batched_tokens`` (a decode token takes a step, a prompt a share
    of one). So ``1 <= W <= max_tokens + num_prompt_tokens /
    max_num_batched_tokens`` whatever the prediction. The key is ``W + beta
    * seq``, where ``seq`` counts ``add_request`` calls and ``beta`` is
    ``aging_per_arrival``: a waiting request gains ``beta`` steps on every
    later arrival. Like ``sjf`` it never preempts for a waiting request, and
    it ignores ``priority``.

    Theorem (anti-starvation). Let ``r`` wait from its ``add_request`` on
    (not admitted yet, no grammar pending). A request ``s`` added ``k >= 1``
    requests after ``r`` is admitted before ``r`` only if ``k < (W(r) - 1) /
    beta``. So at most ``ceil((W(r) - 1) / beta) - 1`` later arrivals are
    admitted before ``r`` (none when ``W(r) - 1 <= beta``), whatever the
    arrivals, their lengths and the predictions.

    Proof. Admission takes waiting requests in key order and stops at the
    first that cannot be admitted, so ``s`` goes first only if ``key(s) <
    key(r)``. Nothing in ``key(r)`` changes while ``r`` waits, and ``W(s) >=
    1``, so ``beta * k < W(r) - W(s) <= W(r) - 1``; the ``k`` are distinct
    integers in ``[1, (W(r) - 1) / beta)``. (Forked children, seated with
    their parent, are not admissions.)

    Args:
      aging_per_arrival: ``beta``, steps of work, > 0 (the default's measurements:
        ``docs/design/scheduler.md``).
      max_num_batched_tokens: the scheduler's token budget, >= 1.

    Raises:
      ValueError: an argument out of range, naming it and its limit.
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
    """A ``Policy`` from its name ("fcfs", "priority", "sjf", "aging", "load_aware", "predicted") or an instance
    (returned as is; a name gets a fresh instance with the default settings).

    ``aging_rate`` (priority units per second) configures "aging";
    ``max_model_len`` bounds "sjf"'s length of a request without max_tokens;
    ``max_num_batched_tokens`` is "predicted"'s unit of prompt work.

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
    if name_or_instance == "predicted":
        return PredictedPolicy(max_num_batched_tokens=max_num_batched_tokens)
    return POLICIES[name_or_instance]()
