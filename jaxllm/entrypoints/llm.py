"""``LLM``: offline batched generation over an ``LLMEngine`` (vLLM's ``vllm.LLM``)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import threading
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from jaxllm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, check_beam_width
from jaxllm.frontend.llm_engine import LLMEngine
from jaxllm.frontend.input_processor import PromptType, add_special_tokens
from jaxllm.frontend.metrics import GenerateProgress
from jaxllm.logger import init_logger
from jaxllm.lora import LoRARequest
from jaxllm.models.config import ModelConfig
from jaxllm.outputs import RequestOutput
from jaxllm.tokenizer import Tokenizer
from scheduler import RequestOutputKind, SamplingParams

logger = init_logger(__name__)

# One prefix-cache salt for every prompt, or one per prompt (None: unsalted).
CacheSalt = Union[str, Sequence[Optional[str]], None]
# One LoRA adapter for every prompt, or one per prompt (None: the base model).
LoRAArg = Union[LoRARequest, Sequence[Optional[LoRARequest]], None]
# One priority for every prompt, or one per prompt (None: 0).
Priority = Union[int, Sequence[int], None]


def _per_prompt(name: str, value: Any, n: int, kinds: tuple[type, ...]) -> list[Any]:
    """``value`` for each of ``n`` prompts: one value of ``kinds`` for all, or a sequence of one per prompt.
    Raises ValueError: a sequence of another length."""
    values = [value] * n if isinstance(value, kinds) else list(value)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
    return values


class _Caller:
    """One :meth:`SharedSteps.outputs` consumer: the outputs handed to it and not yet taken, and the condition its
    thread waits on (so a step wakes the callers it has outputs for, not every waiting thread)."""

    def __init__(self, lock: threading.RLock) -> None:
        self.inbox: collections.deque = collections.deque()
        self.wake = threading.Condition(lock)


class SharedSteps:
    """Several threads driving one ``LLMEngine``: their requests run in the same engine steps.

    Every engine call (adding, aborting, weights, sleep) runs between two steps, one thread at a time; a caller
    waiting for its outputs runs the next step itself when none is running and no thread waits to call the engine
    (so requests added meanwhile join that step). A step hands each output to the caller whose request it is and
    wakes only those callers, plus one idle caller to run the next step when the stepping thread leaves with
    outputs of its own. vLLM's ``LLM`` is single-threaded; this is what lets a multi-threaded rollout (tunix's
    agentic learner) call ``generate`` from many threads with the throughput of one batched call.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._lock = threading.RLock()  # an abandoned stream finalized on a thread holding it closes there
        self._free = threading.Condition(self._lock)  # notified when no step runs
        self._stepping = False
        self._num_waiting = 0  # threads waiting to call the engine: served before the next step starts
        self._callers: dict[str, _Caller] = {}  # request id -> its consumer
        self._idle: list[_Caller] = []  # consumers with nothing to take, waiting for a step to end

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[LLMEngine]:
        """Hold the engine between two steps: no step runs, and no other thread calls it, inside the block."""
        with self._lock:
            self._num_waiting += 1
            try:
                while self._stepping:
                    self._free.wait()
            finally:
                self._num_waiting -= 1
            try:
                yield self._engine
            finally:
                self._free.notify_all()
                self._wake_one_idle()

    def caller(self) -> _Caller:
        """A new consumer, for :meth:`add` calls whose requests one :meth:`outputs` call reads together."""
        return _Caller(self._lock)

    def add(self, ids: Sequence[str], add: Callable[[], None], caller: Optional[_Caller] = None) -> None:
        """Run ``add()`` (which queues the requests ``ids`` into the engine) between two steps, the outputs of
        ``ids`` kept for :meth:`outputs` (in ``caller``'s inbox; None: a new one). Raises what ``add`` raises,
        nothing kept then."""
        caller = caller if caller is not None else self.caller()
        with self.between_steps():
            add()
            self._callers.update((rid, caller) for rid in ids)

    def outputs(self, ids: Sequence[str]) -> Iterator[RequestOutput]:
        """Every output of requests ``ids`` (queued by :meth:`add`, all into one caller's inbox) in step order, until
        each has finished; a consumer that stops early aborts its unfinished ones. Raises what ``LLMEngine.step``
        raises."""
        pending = set(ids)
        caller = self._callers[ids[0]] if ids else _Caller(self._lock)
        try:
            while pending:
                for out in self._take_or_step(caller):
                    yield out
                    if out.finished:
                        pending.discard(out.request_id)
        finally:
            with self.between_steps() as engine:
                for rid in ids:
                    self._callers.pop(rid, None)
                engine.abort_request(list(pending))

    def _wake_one_idle(self) -> None:
        """Wake a consumer waiting with nothing to take, so it runs the next step (the lock is held)."""
        if not self._stepping and not self._num_waiting:
            for idle in self._idle:
                if not idle.inbox:
                    idle.wake.notify()
                    return

    def _take_or_step(self, caller: _Caller) -> list[RequestOutput]:
        """What ``caller``'s inbox holds, running engine steps here while it is empty and no other thread steps."""
        inbox = caller.inbox
        while True:
            with self._lock:
                while not inbox and (self._stepping or self._num_waiting):
                    self._idle.append(caller)
                    try:
                        caller.wake.wait()
                    finally:
                        self._idle.remove(caller)
                if inbox:
                    taken = list(inbox)
                    inbox.clear()
                    return taken
                self._stepping = True
            outs: list[RequestOutput] = []
            try:
                outs = self._engine.step()
            finally:
                with self._lock:
                    self._stepping = False
                    woken = set()
                    for out in outs:
                        owner = self._callers.get(out.request_id)
                        if owner is not None:
                            owner.inbox.append(out)
                            woken.add(owner)
                    for owner in woken:
                        owner.wake.notify()
                    if self._num_waiting:
                        self._free.notify_all()
                    elif inbox:
                        # This thread leaves with outputs (its consumer may be slow): an idle caller steps on.
                        self._wake_one_idle()


class LLM:
    """Offline batched generation, as vLLM's ``LLM``.

    Example::

        from jaxllm import LLM, SamplingParams
        llm = LLM(model="Qwen/Qwen3-0.6B")  # or a local folder or .gguf file
        outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
        print(outs[0].outputs[0].text)

    Args:
      model: HF folder, ``.gguf`` file, a named model (``jaxllm.named_models.NAMED_MODELS``) or a Hugging Face
        Hub id (``revision``, ``download_dir`` in ``kwargs``); None: SmolLM2-135M-Instruct. With ``params``,
        also a ``ModelConfig``.
      params: weights in memory to serve instead of the model's: a tree of numpy or JAX arrays in the layout of
        ``jaxllm.models.param_layout``; float leaves cast to ``dtype``, projections quantized with
        ``quantization``, leaves placed by the ``tensor_parallel_size`` rules.
      generation_config: where :meth:`get_default_sampling_params` comes from, as vLLM's: "auto" the model's
        ``generation_config.json``, "vllm" none (``SamplingParams()``), or a folder's.
      override_generation_config: ``generation_config.json`` keys over those (``{"temperature": 0.6}``).
      chat_template: the template :meth:`chat` renders with when a call gives none (a jinja2 file, or the
        template itself; vLLM's); None: the model's.
      **kwargs: ``EngineConfig`` fields, and vLLM's ``LLM`` keywords (``gpu_memory_utilization``,
        ``enforce_eager``, ``tokenizer``, ``served_model_name``, ...) as ``LLMEngine`` takes them;
        ``data_parallel_size > 1`` runs one core per replica.

    Attributes:
      engine: the ``LLMEngine``.
    """

    def __init__(self, model: Optional[Union[str, os.PathLike, ModelConfig]] = None, *, params: Optional[Any] = None,
                 generation_config: str = "auto", override_generation_config: Optional[dict] = None,
                 chat_template: Optional[str] = None, **kwargs: Any):
        from jaxllm.paths import sampling_defaults
        from jaxllm.tokenizer import compile_chat_template, read_chat_template

        # A bad value fails before the model loads.
        sampling_defaults(None, generation_config, override_generation_config)
        self._chat_template = read_chat_template(chat_template) if chat_template is not None else None
        if self._chat_template is not None:
            compile_chat_template(self._chat_template)
        self.engine = LLMEngine(model, params=params, **kwargs)
        self._defaults = sampling_defaults(self.engine.model_path, generation_config, override_generation_config)
        if self._defaults and generation_config != "vllm":
            logger.warning(f"prompts given no SamplingParams run with {self._defaults}, from "
                           f"{'the model' if generation_config == 'auto' else generation_config}'s "
                           "generation_config.json (as vLLM's LLM); generation_config='vllm' leaves them out")
        self._steps = SharedSteps(self.engine)
        self._ids = itertools.count()
        # Request ids enqueue() queued that wait_for_completion() has not run yet, their outputs kept in one inbox.
        self._enqueued: list[str] = []
        self._enqueue_caller = self._steps.caller()
        self._enqueue_lock = threading.Lock()

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt given no ``SamplingParams`` runs with (vLLM's): the generation config's values
        (``generation_config``, ``override_generation_config``) over ``SamplingParams()``'s."""
        return SamplingParams(**self._defaults)

    def _call(self, method: str, *args: Any) -> Any:
        """``self.engine.<method>(*args)`` between two steps (``SharedSteps.between_steps``)."""
        with self._steps.between_steps() as engine:
            return getattr(engine, method)(*args)

    def get_params(self) -> dict[str, Any]:
        """The weights the engine runs: a tree of device arrays with their shardings, in the layout of
        ``jaxllm.models.param_layout`` (host numpy copies when the cores run in other processes). Asleep, the
        weights live on the host and come back as read-only numpy: level 1's copy with any update since, or
        after level 2 what updates gave.

        Raises:
          RuntimeError: ``sleep(level=2)`` discarded the weights and no update gave them again.
        """
        return self._call("get_params")

    def update_weights(self, params: Any) -> dict[str, int]:
        """Replace the weights between two steps, with no new compilation (``EngineCore.update_weights``).

        Args:
          params: a tree (or ``{"layers/wq": array}`` paths) of numpy or JAX arrays: any subset of the leaves of
            :meth:`get_params`, each of its shape; float leaves are cast to the engine's dtype, float projections
            quantized when the engine is. After ``sleep(level=2)`` every leaf. Asleep, nothing goes to the devices:
            the leaves replace the weights held on the host (a device array is copied there) and
            :meth:`wake_up` places them, with no compilation.

        Returns:
          ``{"num_leaves", "num_bytes" (placed, or held on the host while asleep), "num_preempted" (requests
          recomputed with the new weights)}``.

        Raises:
          ValueError: the first leaf that is unknown, missing or of the wrong shape or dtype, named with the
            expected shape and dtype; the engine keeps its old weights.
        """
        return self._call("update_weights", params)

    def update_weights_from_path(self, path: Union[str, os.PathLike]) -> dict[str, int]:
        """:meth:`update_weights` with every weight of the checkpoint at ``path`` (a HF folder, GGUF or orbax).

        Raises:
          ValueError: ``path`` is not a model, or its weights do not fit (the first leaf named).
        """
        return self._call("update_weights_from_path", path)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter's PEFT folder into the engine now, before a request names it (vLLM's ``add_lora``);
        True. Raises ValueError: LoRA off, or the adapter refused (its rank, a target module, a taken id)."""
        return self._call("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's ``remove_lora``): requests running under it finish under it, then its
        weights go; False when the engine does not know it."""
        return self._call("remove_lora", lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters the engine knows, by ``lora_int_id`` (vLLM's ``list_loras``)."""
        return self._call("list_loras")

    def update_lora(self, name_or_id: Union[str, int], tree: Any) -> dict[str, Any]:
        """Replace a known adapter's A and B between two steps (for RL with a LoRA actor); no prefix-cache block
        computed under the old values is read again. numpy values compile nothing; JAX arrays are padded and
        scaled where they are (no host copy), by one program built at the first such update of their shapes.

        Args:
          name_or_id: the adapter's ``lora_name`` or ``lora_int_id``.
          tree: ``{"layers": {"wq_lora_a": [L, in, r], "wq_lora_b": [L, r, out], ...}}`` (or ``"layers/wq_lora_a"``
            paths), numpy or JAX floats, any subset of the projections (wq, wk, wv, wo, w_gate, w_up, w_down);
            PEFT's values in the ``[in, out]`` orientation (``lora_A.weight.T``, ``lora_B.weight.T``), unscaled,
            ``r`` the adapter's rank.

        Returns:
          ``{"lora_int_id", "num_leaves", "num_preempted"}``.

        Raises:
          ValueError: LoRA off, an unknown adapter, or a leaf unknown or of the wrong shape (named, with the
            shape expected); the old adapter is kept.
        """
        return self._call("update_lora", name_or_id, tree)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix (vLLM's ``LLM.reset_prefix_cache``); ``reset_running_requests`` also starts the
        unfinished requests over (``EngineCore.reset_prefix_cache``; jaxllm has no KV connector to reset); True."""
        return self._call("reset_prefix_cache", reset_running_requests, reset_connector)

    def start_profile(self, profile_prefix: Optional[str] = None, *, delay_iterations: Optional[int] = None,
                      max_iterations: Optional[int] = None, profiler_kwargs: Optional[dict[str, Any]] = None) -> None:
        """Record a ``jax.profiler`` trace of the coming engine steps (vLLM's ``LLM.start_profile``;
        ``LLMEngine.start_profile`` has the arguments, the folders and the errors). Needs ``profiler_config``."""
        with self._steps.between_steps() as engine:
            engine.start_profile(profile_prefix, delay_iterations=delay_iterations, max_iterations=max_iterations,
                                 profiler_kwargs=profiler_kwargs)

    def stop_profile(self) -> None:
        """End the profile session, writing its trace (vLLM's ``LLM.stop_profile``); nothing when none is active."""
        self._call("stop_profile")

    def get_metrics(self) -> list[Any]:
        """The engine's metrics now, as vLLM's ``LLM.get_metrics`` returns them (``LLMEngine.get_metrics``).
        Raises RuntimeError: the engine was built with ``disable_log_stats=True``."""
        return self._call("get_metrics")

    def get_world_size(self, include_dp: bool = True) -> int:
        """Devices the model runs on (vLLM's ``LLM.get_world_size``): tensor parallel size, times the data
        parallel replicas with ``include_dp``."""
        parallel = self.engine.config.parallel
        return parallel.tensor_parallel_size * (parallel.data_parallel_size if include_dp else 1)

    def sleep(self, level: int = 1, mode: str = "abort", reset_connector: bool = True) -> list[dict[str, Any]]:
        """Free device memory, as vLLM's ``LLM.sleep``: level 1 frees the KV cache and moves the weights to the
        host; level 2 also discards the weights (give them again with ``update_weights*`` before :meth:`wake_up`);
        level 0 frees nothing. Updates while asleep replace the weights on the host; :meth:`wake_up` places them.
        Requests are refused until :meth:`wake_up`; ``mode`` says what becomes of queued ones
        (``LLMEngine.sleep``: "abort", "keep", or "wait", refused while any is queued); ``reset_connector`` is
        accepted (no KV connector).

        Returns:
          one report per core: ``{"level", "freed_bytes", "device_bytes_before", "device_bytes_after"}``.

        Raises:
          ValueError: ``level`` not 0, 1 or 2, or another mode.
          RuntimeError: requests are queued with ``mode="wait"``.
        """
        return self._call("sleep", level, mode, reset_connector)

    def release_kv_cache_memory(self, reset_connector: bool = True) -> list[int]:
        """Free the KV cache's device memory after ``sleep(level=0)``, the weights kept on the device (vLLM's
        ``LLM.release_kv_cache_memory``); ``wake_up(tags=["kv_cache"])`` brings it back. Returns the bytes freed
        per core. Raises RuntimeError: not asleep."""
        return self._call("release_kv_cache_memory", reset_connector)

    def reset_mm_cache(self) -> None:
        """vLLM's: empty the multimodal processor's cache; jaxllm serves text models and has none."""

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> "LLM":
        """An ``LLM`` from ``jaxllm.EngineArgs`` (vLLM's ``LLM.from_engine_args``; the same as
        ``LLM(**dataclasses.asdict(engine_args))``). Raises as :class:`LLM`."""
        return cls(**engine_args.engine_kwargs())

    def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        """Bring back what :meth:`sleep` freed (``tags``: some of "weights", "kv_cache" and "scheduling", or None
        for all), with the same shapes and shardings: no program is compiled again. Returns whether everything is
        back (vLLM's).

        Discarded weights (``sleep(level=2)``) no update gave again come back as zeros: vLLM's order wakes
        ``tags=["weights"]``, updates them, then wakes ``["kv_cache"]``. Raises ValueError: an unknown tag.
        """
        return self._call("wake_up", tags)

    def is_sleeping(self) -> bool:
        """True from :meth:`sleep` until :meth:`wake_up` has brought everything back."""
        return self._call("is_sleeping")

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine this runs (vLLM's name for it; :attr:`engine` is the same object)."""
        return self.engine

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
        """The model's tokenizer (None for a model without one)."""
        return self.engine.tokenizer

    def get_tokenizer(self) -> Optional[Tokenizer]:
        """The model's tokenizer, as vLLM's ``LLM.get_tokenizer()`` (None for a model without one)."""
        return self.engine.tokenizer

    def kv_cache_report(self, core: int = 0, block_map: bool = True) -> dict[str, Any]:
        """KV cache diagnostics (``LLMEngine.kv_cache_report``; ``diag.render_kv_report`` draws it): block counts,
        ``fragmentation``, ``cache_crowding``, ``num_preemptions``, queue depth, largest request, block map."""
        return self._call("kv_cache_report", core, block_map)

    def kv_cache_compact(self) -> list[dict[str, Any]]:
        """Move the live KV blocks to the low end of the pool (``EngineCore.kv_cache_compact``); outputs unchanged.
        One report per core: ``{"num_moved_blocks", "num_blocks", "num_used_blocks", "kv_cache_bytes", "seconds"}``."""
        return self._call("kv_cache_compact")

    def kv_cache_resize(self, num_blocks: int) -> list[dict[str, Any]]:
        """Grow or shrink the KV pool to ``num_blocks`` blocks (null block included), unfinished requests kept
        (``EngineCore.kv_cache_resize``); step programs are rebuilt once (``"num_compilations"`` per core's report).

        Raises:
          ValueError: ``num_blocks`` not an int >= 2, below the blocks in use (both named), or too small for an
            unfinished request (named); nothing changes.
          RuntimeError: the KV cache sleeps.
        """
        return self._call("kv_cache_resize", num_blocks)

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: Union[bool, Callable[..., Any]] = True,
        lora_request: LoRAArg = None,
        priority: Priority = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        mm_processor_kwargs: Optional[dict[str, Any]] = None,
        cache_salt: CacheSalt = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; outputs in prompt order (vLLM's ``LLM.generate``).

        Args:
          prompts: one prompt or a list of them, each in any of vLLM's forms: a string, a list of token ids, or
            a ``TextPrompt`` / ``TokensPrompt`` dict (``{"prompt_token_ids": ids}``, with ``"prompt"``: the text to
            report, ``"cache_salt"``; ``InputProcessor.parse_prompt``).
          sampling_params: one for all prompts, or one per prompt (None: :meth:`get_default_sampling_params`).
          use_tqdm: show a progress bar on stderr; a callable makes the bar (``functools.partial(tqdm, ...)``).
          lora_request: a ``LoRARequest`` for all prompts, or one (or None) per prompt (needs ``enable_lora``).
          priority: one for all prompts or one per prompt (lower = more urgent) for the ``priority``, ``aging`` and
            ``load_aware`` policies; a non-zero one is refused under the others.
          tokenization_kwargs: for text prompts, ``{"add_special_tokens": False}`` leaves out the tokenizer's
            special tokens; other keys are refused.
          mm_processor_kwargs: accepted for vLLM's sake; no prompt carries multimodal data to process.
          cache_salt: one salt for all prompts, or one per prompt (None: unsalted); prompts share prefix-cache
            blocks only within a salt (vLLM's ``cache_salt``, given here or in a prompt dict).

        Raises:
          ValueError: any invalid prompt or parameter; nothing is queued then.
          QueueFullError: more prompts than ``max_waiting_requests`` would wait; nothing is queued then.
        """
        # vLLM's LLM.generate asks for final outputs only: no step builds a partial one.
        ids = self._add_all(prompts, sampling_params, priority, cache_salt, lora_request, tokenization_kwargs,
                            output_kind=RequestOutputKind.FINAL_ONLY)
        return self._finish(ids, use_tqdm)

    def generate_stream(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        lora_request: LoRAArg = None,
        priority: Priority = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        cache_salt: CacheSalt = None,
    ) -> Iterator[RequestOutput]:
        """As :meth:`generate`, but yield outputs as tokens arrive, of the kind each ``SamplingParams.output_kind``
        asks for (default ``CUMULATIVE``: every step's, the text so far).

        Each ``RequestOutput`` carries what followed the previous one in ``delta_text``/``delta_token_ids`` (and
        ``outputs[i].delta_*``); a request's last has ``finished=True``. Deltas add up to the final ``text`` and
        ``token_ids`` (split characters and possible stop-string starts are held back).

        Raises:
          ValueError: as :meth:`generate`, before anything is yielded.
        """
        return self._steps.outputs(self._add_all(prompts, sampling_params, priority, cache_salt, lora_request,
                                                 tokenization_kwargs))

    def enqueue(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        lora_request: LoRAArg = None,
        priority: Priority = None,
        use_tqdm: Union[bool, Callable[..., Any]] = True,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        mm_processor_kwargs: Optional[dict[str, Any]] = None,
        cache_salt: CacheSalt = None,
    ) -> list[str]:
        """Queue prompts without running them (vLLM's ``LLM.enqueue``); :meth:`wait_for_completion` runs them.
        Arguments as :meth:`generate` (``use_tqdm``: accepted; queueing shows no bar). Returns their request ids.
        Raises as :meth:`generate`, nothing queued then."""
        with self._enqueue_lock:
            ids = self._add_all(prompts, sampling_params, priority, cache_salt, lora_request, tokenization_kwargs,
                                output_kind=RequestOutputKind.FINAL_ONLY, caller=self._enqueue_caller)
            self._enqueued += ids
        return ids

    def wait_for_completion(self, output_type: Optional[Union[type, tuple[type, ...]]] = None, *,
                            use_tqdm: Union[bool, Callable[..., Any]] = True) -> list[RequestOutput]:
        """Run every request :meth:`enqueue` and :meth:`enqueue_chat` queued until all have finished (vLLM's
        ``LLM.wait_for_completion``); their final outputs in the order they were queued.

        Args:
          output_type: the output class(es) expected; jaxllm's ``LLM`` makes ``RequestOutput`` only.
          use_tqdm: as :meth:`generate`.

        Raises:
          TypeError: an ``output_type`` that ``RequestOutput`` is not.
        """
        if output_type is not None and not issubclass(RequestOutput, output_type):
            raise TypeError(f"output_type={output_type!r}: this LLM generates, and makes RequestOutput only")
        with self._enqueue_lock:
            ids, self._enqueued = self._enqueued, []
            self._enqueue_caller = self._steps.caller()
        return self._finish(ids, use_tqdm)

    def _finish(self, ids: list[str], use_tqdm: Union[bool, Callable[..., Any]]) -> list[RequestOutput]:
        """Step until requests ``ids`` (queued by :meth:`_add_all`) have finished; their final outputs in order."""
        final: dict[str, RequestOutput] = {}
        with GenerateProgress(len(ids), enabled=use_tqdm if ids else False) as progress:
            for out in self._steps.outputs(ids):
                progress.update([out])
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def _add_all(self, prompts: Any, sampling_params: Any, priority: Priority, cache_salt: CacheSalt,
                 lora_request: LoRAArg = None, tokenization_kwargs: Optional[dict[str, Any]] = None,
                 output_kind: Optional[RequestOutputKind] = None, caller: Optional[_Caller] = None) -> list[str]:
        """Queue the prompts (each with its ``SamplingParams``, copied with ``output_kind`` when given; their outputs
        into ``caller``'s inbox, ``SharedSteps.add``); returns their request ids."""
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        if output_kind is not None:
            copies: dict[int, SamplingParams] = {}
            for p in params_list:
                if id(p) not in copies:
                    copies[id(p)] = p if p.output_kind is output_kind else dataclasses.replace(p, output_kind=output_kind)
            params_list = [copies[id(p)] for p in params_list]
        n = len(prompt_list)
        priorities = _per_prompt("priority", 0 if priority is None else priority, n, (int, np.integer))
        salts = _per_prompt("cache_salt", cache_salt, n, (str, type(None)))
        loras = _per_prompt("lora_request", lora_request, n, (LoRARequest, type(None)))
        ids = [f"gen-{next(self._ids)}" for _ in prompt_list]

        def add() -> None:
            try:
                for rid, prompt, params, prio, salt, lora in zip(ids, prompt_list, params_list, priorities, salts,
                                                                 loras):
                    self.engine.add_request(rid, prompt, params, priority=prio, cache_salt=salt, lora_request=lora,
                                            tokenization_kwargs=tokenization_kwargs)
            except BaseException:
                self.engine.abort_request(ids)
                raise

        self._steps.add(ids, add, caller)
        return ids

    def beam_search(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        params: BeamSearchParams,
        lora_request: LoRAArg = None,
        use_tqdm: bool = False,
        concurrency_limit: Optional[int] = None,
        priority: Priority = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``; ``jaxllm.beam_search``): each step runs one
        token of every live beam as a request through the engine, so the beams of all prompts share its steps.

        Args:
          prompts: as :meth:`generate` (a prompt dict's ``cache_salt`` is not kept).
          params: the ``BeamSearchParams``. lora_request, priority: as :meth:`generate`.
          use_tqdm: a bar over the token steps. concurrency_limit: prompts searched at once (None: all).

        Returns:
          one ``BeamSearchOutput`` per prompt: its ``beam_width`` best sequences, best first; a sequence's
          ``tokens`` and ``text`` hold the prompt and what followed, as vLLM's.

        Raises:
          ValueError: a bad prompt, a prompt without room for one token under ``max_model_len``, or a
            ``beam_width`` whose ``2 * beam_width`` logprobs a step are more than ``max_logprobs``.
        """
        from tqdm import tqdm

        check_beam_width(params, self.engine.input_processor.max_logprobs)
        prompt_list = self._as_prompt_list(prompts)
        n = len(prompt_list)
        ids = [self.engine.input_processor.parse_prompt(p).token_ids for p in prompt_list]
        loras = _per_prompt("lora_request", lora_request, n, (LoRARequest, type(None)))
        priorities = _per_prompt("priority", 0 if priority is None else priority, n, (int, np.integer))
        eos = set(self.engine.input_processor.eos_token_ids)
        limit = concurrency_limit or max(n, 1)
        outputs: list[BeamSearchOutput] = []
        for start in range(0, n, limit):
            search = BeamSearch(ids[start:start + limit], params, eos_token_ids=eos,
                                max_model_len=self.engine.client.infos[0].max_model_len,
                                lora_requests=loras[start:start + limit], priorities=priorities[start:start + limit])
            for _ in tqdm(range(params.max_tokens), desc="Beam search", unit="token", disable=not use_tqdm):
                beams = search.live()
                if not beams:
                    break
                search.advance(self.generate([{"prompt_token_ids": b.tokens} for b in beams], search.step_params,
                                             lora_request=[b.lora_request for b in beams],
                                             priority=search.priorities(), use_tqdm=False))
            tokenizer = self.tokenizer
            outputs += search.results(None if tokenizer is None else
                                      lambda t, skip: tokenizer.decode(t, skip_special_tokens=skip))
        return outputs

    def chat(
        self,
        messages: Union[list[dict], Sequence[list[dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: Union[bool, Callable[..., Any]] = True,
        lora_request: LoRAArg = None,
        priority: Priority = None,
        chat_template: Optional[str] = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        mm_processor_kwargs: Optional[dict[str, Any]] = None,
        *,
        cache_salt: CacheSalt = None,
    ) -> list[RequestOutput]:
        """Render conversation(s) with a chat template (``Tokenizer.render_chat``), then :meth:`generate` (vLLM's
        ``LLM.chat``, its arguments in its order).

        Args:
          messages: one conversation (a list of OpenAI-style message dicts: text content or text parts,
            assistant ``tool_calls`` with JSON-text ``arguments``, ``role: "tool"`` results) or several.
          chat_template: a jinja2 template to use instead of the model's.
          chat_template_content_format: how content reaches the template, ``tokenizer.CONTENT_FORMATS``:
            "string" (text parts joined by newlines), "openai" (a list of text parts), "auto" (the one the template
            reads, ``tokenizer.detect_content_format``).
          add_generation_prompt: end the prompt with the template's cue for the assistant's turn.
          continue_final_message: end the prompt inside the last message, so the model continues it
            (vLLM's; ``Tokenizer.apply_chat_template``); not with ``add_generation_prompt``.
          tools: OpenAI's tool dicts, given to the template as HF's ``tools=`` (vLLM's ``LLM.chat(tools=...)``);
            the calls the model writes stay in its text.
          chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).
          tokenization_kwargs: ``{"add_special_tokens": True}`` adds the tokenizer's special tokens to the
            rendered prompt (by default they are left out: the template writes its own); other keys are refused.
          sampling_params, use_tqdm, lora_request, priority, mm_processor_kwargs, cache_salt: as :meth:`generate`.

        Raises:
          ValueError: no tokenizer; ``tokenizer.ChatInputError`` naming the bad argument; or as :meth:`generate`.
        """
        prompts = self._chat_prompts(messages, chat_template, chat_template_content_format, add_generation_prompt,
                                     continue_final_message, tools, chat_template_kwargs, tokenization_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                             priority=priority, cache_salt=cache_salt)

    def enqueue_chat(
        self,
        messages: Union[list[dict], Sequence[list[dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: Union[bool, Callable[..., Any]] = True,
        lora_request: LoRAArg = None,
        priority: Priority = None,
        chat_template: Optional[str] = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        mm_processor_kwargs: Optional[dict[str, Any]] = None,
        *,
        cache_salt: CacheSalt = None,
    ) -> list[str]:
        """:meth:`chat`'s rendering, then :meth:`enqueue` (vLLM's ``LLM.enqueue_chat``); returns the request ids.
        Raises as :meth:`chat`, nothing queued then."""
        prompts = self._chat_prompts(messages, chat_template, chat_template_content_format, add_generation_prompt,
                                     continue_final_message, tools, chat_template_kwargs, tokenization_kwargs)
        return self.enqueue(prompts, sampling_params, lora_request=lora_request, priority=priority,
                            cache_salt=cache_salt)

    def _chat_prompts(self, messages: Any, chat_template: Optional[str], content_format: str,
                      add_generation_prompt: bool, continue_final_message: bool, tools: Optional[list[dict]],
                      chat_template_kwargs: Optional[dict[str, Any]],
                      tokenization_kwargs: Optional[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each conversation of ``messages`` rendered as :meth:`chat` says, as a ``TokensPrompt`` with the rendered
        text (the outputs' ``prompt``, as vLLM's)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        add_special = add_special_tokens(tokenization_kwargs, default=False)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = chat_template if chat_template is not None else self._chat_template
        texts = [self.tokenizer.render_chat(conv, add_generation_prompt, continue_final_message, tools,
                                            chat_template_kwargs, template, content_format) for conv in conversations]
        return [{"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=add_special), "prompt": text}
                for text in texts]

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list[PromptType]:
        if isinstance(prompts, (str, Mapping)) or getattr(prompts, "ndim", None) == 1:  # one text, dict or id array
            return [prompts]
        prompts = list(prompts)
        # A list of ids (Python, numpy or 0-D JAX integers) is one prompt; a list of anything else, several.
        if prompts and all(isinstance(t, (int, np.integer)) or getattr(t, "ndim", None) == 0 for t in prompts):
            return [prompts]
        return prompts

    def _as_params_list(self, params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        # None in the list: that prompt's defaults.
        return [self.get_default_sampling_params() if p is None else p for p in params]
