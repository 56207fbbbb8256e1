"""LLMEngine (add_request / step / abort) and the offline ``LLM`` front door.

Shaped after vLLM: the engine owns one scheduler and one model runner in the
same process, so block ids mean the same on both sides. Each ``step()``
schedules, builds the bucketed batch, runs the jitted model step, feeds the
sampled tokens back to the scheduler, detokenizes and checks stop strings.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import jax
import ml_dtypes
import numpy as np

from jaxllm.batching import StaticBatchScheduler
from jaxllm.config import EngineConfig, ModelConfig
from jaxllm.kv_cache import resolve_num_blocks
from jaxllm.loader import load_model
from jaxllm.metrics import EngineMetrics, GenerateProgress
from jaxllm.models.llama import AttentionOps
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.runner import ModelRunner
from jaxllm.sampling import SamplingArrays
from jaxllm.tokenizer import IncrementalDetokenizer, Tokenizer
from kernels_pallas import get_attention_ops
from scheduler import (
    BucketTable,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
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


def _load_tokenizer(path: Path) -> Optional[Tokenizer]:
    if path.is_file():
        return Tokenizer.from_gguf(path)
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_pretrained(path)
    return None


@dataclasses.dataclass
class _Tracked:
    """Engine-side state of one request: detokenizer and stop strings."""

    request: Request
    prompt: Optional[str]
    seed: int
    detok: Optional[IncrementalDetokenizer]
    text: str = ""
    emitted_tokens: int = 0
    first_token_time: Optional[float] = None


class LLMEngine:
    """The serving engine: requests in, ``RequestOutput`` per step out.

    Args:
      model: a HF model folder or a ``.gguf`` file.
      tokenizer: a Tokenizer; by default read from the model.
      **kwargs: ``EngineConfig`` fields (block_size, num_kv_blocks,
        kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens,
        max_model_len, dtype, seed, scheduling_policy, preemption_mode,
        enable_prefix_caching, enable_chunked_prefill, attention_backend,
        batching, log_stats, metrics_port, ...).

    Attributes:
      metrics: the engine's ``EngineMetrics`` (Prometheus registry at
        ``metrics.registry``).

    Raises:
      ValueError: a bad model path, an unsupported architecture, or a config
        value out of range (named with its limit).
    """

    def __init__(self, model: Union[str, os.PathLike], tokenizer: Optional[Tokenizer] = None, **kwargs: Any):
        self.config = EngineConfig(**kwargs)
        path = Path(model)
        if not path.exists():
            raise ValueError(f"model path {str(path)!r} does not exist")
        self.dtype = resolve_dtype(self.config.dtype)
        self.model_config, params, self.hf_config = load_model(path, self.dtype)
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(path)
        cfg = self.model_config
        self.max_model_len = self.config.resolve_max_model_len(cfg)
        param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
        self.num_blocks = resolve_num_blocks(
            cfg, block_size=self.config.block_size, dtype=self.dtype, num_kv_blocks=self.config.num_kv_blocks,
            kv_cache_memory_bytes=self.config.kv_cache_memory_bytes, max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len, param_bytes=param_bytes,
        )
        backend = self.config.attention_backend or ("pallas" if jax.default_backend() == "gpu" else "reference")
        kernels = get_attention_ops(backend, interpret=self.config.interpret)
        ops = AttentionOps(kernels.ragged_paged_attention, kernels.kv_cache_write)
        self.runner = ModelRunner(
            cfg, params, num_blocks=self.num_blocks, block_size=self.config.block_size, dtype=self.dtype,
            ops=ops, num_host_blocks=self.config.num_host_blocks,
        )
        scheduler_cls = StaticBatchScheduler if self.config.batching == "static" else Scheduler
        self.scheduler = scheduler_cls(self._scheduler_config())
        self.metrics = EngineMetrics(
            self.scheduler, log_stats=self.config.log_stats, metrics_port=self.config.metrics_port
        )
        self.buckets = BucketTable.from_limits(
            self.config.max_num_batched_tokens, self.config.max_num_seqs, self.max_model_len, self.config.block_size
        )
        self._tracked: dict[str, _Tracked] = {}
        self._counter = itertools.count()
        self._seed_rng = np.random.default_rng(self.config.seed)

    def _scheduler_config(self) -> SchedulerConfig:
        c = self.config
        return SchedulerConfig(
            block_size=c.block_size, num_blocks=self.num_blocks, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_prefix_caching=c.enable_prefix_caching, enable_chunked_prefill=c.enable_chunked_prefill,
            long_prefill_token_threshold=c.long_prefill_token_threshold, scheduling_policy=c.scheduling_policy,
            preemption_mode=c.preemption_mode, num_host_blocks=c.num_host_blocks,
        )

    @property
    def eos_token_ids(self) -> list[int]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return list(self.tokenizer.eos_token_ids)
        return list(self.model_config.eos_token_ids)

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
        if request_id in self._tracked:
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
        request = Request(
            request_id, ids, params, eos_token_id=eos[0] if eos else None, arrival_time=arrival_time,
            priority=priority, cache_salt=cache_salt,
        )
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**32))
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
        self._tracked[request_id] = _Tracked(request, text, seed, detok)
        self.scheduler.add_request(request)

    def abort_request(self, request_id: Union[str, Iterable[str]]) -> None:
        """Abort requests; their KV blocks return to the pool at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.scheduler.abort_request(rid)
            self._tracked.pop(rid, None)
            self.metrics.forget(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one scheduler + model step.

        Returns:
          A RequestOutput for every request that produced a token or finished
          in this step (``delta_*`` hold what is new).
        """
        schedule_start = time.perf_counter()
        sched_out = self.scheduler.schedule()
        schedule_seconds = time.perf_counter() - schedule_start
        touched: list[Request] = list(sched_out.finished)
        tokens = np.zeros(0, np.int32)
        if sched_out.scheduled:
            self.runner.swap_out(sched_out.blocks_to_swap_out)
            self.runner.swap_in(sched_out.blocks_to_swap_in)
            batch = build_batch(sched_out, self.buckets)
            requests = [s.request for s in sched_out.scheduled]
            sampling = SamplingArrays.build(
                [r.sampling_params for r in requests],
                [self._tracked[r.request_id].seed for r in requests],
                [r.num_output_tokens for r in requests],
                batch.seq_lens.shape[0],
            )
            tokens = self.runner.execute(batch, sampling)
        touched += self.scheduler.update_from_output(sched_out, tokens)
        outputs = []
        seen = set()
        for request in touched:
            if request.request_id in seen or request.request_id not in self._tracked:
                continue
            seen.add(request.request_id)
            outputs.append(self._make_output(request))
        self.metrics.on_step(sched_out, outputs, schedule_seconds)
        return outputs

    def _make_output(self, request: Request) -> RequestOutput:
        tracked = self._tracked[request.request_id]
        new_ids = request.output_token_ids[tracked.emitted_tokens:]
        tracked.emitted_tokens = len(request.output_token_ids)
        if new_ids and tracked.first_token_time is None:
            tracked.first_token_time = time.monotonic()
        delta = ""
        if tracked.detok is not None:
            for tok in new_ids:
                delta += tracked.detok.step(tok)
            delta = self._apply_stop_strings(tracked, delta)
        finished = request.is_finished
        completion = CompletionOutput(
            index=0, text=tracked.text, token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
        )
        out = RequestOutput(
            request_id=request.request_id, prompt=tracked.prompt, prompt_token_ids=list(request.prompt_token_ids),
            outputs=[completion], finished=finished, delta_text=delta, delta_token_ids=new_ids,
            ignored_reason=request.ignored_reason,
            metrics=dict(arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
                         first_token_time=tracked.first_token_time,
                         finished_time=time.monotonic() if finished else None),
        )
        if finished:
            del self._tracked[request.request_id]
        return out

    def _apply_stop_strings(self, tracked: _Tracked, delta: str) -> str:
        """Append ``delta`` to the text; on a stop string, cut and finish.

        Returns the part of ``delta`` that stays in the output. Only text past
        ``min_tokens`` generated tokens is searched; the search window starts
        ``len(longest stop) - 1`` characters back so a stop string split
        across tokens is found.
        """
        request = tracked.request
        params = request.sampling_params
        before = len(tracked.text)
        tracked.text += delta
        if not params.stop or request.num_output_tokens < params.min_tokens:
            return delta
        longest = max(len(s) for s in params.stop)
        start = max(before - longest + 1, 0)
        hits = [(tracked.text.find(s, start), s) for s in params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return delta
        idx, stop = min(hits)
        cut = idx + len(stop) if params.include_stop_str_in_output else idx
        tracked.text = tracked.text[:cut]
        if not request.is_finished:
            self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED)
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = stop
        return tracked.text[before:]


class LLM:
    """Offline batched generation, as vLLM's ``LLM``.

    Example::

        from jaxllm import LLM, SamplingParams
        llm = LLM(model="path/to/hf_folder_or.gguf")
        outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
        print(outs[0].outputs[0].text)

    Args:
      model: HF folder or ``.gguf`` file; None loads the embedded default
        (SmolLM2-135M-Instruct, fetched once into the jaxllm cache).
      **kwargs: ``EngineConfig`` fields (see ``LLMEngine``).
    """

    def __init__(self, model: Optional[Union[str, os.PathLike]] = None, **kwargs: Any):
        if model is None:
            from jaxllm.default_model import default_model_path

            model = default_model_path()
        self.engine = LLMEngine(model, **kwargs)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
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
        final: dict[str, RequestOutput] = {}
        with GenerateProgress(len(ids), enabled=use_tqdm) as progress:
            while len(final) < len(ids):
                outputs = self.engine.step()
                progress.update(outputs)
                for out in outputs:
                    if out.finished:
                        final[out.request_id] = out
        return [final[rid] for rid in ids]

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

