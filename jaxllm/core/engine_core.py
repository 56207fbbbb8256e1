"""EngineCore: the scheduler and the model runner in one loop; core requests (token ids) in, core outputs out (vLLM's
``EngineCore``). Start-up is ``jaxllm.core.build.build_engine_core``'s; docs/design/architecture.md describes how
``n > 1``, prompt logprobs, speculative decoding and structured output run here."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import jax
import numpy as np

from jaxllm.config import PAUSE_MODES, SLEEP_MODE_OFF, SLEEP_TAGS, EngineConfig
from jaxllm.core.kv_events import make_publisher
from jaxllm.core.messages import (CoreInfo, CoreStats, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                  SampleLogprobs, decode_params, encode_params)
from jaxllm.loader import load_model, load_sharded
from jaxllm.lora import LoRARequest
from jaxllm.loader.orbax import is_orbax_checkpoint
from jaxllm.logger import init_logger
from jaxllm.core.profiler import StepProfiler
from jaxllm.core.prompt_logprobs import PromptLogprobs, prompt_targets, record_prompt_logprobs
from jaxllm.core.requests import CoreRequest, CoreSequence
from jaxllm.sample.sampler import MAX_BANNED_IDS, SamplerOutput
from jaxllm.sample.slots import SamplingSlots, make_sequence_sampling
from jaxllm.spec_decode import NgramProposer
from jaxllm.spec_decode.draft import DraftRunner
from jaxllm.structured_output import StructuredOutputManager
from jaxllm.worker.kv_cache import CacheEngines
from jaxllm.worker.lora import LoRAManager
from jaxllm.worker.model_runner import ModelRunner, StepOutput
from jaxllm.worker.quantization import param_bytes
from jaxllm.worker.sharding import ModelSharding
from jaxllm.worker.weights import device_bytes_in_use, place_leaf, prepare_params
from scheduler import BucketTable, Request, RequestStatus, SamplingParams, Scheduler, SchedulerOutput, build_batch, kv_cache_report
from scheduler.kv.tier import BlockCopy, CopyKind, copies_of
from scheduler.static_batching import StaticBatchScheduler

logger = init_logger(__name__)


def load_host_params(path: str, dtype: Any, quantization: Optional[str], sharding: ModelSharding) -> Any:
    """The checkpoint at ``path`` in ``dtype`` (and ``quantization``) for an update: host numpy (HF, GGUF)
    or placed on ``sharding`` (orbax); ValueError as ``load_model``."""
    if is_orbax_checkpoint(Path(path)):
        return load_sharded(path, dtype, sharding.mesh, quantization)[1]
    return load_model(path, dtype, quantization)[1]


@dataclasses.dataclass
class _Dispatched:
    """A step on the device: its outputs, samples for the next input, token rows with prompt logprobs."""

    out: StepOutput
    next_prev: jax.Array
    num_token_rows: int
    # Whether a row asked for sampled logprobs (else only the tokens are read back).
    logprobs: bool


@dataclasses.dataclass
class _Launched:
    """A scheduled step and its dispatch (None when it had no rows, only block copies)."""

    sched_out: SchedulerOutput
    dispatched: Optional[_Dispatched]


class EngineCore:
    """The scheduler, the model runner and the per-request state of one data-parallel replica, made from parts by
    ``jaxllm.core.build.build_engine_core``.

    Args:
      runner: the target model's ``ModelRunner``; sharding: the replica's ``ModelSharding``.
      kv_cache_dtype: numpy dtype of the KV cache's numbers.
      structured: the ``StructuredOutputManager``.
      lora: the ``LoRAManager`` over ``runner.lora`` (``enable_lora``), or None.
      drafter: the draft model's runner, or None; proposer: the n-gram proposer, or None.
      core_index: this core's data-parallel rank (reported with its outputs).

    Attributes:
      cache_engines: the runners' KV caches (``CacheEngines``, target first): every block operation is one call.
      requests: ``CoreRequest`` by request id.
      param_bytes: ``param_bytes`` of the device parameters (``HEAD_PANELS`` included).
      kv_events: the ``ZmqEventPublisher`` of ``kv_events_config``, or None.
    """

    # Methods a front end may call between steps of a core in another process (``messages.UtilityCall``).
    UTILITY_METHODS = frozenset({"cached_prefix_tokens", "wait_for_warmup", "num_free_blocks", "kv_cache_report",
                                 "preload_prefixes", "host_params", "update_weights_encoded",
                                 "update_weights_from_path", "reset_prefix_cache", "sleep", "wake_up", "is_sleeping",
                                 "kv_cache_compact", "kv_cache_resize", "add_lora", "remove_lora",
                                 "list_loras", "update_lora_encoded", "start_profile", "stop_profile",
                                 "finish_aborted", "pause_scheduler", "resume_scheduler",
                                 "release_kv_cache_memory"})

    def __init__(self, config: EngineConfig, runner: ModelRunner, *, sharding: ModelSharding, max_model_len: int,
                 kv_cache_dtype: Any, structured: StructuredOutputManager, drafter: Optional[DraftRunner] = None,
                 proposer: Optional[NgramProposer] = None, core_index: int = 0,
                 lora: Optional[LoRAManager] = None):
        self.config, self.runner, self.sharding, self.drafter, self.proposer = config, runner, sharding, drafter, proposer
        self.max_model_len, self.kv_cache_dtype, self.structured = max_model_len, np.dtype(kv_cache_dtype), structured
        self.core_index, self.lora = core_index, lora
        self.model_config, self.buckets, self.dtype = runner.cfg, runner.buckets, runner.dtype
        self.num_blocks = runner.cache_engine.num_blocks
        self.param_bytes = param_bytes(runner.weights.params)
        self._runners = [runner] + ([drafter] if drafter is not None else [])
        self.cache_engines = CacheEngines([r.cache_engine for r in self._runners])
        self.slots = SamplingSlots(config.scheduler.max_num_seqs + 1, self.model_config.vocab_size, runner)
        scheduler_cls = StaticBatchScheduler if config.scheduler.batching == "static" else Scheduler
        cache = runner.cache_engine
        num_pool_blocks = 0 if cache.scaled_pool is None else cache.scaled_pool.k.shape[1]
        self.scheduler = scheduler_cls(config.scheduler_config(num_blocks=self.num_blocks, max_model_len=max_model_len,
                                                               num_offload_blocks=cache.num_offload_blocks,
                                                               num_pool_blocks=num_pool_blocks))
        # Seconds the engine loop spent on the host tier's copies: device -> host (offloads: dispatching their
        # gathers, then writing the host pool while the step runs), host -> device (loads, dispatch only); and of
        # the first, the host writes (after the step's dispatch, off the step's critical path).
        self.offload_seconds = [0.0, 0.0]
        self.offload_write_seconds = 0.0
        # Bytes one host-tier block copy moves: K and V of every layer, of every runner.
        self._offload_block_bytes = self.cache_engines.host_block_bytes
        self.requests: dict[str, CoreRequest] = {}
        self.kv_events = make_publisher(config.observability.kv_events_config, core_index)
        # Records whose prompt is not scheduled yet, and sequences holding a prompt-logprobs tracker: most steps
        # have none, and then skip the per-row look at them.
        self._num_unscheduled = 0
        self._num_prompt_trackers = 0
        # With async scheduling: the launched step whose samples are not read yet.
        self._in_flight: Optional[_Launched] = None
        # Speculative decoding counters: rows that verified drafts, drafts, accepted drafts (and by position).
        self._spec_counts = [0, 0, 0]
        self._spec_per_position = [0] * (runner.num_positions - 1)
        # Outputs of a step applied between two steps (before a weight update or a sleep), reported by the next.
        self._held_outputs: list[EngineCoreOutput] = []
        # What sleeps, of SLEEP_TAGS (empty when awake), and the level of the last sleep.
        self._asleep: set[str] = set()
        self._sleep_level = 0
        self.profiler = StepProfiler(config.observability.profiler_config, core_index)
        # pause_scheduler("keep") until resume_scheduler: the core's loop runs no step.
        self.paused = False

    @property
    def schedules_ahead(self) -> bool:
        """Whether steps overlap (``EngineConfig.async_scheduling``, resolved there)."""
        return self.config.scheduler.async_scheduling

    def info(self) -> CoreInfo:
        """What a front end needs to know of this core."""
        return CoreInfo(
            vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
            eos_token_ids=list(self.model_config.eos_token_ids), num_blocks=self.num_blocks,
            block_size=self.config.cache.block_size, max_num_seqs=self.config.scheduler.max_num_seqs,
            max_banned_ids=MAX_BANNED_IDS,
            enable_prefix_caching=self.config.cache.enable_prefix_caching,
            device_ids=[d.id for d in self.sharding.mesh.devices.flat], core_index=self.core_index,
        )

    def wait_for_warmup(self, timeout: Optional[float] = None) -> bool:
        """Wait until every step program is built; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all([r.programs.wait_for_warmup(None if deadline is None else max(0.0, deadline - time.monotonic()))
                    for r in self._runners])

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: Optional[str] = None) -> int:
        """Prompt tokens this core would take from its prefix cache now (the scheduler's
        ``get_computed_blocks`` on a throwaway request; nothing allocated)."""
        probe = Request("prefix-probe", list(token_ids), SamplingParams(), cache_salt=cache_salt)
        return self.scheduler.kv_cache_manager.get_computed_blocks(probe)[1]

    def preload_prefixes(self, prompts: Sequence[Sequence[int]]) -> dict[str, int]:
        """Compute ``prompts`` (token ids) into the prefix cache before serving and pin their full
        blocks (``Scheduler.pin_prefix``); not counted as prefix-cache traffic.

        Returns:
          ``{"num_prompts", "num_cached_tokens", "num_pinned_blocks"}``.

        Raises:
          RuntimeError: requests are already queued or running.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("preload_prefixes: the core already has requests; warm the prefix cache up before "
                               "serving")
        sched = self.scheduler
        counted = sched.prefix_cache_queries, sched.prefix_cache_hits
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for i, ids in enumerate(prompts):
            self.add_request(EngineCoreRequest(f"preload-{i}", list(ids), params, seeds=[0], stop_ids=[],
                                               bad_words_token_ids=[], eos_token_id=None,
                                               arrival_time=time.monotonic()))
        while self.has_unfinished_requests():
            self.step()
        sched.prefix_cache_queries, sched.prefix_cache_hits = counted
        cached = sum(self.cached_prefix_tokens(ids) for ids in prompts)
        pinned = sum(sched.pin_prefix(ids) for ids in prompts)
        logger.info(f"preloaded {len(prompts)} prompts into the prefix cache: {cached} tokens in full blocks, "
                    f"{pinned} blocks pinned")
        return dict(num_prompts=len(prompts), num_cached_tokens=cached, num_pinned_blocks=pinned)

    def kv_cache_report(self, block_map: bool = True) -> dict[str, Any]:
        """The scheduler's KV diagnostics (``scheduler.diagnostics.kv_cache_report``) with this core's index."""
        return {**kv_cache_report(self.scheduler, block_map), "core_index": self.core_index}

    def num_free_blocks(self) -> int:
        """Device KV blocks in the free queue (``num_blocks - 1`` when no request holds one)."""
        return self.scheduler.block_pool.num_free_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the front end has validated (``jaxllm.frontend.input_processor``); a structured-output
        constraint starts compiling (off this thread) and the request waits for it."""
        if self._asleep - {"scheduling"}:
            raise RuntimeError(f"the engine is sleeping (sleep(level={self._sleep_level})): call wake_up() first")
        params, ids, n = request.sampling_params, request.prompt_token_ids, request.sampling_params.n
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use in the engine core")
        lora_id = self._add_lora_of(request.lora_request)
        grammar = None if params.structured_outputs is None else self.structured.compile(params.structured_outputs)
        kwargs = dict(eos_token_id=request.eos_token_id, arrival_time=request.arrival_time,
                      priority=request.priority, cache_salt=request.cache_salt,
                      grammar_ready=None if grammar is None else self.structured.ready(grammar),
                      lora_int_id=lora_id, lora_epoch=self.lora.epochs[lora_id] if lora_id else 0)
        record = CoreRequest(request.request_id, num_live=n)
        for i, seed in enumerate(request.seeds):
            seq_params = params
            if n > 1:
                seq_params = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            seq = CoreSequence(record, i, request.request_id if n == 1 else f"{i}_{request.request_id}", ids,
                               seq_params, **kwargs)
            seq.logprobs = None if params.logprobs is None else []
            if grammar is not None:
                self.structured.add(seq, grammar)
            self.slots.register(seq, make_sequence_sampling(seq_params, seed, request.stop_ids,
                                                            self.model_config.vocab_size, request.bad_words_token_ids))
            record.seqs.append(seq)
        if n > 1 and len(ids) > 1:
            # Prefill-only: its one sample is never used, so it samples greedily.
            parent_params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
            record.parent = CoreSequence(record, -1, f"prefill_{request.request_id}", ids[:-1], parent_params, **kwargs)
            record.parent.prefill_only = True
        if params.prompt_logprobs is not None:
            record.prompt_logprobs = PromptLogprobs(ids, params.prompt_logprobs)
            if not record.prompt_logprobs.complete:
                record.prefill.prompt_logprobs = record.prompt_logprobs
                record.prefill.skip_reading_prefix_cache = True
                self._num_prompt_trackers += 1
        self.requests[request.request_id] = record
        self._num_unscheduled += 1
        for seq in [record.parent] if record.parent is not None else record.seqs:
            self.scheduler.add_request(seq)

    def _add_lora_of(self, lora_request: Optional[LoRARequest]) -> int:
        """The adapter id of a request's ``lora_request`` (0: none), known to the engine from now on (one removed
        while others still run under it stays removed: the request runs under it too)."""
        if lora_request is None:
            return 0
        self.add_lora(lora_request, revive=False)
        return lora_request.lora_int_id

    # ------------------------------------------------------------ LoRA adapters (between steps)

    def add_lora(self, lora_request: Any, revive: bool = True) -> bool:
        """Know an adapter and read its PEFT folder now (vLLM's ``add_lora``); True. ``lora_request``: a
        ``LoRARequest`` or its fields as a list (from another process); ``revive``: ``LoRAManager.add``'s.

        Raises:
          ValueError: LoRA is off, or the adapter's errors (``LoRAManager.add``: rank above ``max_lora_rank``,
            an unknown target module, an id or name already taken).
        """
        if self.lora is None:
            name = getattr(lora_request, "lora_name", lora_request)
            raise ValueError(f"LoRA adapter {name!r}: the engine was started without enable_lora=True "
                             "(--enable-lora)")
        self.lora.add(lora_request if isinstance(lora_request, LoRARequest) else LoRARequest(*lora_request), revive)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's ``remove_lora``); False when it is not known (or LoRA is off).

        Requests already running under it finish under it, as in vLLM: its weights and device slot go when the
        last of them ends, no KV block of theirs is dropped, and no other request is touched. Blocks cached under
        it are never read again (its id's prefix-cache key changes).
        """
        if self.lora is None:
            return False
        return self.lora.remove(lora_int_id, lora_int_id in self._loras_in_use())

    def _loras_in_use(self) -> set[int]:
        """The adapter ids of the unfinished requests."""
        return {seq.lora_int_id for record in self.requests.values() for seq in record.live_sequences()}

    def list_loras(self) -> list[LoRARequest]:
        """The adapters the engine knows, by id (none without LoRA)."""
        return [] if self.lora is None else self.lora.list_loras()

    def update_lora(self, name_or_id: Any, tree: Any) -> dict[str, Any]:
        """Replace a known adapter's A/B between two steps with no new compilation (``LoRAManager.update``); no
        prefix-cache block computed under the old values is read again: the adapter's key changes, and if
        unfinished requests use it, the prefix cache is reset and they are recomputed (as ``update_weights``).

        Returns:
          ``{"lora_int_id", "num_leaves", "num_preempted"}``.

        Raises:
          ValueError: LoRA is off, an unknown adapter, or a leaf unknown or of the wrong shape (named); the old
            adapter is kept.
        """
        if self.lora is None:
            raise ValueError("update_lora: the engine was started without enable_lora=True (--enable-lora)")
        self._settle()
        report = self.lora.update(name_or_id, tree)
        lora_id = report["lora_int_id"]
        used = any(r.lora_int_id == lora_id for r in self.scheduler.requests.values())
        return {**report, "num_preempted": self._drop_kv_state() if used else 0}

    def update_lora_encoded(self, name_or_id: Any, encoded: dict[str, Any]) -> dict[str, Any]:
        """:meth:`update_lora` of a tree sent by another process (``messages.encode_params``)."""
        return self.update_lora(name_or_id, decode_params(encoded))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort whole requests (unknown ids are ignored); their KV blocks return to the pool at once."""
        for rid in request_ids:
            record = self.requests.get(rid)
            for seq in [] if record is None else record.live_sequences():
                if not seq.is_finished:
                    self.scheduler.abort_request(seq.request_id)
                self._release(seq)
            if record is not None:
                self._forget(record)

    def abort_all(self) -> None:
        """Abort every request."""
        self.abort_requests(list(self.requests))

    def stop_sequences(self, sequences: Iterable[tuple[str, int]]) -> None:
        """Finish sequences the front end found a stop string in (``(request_id, index)``; unknown ones are
        ignored): their blocks are freed at once and nothing more is reported of them."""
        for rid, index in sequences:
            record = self.requests.get(rid)
            if record is None or index >= len(record.seqs) or record.seqs[index].done:
                continue
            seq = record.seqs[index]
            if not seq.is_finished:
                self.scheduler.finish_requests(seq.request_id, RequestStatus.FINISHED_STOPPED)
            self._finish(seq)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued, running, unreported, or a step is in flight."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._held_outputs)

    @property
    def can_step(self) -> bool:
        """Whether :meth:`step` has work now: outputs held to report, or unfinished requests while no step is
        held (the core loop steps while this holds)."""
        return bool(self._held_outputs) or (self.has_unfinished_requests() and not self.steps_held)

    def step(self) -> EngineCoreOutputs:
        """Schedule, launch the step, apply the samples, report. With ``async_scheduling`` step N+1 launches
        before step N is applied, so outputs trail by one step (the first call reports none). While a profile
        session is active, the step is one of its steps (:meth:`start_profile`). Raises RuntimeError while
        :attr:`steps_held` (outputs held meanwhile, as an abort's, are reported without a step).

        Returns:
          an output for every sequence that produced a token or finished, and the core's stats.
        """
        if self.steps_held:
            if self._held_outputs:
                return EngineCoreOutputs(self._take_held_outputs(), self.stats(), self.core_index)
            raise RuntimeError(f"no step runs while the engine is {'paused' if self.paused else 'sleeping'}: "
                               f"{'resume_generation()' if self.paused else 'wake_up()'} first")
        if not self.profiler.active:
            return self._step()
        with self.profiler.step():
            return self._step()

    def _step(self) -> EngineCoreOutputs:
        start = time.perf_counter()
        outputs = self._take_held_outputs() + self._fail_grammars()
        sched_out = self._schedule()
        schedule_seconds = time.perf_counter() - start
        touched: list[Request] = list(sched_out.finished)
        prev = self._in_flight
        prev_tokens = None if prev is None else prev.dispatched.next_prev
        if prev is not None and self._needs_previous_samples(sched_out):
            touched += self._apply(prev)
            prev = self._in_flight = None
        launched = self._launch(sched_out, prev_tokens)
        done = [] if prev is None else [prev]
        self._in_flight = launched if self.schedules_ahead and launched.dispatched is not None else None
        if self._in_flight is None:
            done.append(launched)  # nothing left on the device to overlap with: apply it now, in order
        for step in done:
            touched += self._apply(step)
        outputs += self._report(touched)
        stats = self.stats(schedule_seconds, sched_out.total_num_scheduled_tokens,
                           self.structured.bitmask_seconds if launched.dispatched is not None else None)
        stats.step_seconds = time.perf_counter() - start
        return EngineCoreOutputs(outputs, stats, self.core_index)

    # ------------------------------------------------------------ pausing (vLLM's pause_generation, between steps)

    def finish_aborted(self, request_ids: Optional[Sequence[str]] = None) -> int:
        """Abort requests (None: all), each live sequence reported by the next step as finished with
        finish_reason "abort", its tokens so far kept (vLLM's pause in "abort" mode and ``/abort_requests``);
        ids this core does not hold are ignored. Returns the requests aborted."""
        self._settle()
        wanted = list(self.requests) if request_ids is None else dict.fromkeys(request_ids)
        records = [self.requests[rid] for rid in wanted if rid in self.requests]
        for record in records:
            self._held_outputs += self._abort_reported(record)
        return len(records)

    def pause_scheduler(self, mode: str = "abort") -> int:
        """vLLM's engine-core pause (the front end refuses new requests in "abort" and "wait" modes and waits for
        the open ones): "abort" is :meth:`finish_aborted` of all; "keep" runs no step until
        :meth:`resume_scheduler`, requests (and new ones) keeping their place and KV; "wait" changes nothing here.
        Returns the requests aborted. Raises ValueError: another mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode={mode!r} must be one of {list(PAUSE_MODES)}")
        self.paused = mode == "keep"
        return self.finish_aborted() if mode == "abort" else 0

    def resume_scheduler(self) -> None:
        """Run steps again after :meth:`pause_scheduler`."""
        self.paused = False

    # ------------------------------------------------------------ profiling (vLLM's start_profile / stop_profile)

    def start_profile(self, profile_prefix: Optional[str] = None, delay_iterations: Optional[int] = None,
                      max_iterations: Optional[int] = None,
                      profiler_kwargs: Optional[dict[str, Any]] = None) -> str:
        """Record a ``jax.profiler`` trace of the coming steps (``jaxllm.core.profiler.StepProfiler.start``): after
        ``delay_iterations`` steps, for ``max_iterations`` steps or until :meth:`stop_profile` (None: the
        ``profiler_config``'s). Returns the trace folder.

        Raises:
          RuntimeError: no ``profiler_config`` profiler, a session already active, or JAX's profiler refused.
          ValueError: a bad prefix, count or ``profiler_kwargs`` key (named).
        """
        return self.profiler.start(profile_prefix, delay_iterations, max_iterations, profiler_kwargs)

    def stop_profile(self) -> Optional[str]:
        """End the profile session, writing its trace; its folder, or None when none was active."""
        return self.profiler.stop()

    # ------------------------------------------------------------ weights and sleep (between steps)

    def get_params(self) -> Any:
        """The target model's parameters (``WeightStore.get_params``): device arrays with their shardings; asleep,
        read-only host numpy (level 1's copy, or what updates gave since). Raises RuntimeError: discarded
        (``sleep(level=2)``) and not given again."""
        return self.runner.weights.get_params()

    def host_params(self) -> dict[str, Any]:
        """:meth:`get_params` copied to the host, encoded for another process (``messages.encode_params``)."""
        return encode_params(jax.device_get(self.get_params()))

    def update_weights(self, params: Any) -> dict[str, int]:
        """Replace the target model's weights between two steps, with no new compilation; the KV of
        the old weights is dropped (prefix cache reset, unfinished requests recomputed). ``params``: any subset of the
        leaves, or all after ``sleep(level=2)``; the draft model keeps its weights. Asleep, the weights stay where
        they are: each leaf replaces the held one on the host (``WeightStore.stage``: no host-to-device transfer)
        and :meth:`wake_up` places them.

        Returns:
          ``{"num_leaves", "num_bytes" (placed, or held on the host while asleep), "num_preempted"}``.

        Raises:
          ValueError: a leaf unknown, missing or of the wrong shape or dtype (``prepare_params``); nothing changes then.
        """
        weights = self.runner.weights
        flat = prepare_params(params, weights.param_layout(), partial=weights.state != "discarded",
                              optional=weights.kept_through_discard)
        self._settle()
        num_leaves, num_bytes = len(flat), 0
        if weights.state != "device":
            num_bytes = weights.stage(flat)
        else:
            layout = weights.param_layout()
            for path in list(flat):
                leaf = place_leaf(flat.pop(path), layout[path].sharding)
                num_bytes += leaf.nbytes
                weights.set_param(path, leaf)
        preempted = self._drop_kv_state()
        self.param_bytes = param_bytes(weights.params)
        return {"num_leaves": num_leaves, "num_bytes": num_bytes, "num_preempted": preempted}

    def update_weights_encoded(self, encoded: dict[str, Any]) -> dict[str, int]:
        """:meth:`update_weights` of a tree sent by another process (``messages.encode_params``)."""
        return self.update_weights(decode_params(encoded))

    def update_weights_from_path(self, path: str) -> dict[str, int]:
        """:meth:`update_weights` with the checkpoint at ``path`` (HF folder, GGUF file or
        orbax folder); ValueError when it is not a model or does not fit."""
        return self.update_weights(load_host_params(path, self.dtype, self.config.quantization, self.sharding))

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``); running requests keep their own KV, unless
        ``reset_running_requests`` starts every unfinished one over (recompute preemption, as vLLM's).
        ``reset_connector``: vLLM's external KV connector, which jaxllm has none of. Returns True (it cannot fail
        here)."""
        self._settle()
        if reset_running_requests:
            self._drop_kv_state()
            return True
        self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return True

    def sleep(self, level: int = 1, mode: str = "abort") -> dict[str, Any]:
        """Free device memory between rollouts (vLLM's ``sleep``): level 1 frees the KV caches and offloads the
        weights to the host, level 2 discards the weights (restore them by ``update_weights`` before :meth:`wake_up`);
        level 0 frees nothing and runs no step until :meth:`wake_up`, new requests queueing. The prefix cache is
        reset (levels 1 and 2); programs stay compiled.

        Args:
          level: 0, 1 or 2.
          mode: what becomes of unfinished requests (vLLM's): "abort", each finished with finish_reason "abort"
            (reported by the first step after :meth:`wake_up`); "keep", they wait, and recompute what the freed KV
            cache held after :meth:`wake_up`; "wait", none may be left (the front end waits for them first).

        Returns:
          ``{"level", "freed_bytes", "device_bytes_before", "device_bytes_after"}`` (the last two None without
          memory stats).

        Raises:
          ValueError: ``level`` or ``mode`` out of range, or ``enable_sleep_mode`` off.
          RuntimeError: requests are unfinished with ``mode="wait"``.
        """
        if not self.config.enable_sleep_mode:
            raise ValueError(SLEEP_MODE_OFF)
        if level not in (0, 1, 2):
            raise ValueError(f"sleep(level={level!r}): level must be 0 (run no step), 1 (free the KV cache, weights "
                             "to the host) or 2 (free the KV cache, discard the weights)")
        if mode not in PAUSE_MODES:
            raise ValueError(f"sleep(mode={mode!r}): mode must be one of {list(PAUSE_MODES)}")
        self._settle()
        if self.requests and mode == "wait":
            raise RuntimeError(f"sleep(mode='wait'): {len(self.requests)} requests are unfinished; finish them, or "
                               "sleep with mode 'abort' or 'keep'")
        if mode == "abort":
            self.finish_aborted()
        device = self.sharding.mesh.devices.flat[0]
        before = device_bytes_in_use(device)
        freed = 0
        if level == 0:
            if not self._asleep:  # after a deeper sleep, what it freed stays freed, and its level
                self._sleep_level = 0
            self._asleep.add("scheduling")
        else:
            self._drop_kv_state()  # kept requests start over after wake_up; the prefix cache empties
            freed = self.cache_engines.release() + self.runner.weights.release(offload=level == 1)
            self._asleep, self._sleep_level = set(SLEEP_TAGS), level
        return {"level": level, "freed_bytes": freed, "device_bytes_before": before,
                "device_bytes_after": device_bytes_in_use(device)}

    def release_kv_cache_memory(self) -> int:
        """Free the KV cache's device memory after a level-0 :meth:`sleep`, the weights kept (vLLM's): unfinished
        requests recompute what it held after ``wake_up(["kv_cache"])``; the prefix cache empties. Returns the
        bytes freed. Raises RuntimeError: not asleep at level 0 (or deeper)."""
        if "scheduling" not in self._asleep:
            raise RuntimeError("release_kv_cache_memory: sleep(level=0) first, so that no step runs")
        self._settle()
        self._drop_kv_state()
        freed = self.cache_engines.release()
        self._asleep.add("kv_cache")
        return freed

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> bool:
        """Bring back what :meth:`sleep` freed (vLLM's ``wake_up``): ``tags`` None for all, or some of
        "weights", "kv_cache" (zeroed) and "scheduling"; nothing compiles. Steps run again once the weights and
        the KV cache are back (after a level-0 sleep, at any wake-up). Returns whether they are.

        Discarded weights no update gave again come back as zeros (``WeightStore.restore``).
        Raises ValueError: an unknown tag.
        """
        tags = set(SLEEP_TAGS) if tags is None else set(tags)
        unknown = tags - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"wake_up: unknown tags {sorted(unknown)}; the tags are {list(SLEEP_TAGS)}")
        if "weights" in tags and "weights" in self._asleep:
            self.runner.weights.restore()
        if "kv_cache" in tags:
            self.cache_engines.allocate()
        self._asleep -= tags
        if not self._asleep & {"weights", "kv_cache"}:  # as vLLM's: steps run again once the memory is back,
            self._asleep.clear()                        # a pause_generation pause ended too
            self.paused = False
        return not self._asleep

    def is_sleeping(self) -> bool:
        """True from :meth:`sleep` until :meth:`wake_up` has brought everything back."""
        return bool(self._asleep)

    @property
    def steps_held(self) -> bool:
        """Whether the core's loop runs no step: paused (``pause_scheduler("keep")``) or asleep."""
        return self.paused or bool(self._asleep)

    # ------------------------------------------------------------ an elastic KV pool (between steps)

    def kv_cache_compact(self) -> dict[str, Any]:
        """Move every live block to the lowest block ids between two steps (``Scheduler.compact_kv_cache``
        and each runner's copy program); nothing compiles or is recomputed.

        Returns:
          ``{"num_moved_blocks", "num_blocks", "num_used_blocks" (null included), "kv_cache_bytes", "seconds"}``.

        Raises:
          RuntimeError: the KV cache sleeps.
        """
        start = time.perf_counter()
        self._settle()
        self._need_kv_cache("kv_cache_compact")
        moves = self.scheduler.compact_kv_cache()
        self.cache_engines.move_blocks(moves)
        return self._pool_report(len(moves), start)

    def kv_cache_resize(self, num_blocks: int) -> dict[str, Any]:
        """Resize every runner's KV pool to ``num_blocks`` blocks (null included) between two steps,
        running requests kept (a shrink compacts first, evicting cached free blocks that do not fit).

        Returns:
          :meth:`kv_cache_compact`'s report plus ``"num_compilations"``.

        Raises:
          ValueError: ``num_blocks`` not an int >= 2, or too small for the blocks in use or an unfinished request.
          RuntimeError: the KV cache sleeps, or the device could not hold the new arrays (nothing changes).
        """
        start = time.perf_counter()
        self._settle()
        self._need_kv_cache("kv_cache_resize")
        sched = self.scheduler
        sched.check_resize(num_blocks)
        moves = sched.compact_kv_cache(num_blocks) if num_blocks < sched.block_pool.num_blocks else []
        self.cache_engines.move_blocks(moves)
        compiled = sum(r.resize_kv_cache(num_blocks) for r in self._runners)
        sched.resize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        return {**self._pool_report(len(moves), start), "num_compilations": compiled}

    def _need_kv_cache(self, what: str) -> None:
        if "kv_cache" in self._asleep:
            raise RuntimeError(f"{what}: the KV cache sleeps; wake_up() first")

    def _pool_report(self, num_moved: int, start: float) -> dict[str, Any]:
        pool = self.scheduler.block_pool
        return {"num_moved_blocks": num_moved, "num_blocks": pool.num_blocks,
                "num_used_blocks": pool.num_blocks - pool.num_free_blocks,
                "kv_cache_bytes": self.cache_engines.nbytes,
                "seconds": time.perf_counter() - start}

    def _settle(self) -> None:
        """Apply the step in flight now, holding its outputs for the next :meth:`step`."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._held_outputs += self._report(self._apply(step))

    def _take_held_outputs(self) -> list[EngineCoreOutput]:
        held, self._held_outputs = self._held_outputs, []
        return held

    def _drop_kv_state(self) -> int:
        """Reset the prefix cache and preempt every unfinished request for recompute; returns them."""
        preempted = self.scheduler.reset_prefix_cache(reset_running_requests=True)
        self._publish_kv_events()
        for seq in preempted:
            self.slots.release(seq)
        return len(preempted)

    def _publish_kv_events(self) -> None:
        """Publish the prefix cache's events so far: each step's, and a wipe's at once (a router must not wait for
        the next step to learn that the cache is empty)."""
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.take_kv_events())

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step; preempted sequences give their sampling slots back."""
        sched_out = self.scheduler.schedule()
        for request in sched_out.preempted:
            self.slots.release(request)
        for row in sched_out.scheduled if self._num_unscheduled else ():
            record = row.request.record
            if record.num_cached_tokens is None:
                # Its prompt is scheduled for the first time: the prompt tokens read from the prefix cache are the
                # row's computed tokens (vLLM's ``num_cached_tokens``).
                record.num_cached_tokens = row.num_computed_tokens
                self._num_unscheduled -= 1
        return sched_out

    def _needs_previous_samples(self, sched_out: SchedulerOutput) -> bool:
        """Whether a row's bitmask or bad-word bans need the in-flight step's sample."""
        return self.structured.needs_previous_samples(sched_out) or self.slots.needs_previous_samples(sched_out)

    def _report(self, touched: list[Request]) -> list[EngineCoreOutput]:
        """Outputs of the touched sequences (touched prefill parents fork); publishes the step's KV events."""
        self._publish_kv_events()
        outputs = []
        for seq in dict.fromkeys(touched):
            if seq.done:
                continue
            if seq.index < 0:
                self._advance_parent(seq)
            else:
                outputs.append(self._output(seq))
        return outputs

    def _fail_grammars(self) -> list[EngineCoreOutput]:
        """Abort the requests whose grammar failed to compile in the core (finished with "abort")."""
        if not self.structured.grammar_failed():
            return []
        outputs = []
        for record in list(self.requests.values()):
            error = next((s.grammar.error for s in record.seqs if s.grammar is not None and s.grammar.error), None)
            if error is None:
                continue
            logger.warning(f"request {record.request_id!r}: its grammar failed to compile, so it is aborted: {error}")
            outputs += self._abort_reported(record)
        return outputs

    def _abort_reported(self, record: CoreRequest) -> list[EngineCoreOutput]:
        """Abort ``record``; an output finishing each of its live sequences with "abort"."""
        outputs = [EngineCoreOutput(record.request_id, seq.index, [], finish_reason="abort")
                   for seq in record.seqs if not seq.done]
        self.abort_requests([record.request_id])
        return outputs

    def _copy_blocks(self, copies: Sequence[BlockCopy]) -> list[list]:
        """Do ``copies`` (a ``SchedulerOutput.block_copies``) on every runner's cache in one call
        (``CacheEngines.apply``), timing the tier's; returns the offloads' host writes for :meth:`_write_offloads`
        once the step is dispatched (no load of the step reads a slot it writes)."""
        pending, offload_seconds, load_seconds = self.cache_engines.apply(copies)
        self.offload_seconds[0] += offload_seconds
        self.offload_seconds[1] += load_seconds
        return pending

    def _write_offloads(self, pending: list[list]) -> None:
        """Complete the offloads :meth:`_copy_blocks` gathered (hits from the next schedule)."""
        if not any(pending):
            return
        start = time.perf_counter()
        self.cache_engines.finish_swap_out(pending)
        seconds = time.perf_counter() - start
        self.offload_seconds[0] += seconds
        self.offload_write_seconds += seconds

    def _launch(self, sched_out: SchedulerOutput, prev_tokens: Optional[jax.Array]) -> _Launched:
        """Do the output's block copies, dispatch its step, then write the host tier's offloads while it runs;
        a failed launch sends its rows back to waiting."""
        try:
            offloads = self._copy_blocks(sched_out.block_copies)
            if not sched_out.requests:
                self._write_offloads(offloads)
                return _Launched(sched_out, None)
            batch = build_batch(sched_out, self._serving_buckets())
            targets = (prompt_targets(sched_out.scheduled, batch.input_ids.shape[0]) if self._num_prompt_trackers
                       else None)
            num_rows = batch.seq_lens.shape[0]
            arrays = self.slots.arrays(sched_out, num_rows, self.runner.num_positions)
            lora_slots = (None if self.lora is None else
                          self.lora.row_slots([r.lora_int_id for r in batch.requests], num_rows))
            out, next_prev, inputs = self.runner.dispatch(batch, arrays, prev_tokens, targets,
                                                          self.structured.bitmask(sched_out, num_rows), lora_slots)
            if self.drafter is not None:
                out = dataclasses.replace(out, draft_token_ids=self.drafter.propose_async(batch, inputs, out.sampled))
            self._write_offloads(offloads)
        except Exception:
            self.scheduler.discard_output(sched_out)
            raise
        return _Launched(sched_out, _Dispatched(out, next_prev, 0 if targets is None else batch.num_tokens,
                                                bool((arrays.num_logprobs >= 0).any())))

    def _serving_buckets(self) -> BucketTable:
        """The buckets a step may use now: during a background warm-up, those whose programs every runner has."""
        buckets = self.runner.programs.serving_buckets()
        if self.drafter is not None:
            ready = set(self.drafter.programs.serving_buckets().token_buckets) & set(buckets.token_buckets)
            buckets = buckets.restricted(tuple(sorted(ready)))
        return buckets

    def _apply(self, step: _Launched) -> list[Request]:
        """Read a launched step's samples into the scheduler and the logprob records; returns the requests it touched."""
        d = step.dispatched
        out = None if d is None else d.out.fetch_rows(len(step.sched_out.requests), d.num_token_rows, d.logprobs)
        sampled = None if out is None else out.sampled
        tokens = np.zeros(0, np.int32) if sampled is None else sampled.token_ids
        if sampled is not None and sampled.num_emitted is not None:
            touched = self.scheduler.update_from_output(step.sched_out, tokens, sampled.num_emitted)
            self._count_accepted(step.sched_out, sampled.num_emitted)
            self._propose(step.sched_out, out)
        else:
            touched = self.scheduler.update_from_output(step.sched_out, tokens)
        self._end_grammars(self.structured.advance(touched))
        if sampled is not None:
            if d.logprobs:
                self._record_logprobs(step.sched_out, sampled)
            if d.num_token_rows:
                self._num_prompt_trackers -= record_prompt_logprobs(step.sched_out.scheduled, out.prompt)
        return touched

    def _end_grammars(self, sequences: list[CoreSequence]) -> None:
        """Stop the sequences whose grammar ended at their last token (EOS) while ``min_tokens`` or
        ``ignore_eos`` kept them going (vLLM #54218)."""
        for seq in sequences:
            token = seq.output_token_ids[-1]
            if token in seq.sampling_params.stop_token_ids:
                seq.stop_reason = token
            self.scheduler.finish_requests(seq.request_id, RequestStatus.FINISHED_STOPPED)

    def _count_accepted(self, sched_out: SchedulerOutput, num_emitted: np.ndarray) -> None:
        """Add a step's verified and accepted drafts to the speculative decoding counters."""
        drafted = sched_out.num_spec_tokens.nonzero()[0]
        if not len(drafted):
            return
        accepted = num_emitted[drafted] - 1
        self._spec_counts[0] += len(drafted)
        self._spec_counts[1] += int(sched_out.num_spec_tokens.sum())
        self._spec_counts[2] += int(accepted.sum())
        for position in range(int(accepted.max())):
            self._spec_per_position[position] += int((accepted > position).sum())

    def _propose(self, sched_out: SchedulerOutput, out: StepOutput) -> None:
        """Drafts for every running sequence that sampled this step, structured-output ones excepted."""
        drafts = {}
        for i, row in enumerate(sched_out.scheduled):
            req = row.request
            if (row.samples and req.status == RequestStatus.RUNNING and not req.prefill_only
                    and not self.structured.constrains(req)):
                drafts[req.request_id] = (out.draft_token_ids[i].tolist() if self.drafter is not None
                                          else self.proposer.propose(req.all_token_ids))
        self.scheduler.update_draft_token_ids(drafts)

    def _advance_parent(self, parent: CoreSequence) -> None:
        """Fork a prefill parent into its sequences once it has sampled (or hand them over as plain
        requests if it finished otherwise)."""
        parent.record.parent = None
        self._release(parent)
        children = parent.record.seqs
        if parent.is_finished:
            for child in children:
                self.scheduler.add_request(child)
            return
        pairs = self.scheduler.fork_request(parent.request_id, children)
        # The children's fresh blocks may have been hashed ones, offloaded to the host tier before they are written.
        copies = self.scheduler.kv_cache_manager.take_block_copies() + copies_of(CopyKind.COPY, pairs)
        self._write_offloads(self._copy_blocks(copies))

    def _record_logprobs(self, sched_out: SchedulerOutput, sampled: SamplerOutput) -> None:
        """Keep each used sample's logprobs (the chosen token, then the top ``logprobs``) until reported."""
        for i, row in enumerate(sched_out.scheduled):
            seq = row.request
            if seq.done or not row.samples or seq.logprobs is None or seq.num_logprobs >= seq.num_output_tokens:
                continue
            k = seq.sampling_params.logprobs
            if sampled.num_emitted is not None:
                # Speculative rows: one entry per token the scheduler kept.
                new = min(seq.num_output_tokens - seq.num_logprobs, int(sampled.num_emitted[i]))
                positions = [(i, j) for j in range(new)]
            else:
                positions = [i]
            for p in positions:
                seq.logprobs.append(SampleLogprobs(int(sampled.token_ids[p]), float(sampled.logprobs[p]),
                                                   int(sampled.ranks[p]), sampled.top_ids[p][:k].tolist(),
                                                   sampled.top_logprobs[p][:k].tolist()))
            seq.num_logprobs += len(positions)

    def _output(self, seq: CoreSequence) -> EngineCoreOutput:
        """What is new of a touched sequence; a finished one is forgotten."""
        record = seq.record
        new_ids = seq.output_token_ids[seq.num_reported:]
        seq.num_reported += len(new_ids)
        out = EngineCoreOutput(record.request_id, seq.index, new_ids, num_cached_tokens=record.num_cached_tokens or 0,
                               first_scheduled_time=seq.first_scheduled_time)
        if seq.logprobs:
            out.new_logprobs, seq.logprobs = seq.logprobs, []
        tracker = record.prompt_logprobs
        if tracker is not None and len(tracker.rows) > record.num_prompt_logprobs_reported:
            out.new_prompt_logprobs = tracker.rows[record.num_prompt_logprobs_reported:]
            record.num_prompt_logprobs_reported = len(tracker.rows)
        if seq.is_finished:
            out.finish_reason, out.stop_reason, out.ignored_reason = seq.finish_reason, seq.stop_reason, seq.ignored_reason
            self._finish(seq)
        return out

    def _finish(self, seq: CoreSequence) -> None:
        """A sequence reported finished; its request is forgotten with its last sequence."""
        self._release(seq)
        record = seq.record
        record.num_live -= 1
        if record.num_live == 0:
            self._forget(record)

    def _forget(self, record: CoreRequest) -> None:
        """Drop a request whose sequences are all released: one pop of the index."""
        del self.requests[record.request_id]
        if record.num_cached_tokens is None:
            self._num_unscheduled -= 1
        record.forget()
        if self.lora is not None and self.lora.retiring:
            self.lora.drop_retired(self._loras_in_use())

    def _release(self, seq: CoreSequence) -> None:
        """Nothing more is recorded or reported of ``seq``: its sampling slot and grammar go."""
        seq.done = True
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs = None
            self._num_prompt_trackers -= 1
        self.slots.forget(seq)
        self.structured.remove(seq)

    def stats(self, schedule_seconds: Optional[float] = None, num_scheduled_tokens: Optional[int] = None,
              grammar_bitmask_seconds: Optional[float] = None) -> CoreStats:
        """The core's ``CoreStats`` now (``schedule_seconds``, ``num_scheduled_tokens`` and
        ``grammar_bitmask_seconds`` of the step just run)."""
        s = self.scheduler.stats
        live, allocated = self._kv_slots()
        return CoreStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
            num_free_blocks=s.num_free_blocks, num_blocks=s.num_blocks, kv_live_slots=live,
            kv_allocated_slots=allocated, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions,
            compilations=sum(r.compile_stats.num_compilations for r in self._runners),
            num_preempted_waiting=s.num_preempted_waiting, max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            prompt_len_cv=self._prompt_len_cv(), schedule_seconds=schedule_seconds,
            num_scheduled_tokens=num_scheduled_tokens, num_waiting_for_grammar=s.num_waiting_for_fsm,
            grammar_bitmask_seconds=grammar_bitmask_seconds, spec_num_drafts=self._spec_counts[0],
            spec_num_draft_tokens=self._spec_counts[1], spec_num_accepted_tokens=self._spec_counts[2],
            spec_accepted_per_position=list(self._spec_per_position), prefix_cache_hits_host=s.prefix_cache_hits_host,
            kv_offload_bytes_to_host=s.num_blocks_offloaded * self._offload_block_bytes,
            kv_offload_bytes_to_device=s.num_blocks_loaded * self._offload_block_bytes,
            kv_offload_seconds_to_host=self.offload_seconds[0], kv_offload_seconds_to_device=self.offload_seconds[1],
            num_offload_blocks=s.num_offload_blocks, num_offload_cached_blocks=s.num_offload_cached_blocks,
            num_predicted_finished=s.num_predicted_finished, predicted_output_tokens=s.predicted_output_tokens,
            actual_output_tokens=s.actual_output_tokens, prediction_abs_error_tokens=s.prediction_abs_error_tokens,
            num_pool_blocks=s.num_pool_blocks, num_pool_in_use=s.num_pool_in_use,
            num_blocks_pooled=s.num_blocks_pooled,
        )

    def _prompt_len_cv(self) -> float:
        """Coefficient of variation of the running requests' prompt lengths (0 with fewer than two)."""
        running = self.scheduler.running
        if len(running) < 2:
            return 0.0
        lengths = np.fromiter((r.num_prompt_tokens for r in running), np.float64, len(running))
        return float(lengths.std() / lengths.mean())

    def _kv_slots(self) -> tuple[int, int]:
        """(slots holding a computed token, allocated slots) over the referenced device blocks."""
        sched = self.scheduler
        bs = sched.config.block_size
        pool = sched.block_pool
        allocated = (pool.num_blocks - 1 - pool.num_free_blocks) * bs
        tables = sched.kv_cache_manager.req_to_block_ids
        unused = sum(max(len(tables.get(r.request_id, ())) * bs - r.num_computed_tokens, 0) for r in sched.running)
        return allocated - unused, allocated
