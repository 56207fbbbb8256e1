"""The continuous-batching step: token budget, chunked prefill, prefix hits, preemption.

Follows vLLM v1's ``Scheduler``: no prefill/decode phases. Every step hands
out at most ``max_num_batched_tokens`` tokens to at most ``max_num_seqs``
requests so that each request's ``num_computed_tokens`` catches up with its
``num_tokens``; running requests are served first, then waiting ones in
policy order.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import time
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np

from scheduler.block_pool import BlockPool
from scheduler.config import SchedulerConfig
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.output import ScheduledRequest, SchedulerOutput, SchedulerStats
from scheduler.policy import get_policy
from scheduler.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING
_REPORTED_FINISHES = (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_IGNORED)


class UnknownRequestError(KeyError, ValueError):
    """No unfinished request has this id (a ``KeyError`` for lookups, a ``ValueError`` for bad input)."""


class _Step:
    """Mutable state of one ``schedule()`` call."""

    __slots__ = ("budget", "rows", "out", "preempted_ids", "admitted_ids", "now")

    def __init__(self, budget: int, now: float) -> None:
        self.budget = budget
        self.rows: dict[str, ScheduledRequest] = {}
        self.out = SchedulerOutput()
        self.preempted_ids: set[str] = set()
        self.admitted_ids: set[str] = set()
        self.now = now


class Scheduler:
    """Decides, step by step, which tokens of which requests the model computes.

    Each ``schedule()`` must be followed by one ``update_from_output()`` with
    that output before the next ``schedule()`` -- or, with
    ``config.async_scheduling``, before the one after it: the host schedules
    step N+1 while the device runs step N. A request's
    ``num_computed_tokens`` then advances when it is scheduled (as in vLLM
    v1); a sample still on the device is counted in
    ``num_pending_samples`` and its row in the next output carries
    ``prev_row`` so the runner feeds it from the device. A request that
    turns out to have stopped at step N has its step N+1 sample discarded;
    one that is certain to stop by length is not scheduled again.

    Step rules (vLLM v1 unless noted):

    * Running requests, in policy order, get their remaining tokens (1 for a
      decode; a prefill chunk capped by ``long_prefill_token_threshold`` and
      the budget). If a block cannot be had, the policy's victim is
      preempted; that may be the requester itself.
    * Then waiting requests, in policy order, are admitted while seats, budget
      and blocks last, each taking its prefix-cache hit first. Admission stops
      at the first request that cannot be admitted, or that was preempted in
      this very step (it would only evict what it just gave up). Under
      ``priority``/``aging`` a waiting request may first preempt less urgent
      running ones (never ones admitted this step).
    * With chunked prefill off, a prompt that does not fit the remaining
      budget waits for a later step.
    * A request whose tokens fill whole blocks, all cached, recomputes only
      its last token, into a copy of the last block (``blocks_to_copy``;
      our addition, see ``KVCacheManager``). This holds for re-prefills of
      recompute-preempted requests too. The copy needs one block more than
      recomputing the last block's tokens; when that block is not free the
      request takes one hit fewer instead. So admission never needs more
      than ``add_request`` checked against the whole cache, and the head of
      the queue is always admitted once nothing else runs (liveness).
    * With async scheduling, a running request that alone cannot grow while
      blocks are pinned as copy sources of the step in flight waits a step.
    * ``recompute`` preemption frees the victim's blocks (their hashes stay,
      so its re-prefill can hit the cache) and resets its progress; ``swap``
      copies its computed blocks to the host pool and back on resume,
      reporting the copies in the output (falling back to recompute when the
      host pool is short).
    * A request that can never fit -- prompt over ``max_model_len``, or
      prompt + ``max_tokens`` (capped at ``max_model_len``) needing more than
      the whole cache -- is finished as ``FINISHED_IGNORED`` at
      ``add_request``. A request without ``max_tokens`` that alone fills
      the whole cache is finished as ``FINISHED_LENGTH_CAPPED`` rather than
      preempting itself forever (our addition).

    Args:
      config: a validated ``SchedulerConfig``.
      clock: seconds, monotonic; what ``arrival_time`` and queue times are
        measured on. Tests pass a fake clock.

    Attributes (for tests and the engine's metrics):
      config, policy, block_pool (``BlockPool``), kv_cache_manager
      (``KVCacheManager``), requests (id -> unfinished ``Request``),
      running and waiting (``Request`` lists).
    """

    def __init__(self, config: SchedulerConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.policy = get_policy(config.scheduling_policy, aging_rate=config.aging_rate, max_model_len=config.max_model_len)
        self.block_pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.kv_cache_manager = KVCacheManager(
            self.block_pool, config.block_size, config.enable_prefix_caching, config.num_host_blocks
        )
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self._clock = clock
        self._seq = itertools.count()
        self._swap = config.preemption_mode == "swap"
        # Static-key policies only need a re-sort of the waiting list after
        # it changes; the running list stays sorted by insertion in order.
        self._waiting_dirty = False
        self._pending: collections.deque[SchedulerOutput] = collections.deque()
        self._max_pending = 2 if config.async_scheduling else 1
        self._finished_for_schedule: list[Request] = []
        self._finished_for_update: list[Request] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0

    # ----------------------------------------------------------------- intake

    def add_request(self, request: Request) -> None:
        """Queue a new request, or finish it at once as ``FINISHED_IGNORED`` if it can never fit.

        An ignored request has ``ignored_reason`` set and is reported in the
        next ``SchedulerOutput.finished`` and ``update_from_output`` result.

        Raises:
          ValueError: the id belongs to an unfinished request, or the request
            was already scheduled somewhere (status not WAITING, or progress
            recorded).
        """
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"add_request: request_id {rid!r} is already unfinished in this scheduler")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(f"add_request: {request!r} is not fresh (status must be WAITING with no progress)")
        self._prepare(request)
        reason = self._never_fits(request)
        if reason is not None:
            request.status = RequestStatus.FINISHED_IGNORED
            request.ignored_reason = reason
            self._finished_for_schedule.append(request)
            self._finished_for_update.append(request)
            return
        self.requests[rid] = request
        self.waiting.append(request)
        self._waiting_dirty = True

    def _prepare(self, request: Request) -> None:
        """Set the policy tie-break and the update loop's stop filter."""
        request._seq = next(self._seq)
        sp = request.sampling_params
        stop_ids = set(sp.stop_token_ids)
        if request.eos_token_id is not None and not sp.ignore_eos:
            stop_ids.add(request.eos_token_id)
        request._stop_ids = frozenset(stop_ids)
        limit = self.config.max_model_len
        if request.max_tokens is not None:
            limit = min(limit, request.num_prompt_tokens + request.max_tokens)
        request._length_limit = limit

    def fork_request(self, parent_id: str, children: Sequence[Request]) -> list[tuple[int, int]]:
        """Replace running ``parent_id`` by ``children`` that share its computed KV blocks.

        For ``n > 1`` sampling: the parent prefilled the common prompt; each
        child continues from there (its tokens start with the parent's
        computed tokens) with its own sampling. Call it between
        ``update_from_output`` and the next ``schedule``. Children run at once
        while seats (``max_num_seqs``) and blocks for their copied last block
        last; the rest are queued as new requests (a prefix-cache hit may
        still spare their prompt). The parent is finished as
        ``FINISHED_STOPPED`` and not reported.

        Returns:
          ``(src_block, dst_block)`` copies the runner must do before the
          next step (each forked child's copy of a partly written last block).

        Raises:
          ValueError: the parent is not running, a child is not fresh, or a
            child's tokens do not extend the parent's computed tokens.
        """
        parent = self.get_request(parent_id)
        computed = parent.num_computed_tokens
        if parent.status is not _RUNNING or not children:
            raise ValueError(f"fork_request: {parent!r} is not running, or there are no children")
        for child in children:
            if (child.status != RequestStatus.WAITING or child.num_computed_tokens or child.request_id in self.requests
                    or child.num_tokens <= computed or child.all_token_ids[:computed] != parent.all_token_ids[:computed]):
                raise ValueError(f"fork_request: {child!r} is not a fresh continuation of {parent!r}")
        self.running.remove(parent)
        del self.requests[parent_id]
        parent.status = RequestStatus.FINISHED_STOPPED
        seats = self.config.max_num_seqs - len(self.running)
        num_forked, copies = self.kv_cache_manager.fork(parent, children[:seats])
        for child in children[:num_forked]:
            self._prepare(child)
            child.status = _RUNNING
            child.num_computed_tokens = computed
            child.first_scheduled_time = parent.first_scheduled_time
            self.requests[child.request_id] = child
            self.running.append(child)
        self._running_dirty = True
        for child in children[num_forked:]:
            self.add_request(child)
        return copies

    def _never_fits(self, request: Request) -> Optional[str]:
        cfg = self.config
        prompt = request.num_prompt_tokens
        if prompt > cfg.max_model_len:
            return f"prompt has {prompt} tokens, more than max_model_len={cfg.max_model_len}"
        max_tokens = request.max_tokens
        # The last generated token is never fed back, so it needs no KV slot.
        if max_tokens is None:
            kv_tokens = prompt
        else:
            kv_tokens = min(prompt + max_tokens, max(cfg.max_model_len, prompt + 1)) - 1
        need = -(-kv_tokens // cfg.block_size)
        have = cfg.num_blocks - 1
        if need > have:
            return (
                f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks of "
                f"{cfg.block_size} tokens; the whole cache has {have}"
            )
        return None

    # ------------------------------------------------------------------- step

    def schedule(self) -> SchedulerOutput:
        """Choose this step's rows; returns them with the block copies to do first.

        Raises:
          RuntimeError: the previous output (with async scheduling, the one
            before it) has not been passed to ``update_from_output`` yet.
        """
        if len(self._pending) >= self._max_pending:
            raise RuntimeError("schedule() called again before update_from_output() of the previous output")
        now = self._clock()
        step = _Step(self.config.max_num_batched_tokens, now)
        self._schedule_running(step)
        self._schedule_waiting(step)
        out = step.out
        out.block_size = self.config.block_size
        out.block_table = self.kv_cache_manager.block_table.table
        out.scheduled = list(step.rows.values())
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - step.budget
        out.finished, self._finished_for_schedule = self._finished_for_schedule, []
        out.blocks_to_copy = self.kv_cache_manager.take_blocks_to_copy()
        self.kv_cache_manager.end_step()
        self._advance(out.scheduled)
        self._pending.append(out)
        return out

    @staticmethod
    def _advance(rows: list[ScheduledRequest]) -> None:
        """Count the scheduled tokens as computed and the samples as pending."""
        for i, row in enumerate(rows):
            req = row.request
            req.num_computed_tokens = row.num_computed_tokens + row.num_new_tokens
            if row.num_computed_tokens >= len(req._all_token_ids):
                row.prev_row = req._last_sample_row
            if row.samples:
                row.sample_index = len(req.output_token_ids) + req.num_pending_samples
                req.num_pending_samples += 1
                req._last_sample_row = i

    def _schedule_running(self, step: _Step) -> None:
        if self.policy.keys_change_over_time:
            self.policy.sort(self.running, step.now)
        kv = self.kv_cache_manager
        allocate, block_ids, table_rows = kv.allocate_slots, kv.req_to_block_ids, kv.req_to_row
        bs = self.config.block_size
        rows = step.rows
        # The hot path of a step: one pass per running request, with the
        # common decode that needs no new block kept free of calls.
        for req in list(self.running):
            if step.budget <= 0:
                break
            if req.status is not _RUNNING:
                continue
            computed = req.num_computed_tokens
            num_tokens = len(req._all_token_ids) + req.num_pending_samples
            if req.num_pending_samples and (num_tokens >= req._length_limit or req.prefill_only):
                # Only with async scheduling: its pending sample ends it, or
                # it is a prefill parent waiting to be forked. (A prompt of
                # exactly max_model_len tokens reaches the limit with no
                # sample pending; it must still finish its prefill.)
                continue
            n = num_tokens - computed
            if n != 1:
                n = self._chunk(n, step.budget)
                if n == 0:
                    continue
            rid = req.request_id
            ids = block_ids[rid]
            if computed + n > len(ids) * bs and not (allocate(req, n) or self._preempt_until_allocated(req, n, step)):
                continue
            rows[rid] = ScheduledRequest(req, n, computed, ids[:], computed + n >= num_tokens, table_rows[rid])
            step.budget -= n

    def _preempt_until_allocated(self, req: Request, n: int, step: _Step) -> bool:
        while True:
            candidates = list(self.running)
            if len(candidates) == 1:
                if self.kv_cache_manager.copy_sources:
                    # With async scheduling, sources of the previous step's
                    # copies stay pinned until its update: wait for them.
                    return False
                # It holds every used block and still cannot grow: only a
                # request without max_tokens gets here (admission rules out
                # the rest), and preempting itself would loop forever.
                self.running.remove(req)
                self._release(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                self._finished_for_update.append(req)
                return False
            victim = self.policy.select_victim(candidates, step.now)
            self._preempt(victim, step)
            if victim is req:
                return False
            if self.kv_cache_manager.allocate_slots(req, n):
                return True

    def _schedule_waiting(self, step: _Step) -> None:
        if not self.waiting:
            return
        if self._waiting_dirty or self.policy.keys_change_over_time:
            self.policy.sort(self.waiting, step.now)
            self._waiting_dirty = False
        queue, self.waiting = self.waiting, []
        i = 0
        while i < len(queue):
            req = queue[i]
            if req.request_id in step.preempted_ids or not self._admit(req, step):
                break
            i += 1
        if self.waiting:
            self._waiting_dirty = True
        self.waiting = queue[i:] + self.waiting

    def _admit(self, req: Request, step: _Step) -> bool:
        while True:
            if len(self.running) < self.config.max_num_seqs and step.budget > 0 and self._try_admit(req, step):
                return True
            victim = self._waiting_victim(req, step)
            if victim is None:
                return False
            self._preempt(victim, step)

    def _try_admit(self, req: Request, step: _Step) -> bool:
        kv = self.kv_cache_manager
        rid = req.request_id
        if rid in kv.swapped:
            n = self._chunk(req.num_tokens - req.num_computed_tokens, step.budget)
            pairs = kv.swap_in(req, n) if n else None
            if pairs is None:
                return False
            step.out.blocks_to_swap_in.extend(pairs)
        else:
            n = self._allocate_admission(req, step.budget)
            if n == 0:
                return False
        req.status = _RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = step.now
        self._insert_running(req, step.now)
        step.admitted_ids.add(rid)
        self._add_row(req, n, step)
        return True

    def _allocate_admission(self, req: Request, budget: int) -> int:
        """Take ``req``'s prefix hits and blocks for its first chunk; returns the chunk's tokens, 0 if it must wait.

        A request whose hits cover all its tokens copies the last hit on
        write, which needs one block more than recomputing that block's
        tokens would. When that block is not free it takes one hit fewer, so
        the capacity a request needs never exceeds what ``_never_fits``
        checks at ``add_request``: alone, every admission succeeds.
        """
        kv = self.kv_cache_manager
        hits, num_hit = kv.get_computed_blocks(req)
        while True:
            n = self._chunk(req.num_tokens - num_hit, budget)
            if n == 0:
                return 0
            if kv.allocate_slots(req, n, hits):
                break
            if not kv.copies_last_block(req, hits):
                return 0
            hits = hits[:-1]
            num_hit = len(hits) * self.config.block_size
        if kv.enable_caching and not req.skip_reading_prefix_cache:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_hit
        req.num_computed_tokens = num_hit
        return n

    def _insert_running(self, req: Request, now: float) -> None:
        """Add ``req`` to the running list, keeping a static-key policy's order without a re-sort."""
        running = self.running
        policy = self.policy
        if policy.keys_change_over_time or not running:
            running.append(req)
            return
        key = policy.key(req, now)
        # Admissions usually come after everything running (FCFS), so the
        # tail is checked before a binary search.
        if policy.key(running[-1], now) < key:
            running.append(req)
        else:
            bisect.insort(running, req, key=lambda r: policy.key(r, now))

    def _waiting_victim(self, req: Request, step: _Step) -> Optional[Request]:
        if not self.policy.preempts_for_waiting:
            return None
        candidates = [r for r in self.running if r.request_id not in step.admitted_ids]
        if not candidates:
            return None
        victim = self.policy.select_victim(candidates, step.now)
        return victim if self.policy.may_preempt(req, victim, step.now) else None

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to schedule for a request with ``remaining`` uncomputed tokens; 0 if it must wait."""
        cfg = self.config
        if remaining > 1 and 0 < cfg.long_prefill_token_threshold < remaining and cfg.enable_chunked_prefill:
            remaining = cfg.long_prefill_token_threshold
        if remaining > budget:
            return budget if cfg.enable_chunked_prefill else 0
        return remaining

    def _add_row(self, req: Request, n: int, step: _Step) -> None:
        kv, rid, computed = self.kv_cache_manager, req.request_id, req.num_computed_tokens
        step.rows[rid] = ScheduledRequest(
            req, n, computed, kv.req_to_block_ids[rid][:], computed + n >= req.num_tokens, kv.req_to_row[rid]
        )
        step.budget -= n

    def _preempt(self, victim: Request, step: _Step) -> None:
        self.running.remove(victim)
        row = step.rows.pop(victim.request_id, None)
        if row is not None:
            step.budget += row.num_new_tokens
        if victim.num_pending_samples:
            # Its in-flight sample will be discarded, so the last known token
            # is computed again on resume to sample it anew (same key).
            victim.num_pending_samples = 0
            victim.num_computed_tokens = min(victim.num_computed_tokens, len(victim._all_token_ids) - 1)
        pairs = self.kv_cache_manager.swap_out(victim) if self._swap else None
        if pairs is None:
            self.kv_cache_manager.free(victim)
            victim.num_computed_tokens = 0
        else:
            step.out.blocks_to_swap_out.extend(pairs)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted_ids.add(victim.request_id)
        step.out.preempted.append(victim)
        self.waiting.append(victim)
        self._waiting_dirty = True

    # ----------------------------------------------------------------- update

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: Union[Sequence[int], np.ndarray]) -> list[Request]:
        """Apply one model step: advance progress, append samples, stop, free, cache.

        Args:
          output: the output of the last ``schedule()``.
          sampled_token_ids: ``[num_seqs]`` ints (list or integer array, any
            extra padding entries beyond ``len(output.scheduled)`` ignored);
            entry i belongs to ``output.scheduled[i]``. Samples of partial
            prefill rows are discarded.

        Stop rules, checked after appending the token: once ``min_tokens``
        outputs exist, eos (unless ``ignore_eos``; ``stop_reason`` None) or a
        ``stop_token_ids`` member (``stop_reason`` = that id) ->
        ``FINISHED_STOPPED``; else ``max_tokens`` outputs or ``max_model_len``
        tokens -> ``FINISHED_LENGTH_CAPPED``. Stop strings are the engine's
        (``finish_requests``). Finished requests' blocks are freed after
        their full blocks are registered in the prefix cache.

        Returns:
          every request that received a token this step or finished, plus
          those ignored or aborted since the last call, each once.

        Raises:
          ValueError: ``output`` is not the pending output, or fewer sampled
            ids than rows (nothing is changed).
        """
        if not self._pending or output is not self._pending[0]:
            raise ValueError("update_from_output: output is not the pending output (the oldest schedule() result not yet updated)")
        rows = output.scheduled
        if len(sampled_token_ids) < len(rows):
            raise ValueError(
                f"update_from_output: {len(sampled_token_ids)} sampled token ids for {len(rows)} scheduled rows"
            )
        self._pending.popleft()
        # The runner has done this step's copies.
        self.kv_cache_manager.release_copy_sources()
        result, self._finished_for_update = self._finished_for_update, []
        cache = self.kv_cache_manager.cache_computed_blocks if self.config.enable_prefix_caching else None
        bs = self.config.block_size
        any_finished = False
        for row, token in zip(rows, sampled_token_ids):
            req = row.request
            if req.status is not _RUNNING:
                continue
            if cache is not None and (row.num_computed_tokens + row.num_new_tokens) // bs != row.num_computed_tokens // bs:
                cache(req)
            if not row.samples:
                continue
            req.num_pending_samples -= 1
            token = int(token)
            req.output_token_ids.append(token)
            req._all_token_ids.append(token)
            # Cheap filter; _stop_status holds the rules.
            if token in req._stop_ids or len(req._all_token_ids) >= req._length_limit:
                status = self._stop_status(req, token)
                if status is not None:
                    self._release(req, status)
                    any_finished = True
            result.append(req)
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return result

    def _stop_status(self, req: Request, token: int) -> Optional[RequestStatus]:
        sp = req.sampling_params
        num_output = len(req.output_token_ids)
        if num_output >= sp.min_tokens:
            if token == req.eos_token_id and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        max_tokens = req.max_tokens
        if (max_tokens is not None and num_output >= max_tokens) or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def discard_output(self, output: SchedulerOutput) -> None:
        """Forget the newest ``schedule()`` output, whose step never ran (the
        runner failed before launching it).

        Its rows' requests lose their blocks and progress and wait again, as
        after a recompute preemption, so the scheduler stays consistent and
        the next ``schedule()`` works.

        Raises:
          ValueError: ``output`` is not the newest pending output.
        """
        if not self._pending or output is not self._pending[-1]:
            raise ValueError("discard_output: output is not the newest pending output of schedule()")
        self._pending.pop()
        self.kv_cache_manager.release_copy_sources()
        for row in output.scheduled:
            req = row.request
            if req.status is not _RUNNING:
                continue
            self.running.remove(req)
            self.kv_cache_manager.free(req)
            req.num_computed_tokens = 0
            req.num_pending_samples = 0
            req.status = RequestStatus.PREEMPTED
            self.waiting.append(req)
        self._waiting_dirty = True

    def _release(self, req: Request, status: RequestStatus) -> None:
        """Finish ``req``: set ``status``, free its blocks, forget it. The caller fixes the running/waiting lists."""
        req.status = status
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]

    # ---------------------------------------------------------- engine hooks

    def finish_requests(self, request_ids: Union[str, Iterable[str]], status: RequestStatus) -> None:
        """Finish requests from outside (stop strings, aborts), freeing all their blocks at once.

        Unknown or already finished ids are skipped. Aborted (and ignored)
        requests are reported in the next ``SchedulerOutput.finished`` and
        ``update_from_output`` result; other statuses are not, as the caller
        already knows.

        Raises:
          ValueError: ``status`` is not a ``FINISHED_*`` status.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_requests: status={status!r} is not a FINISHED_* status")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            (self.running if req.status is _RUNNING else self.waiting).remove(req)
            self._release(req, status)
            if status in _REPORTED_FINISHES:
                self._finished_for_schedule.append(req)
                self._finished_for_update.append(req)

    def abort_request(self, request_id: str) -> None:
        """Abort a waiting, running or preempted request, freeing every block at once; unknown ids are a no-op."""
        self.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def get_request(self, request_id: str) -> Request:
        """The unfinished request with this id.

        Raises:
          UnknownRequestError: (a KeyError and a ValueError) no unfinished request has this id.
        """
        try:
            return self.requests[request_id]
        except KeyError:
            raise UnknownRequestError(f"no unfinished request has request_id {request_id!r}") from None

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished, or a finished one awaits reporting by ``update_from_output``."""
        return bool(self.requests) or bool(self._finished_for_update)

    @property
    def num_unfinished_requests(self) -> int:
        """Requests waiting, running or preempted."""
        return len(self.requests)

    @property
    def stats(self) -> SchedulerStats:
        """A fresh ``SchedulerStats`` snapshot."""
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted_waiting=sum(1 for r in self.waiting if r.status == RequestStatus.PREEMPTED),
            kv_cache_usage=self.block_pool.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_free_blocks=self.block_pool.num_free_blocks,
            num_blocks=self.block_pool.num_blocks,
        )
