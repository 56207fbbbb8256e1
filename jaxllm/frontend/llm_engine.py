"""LLMEngine: the step-by-step engine API (add_request / step / abort), vLLM's ``LLMEngine``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

from jaxllm.config import EngineConfig, check_profile_request
from jaxllm.core.client import InprocClient, MPClient
from jaxllm.core.messages import decode_params, encode_params, unflatten
from jaxllm.frontend.front_end import FrontEnd, tokenizer_config
from jaxllm.frontend.input_processor import PromptType, add_special_tokens
from jaxllm.lora import LoRARequest
from jaxllm.outputs import RequestOutput
from jaxllm.tokenizer import Tokenizer, load_tokenizer
from scheduler import SamplingParams

if TYPE_CHECKING:
    import jax

    from jaxllm.entrypoints.engine_args import EngineArgs

    from jaxllm.models.config import ModelConfig


class LLMEngine(FrontEnd):
    """The serving engine: requests in, ``RequestOutput`` per step out.

    Args:
      model: a HF folder, a ``.gguf`` file, a jaxllm orbax folder, a named model such as ``gemma3-270m`` or a Hub id
        (``revision``, ``download_dir`` in ``kwargs``; ``jaxllm.named_models.resolve_model``), None for
        SmolLM2-135M-Instruct; with ``params`` also a ``ModelConfig``.
      tokenizer: a Tokenizer, or where to load one from (a folder, ``.gguf``, named model or Hub id, as vLLM's
        ``tokenizer``); by default the model's. The engine core reads one loaded from elsewhere than the model
        from its ``source`` too (``EngineConfig.tokenizer``).
      params: weights to serve instead (``jaxllm.models.param_layout``'s layout, numpy or JAX arrays).
      mesh: the replica's ``(data, model)`` mesh (one replica only); default ``make_mesh(tensor_parallel_size)``.
      served_model_name: the model's name in the metrics (default: ``model``), as vLLM's.
      **kwargs: ``EngineConfig`` fields, and vLLM's ``EngineArgs`` keywords (``gpu_memory_utilization``,
        ``enforce_eager``, ...) as ``jaxllm.entrypoints.vllm_flags`` maps them.

    Attributes:
      model_path: the model's local path (None for weights given with a ``ModelConfig``).
      client: ``InprocClient`` or ``MPClient``. metrics, input_processor, output_processor: ``FrontEnd``'s.

    Raises:
      ValueError: a bad model path or architecture, a config value out of range (named), heads that do not split
        over ``tensor_parallel_size``, or a ``mesh`` with ``data_parallel_size > 1``.
    """

    def __init__(self, model: Union[str, os.PathLike, ModelConfig, None] = None,
                 tokenizer: Union[Tokenizer, str, os.PathLike, None] = None,
                 *, mesh: Optional["jax.sharding.Mesh"] = None, params: Optional[Any] = None,
                 served_model_name: Optional[str] = None, **kwargs: Any):
        from jaxllm.entrypoints.vllm_flags import vllm_engine_kwargs
        from jaxllm.named_models import resolve_model

        kwargs = vllm_engine_kwargs(kwargs)
        if model is None or isinstance(model, (str, os.PathLike)):
            model = resolve_model(model, kwargs.get("revision"), kwargs.get("download_dir"))
        tokenizer, kwargs = tokenizer_config(tokenizer, kwargs)
        config = EngineConfig(**kwargs)
        if config.data_parallel_size > 1:
            if mesh is not None:
                raise ValueError("mesh is for one replica; data_parallel_size > 1 places each core process itself")
            client: Union[InprocClient, MPClient] = MPClient(model, config, params=params)
        else:
            from jaxllm.core.build import build_engine_core

            client = InprocClient(build_engine_core(model, config, mesh=mesh, params=params))
        is_path = isinstance(model, (str, os.PathLike))
        self.model_path = model if is_path else None
        if tokenizer is None and is_path:
            tokenizer = load_tokenizer(model)
        super().__init__(tokenizer, client, config,
                         served_model_name or (str(model) if is_path else model.model_type))

    @property
    def core(self):
        """The ``EngineCore`` of a one-replica engine. Raises AttributeError: cores in other processes."""
        if not isinstance(self.client, InprocClient):
            raise AttributeError("the engine cores run in their own processes (data_parallel_size > 1)")
        return self.client.core

    # The in-process core's parts, as tests and benchmarks read them.
    scheduler = property(lambda self: self.core.scheduler, doc="The in-process core's scheduler.")
    runner = property(lambda self: self.core.runner, doc="The in-process core's model runner.")
    buckets = property(lambda self: self.core.buckets, doc="The in-process core's bucket table.")
    model_config = property(lambda self: self.core.model_config, doc="The model's ModelConfig.")
    kv_cache_dtype = property(lambda self: self.core.kv_cache_dtype,
                              doc="The in-process core's KV cache number dtype (int8 / float8_e4m3fn when quantized).")
    param_bytes = property(lambda self: self.core.param_bytes,
                           doc="The in-process core's ``jaxllm.worker.quantization.param_bytes`` of its parameters.")

    @property
    def num_blocks(self) -> int:
        """KV blocks of each core (the null block included)."""
        return self.client.infos[0].num_blocks

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens per request at most."""
        return self.client.infos[0].max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end generation (``InputProcessor.eos_token_ids``)."""
        return self.input_processor.eos_token_ids

    def encode_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """Prompt text or ids -> (text or None, token ids) (``InputProcessor.encode_prompt``)."""
        return self.input_processor.encode_prompt(prompt)

    def wait_for_warmup(self, timeout: Optional[float] = None) -> bool:
        """Wait until every step program is built; False if ``timeout`` seconds passed first."""
        return self.client.wait_for_warmup(timeout)

    def kv_cache_report(self, core: int = 0, block_map: bool = True) -> dict[str, Any]:
        """KV diagnostics of one core. Raises ValueError: ``core`` outside ``[0, data_parallel_size)``."""
        if not 0 <= core < len(self.client.infos):
            raise ValueError(f"core={core} must be in [0, {len(self.client.infos)})")
        if isinstance(self.client, InprocClient):
            return self.client.core.kv_cache_report(block_map)
        return self.client.call_utility(core, "kv_cache_report", block_map)

    def kv_cache_compact(self) -> list[dict[str, Any]]:
        """Move every core's live KV blocks to the low end of its pool (``EngineCore.kv_cache_compact``); reports."""
        return self._each_core("kv_cache_compact", all_results=True)

    def kv_cache_resize(self, num_blocks: int) -> list[dict[str, Any]]:
        """Resize every core's KV pool to ``num_blocks`` blocks, keeping running requests; one report per core.

        Raises:
          ValueError: ``num_blocks`` not an int >= 2 or too small; a refusing core keeps its pool.
          RuntimeError: the KV cache sleeps.
        """
        reports = self._each_core("kv_cache_resize", num_blocks, all_results=True)
        self._note_kv_resize(num_blocks)
        return reports

    def get_params(self) -> dict[str, Any]:
        """The weights the engine runs, in ``param_layout``'s layout: device arrays with their shardings, or host
        numpy copies of core 0's from another process; asleep, host numpy (``EngineCore.get_params``).
        Raises RuntimeError: the weights were discarded (``sleep(level=2)``) and not given again."""
        if isinstance(self.client, InprocClient):
            return self.client.core.get_params()
        return unflatten(decode_params(self.client.call_utility(0, "host_params")))

    def update_weights(self, params: Any) -> dict[str, int]:
        """Replace every core's weights (``EngineCore.update_weights``). Raises ValueError: a bad leaf (named);
        nothing changes then."""
        return self._each_core("update_weights", params)

    def update_weights_from_path(self, path: Union[str, os.PathLike]) -> dict[str, int]:
        """:meth:`update_weights` with the checkpoint at ``path``. Raises ValueError: not a model, or its weights
        do not fit."""
        return self._each_core("update_weights_from_path", str(path))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into every core now (vLLM's ``add_lora``); True. Raises ValueError as
        ``EngineCore.add_lora``."""
        return all(self._each_core("add_lora", lora_request, all_results=True))

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter in every core (vLLM's ``remove_lora``; ``EngineCore.remove_lora``: requests running
        under it finish under it); False when core 0 did not know it."""
        return self._each_core("remove_lora", lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters core 0 knows, by id (vLLM's ``list_loras``)."""
        return [r if isinstance(r, LoRARequest) else LoRARequest(*r) for r in self._each_core("list_loras")]

    def update_lora(self, name_or_id: Union[str, int], tree: Any) -> dict[str, Any]:
        """Replace a known adapter's A/B in every core (``EngineCore.update_lora``). Raises ValueError: an unknown
        adapter or a bad leaf (named); the old adapter is kept."""
        return self._each_core("update_lora", name_or_id, tree)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix in every core (vLLM's ``reset_prefix_cache``; ``reset_running_requests``
        also starts the unfinished requests over, ``EngineCore.reset_prefix_cache``); True."""
        return all(self._each_core("reset_prefix_cache", bool(reset_running_requests), bool(reset_connector),
                                   all_results=True))

    def sleep(self, level: int = 1, mode: str = "abort", reset_connector: bool = True) -> list[dict[str, Any]]:
        """Free device memory while idle (vLLM's ``sleep``; ``EngineCore.sleep``): level 1 frees the KV cache and
        moves the weights to the host, level 2 discards the weights, level 0 frees nothing; no step runs and no
        request is taken until :meth:`wake_up`. Returns one report per core.

        Args:
          mode: unfinished requests: "abort", finished with finish_reason "abort" (reported by the first step after
            :meth:`wake_up`); "keep", they wait and go on after it; "wait", refused while any is unfinished, as
            vLLM's in-process engine refuses it (step them to completion first).
          reset_connector: accepted (jaxllm has no KV connector).

        Raises:
          ValueError: ``level`` not 0, 1 or 2, another mode, or ``enable_sleep_mode`` off.
          RuntimeError: requests are unfinished with ``mode="wait"``.
        """
        if mode == "wait" and self.has_unfinished_requests():  # refused before any core sleeps
            raise RuntimeError(f"sleep(mode='wait'): {self.get_num_unfinished_requests()} requests are unfinished; "
                               "finish them, or sleep with mode 'abort' or 'keep'")
        reports = self._each_core("sleep", level, mode, all_results=True)
        self.sleeping = True
        return reports

    def release_kv_cache_memory(self, reset_connector: bool = True) -> list[int]:
        """Free the KV cache's device memory after ``sleep(level=0)``, the weights kept (vLLM's;
        ``EngineCore.release_kv_cache_memory``); ``wake_up(tags=["kv_cache"])`` brings it back and unfinished
        requests recompute. ``reset_connector`` is accepted (no KV connector). Returns the bytes freed per core.
        Raises RuntimeError: not asleep."""
        return self._each_core("release_kv_cache_memory", all_results=True)

    def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        """Bring back what :meth:`sleep` freed (``tags``: some of "weights", "kv_cache" and "scheduling", or None
        for all), no compilation; whether everything is back (vLLM's).

        Discarded weights (``sleep(level=2)``) not given again come back as zeros, to be updated (vLLM's order).
        Raises ValueError: an unknown tag.
        """
        awake = all(self._each_core("wake_up", tags, all_results=True))
        self.sleeping = not awake
        return awake

    def is_sleeping(self) -> bool:
        """True from :meth:`sleep` until :meth:`wake_up` has brought everything back."""
        return any(self._each_core("is_sleeping", all_results=True))

    @classmethod
    def from_engine_args(cls, engine_args: "EngineArgs", usage_context: Any = None, stat_loggers: Any = None,
                         enable_multiprocessing: bool = False) -> "LLMEngine":
        """vLLM's ``LLMEngine.from_engine_args``: the engine ``engine_args`` (``jaxllm.EngineArgs``) describe.
        ``usage_context``, ``stat_loggers`` and ``enable_multiprocessing`` are accepted without effect (the cores
        run in this process unless ``data_parallel_size`` > 1; the stats go to jaxllm's metrics). Raises as
        :class:`LLMEngine`."""
        return cls(**engine_args.engine_kwargs())

    def start_profile(self, profile_prefix: Optional[str] = None, *, delay_iterations: Optional[int] = None,
                      max_iterations: Optional[int] = None, profiler_kwargs: Optional[dict[str, Any]] = None) -> None:
        """Record a ``jax.profiler`` trace of the coming engine steps in every core (vLLM's ``start_profile``;
        ``EngineCore.start_profile``): core d writes ``<torch_profiler_dir>/<profile_prefix>_dp<d>`` (``dp<d>``
        without a prefix), TensorBoard's and XProf's format, one annotated step per engine step.

        Args:
          profile_prefix: the trace folder's prefix, vLLM's rule (1-128 of letters, digits, '.', '_', '-').
          delay_iterations: engine steps run untraced first; None: the ``profiler_config``'s.
          max_iterations: steps traced, then the trace stops by itself; 0: until :meth:`stop_profile`; None: the
            config's.
          profiler_kwargs: ``create_perfetto_trace`` (bool: also a Perfetto ``.trace.json.gz``),
            ``host_tracer_level``, ``python_tracer_level`` (ints), ``enable_hlo_proto`` (bool);
            torch.profiler's keywords are accepted without effect.

        Raises:
          ValueError: a bad prefix, count or ``profiler_kwargs`` key (named).
          RuntimeError: no ``profiler_config`` profiler, a session already active, or JAX's profiler refused.
        """
        args = (profile_prefix, delay_iterations, max_iterations, profiler_kwargs)
        check_profile_request(*args)
        if isinstance(self.client, InprocClient):
            self.client.core.start_profile(*args)
            return
        for core in range(len(self.client.infos)):
            try:
                self.client.call_utility(core, "start_profile", *args)
            except Exception:
                for started in range(core):
                    self.client.call_utility(started, "stop_profile")
                raise

    def stop_profile(self) -> None:
        """End the profile session in every core, writing the traces (vLLM's ``stop_profile``); nothing when none
        is active. Every core stops before the first failure is raised (RuntimeError)."""
        if isinstance(self.client, InprocClient):
            self.client.core.stop_profile()
            return
        errors = []
        for core in range(len(self.client.infos)):
            try:
                self.client.call_utility(core, "stop_profile")
            except RuntimeError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _each_core(self, method: str, *args: Any, all_results: bool = False) -> Any:
        """``EngineCore.<method>(*args)`` in every core, in order; core 0's result (or all with ``all_results``)."""
        if isinstance(self.client, InprocClient):
            result = getattr(self.client.core, method)(*args)
            return [result] if all_results else result
        if method == "update_weights":
            method, args = "update_weights_encoded", (encode_params(args[0]),)
        elif method == "update_lora":
            method, args = "update_lora_encoded", (args[0], encode_params(args[1]))
        results = [self.client.call_utility(d, method, *args) for d in range(len(self.client.infos))]
        return results if all_results else results[0]

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        *,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        data_parallel_rank: Optional[int] = None,
        lora_request: Optional[LoRARequest] = None,
        tokenization_kwargs: Optional[dict[str, Any]] = None,
        trace_headers: Optional[dict[str, str]] = None,
        prompt_text: Optional[str] = None,
    ) -> None:
        """Queue a request, validated before anything changes (``prompt``: any of vLLM's forms,
        ``InputProcessor.parse_prompt``; ``data_parallel_rank``: a core chosen by the caller; ``lora_request``: the
        LoRA adapter it runs under, read by the core now if new; ``tokenization_kwargs``: vLLM's, only
        ``add_special_tokens``, ``input_processor.add_special_tokens``; ``prompt_text``: the text the outputs report
        for a token-id prompt; ``trace_headers``: accepted, not used, as jaxllm has no tracing).

        Raises:
          ValueError: an empty or too-long prompt, an id outside the vocabulary, a prompt dict key refused, a
            ``cache_salt`` unlike the prompt dict's, a duplicate id, a bad rank.
          QueueFullError: ``max_waiting_requests`` sequences already wait; nothing is queued.
        """
        text, ids, cache_salt = self.input_processor.parse_prompt(prompt, cache_salt,
                                                                  add_special_tokens(tokenization_kwargs))
        self._queue(request_id, ids, params if params is not None else SamplingParams(),
                    prompt=text if text is not None else prompt_text,
                    priority=priority, arrival_time=arrival_time, cache_salt=cache_salt,
                    data_parallel_rank=data_parallel_rank, lora_request=lora_request)

    def abort_request(self, request_ids: Union[str, Iterable[str]], internal: bool = False) -> None:
        """Abort requests (vLLM's ``abort_request``: a list of ids, or one); their KV blocks return to the pool at
        once (in a core process: at its next loop turn). ``internal``: vLLM's flag for its own ids; every id here
        is the caller's."""
        self._abort([request_ids] if isinstance(request_ids, str) else list(request_ids))

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued, running, unreported, or a step is in flight."""
        if isinstance(self.client, InprocClient):
            return self.client.has_unfinished_requests()
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine-core step; a ``RequestOutput`` per request the step touched, as its ``output_kind`` asks
        (``FINAL_ONLY``: only once finished; with ``async_scheduling`` one step late: the first call returns none).
        Raises ``EngineDeadError``: a core process died; RuntimeError: the engine sleeps (:meth:`sleep`)."""
        if self.sleeping:
            raise RuntimeError("no step runs while the engine is sleeping: wake_up() first")
        if not isinstance(self.client, InprocClient) and not self.output_processor.has_unfinished_requests():
            return []
        return [out for core_outputs in self.client.get_outputs() for out in self._process_core_outputs(core_outputs)]

    def shutdown(self) -> None:
        """Stop the cores (other processes exit) and the metrics server."""
        self.client.shutdown()
        self.metrics.close()
