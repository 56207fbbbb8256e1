"""The continuous-batching step (vLLM v1's ``Scheduler``, no prefill/decode phases)."""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import time
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np

from scheduler.config import SchedulerConfig
from scheduler.degradation import DegradationController
from scheduler.kv.block_pool import BlockPool, KVBlock
from scheduler.kv.kv_cache_manager import KVCacheManager
from scheduler.kv.tier import Admission, KVTier
from scheduler.kv_events import KVEvent
from scheduler.output import SchedulerOutput, SchedulerStats
from scheduler.persistent_batch import (
    COMPUTED, EOS, HAS_STOP_IDS, LAST_TOKEN, LENGTH_LIMIT, PENDING, PREFILL_ONLY, SPEC, TOKENS, PersistentBatch,
)
from scheduler.policy import get_policy
from scheduler.predictor import OutputLengthPredictor
from scheduler.request import Request, RequestStatus
from scheduler.step import Step

_RUNNING = RequestStatus.RUNNING
_WAITING_FOR_FSM = RequestStatus.WAITING_FOR_FSM
_REPORTED_FINISHES = (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_IGNORED)
# Finishes whose output length the predictor learns from (an abort says nothing of it).
_NATURAL_FINISHES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class LoraGate:
    """Which LoRA adapters a step may admit requests of (vLLM's ``max_loras`` rule), without starving one: once a
    request waits for a free adapter seat, requests of running adapters wait too, so those drain and it gets one
    (base-model requests still go).

    Args:
      running: the running requests. max_loras: distinct adapters at most.
    """

    def __init__(self, running: Sequence[Request], max_loras: int) -> None:
        self.running = {r.lora_int_id for r in running if r.lora_int_id}
        self.max_loras = max_loras
        self.blocked = False

    def admits(self, lora_int_id: int) -> bool:
        """Whether a waiting request of adapter ``lora_int_id`` (not 0) may be admitted now; a refusal blocks
        every later adapter request of this step."""
        if not self.blocked and (lora_int_id in self.running or len(self.running) < self.max_loras):
            return True
        self.blocked = True
        return False


def _outputs_left(req: Request) -> int:
    """Output tokens ``req`` is predicted to generate still, within its length limit (>= 0)."""
    return max(min(req.predicted_output_tokens - req.num_output_tokens, req.length_limit - req.num_tokens), 0)


class UnknownRequestError(KeyError, ValueError):
    """No unfinished request has this id (a ``KeyError`` for lookups, a ``ValueError`` for bad input)."""


class Scheduler:
    """Decides, step by step, which tokens of which requests the model computes (vLLM v1's ``Scheduler``).

    Each ``schedule()`` must be followed by one ``update_from_output()`` of that output before the next
    ``schedule()`` (with ``config.async_scheduling``, before the one after it). Rules: ``docs/design/scheduler.md``.
    ``config`` is a validated ``SchedulerConfig``; ``clock`` gives monotonic seconds (arrival and queue times).
    Attributes read by tests and metrics: config, policy, block_pool, kv_cache_manager, tiers, batch
    (``PersistentBatch``), requests (id -> unfinished ``Request``), running, waiting, degradation (None when off),
    predictor, copy_budget (host-tier copies a step queues beyond its first loading request's).
    """

    def __init__(self, config: SchedulerConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.policy = get_policy(config.scheduling_policy, aging_rate=config.aging_rate,
                                 max_model_len=config.max_model_len, max_num_batched_tokens=config.max_num_batched_tokens)
        self.predictor = OutputLengthPredictor(config.block_size)
        self.block_pool = BlockPool(config.num_blocks, config.enable_prefix_caching, config.enable_kv_cache_events,
                                    num_offload_blocks=config.num_offload_blocks, offload_base=config.num_host_blocks,
                                    block_size=config.block_size)
        self.kv_cache_manager = KVCacheManager.for_config(self.block_pool, config)
        self.batch = PersistentBatch(config.max_num_seqs)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self._clock = clock
        self._seq = itertools.count()
        # The swap tier takes preempted requests only in swap mode.
        self.tiers: list[KVTier] = [t for t in self.kv_cache_manager.tiers
                                    if t is not self.kv_cache_manager.swap or config.preemption_mode == "swap"]
        self._room_tiers = [t for t in self.tiers if t.makes_room]
        # Static-key policies only need a re-sort of the waiting list after it changes; the running list stays sorted by
        # insertion in order.
        self._waiting_dirty = False
        # Outputs not yet updated, each with _num_stopped when it was made, the blocks its admissions registered in the
        # prefix cache (forgotten if it is discarded), and the ids of its requests that started over since
        # (discard_output), whose rows it must skip even once they run again.
        self._pending: collections.deque[tuple[SchedulerOutput, int, list[KVBlock], set[str]]] = collections.deque()
        # Times a request stopped running (finished or preempted): while it has not changed, every row of a pending
        # output is still running.
        self._num_stopped = 0
        self._max_pending = 2 if config.async_scheduling else 1
        self._finished_for_schedule: list[Request] = []
        self._finished_for_update: list[Request] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Of those hits, tokens loaded from the host tier.
        self.prefix_cache_hits_host = 0
        # Host-tier copies (offloads and loads together) one step queues at most beyond the first loading request's: as
        # many blocks as the step could compute, so a storm of host hits cannot stretch a step's copies.
        self.copy_budget = max(config.max_num_batched_tokens // config.block_size, 1)
        self.num_preemptions = 0
        settings = config.degradation
        self.degradation = None if settings is None else DegradationController(
            settings, config.max_num_seqs, config.max_num_batched_tokens, config.num_blocks - 1,
            lower_token_budget=config.enable_chunked_prefill,
        )
        self._preemptions_seen = 0

    @property
    def max_num_seqs(self) -> int:
        """Seats in force: ``config.max_num_seqs``, or less while degraded."""
        return self.config.max_num_seqs if self.degradation is None else self.degradation.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        """Token budget per step in force: ``config.max_num_batched_tokens``, or less while degraded."""
        d = self.degradation
        return self.config.max_num_batched_tokens if d is None else d.max_num_batched_tokens

    # ----------------------------------------------------------------- intake

    def add_request(self, request: Request) -> None:
        """Queue a new request, or finish it at once as ``FINISHED_IGNORED`` (``ignored_reason`` set, reported by
        the next ``schedule`` and ``update_from_output``) if it can never fit. Raises ValueError if the id is
        unfinished already or the request is not fresh."""
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
        self.kv_cache_manager.hash_blocks(request)
        request.predicted_output_tokens = self.predictor.predict(request)
        if request.use_structured_output and not request.grammar_ready():
            request.status = RequestStatus.WAITING_FOR_FSM
        self.requests[rid] = request
        self.waiting.append(request)
        self._waiting_dirty = True

    def _prepare(self, request: Request) -> None:
        """Set the policy tie-break and the length limit."""
        request._seq = next(self._seq)
        limit = self.config.max_model_len
        if request.max_tokens is not None:
            limit = min(limit, request.num_prompt_tokens + request.max_tokens)
        request.length_limit = limit

    def fork_request(self, parent_id: str, children: Sequence[Request]) -> list[tuple[int, int]]:
        """Replace running ``parent_id`` by ``children`` (``n > 1`` sampling) sharing its computed KV blocks.

        Call between ``update_from_output`` and ``schedule``. Children run at once while seats and blocks last, the
        rest are queued; the parent is finished (``FINISHED_STOPPED``, not reported). Returns the
        ``(src_block, dst_block)`` copies to do before the next step. Raises ValueError if the parent is not
        running or a child is not fresh or does not extend the parent's computed tokens.
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
        self._num_stopped += 1
        # The parent's own seat at least: while degradation holds the batch under its size, the first child takes over
        # that seat rather than recomputing the prompt later.
        seats = max(self.max_num_seqs - len(self.running), 1)
        num_forked, copies = self.kv_cache_manager.fork(parent, children[:seats])
        for child in children[:num_forked]:
            self._prepare(child)
            child.predicted_output_tokens = self.predictor.predict(child)
            child.status = _RUNNING
            child.num_computed_tokens = computed
            child.first_scheduled_time = parent.first_scheduled_time
            self.batch.load(child)
            self.requests[child.request_id] = child
            self.running.append(child)
        for child in children[num_forked:]:
            self.add_request(child)
        return copies

    def _never_fits(self, request: Request) -> Optional[str]:
        cfg, prompt = self.config, request.num_prompt_tokens
        if prompt > cfg.max_model_len:
            return f"prompt has {prompt} tokens, more than max_model_len={cfg.max_model_len}"
        need, have = self._kv_blocks_needed(request), cfg.num_blocks - 1
        if need > have:
            return (f"prompt ({prompt} tokens) + max_tokens ({request.max_tokens}) needs {need} KV blocks of "
                    f"{cfg.block_size} tokens; the whole cache has {have}")
        return None

    def _kv_blocks_needed(self, request: Request) -> int:
        """Blocks ``request`` holds at most over its life (its prompt alone without ``max_tokens``)."""
        cfg, prompt, max_tokens = self.config, request.num_prompt_tokens, request.max_tokens
        # The last generated token is never fed back, so it needs no KV slot.
        if max_tokens is None:
            kv_tokens = prompt
        else:
            kv_tokens = min(prompt + max_tokens, max(cfg.max_model_len, prompt + 1)) - 1
        return -(-kv_tokens // cfg.block_size)

    # ------------------------------------------------------------------- step

    def schedule(self) -> SchedulerOutput:
        """Choose this step's rows, with the block copies to do first. Raises RuntimeError if the previous
        output (async: the one before it) is not updated yet."""
        if len(self._pending) >= self._max_pending:
            raise RuntimeError("schedule() called again before update_from_output() of the previous output")
        now = self._clock()
        if self.policy.observes_load and self.policy.observe_load(len(self.waiting), len(self.running), now):
            self.policy.sort(self.running, now)
            self._waiting_dirty = True
        step = Step(self.max_num_batched_tokens, now)
        self.kv_cache_manager.start_step()
        self._schedule_running(step)
        self._schedule_waiting(step)
        out = step.emit(self.batch, self.kv_cache_manager.block_table, self.config.block_size)
        out.finished, self._finished_for_schedule = self._finished_for_schedule, []
        out.block_copies = self.kv_cache_manager.take_block_copies()
        self._pending.append((out, self._num_stopped, self.kv_cache_manager.scheduled_blocks, set()))
        self.kv_cache_manager.end_step()
        return out

    def _schedule_running(self, step: Step) -> None:
        """Give running requests, in policy order, their remaining tokens within the budget."""
        if self.policy.keys_change_over_time:
            self.policy.sort(self.running, step.now)
        running = list(self.running)
        if not running:
            return
        cfg, kv = self.config, self.kv_cache_manager
        bs = cfg.block_size
        rows = np.array([r.batch_row for r in running], dtype=np.intp)
        state = self.batch.data.take(rows, axis=0)
        computed, pending = state[:, COMPUTED], state[:, PENDING]
        total = state[:, TOKENS] + pending
        # Drafts (only on decode rows with nothing pending) ride after the last token.
        new = total + state[:, SPEC] - computed
        if pending.any():
            # Only with async scheduling: its pending sample ends it, or it is a prefill parent waiting to be forked. (A
            # prompt of exactly max_model_len tokens reaches the limit with no sample pending; it must still finish its
            # prefill.)
            new[(pending > 0) & ((total >= state[:, LENGTH_LIMIT]) | (state[:, PREFILL_ONLY] > 0))] = 0
        threshold = cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill else 0
        if threshold:
            np.minimum(new, threshold, out=new)
        cumulative = new.cumsum()
        end = len(running)
        if cumulative[-1] > step.budget:
            if not cfg.enable_chunked_prefill:
                end = 0
            else:
                cut = int(cumulative.searchsorted(step.budget))
                new[cut] -= cumulative[cut] - step.budget
                new[cut + 1 :] = 0
                cumulative[cut:] = step.budget
        # Blocks the new tokens reach beyond those held (none for a row scheduling nothing).
        held = kv.block_table.lengths[rows]
        need = np.maximum((computed + new + (bs - 1)) // bs - held, 0)
        if cfg.num_lookahead_tokens or cfg.async_scheduling:
            # Lookahead slots, up to the last position a row may ever write, while blocks last; under async scheduling a
            # chunk that ends a prompt also reaches its first decode slot (see _allocate_admission).
            ends = computed + new
            look = cfg.num_lookahead_tokens
            if cfg.async_scheduling:
                look = np.maximum(look, ((new > 1) & (ends == total) & (state[:, PREFILL_ONLY] == 0)).astype(np.int64))
            reach = np.where(new > 0, np.minimum(ends + look, state[:, LENGTH_LIMIT] - 1), 0)
            ahead = np.maximum((np.maximum(ends, reach) + (bs - 1)) // bs - held, 0)
            if ahead[:end].sum() <= kv.block_pool.num_free_blocks:
                need = ahead
        cumulative_need = need[:end].cumsum()
        if end and cumulative_need[-1] > kv.block_pool.num_free_blocks:
            end = int(cumulative_need.searchsorted(kv.block_pool.num_free_blocks, side="right"))
        if end:
            needy = need[:end].nonzero()[0]
            if len(needy):
                kv.append_blocks([running[i] for i in needy.tolist()], rows[needy], need[needy])
            step.budget -= int(cumulative[end - 1])
            if new[:end].all():
                taken = slice(end)
                step.bulk_requests = running[:end]
            else:
                taken = new[:end].nonzero()[0]
                step.bulk_requests = [running[i] for i in taken.tolist()]
            step.bulk_rows, step.bulk_new, step.bulk_computed = rows[taken], new[taken], computed[taken]
        for req in running[end:]:
            if step.budget <= 0:
                break
            if req.status is _RUNNING:
                self._schedule_running_one(req, step)

    def _schedule_running_one(self, req: Request, step: Step) -> None:
        computed = req.num_computed_tokens
        pending = int(self.batch.data[req.batch_row, PENDING])
        num_tokens = req.num_tokens + pending
        if pending and (num_tokens >= req.length_limit or req.prefill_only):
            return
        n = num_tokens - computed
        if n != 1:
            n = self._chunk(n, step.budget)
            if n == 0:
                return
        kv = self.kv_cache_manager
        # Drafts fill what the budget leaves, and are the first to go when blocks are short.
        with_drafts = n + min(len(req.spec_token_ids), step.budget - n) if n == 1 and not pending else n
        held = kv.block_table.lengths[req.batch_row] * self.config.block_size
        if computed + with_drafts <= held or kv.allocate_slots(req, with_drafts):
            n = with_drafts
        elif computed + n > held and not (kv.allocate_slots(req, n) or self._preempt_until_allocated(req, n, step)):
            return
        step.add(req, n, computed)

    def _preempt_until_allocated(self, req: Request, n: int, step: Step) -> bool:
        kv = self.kv_cache_manager
        while True:
            if self._make_room_for(req, n, step) and kv.allocate_slots(req, n):
                return True
            candidates = list(self.running)
            if len(candidates) == 1:
                if self.kv_cache_manager.copy_sources:
                    # With async scheduling, sources of the previous step's copies stay pinned until its update: wait
                    # for them.
                    return False
                # It holds every used block and still cannot grow: only a request without max_tokens gets here
                # (admission rules out the rest), and preempting itself would loop forever.
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

    def _make_room_for(self, req: Request, n: int, step: Step) -> bool:
        """Have the tiers make room so that running ``req`` can take ``n`` more tokens, instead of a preemption."""
        if not self._room_tiers:
            return False
        return self._make_room(self.kv_cache_manager.num_blocks_to_allocate(req, n) - self.block_pool.num_free_blocks,
                               step)

    def _make_room(self, need: int, step: Step) -> bool:
        """Ask the tiers to free ``need`` device blocks (``KVTier.make_room``), victims in the policy's order."""
        if need < 1:
            return False
        victims = sorted(self.running, key=lambda r: self.policy.key(r, step.now), reverse=True)
        return any(t.make_room(need, victims) for t in self._room_tiers)

    def _holder(self, req: Request) -> Optional[KVTier]:
        """The tier holding ``req``'s KV whole (``KVTier.holds_request``), or None."""
        return next((t for t in self.tiers if t.holds_request(req)), None)

    def _schedule_waiting(self, step: Step) -> None:
        if not self.waiting:
            return
        if self._waiting_dirty or self.policy.keys_change_over_time:
            self.policy.sort(self.waiting, step.now)
            self._waiting_dirty = False
        if self.config.reserve_predicted_output:
            step.headroom = self.block_pool.num_free_blocks - self._reserved_blocks()
        queue, self.waiting = self.waiting, []
        # Requests whose grammar is still compiling, or whose LoRA adapter may not run now, passed over in queue order.
        unready: list[Request] = []
        loras: Optional[LoraGate] = None
        i = 0
        while i < len(queue):
            req = queue[i]
            if req.status is _WAITING_FOR_FSM:
                if not req.grammar_ready():
                    unready.append(req)
                    i += 1
                    continue
                req.status = RequestStatus.WAITING
            if req.lora_int_id:
                loras = loras or LoraGate(self.running, self.config.max_loras)
                if not loras.admits(req.lora_int_id):
                    unready.append(req)
                    i += 1
                    continue
            if req.request_id in step.preempted_ids or not self._admit(req, step):
                break
            if loras is not None:
                loras.running.add(req.lora_int_id)
            i += 1
        if self.waiting:
            self._waiting_dirty = True
        self.waiting = unready + queue[i:] + self.waiting

    def _admit(self, req: Request, step: Step) -> bool:
        while True:
            if len(self.running) < self.max_num_seqs and step.budget > 0:
                admitted = self._try_admit(req, step)
                if admitted:
                    return True
                if admitted is None:
                    # It waits for this step's host-tier copies, which no preemption shortens.
                    return False
            victim = self._waiting_victim(req, step)
            if victim is None:
                return False
            if self._make_room_to_admit(req, step) and self._try_admit(req, step):
                return True
            self._preempt(victim, step)

    def _make_room_to_admit(self, req: Request, step: Step) -> bool:
        """Have the tiers make room to admit waiting ``req`` instead of preempting; False, changing nothing, if
        blocks are not what it lacks or the tiers cannot free enough."""
        kv = self.kv_cache_manager
        if (not self._room_tiers or len(self.running) >= self.max_num_seqs or step.budget <= 0
                or self._holder(req) is not None or self.config.reserve_predicted_output):
            return False
        hits, num_hit = kv.get_computed_blocks(req)
        n = self._chunk(req.num_tokens - num_hit, step.budget)
        ahead = int(self.config.async_scheduling and not req.prefill_only and req.num_tokens + 1 < req.length_limit)
        need = kv.num_blocks_to_allocate(req, n, hits, ahead) if n else 0
        return bool(n) and self._make_room(need - self.block_pool.num_free_blocks, step)

    def _try_admit(self, req: Request, step: Step) -> Optional[bool]:
        """Admit ``req`` into this step if it fits; None when a tier has it wait a step (``KVTier.match``)."""
        kv = self.kv_cache_manager
        rid = req.request_id
        need = self._predicted_need(req) if self.config.reserve_predicted_output else 0
        # Alone, a request is always admitted (liveness); its need still counts against those after it.
        if need > step.headroom and self.running:
            return False
        holder = self._holder(req)
        if holder is not None:
            n = self._chunk(req.num_tokens - req.num_computed_tokens, step.budget)
            if not n or not holder.resume(req, n):
                return False
        else:
            n = self._allocate_admission(req, step.budget, may_wait=step.num_rows > 0)
            if n <= 0:
                return None if n < 0 else False
        req.status = _RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = step.now
        self.batch.load(req)
        self._insert_running(req, step.now)
        step.admitted_ids.add(rid)
        step.add(req, n, req.num_computed_tokens)
        step.headroom -= need
        return True

    def _reserved_blocks(self) -> int:
        """Blocks the running requests still lack for their predicted lengths (``reserve_predicted_output``)."""
        bs, lengths = self.config.block_size, self.kv_cache_manager.block_table.lengths
        # The last output token is never fed back, so it takes no KV slot.
        return sum(max(-(-(r.num_tokens + _outputs_left(r) - 1) // bs) - int(lengths[r.batch_row]), 0)
                   for r in self.running)

    def _predicted_need(self, req: Request) -> int:
        """Free blocks that admitting waiting ``req`` takes to hold its prompt and predicted outputs."""
        kv, left = self.kv_cache_manager, max(_outputs_left(req) - 1, 0)
        if self._holder(req) is not None:
            return -(-(req.num_tokens + left) // self.config.block_size)
        hits, num_hit = kv.get_computed_blocks(req)
        return kv.num_blocks_to_allocate(req, req.num_tokens - num_hit, hits, left)

    def _allocate_admission(self, req: Request, budget: int, may_wait: bool) -> int:
        """Take ``req``'s prefix hits and first chunk's blocks; returns the chunk's tokens, 0 if it must wait, -1 if a
        tier has it wait a step (``may_wait``). A full hit takes one hit fewer when the copy-on-write block is short."""
        kv = self.kv_cache_manager
        hits, num_hit = kv.get_computed_blocks(req)
        num_host = 0
        if self.tiers:
            admission = Admission(budget, may_wait, self._chunk, self.copy_budget)
            for tier in self.tiers:
                matched = tier.match(req, hits, admission)
                if matched is None:
                    return -1
                hits, num = matched
                num_host += num
            if num_host:
                num_hit = len(hits) * self.config.block_size
        # Under async scheduling, a request admitted beside running ones whose chunk ends its prompt also takes the slot
        # of its first decode token. Without it the next step, scheduled before this one's sample is known, may preempt
        # it for that block, which discards the sample, and readmit it to recompute the same tokens, step after step
        # (sync scheduling avoids this: there the victim keeps its sampled token).
        ahead = int(self.config.async_scheduling and bool(self.running) and not req.prefill_only
                    and req.num_tokens + 1 < req.length_limit)
        # The same loop with a prompt prefilled in chunks: a preempted request comes back only when its whole remaining
        # prompt and that slot fit, so its last chunk cannot find the pool short again.
        if ahead and req.num_preemptions and (kv.num_blocks_to_allocate(req, req.num_tokens - num_hit, hits, 1)
                                              > len(kv.block_pool.free_queue)):
            return 0
        while True:
            n = self._chunk(req.num_tokens - num_hit, budget)
            if n == 0:
                return 0
            if kv.allocate_slots(req, n, hits, ahead if num_hit + n == req.num_tokens else 0):
                break
            if not kv.copies_last_block(req, hits):
                return 0
            hits = hits[:-1]
            num_hit = len(hits) * self.config.block_size
        if kv.enable_caching and not req.skip_reading_prefix_cache:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_hit
            self.prefix_cache_hits_host += num_host * self.config.block_size
        req.num_computed_tokens = num_hit
        kv.cache_scheduled_blocks(req, num_hit + n)
        return n

    def _insert_running(self, req: Request, now: float) -> None:
        """Add ``req`` to the running list, keeping a static-key policy's order without a re-sort."""
        running = self.running
        policy = self.policy
        if policy.keys_change_over_time or not running:
            running.append(req)
            return
        key = policy.key(req, now)
        # Admissions usually come after everything running (FCFS), so the tail is checked before a binary search.
        if policy.key(running[-1], now) < key:
            running.append(req)
        else:
            bisect.insort(running, req, key=lambda r: policy.key(r, now))

    def _waiting_victim(self, req: Request, step: Step) -> Optional[Request]:
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

    def _preempt(self, victim: Request, step: Step) -> None:
        self.running.remove(victim)
        step.drop(victim)
        victim.spec_token_ids = []
        if self.batch.data[victim.batch_row, PENDING]:
            # Its in-flight sample will be discarded, so the last known token is computed again on resume to sample it
            # anew (same key).
            victim.num_computed_tokens = min(victim.num_computed_tokens, victim.num_tokens - 1)
        if not any(t.keep(victim) for t in self.tiers):
            self.kv_cache_manager.free(victim)
            victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        self._num_stopped += 1
        victim.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted_ids.add(victim.request_id)
        step.preempted.append(victim)
        self.waiting.append(victim)
        self._waiting_dirty = True

    # ----------------------------------------------------------------- update

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: Union[Sequence[int], np.ndarray],
                           num_sampled: Optional[np.ndarray] = None) -> list[Request]:
        """Apply one model step: append each row's samples, stop, free, register full blocks in the prefix cache.

        Args:
          output: the oldest ``schedule()`` output not yet updated.
          sampled_token_ids: ``[num_seqs]`` ints (extra ignored; partial prefill rows' discarded); with
            speculative decoding ``[num_seqs, >= 1]``: row i's accepted drafts then one sampled token.
          num_sampled: int ``[num_seqs]``, with a 2-D ``sampled_token_ids``: valid tokens per row.

        A request stops (tokens after it dropped) at eos (after ``min_tokens``, unless ``ignore_eos``) or a
        ``stop_token_ids`` id (``FINISHED_STOPPED``), or at ``max_tokens``/``max_model_len`` (``FINISHED_LENGTH_CAPPED``).
        Returns every request that got a token or finished, plus those ignored or aborted since, once. Raises
        ValueError (nothing changed) if ``output`` is not the pending one, ids are fewer than rows, or a 2-D
        ``sampled_token_ids`` lacks ``num_sampled``.
        """
        if not self._pending or output is not self._pending[0][0]:
            raise ValueError("update_from_output: output is not the pending output (the oldest schedule() result not yet updated)")
        requests = output.requests
        if len(sampled_token_ids) < len(requests):
            raise ValueError(
                f"update_from_output: {len(sampled_token_ids)} sampled token ids for {len(requests)} scheduled rows"
            )
        if np.ndim(sampled_token_ids) == 2:
            if num_sampled is None:
                raise ValueError("update_from_output: a 2-D sampled_token_ids needs num_sampled (tokens per row)")
            if not output.num_spec_tokens.any():
                sampled_token_ids = np.asarray(sampled_token_ids)[:, 0]
        _, num_stopped, _, restarted = self._pending.popleft()
        # The runner has done this step's copies.
        self.kv_cache_manager.release_copy_sources()
        result = self._apply_samples(output, sampled_token_ids, num_sampled, num_stopped, restarted)
        if self.degradation is not None:
            self._observe_pressure()
        return result

    def _apply_samples(
        self, output: SchedulerOutput, sampled_token_ids: Union[Sequence[int], np.ndarray],
        num_sampled: Optional[np.ndarray], num_stopped: int, restarted: set[str],
    ) -> list[Request]:
        """The body of :meth:`update_from_output` once ``output`` is popped."""
        requests = output.requests
        result, self._finished_for_update = self._finished_for_update, []
        if not requests:
            return result
        # Rows whose request was preempted or finished since schedule() are skipped.
        all_alive = num_stopped == self._num_stopped
        alive = None if all_alive else np.array(
            [r.status is _RUNNING and r.request_id not in restarted for r in requests], dtype=bool)
        if np.ndim(sampled_token_ids) == 2:
            return self._update_speculative(output, np.asarray(sampled_token_ids), np.asarray(num_sampled), alive,
                                            result)
        if self.config.enable_prefix_caching:
            bs = self.config.block_size
            filled = output.num_computed_tokens % bs + output.num_new_tokens >= bs
            filled = (filled if all_alive else filled & alive).nonzero()[0]
            if len(filled):
                self.kv_cache_manager.cache_computed_blocks(*[requests[i] for i in filled.tolist()])
        tokens = np.asarray(sampled_token_ids)[: len(requests)]
        if all_alive and output.samples.all():
            taken, receivers = slice(None), requests
        else:
            taken = (output.samples if all_alive else output.samples & alive).nonzero()[0]
            if not len(taken):
                return result
            receivers = [requests[i] for i in taken.tolist()]
            tokens = tokens[taken]
        token_list = tokens.tolist()
        for req, token in zip(receivers, token_list):
            req.append_output_token(token)
        data, rows = self.batch.data, output.batch_rows[taken]
        state = data.take(rows, axis=0)
        # Drafts of a row that did not verify them (cut for blocks) are stale now.
        for j in state[:, SPEC].nonzero()[0].tolist():
            receivers[j].spec_token_ids = []
        state[:, SPEC] = 0
        known = state[:, TOKENS] + 1
        state[:, TOKENS] = known
        state[:, PENDING] -= 1
        state[:, LAST_TOKEN] = tokens
        data[rows] = state
        # A cheap filter on the whole batch; Request.stop_status holds the rules.
        maybe_stop = (known >= state[:, LENGTH_LIMIT]) | (tokens == state[:, EOS]) | (state[:, HAS_STOP_IDS] > 0)
        finished = []
        for j in maybe_stop.nonzero()[0].tolist():
            status = receivers[j].stop_status(token_list[j], self.config.max_model_len)
            if status is not None:
                self._release(receivers[j], status)
                finished.append(receivers[j])
        result.extend(receivers)
        for req in finished:
            self.running.remove(req)
        return result

    def _update_speculative(self, output: SchedulerOutput, sampled: np.ndarray, num_sampled: np.ndarray,
                            alive: Optional[np.ndarray], result: list[Request]) -> list[Request]:
        """``update_from_output`` of a step with drafts; a hash only ever covers accepted tokens."""
        data, bs = self.batch.data, self.config.block_size
        caching = self.config.enable_prefix_caching
        receivers, filled, finished = [], [], []
        rows = zip(output.requests, output.num_spec_tokens.tolist(), output.samples.tolist(),
                   output.num_computed_tokens.tolist(), output.num_new_tokens.tolist(), num_sampled.tolist())
        for i, (req, num_spec, samples, computed, new, count) in enumerate(rows):
            if alive is not None and not alive[i]:
                continue
            row = req.batch_row
            tokens = sampled[i, :count].tolist() if samples else []
            if num_spec:
                rejected = num_spec + 1 - len(tokens)
                req.num_computed_tokens -= rejected
                data[row, COMPUTED] -= rejected
            status = None
            for token in tokens:
                req.append_output_token(token)
                status = req.stop_status(token, self.config.max_model_len)
                if status is not None:
                    break
            if tokens:
                data[row, TOKENS] = req.num_tokens
                data[row, PENDING] -= 1
                data[row, LAST_TOKEN] = req._all_token_ids[-1]
                data[row, SPEC] = 0
                req.spec_token_ids = []
                receivers.append(req)
            if caching and computed % bs + new >= bs:
                filled.append(req)
            if status is not None:
                finished.append((req, status))
        if filled:
            self.kv_cache_manager.cache_computed_blocks(*filled)
        for req, status in finished:
            self._release(req, status)
            self.running.remove(req)
        result.extend(receivers)
        return result

    def update_draft_token_ids(self, draft_token_ids: dict[str, Sequence[int]]) -> None:
        """Hand running requests the drafts their next decode row verifies (vLLM v1's method of the name).

        ``draft_token_ids``: request id -> token ids; they replace the old ones, cut to the length limit, and are
        dropped for a request not running, unknown, or not at a decode.
        """
        data = self.batch.data
        for rid, ids in draft_token_ids.items():
            req = self.requests.get(rid)
            if req is None or req.status is not _RUNNING:
                continue
            row = req.batch_row
            at_decode = not data[row, PENDING] and req.num_computed_tokens == req.num_tokens - 1
            ids = list(ids[: max(req.length_limit - req.num_tokens - 1, 0)]) if at_decode else []
            req.spec_token_ids = ids
            data[row, SPEC] = len(ids)

    def _observe_pressure(self) -> None:
        """Feed the step's KV pressure to the degradation controller; unpin warm-up prefixes at its first back-off."""
        new = self.num_preemptions - self._preemptions_seen
        self._preemptions_seen = self.num_preemptions
        idle = not self.requests
        free = self.block_pool.num_free_blocks
        # Making room is the first move: the batch backs off only once the tiers can no longer cover the shortage.
        if self._room_tiers and free < self.degradation.low_water:
            free += sum(t.reclaimable(self.running) for t in self._room_tiers)
        if self.degradation.observe(free, new, idle):
            self.kv_cache_manager.release_pinned_prefixes()

    def pin_prefix(self, token_ids: Sequence[int], cache_salt: Optional[str] = None) -> int:
        """Pin the cached full blocks prefixing ``token_ids`` while degradation is on (released at its first
        back-off); returns the blocks newly pinned (0 when off)."""
        return 0 if self.degradation is None else self.kv_cache_manager.pin_prefix(token_ids, cache_salt)

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's events since the last call, oldest first (``BlockPool.take_kv_events``)."""
        return self.block_pool.take_kv_events()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> list[Request]:
        """Forget every block hash and unpin prefixes, so no KV so far is read again (vLLM's ``reset_prefix_cache``).

        ``reset_running_requests`` also starts every unfinished request over (recompute preemption, tier copies
        dropped). Returns the requests preempted here. Raises RuntimeError while a step is in flight.
        """
        if self._pending:
            raise RuntimeError("reset_prefix_cache: a scheduled step has not been applied yet (update_from_output)")
        preempted = list(self.running) if reset_running_requests else []
        for req in preempted:
            self.running.remove(req)
            self._reset_progress(req)
            self.waiting.append(req)
        for req in self.waiting if reset_running_requests else ():
            if self._holder(req) is not None:
                self._reset_progress(req)
        self._waiting_dirty = True
        self.kv_cache_manager.release_pinned_prefixes()
        self.block_pool.reset_prefix_cache()
        return preempted

    # ------------------------------------------------ compaction and resizing (between steps)

    def compact_kv_cache(self, num_blocks: Optional[int] = None) -> list[tuple[int, int]]:
        """Move referenced and cached free blocks to the lowest ids (``BlockPool.compact``), rewriting block tables.

        ``num_blocks``: a smaller pool to make room for (cached free blocks above it evicted). Returns ``(src, dst)``
        device copies, no destination a source. Raises RuntimeError while a step is in flight, ValueError if
        :meth:`check_resize` refuses ``num_blocks`` or a tier refuses moving ids.
        """
        self._check_between_steps("compact_kv_cache")
        self._check_ids_may_move("compact_kv_cache()")
        if num_blocks is not None:
            self.check_resize(num_blocks)
        moves = self.block_pool.compact(num_blocks)
        self.kv_cache_manager.renumber(moves)
        return moves

    def check_resize(self, num_blocks: int) -> None:
        """Raise unless :meth:`resize_kv_cache` would accept ``num_blocks``: ValueError if not an int >= 2, below the
        referenced blocks + 1, or too small for an unfinished request; RuntimeError while a step is in flight."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"resize_kv_cache: num_blocks={num_blocks!r} must be an int >= 2 (block 0 is the "
                             "null block)")
        self._check_between_steps("resize_kv_cache")
        self._check_ids_may_move(f"resize_kv_cache(num_blocks={num_blocks})")
        used = sum(1 for b in self.block_pool.blocks if b.ref_cnt > 0)
        if num_blocks < used + 1:
            raise ValueError(f"resize_kv_cache: num_blocks={num_blocks} is below the {used + 1} blocks in use "
                             f"({used} held by requests and pins, plus the null block)")
        need = max(self.requests.values(), key=self._kv_blocks_needed, default=None)
        if need is not None and self._kv_blocks_needed(need) > num_blocks - 1:
            raise ValueError(f"resize_kv_cache: request {need.request_id!r} needs {self._kv_blocks_needed(need)} "
                             f"blocks, more than the {num_blocks - 1} usable of num_blocks={num_blocks}")

    def resize_kv_cache(self, num_blocks: int) -> list[tuple[int, int]]:
        """Grow or shrink the pool to ``num_blocks`` (null block included; a shrink compacts first), no request
        touched; returns the compaction's device copies. Raises as :meth:`check_resize`, changing nothing."""
        self.check_resize(num_blocks)
        moves = self.compact_kv_cache(num_blocks) if num_blocks < self.block_pool.num_blocks else []
        self.block_pool.resize(num_blocks)
        self.config = dataclasses.replace(self.config, num_blocks=num_blocks)
        if self.degradation is not None:
            self.degradation.resize(num_blocks - 1)
        return moves

    def _check_ids_may_move(self, what: str) -> None:
        for tier in self.tiers:
            reason = tier.refuses_compaction()
            if reason is not None:
                raise ValueError(f"{what}: {reason}")

    def _check_between_steps(self, what: str) -> None:
        if self._pending:
            raise RuntimeError(f"{what}: a scheduled step has not been applied yet (update_from_output)")

    def _reset_progress(self, req: Request) -> None:
        """Free all of an unfinished request's blocks and start it over, tokens kept (a recompute preemption)."""
        self.kv_cache_manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        if req.status is _RUNNING:
            req.status = RequestStatus.PREEMPTED
            self._num_stopped += 1

    def discard_output(self, output: SchedulerOutput) -> None:
        """Forget the newest ``schedule()`` output, whose step never ran. Its requests, and those whose KV its copies
        were to write, start over (recompute); its prefix-cache registrations are forgotten. Raises ValueError if
        ``output`` is not the newest pending output."""
        if not self._pending or output is not self._pending[-1][0]:
            raise ValueError("discard_output: output is not the newest pending output of schedule()")
        _, _, scheduled_blocks, _ = self._pending.pop()
        self.block_pool.uncache_blocks(scheduled_blocks)
        self.kv_cache_manager.release_copy_sources()
        rows = {id(r) for r in output.requests}
        lost = [r for t in self.tiers for r in t.forget(output.block_copies, self.running) if id(r) not in rows]
        restarted = [r.request_id for r in output.preempted]
        for req in output.requests + lost:
            if req.status is not _RUNNING:
                continue
            self.running.remove(req)
            self.kv_cache_manager.free(req)
            req.num_computed_tokens = 0
            req.spec_token_ids = []
            req.status = RequestStatus.PREEMPTED
            self._num_stopped += 1
            self.waiting.append(req)
            restarted.append(req.request_id)
        if self._pending:
            # Under async scheduling the step before it is still to be applied; these requests may run again before
            # that, and must not take that step's rows (samples, old batch rows) as their own.
            self._pending[0][3].update(restarted)
        self._waiting_dirty = True

    def _release(self, req: Request, status: RequestStatus) -> None:
        """Finish ``req``: set ``status``, free its blocks, forget it. The caller fixes the running/waiting lists."""
        req.status = status
        self._num_stopped += 1
        if status in _NATURAL_FINISHES:
            self.predictor.observe(req)
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]

    # ---------------------------------------------------------- engine hooks

    def finish_requests(self, request_ids: Union[str, Iterable[str]], status: RequestStatus) -> None:
        """Finish requests from outside (stop strings, aborts), freeing their blocks; unknown ids skipped. Aborted
        and ignored ones are reported next. Raises ValueError if ``status`` is not ``FINISHED_*``."""
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
        """The unfinished request with this id; else raises ``UnknownRequestError``."""
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
            **{k: v for tier in self.kv_cache_manager.tiers for k, v in tier.stats().items()},
            prefix_cache_hits_host=self.prefix_cache_hits_host,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted_waiting=sum(1 for r in self.waiting if r.status == RequestStatus.PREEMPTED),
            num_waiting_for_fsm=sum(1 for r in self.waiting if r.status is _WAITING_FOR_FSM),
            kv_cache_usage=self.block_pool.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_free_blocks=self.block_pool.num_free_blocks,
            num_blocks=self.block_pool.num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            **self.predictor.stats(),
        )
