"""EngineCore: the scheduler and the model runner in one loop; core requests in, core outputs out (vLLM's ``EngineCore``).

The core sees token ids only: the front end (``jaxllm.frontend.llm_engine.LLMEngine``, ``jaxllm.frontend.async_llm.AsyncLLM``) tokenizes,
validates, detokenizes and checks stop strings. Scheduler and runner share this process, so block ids mean the
same on both sides. Each ``step()`` schedules, builds the bucketed batch, runs the jitted model step, feeds the
sampled tokens back to the scheduler and reports, per sequence, its new token ids, finish and logprobs
(``jaxllm.core.messages``).

A request with ``n > 1`` runs as ``n`` sequences (vLLM's parent/child requests): a prefill-only parent computes all
prompt tokens but the last, then the scheduler forks it into the ``n`` sequences, which share its KV blocks; each
computes the last prompt token itself (a one-token step) and samples with its own seed.

Prompt logprobs (``jaxllm.core.prompt_logprobs``) are computed by the request that computes the prompt: the sequence
itself, or the prefill parent.

Speculative decoding (``EngineConfig.speculative_config``): after each step the proposer drafts tokens for every
sequence that sampled, the scheduler puts them on its next decode row, and the step's sampler verifies them
(``jaxllm.spec_decode``); a row then reports up to ``1 + num_speculative_tokens`` tokens.
Speculation skips structured-output requests: a constrained sequence gets no drafts (its grammar's bitmask
applies to its one sampled token per step).

Structured output (``jaxllm.structured_output``): a constrained request's grammar compiles in a thread pool while
the request waits in the scheduler (``WAITING_FOR_FSM``; a prefill parent waits too, so its forked sequences find
it ready); each sequence has its own matcher, which fills its row of the step's token bitmask and consumes its
sampled tokens. Under async scheduling the bitmask of step N+1 needs step N's token: a step that holds a
constrained row fed by the step in flight first applies that step (reads its samples, as without async), then
builds the bitmask and launches; steps without such rows keep the overlap.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import jax
import ml_dtypes
import numpy as np

from scheduler.static_batching import StaticBatchScheduler
from jaxllm.config import EngineConfig
from jaxllm.core.messages import CoreInfo, CoreStats, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SampleLogprobs
from jaxllm.paths import cache_dir
from jaxllm.worker.kv_cache import calibrate_kv_scales, calibration_ids, kv_number_dtype, resolve_num_blocks
from jaxllm.loader import load_sharded, read_model_config
from jaxllm.core.prompt_logprobs import PromptLogprobs, prompt_targets, record_prompt_logprobs
from jaxllm.worker.quantization import param_bytes, weight_quantization
from jaxllm.worker.model_runner import ModelRunner, StepOutput, enable_persistent_compilation_cache
from jaxllm.sample.sampler import MAX_BANNED_IDS, SamplerOutput
from jaxllm.sample.slots import SamplingSlots, make_sequence_sampling
from jaxllm.worker.sharding import make_mesh
from jaxllm.spec_decode import NgramProposer
from jaxllm.spec_decode.draft import DraftRunner
from jaxllm.structured_output import StructuredOutputManager
from jaxllm.tokenizer import load_tokenizer
from kernels_pallas import default_attention_backend, get_attention_ops
from scheduler import (
    BucketTable,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    build_batch,
    kv_cache_report,
)

_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def resolve_dtype(name: str) -> Any:
    """"auto" is float32 on CPU (fast there, and exact against HF) and
    bfloat16 on accelerators; other names map directly."""
    if name == "auto":
        return np.float32 if jax.default_backend() == "cpu" else ml_dtypes.bfloat16
    return _DTYPES[name]


@dataclasses.dataclass
class _Sequence:
    """One sequence of a request, and what of it the core has not reported yet."""

    request: Request
    index: int
    num_reported: int = 0
    logprobs: Optional[list[SampleLogprobs]] = None  # unreported; None when not asked for
    num_logprobs: int = 0


@dataclasses.dataclass
class _Group:
    """One request: its ``n`` sequences and, until it forks, their prefill parent."""

    request_id: str
    seqs: list[_Sequence]
    num_live: int
    parent: Optional[Request] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    num_prompt_logprobs_reported: int = 0
    num_cached_tokens: int = 0


@dataclasses.dataclass
class _Dispatched:
    """A step on the device: its outputs, its samples padded for the next step's input, and how many token rows
    carry prompt logprobs (0: none to fetch)."""

    out: StepOutput
    next_prev: jax.Array
    num_token_rows: int


@dataclasses.dataclass
class _Launched:
    """A scheduled step and its dispatch (None when it had no rows, only block copies)."""

    sched_out: SchedulerOutput
    dispatched: Optional[_Dispatched]


class EngineCore:
    """The scheduler, the model runner and the per-request sampling state of one data-parallel replica.

    Args:
      model: a HF model folder, a ``.gguf`` file, or a jaxllm orbax folder.
      config: the ``EngineConfig`` (``data_parallel_size`` must be 1: one core is one replica).
      mesh: this replica's ``(data, model)`` mesh; by default
        ``make_mesh(tensor_parallel_size)`` over the first devices.
      core_index: this core's data-parallel rank (reported with its outputs).

    Attributes:
      scheduler, runner, buckets, num_blocks, model_config, max_model_len, hf_config, sharding, dtype,
      structured (the ``StructuredOutputManager``; it loads the model's tokenizer at the first constraint).
      kv_cache_dtype: numpy dtype of the KV cache's numbers (int8 or float8_e4m3fn when quantized; the
        config's ``kv_cache_dtype``).
      param_bytes: ``jaxllm.worker.quantization.param_bytes`` of the parameters on the devices (printed at start-up
        with the KV block count).

    Raises:
      ValueError: a bad model path, an unsupported architecture, a config value out of range (named with its
        limit), heads that do not split over ``tensor_parallel_size``, or ``data_parallel_size > 1``.
    """

    # Methods a front end may call between steps of a core in another process (``messages.UtilityCall``).
    UTILITY_METHODS = frozenset({"cached_prefix_tokens", "wait_for_warmup", "num_free_blocks", "kv_cache_report",
                                 "preload_prefixes"})

    def __init__(self, model: Union[str, os.PathLike], config: EngineConfig, *,
                 mesh: Optional[jax.sharding.Mesh] = None, core_index: int = 0):
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: an EngineCore is one replica; "
                             "LLM and the server run one core per replica")
        self.config = config
        self.core_index = core_index
        path = Path(model)
        # The config is checked before any weight is read.
        self.max_model_len = config.resolve_max_model_len(read_model_config(path)[0])
        self.dtype = resolve_dtype(config.dtype)
        mesh = mesh if mesh is not None else make_mesh(config.tensor_parallel_size)
        self.model_config, params, self.hf_config, self.sharding = load_sharded(
            path, self.dtype, mesh, quantization=config.quantization)
        cfg = self.model_config
        self.kv_cache_dtype = kv_number_dtype(config.kv_cache_dtype, self.dtype)
        self.num_blocks = resolve_num_blocks(
            self.sharding.per_device_config(), block_size=config.block_size, dtype=self.kv_cache_dtype,
            num_kv_blocks=config.num_kv_blocks, kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
            device=self.sharding.mesh.devices.flat[0],
        )
        backend = config.attention_backend or default_attention_backend()
        ops = self.sharding.attention_ops(get_attention_ops(backend, interpret=config.interpret))
        self.buckets = BucketTable(*config.bucket_ladders(self.max_model_len, backend))
        self.spec = config.speculative_config
        num_positions = 1 + self.spec.num_speculative_tokens if self.spec is not None else 1
        self.proposer = None
        if self.spec is not None and self.spec.method == "ngram":
            self.proposer = NgramProposer(self.spec.num_speculative_tokens, self.spec.prompt_lookup_min,
                                          self.spec.prompt_lookup_max)
        cache = config.compilation_cache
        enable_persistent_compilation_cache(str(cache_dir() / "xla") if cache == "default" else cache)
        if self.kv_cache_dtype != np.dtype(self.dtype):
            ids = calibration_ids(load_tokenizer(path), cfg.vocab_size)[: self.max_model_len]
            k_scale, v_scale = calibrate_kv_scales(cfg, params, ids, ops=ops, sharding=self.sharding,
                                                   kv_dtype=self.kv_cache_dtype)
            params = {**params, "layers": {**params["layers"], "k_scale": k_scale, "v_scale": v_scale}}
        self.runner = ModelRunner(
            cfg, params, num_blocks=self.num_blocks, block_size=config.block_size, dtype=self.dtype,
            ops=ops, buckets=self.buckets, sharding=self.sharding, num_host_blocks=config.num_host_blocks,
            num_sampling_slots=config.max_num_seqs + 1, max_model_len=self.max_model_len,
            float_bits_storage=backend != "pallas" and self.sharding.mesh.devices.flat[0].platform == "cpu",
            kv_cache_dtype=self.kv_cache_dtype, num_positions=num_positions,
        )
        self.param_bytes = param_bytes(self.runner.params)
        self.drafter = None
        if self.spec is not None and self.spec.method == "draft_model":
            self.drafter = self._load_drafter(backend, num_positions)
        self._runners = [self.runner] + ([self.drafter] if self.drafter is not None else [])
        self.slots = SamplingSlots(config.max_num_seqs + 1, cfg.vocab_size, self.runner)
        self.structured = StructuredOutputManager(lambda: load_tokenizer(path), cfg.vocab_size, cfg.eos_token_ids)
        scheduler_cls = StaticBatchScheduler if config.batching == "static" else Scheduler
        self.scheduler = scheduler_cls(self._scheduler_config())
        b = self.buckets
        pb = self.param_bytes
        quantized = (f" ({pb['quantized'] / 2**20:.1f} MiB of {weight_quantization(params)} weights and scales, "
                     f"{pb['quantized_as_float32'] / 2**20:.1f} MiB as float32)" if pb["quantized"] else "")
        _log(f"parameters: {pb['total'] / 2**20:.1f} MiB{quantized}")
        _log(f"{len(b)} step programs (tokens {list(b.token_buckets)}, rows {[b.seq_bucket_for(t) for t in b.token_buckets]}, "
             f"block-table widths {list(b.width_buckets)}); {self.num_blocks} KV blocks of {config.block_size} "
             f"tokens ({self.kv_cache_dtype.name}); attention {backend}; tensor parallel {self.sharding.tensor_parallel_size}")
        if config.precompile:
            background = config.precompile == "background"
            for r in self._runners:
                seconds = r.warmup(swap=config.preemption_mode == "swap", background=background)
                pending = r.num_pending_programs()
                _log(f"built {r.num_compilations} {'draft model ' if r is self.drafter else ''}programs in "
                     f"{seconds:.1f} s: {r.num_compilations - r.num_cache_hits} compiled ({r.compile_seconds:.1f} s), "
                     f"{r.num_cache_hits} loaded from the persistent cache ({r.cache_load_seconds:.1f} s)"
                     + (f"; {pending} more building in the background" if pending else ""))
        else:
            _log("step programs are built on first use (precompile=False)")
        self._groups: dict[str, _Group] = {}
        # Sequence request id -> (its group, the sequence), while it runs.
        self._seqs: dict[str, tuple[_Group, _Sequence]] = {}
        # Prefill parent request id -> its group, until it forks.
        self._parents: dict[str, _Group] = {}
        # With async scheduling: the launched step whose samples are not read yet.
        self._in_flight: Optional[_Launched] = None
        # Request id (a sequence or a prefill parent) -> its group's prompt
        # logprobs, while some prompt position is not recorded yet.
        self._prompt_lp: dict[str, PromptLogprobs] = {}
        # Id of the request that computes a group's prompt -> the group, until
        # it is first scheduled (its prefix-cache hits are then known).
        self._unscheduled: dict[str, _Group] = {}
        # Speculative decoding counters: rows that verified drafts, drafts, accepted drafts (and by position).
        self._spec_counts = [0, 0, 0]
        self._spec_per_position = [0] * (num_positions - 1)

    def _load_drafter(self, backend: str, num_positions: int) -> DraftRunner:
        """The draft model's runner: its own weights and KV cache (the target's block count and size), on this mesh.

        Raises:
          ValueError: a bad draft model path, or a draft model whose vocabulary differs from the target's or whose
            positions do not reach ``max_model_len``.
        """
        spec, config = self.spec, self.config
        cfg, params, _, sharding = load_sharded(Path(spec.model), self.dtype, self.sharding.mesh)
        if cfg.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"speculative_config model={spec.model!r} has vocab_size={cfg.vocab_size}; the target "
                             f"has {self.model_config.vocab_size}, and drafts must be the target's token ids")
        if cfg.max_position_embeddings < self.max_model_len:
            raise ValueError(f"speculative_config model={spec.model!r} has max_position_embeddings="
                             f"{cfg.max_position_embeddings}, below max_model_len={self.max_model_len}")
        ops = sharding.attention_ops(get_attention_ops(backend, interpret=config.interpret))
        return DraftRunner(
            cfg, params, num_speculative_tokens=spec.num_speculative_tokens, num_blocks=self.num_blocks,
            block_size=config.block_size, dtype=self.dtype, ops=ops, buckets=self.buckets, sharding=sharding,
            num_host_blocks=config.num_host_blocks, max_model_len=self.max_model_len,
            float_bits_storage=self.runner.float_bits_storage, num_positions=num_positions,
        )

    def _scheduler_config(self) -> SchedulerConfig:
        c = self.config
        return SchedulerConfig(
            block_size=c.block_size, num_blocks=self.num_blocks, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_prefix_caching=c.enable_prefix_caching, enable_chunked_prefill=c.enable_chunked_prefill,
            long_prefill_token_threshold=c.long_prefill_token_threshold, scheduling_policy=c.scheduling_policy,
            preemption_mode=c.preemption_mode, num_host_blocks=c.num_host_blocks,
            async_scheduling=self.schedules_ahead, graceful_degradation=c.graceful_degradation,
            num_lookahead_tokens=(self.spec.num_speculative_tokens
                                  if self.spec is not None and self.spec.method == "draft_model" else 0),
        )

    @property
    def schedules_ahead(self) -> bool:
        """Whether steps overlap (``async_scheduling``): never while speculating, whose drafts need the last step's
        tokens."""
        return bool(self.config.async_scheduling) and self.spec is None

    def info(self) -> CoreInfo:
        """What a front end needs to know of this core."""
        return CoreInfo(
            vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
            eos_token_ids=list(self.model_config.eos_token_ids), num_blocks=self.num_blocks,
            block_size=self.config.block_size, max_num_seqs=self.config.max_num_seqs,
            async_scheduling=self.schedules_ahead, max_banned_ids=MAX_BANNED_IDS,
            enable_prefix_caching=self.config.enable_prefix_caching,
            device_ids=[d.id for d in self.sharding.mesh.devices.flat], core_index=self.core_index,
        )

    def wait_for_warmup(self, timeout: Optional[float] = None) -> bool:
        """Wait until every step program is built (see ``EngineConfig.precompile``).

        Returns:
          True once nothing is left to build; False if ``timeout`` seconds passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        return all([r.wait_for_warmup(None if deadline is None else max(0.0, deadline - time.monotonic()))
                    for r in self._runners])

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: Optional[str] = None) -> int:
        """Prompt tokens this core would take from its prefix cache right now.

        Asks ``KVCacheManager.get_computed_blocks`` about a throwaway request,
        so the answer follows the scheduler's own rule (hash -> block map, the
        last token always computed); nothing is allocated.
        """
        probe = Request("prefix-probe", list(token_ids), SamplingParams(), cache_salt=cache_salt)
        return self.scheduler.kv_cache_manager.get_computed_blocks(probe)[1]

    def preload_prefixes(self, prompts: Sequence[Sequence[int]]) -> dict[str, int]:
        """Compute ``prompts`` (token ids, validated by the front end) into the prefix cache before serving, and
        pin their full blocks (``Scheduler.pin_prefix``; only with graceful degradation, which releases them under
        KV pressure). Each runs as a one-token greedy request; their prefix-cache lookups are not counted in
        ``prefix_cache_queries``/``prefix_cache_hits`` (warm-up is not traffic).

        Returns:
          ``{"num_prompts", "num_cached_tokens" (prompt tokens now in full cached blocks), "num_pinned_blocks"}``.

        Raises:
          RuntimeError: requests are already queued or running (warm up before serving).
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
        _log(f"preloaded {len(prompts)} prompts into the prefix cache: {cached} tokens in full blocks, "
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
        params = request.sampling_params
        ids = request.prompt_token_ids
        n = params.n
        grammar = None if params.structured_outputs is None else self.structured.compile(params.structured_outputs)
        kwargs = dict(eos_token_id=request.eos_token_id, arrival_time=request.arrival_time,
                      priority=request.priority, cache_salt=request.cache_salt,
                      grammar_ready=None if grammar is None else self.structured.ready(grammar))
        seqs = []
        for i, seed in enumerate(request.seeds):
            seq_params = params
            if n > 1:
                seq_params = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            seq_id = request.request_id if n == 1 else f"{i}_{request.request_id}"
            seq = _Sequence(Request(seq_id, ids, seq_params, **kwargs), i,
                            logprobs=None if params.logprobs is None else [])
            seqs.append(seq)
            if grammar is not None:
                self.structured.add(seq.request, grammar)
            self.slots.register(seq_id, make_sequence_sampling(seq_params, seed, request.stop_ids,
                                                               self.model_config.vocab_size,
                                                               request.bad_words_token_ids))
        group = self._groups[request.request_id] = _Group(request.request_id, seqs, num_live=n)
        for seq in seqs:
            self._seqs[seq.request.request_id] = (group, seq)
        if n > 1 and len(ids) > 1:
            # Prefill-only: its one sample is never used, so it samples greedily.
            parent_params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
            group.parent = Request(f"prefill_{request.request_id}", ids[:-1], parent_params, **kwargs)
            group.parent.prefill_only = True
            self._parents[group.parent.request_id] = group
            prefill = group.parent
        else:
            prefill = seqs[0].request
        self._unscheduled[prefill.request_id] = group
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = PromptLogprobs(ids, params.prompt_logprobs)
            if not group.prompt_logprobs.complete:
                self._prompt_lp[prefill.request_id] = group.prompt_logprobs
                prefill.skip_reading_prefix_cache = True
        if group.parent is not None:
            self.scheduler.add_request(group.parent)
        else:
            for seq in seqs:
                self.scheduler.add_request(seq.request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort whole requests (unknown ids are ignored); their KV blocks return to the pool at once."""
        for rid in request_ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            if group.parent is not None:
                self.scheduler.abort_request(group.parent.request_id)
                self._forget(group.parent.request_id)
                self._parents.pop(group.parent.request_id, None)
            for seq in group.seqs:
                if not seq.request.is_finished:
                    self.scheduler.abort_request(seq.request.request_id)
                self._forget(seq.request.request_id)

    def abort_all(self) -> None:
        """Abort every request."""
        self.abort_requests(list(self._groups))

    def stop_sequences(self, sequences: Iterable[tuple[str, int]]) -> None:
        """Finish sequences the front end found a stop string in (``(request_id, index)``; unknown ones are
        ignored): their blocks are freed at once and nothing more is reported of them."""
        for rid, index in sequences:
            group = self._groups.get(rid)
            if group is None or index >= len(group.seqs):
                continue
            seq = group.seqs[index]
            if seq.request.request_id not in self._seqs:
                continue
            if not seq.request.is_finished:
                self.scheduler.finish_requests(seq.request.request_id, RequestStatus.FINISHED_STOPPED)
            self._finish(group, seq)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued, running, unreported, or a step is in flight."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> EngineCoreOutputs:
        """Run one scheduler + model step.

        With ``async_scheduling`` the step schedules and launches step N+1
        before it reads step N's samples, so the host's scheduling and batch
        building overlap the device's work; outputs then trail the launches
        by one step (the first call reports none).

        Returns:
          an output for every sequence that produced a token or finished in
          this step, and the core's stats after it.
        """
        outputs = self._fail_grammars()
        schedule_start = time.perf_counter()
        sched_out = self.scheduler.schedule()
        schedule_seconds = time.perf_counter() - schedule_start
        for request in sched_out.preempted:
            self.slots.release(request.request_id)
        if self._unscheduled:
            self._record_cached_tokens(sched_out)
        touched: list[Request] = list(sched_out.finished)
        prev = self._in_flight
        prev_tokens = None if prev is None else prev.dispatched.next_prev
        if prev is not None and (self.structured.needs_previous_samples(sched_out)
                                 or self.slots.needs_previous_samples(sched_out)):
            # A constrained row's bitmask, or the bans of a row's multi-token bad words, need the token the
            # step in flight samples for it.
            touched += self._apply(prev)
            prev = self._in_flight = None
        try:
            launched = _Launched(sched_out, self._launch(sched_out, prev_tokens))
        except Exception:
            # Its rows never ran: they go back to waiting, so the engine stays usable.
            self.scheduler.discard_output(sched_out)
            raise
        done = [prev] if prev is not None else []
        # Drafts need the previous step's tokens: with speculation every step is applied before the next.
        if self.schedules_ahead and launched.dispatched is not None:
            self._in_flight = launched
        else:
            # Nothing left on the device to overlap with: apply it now, in order.
            self._in_flight = None
            done.append(launched)
        for step in done:
            touched += self._apply(step)
        for request in dict.fromkeys(touched):
            owner = self._seqs.get(request.request_id)
            if owner is not None and owner[1].request is request:
                outputs.append(self._output(*owner))
            elif request.request_id in self._parents and self._parents[request.request_id].parent is request:
                self._advance_parent(request)
        bitmask_seconds = self.structured.bitmask_seconds if launched.dispatched is not None else None
        stats = self.stats(schedule_seconds, sched_out.total_num_scheduled_tokens, bitmask_seconds)
        stats.step_seconds = time.perf_counter() - schedule_start
        return EngineCoreOutputs(outputs, stats, self.core_index)

    def _fail_grammars(self) -> list[EngineCoreOutput]:
        """Abort the requests whose grammar failed to compile in the core (valid for the front end, not with
        the model's tokenizer): each sequence is reported finished with "abort"."""
        outputs = []
        for rid, error in self.structured.take_failed():
            owner = self._seqs.get(rid)
            if owner is None or owner[0].request_id not in self._groups:
                continue
            group = owner[0]
            _log(f"request {group.request_id!r}: its grammar failed to compile, so it is aborted: {error}")
            outputs += [EngineCoreOutput(group.request_id, seq.index, [], finish_reason="abort")
                        for seq in group.seqs if seq.request.request_id in self._seqs]
            self.abort_requests([group.request_id])
        return outputs

    def _launch(self, sched_out: SchedulerOutput, prev_tokens: Optional[jax.Array]) -> Optional[_Dispatched]:
        """Do the output's block copies and dispatch its step (None when it has no rows).

        The block copies run either way: a step may only swap a preempted request out.
        """
        for runner in self._runners:
            runner.swap_out(sched_out.blocks_to_swap_out)
            runner.swap_in(sched_out.blocks_to_swap_in)
            runner.copy_blocks(sched_out.blocks_to_copy)
        if not sched_out.scheduled:
            return None
        batch = build_batch(sched_out, self._serving_buckets())
        targets = prompt_targets(sched_out.scheduled, self._prompt_lp, batch.input_ids.shape[0])
        num_rows = batch.seq_lens.shape[0]
        arrays = self.slots.arrays(sched_out, num_rows, self.runner.num_positions)
        out, next_prev = self.runner.dispatch(batch, arrays, prev_tokens, targets,
                                              self.structured.bitmask(sched_out, num_rows))
        if self.drafter is not None:
            out = dataclasses.replace(out, draft_token_ids=self.drafter.propose_async(batch, out.sampled))
        return _Dispatched(out, next_prev, 0 if targets is None else batch.num_tokens)

    def _serving_buckets(self) -> BucketTable:
        """The buckets a step may use now: during a background warm-up, those whose programs every runner has."""
        buckets = self.runner.serving_buckets()
        if self.drafter is not None:
            ready = set(self.drafter.serving_buckets().token_buckets) & set(buckets.token_buckets)
            buckets = BucketTable(tuple(sorted(ready)), buckets.seq_buckets, buckets.width_buckets)
        return buckets

    def _apply(self, step: _Launched) -> list[Request]:
        """Read a launched step's samples into the scheduler and the logprob records; returns the requests it touched."""
        d = step.dispatched
        out = None if d is None else d.out.fetch_rows(len(step.sched_out.scheduled), d.num_token_rows)
        sampled = None if out is None else out.sampled
        tokens = np.zeros(0, np.int32) if sampled is None else sampled.token_ids
        if sampled is not None and sampled.num_emitted is not None:
            touched = self.scheduler.update_from_output(step.sched_out, tokens, sampled.num_emitted)
            self._count_accepted(step.sched_out, sampled.num_emitted)
            self._propose(step.sched_out, out)
        else:
            touched = self.scheduler.update_from_output(step.sched_out, tokens)
        self.structured.advance(touched)
        if sampled is not None:
            self._record_logprobs(step.sched_out, sampled)
            if d.num_token_rows:
                record_prompt_logprobs(step.sched_out.scheduled, self._prompt_lp, out.prompt)
        return touched

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
        """Drafts for every running sequence that sampled in this step (the others keep theirs): the draft model's
        from the step's outputs, or n-gram lookups. Structured-output sequences get none: their bitmask covers
        one sampled token per step."""
        drafts = {}
        for i, row in enumerate(sched_out.scheduled):
            req = row.request
            if (row.samples and req.status == RequestStatus.RUNNING and not req.prefill_only
                    and not self.structured.constrains(req)):
                drafts[req.request_id] = (out.draft_token_ids[i].tolist() if self.drafter is not None
                                          else self.proposer.propose(req.all_token_ids))
        self.scheduler.update_draft_token_ids(drafts)

    def _advance_parent(self, parent: Request) -> None:
        """Fork a prefill parent into its sequences once its prompt is computed (it has sampled once).

        A parent finished otherwise (ignored, or length-capped by a full
        cache) hands its sequences to the scheduler as plain requests.
        """
        group = self._parents.pop(parent.request_id)
        group.parent = None
        self._forget(parent.request_id)
        children = [seq.request for seq in group.seqs]
        if parent.is_finished:
            for child in children:
                self.scheduler.add_request(child)
            return
        copies = self.scheduler.fork_request(parent.request_id, children)
        for runner in self._runners:
            runner.copy_blocks(copies)

    def _record_cached_tokens(self, sched_out: SchedulerOutput) -> None:
        """A group whose prompt is scheduled for the first time: its prompt
        tokens read from the prefix cache are the row's computed tokens
        (vLLM's ``num_cached_tokens``)."""
        for row in sched_out.scheduled:
            group = self._unscheduled.pop(row.request.request_id, None)
            if group is not None:
                group.num_cached_tokens = row.num_computed_tokens

    def _record_logprobs(self, sched_out: SchedulerOutput, sampled: SamplerOutput) -> None:
        """Keep each used sample's logprobs (the chosen token, then the top ``logprobs``) until reported."""
        for i, row in enumerate(sched_out.scheduled):
            owner = self._seqs.get(row.request.request_id)
            if owner is None or not row.samples:
                continue
            seq = owner[1]
            # An aborted request's id may already name a new request.
            if (seq.request is not row.request or seq.logprobs is None
                    or seq.num_logprobs >= row.request.num_output_tokens):
                continue
            k = row.request.sampling_params.logprobs
            if sampled.num_emitted is not None:
                # Speculative rows: one entry per token the scheduler kept.
                new = min(row.request.num_output_tokens - seq.num_logprobs, int(sampled.num_emitted[i]))
                positions = [(i, j) for j in range(new)]
            else:
                positions = [i]
            for p in positions:
                seq.logprobs.append(SampleLogprobs(int(sampled.token_ids[p]), float(sampled.logprobs[p]),
                                                   int(sampled.ranks[p]), sampled.top_ids[p][:k].tolist(),
                                                   sampled.top_logprobs[p][:k].tolist()))
            seq.num_logprobs += len(positions)

    def _output(self, group: _Group, seq: _Sequence) -> EngineCoreOutput:
        """What is new of a touched sequence; a finished one is forgotten."""
        request = seq.request
        new_ids = request.output_token_ids[seq.num_reported:]
        seq.num_reported += len(new_ids)
        out = EngineCoreOutput(group.request_id, seq.index, new_ids, num_cached_tokens=group.num_cached_tokens,
                               first_scheduled_time=request.first_scheduled_time)
        if seq.logprobs:
            out.new_logprobs, seq.logprobs = seq.logprobs, []
        tracker = group.prompt_logprobs
        if tracker is not None and len(tracker.rows) > group.num_prompt_logprobs_reported:
            out.new_prompt_logprobs = tracker.rows[group.num_prompt_logprobs_reported:]
            group.num_prompt_logprobs_reported = len(tracker.rows)
        if request.is_finished:
            out.finish_reason = request.finish_reason
            out.stop_reason = request.stop_reason
            out.ignored_reason = request.ignored_reason
            self._finish(group, seq)
        return out

    def _finish(self, group: _Group, seq: _Sequence) -> None:
        self._forget(seq.request.request_id)
        group.num_live -= 1
        if group.num_live == 0:
            self._groups.pop(group.request_id, None)

    def _forget(self, request_id: str) -> None:
        """Drop a sequence's (or a parent's) per-request state."""
        self.slots.forget(request_id)
        self.structured.remove(request_id)
        self._seqs.pop(request_id, None)
        self._prompt_lp.pop(request_id, None)
        self._unscheduled.pop(request_id, None)

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
            compilations=sum(r.num_compilations for r in self._runners),
            num_preempted_waiting=s.num_preempted_waiting, max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            prompt_len_cv=self._prompt_len_cv(), schedule_seconds=schedule_seconds,
            num_scheduled_tokens=num_scheduled_tokens, num_waiting_for_grammar=s.num_waiting_for_fsm,
            grammar_bitmask_seconds=grammar_bitmask_seconds, spec_num_drafts=self._spec_counts[0],
            spec_num_draft_tokens=self._spec_counts[1], spec_num_accepted_tokens=self._spec_counts[2],
            spec_accepted_per_position=list(self._spec_per_position),
        )

    def _prompt_len_cv(self) -> float:
        """Coefficient of variation (population std / mean) of the running requests' prompt lengths, in tokens;
        0 with fewer than two running (the board's "request mix" signal: high when short and long prompts share
        the batch)."""
        running = self.scheduler.running
        if len(running) < 2:
            return 0.0
        lengths = np.fromiter((r.num_prompt_tokens for r in running), np.float64, len(running))
        return float(lengths.std() / lengths.mean())

    def _kv_slots(self) -> tuple[int, int]:
        """(slots holding a computed token, allocated slots) over the referenced device blocks.

        Only full, computed blocks are ever shared through the prefix cache,
        so every unused slot sits in exactly one running request's own tail
        blocks and the per-request sum counts each once.
        """
        sched = self.scheduler
        bs = sched.config.block_size
        pool = sched.block_pool
        allocated = (pool.num_blocks - 1 - pool.num_free_blocks) * bs
        tables = sched.kv_cache_manager.req_to_block_ids
        unused = sum(max(len(tables.get(r.request_id, ())) * bs - r.num_computed_tokens, 0) for r in sched.running)
        return allocated - unused, allocated


def _log(msg: str) -> None:
    """Start-up facts go to stderr so stdout carries only generated text."""
    print(f"[jaxllm] {msg}", file=sys.stderr, flush=True)
