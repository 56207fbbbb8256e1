"""AsyncLLM: the asyncio front end of the server, over engine-core processes (vLLM's ``AsyncLLM``); a consumer
that stops reading aborts its request, a dead core fails every open request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from typing import Any, AsyncIterator, Iterable, Mapping, Optional, Union

from jaxllm.config import PAUSE_MODES, SLEEP_MODE_OFF, EngineConfig, check_profile_request
from jaxllm.core.client import EngineDeadError, MPClient
from jaxllm.entrypoints.engine_args import AsyncEngineArgs
from jaxllm.core.messages import decode_params, encode_params, unflatten
from jaxllm.frontend.front_end import FrontEnd, tokenizer_config
from jaxllm.frontend.input_processor import PromptType, add_special_tokens
from jaxllm.lora import LoRARequest
from jaxllm.outputs import RequestOutput
from jaxllm.tokenizer import Tokenizer, load_tokenizer
from scheduler import SamplingParams

logger = logging.getLogger("jaxllm.frontend.async_llm")

# How often a pause or an abort looks whether the requests it waits for have finished, seconds.
DRAIN_POLL_SECONDS = 0.005


class AsyncLLM(FrontEnd):
    """Generate from asyncio code; the engine cores run in their own processes.

    Args:
      model, params: as ``LLMEngine``. tokenizer: as ``LLMEngine``'s (a Tokenizer or where to load one from); by
        default the model's.
      served_model_name: the model's name in the metrics (default: ``model``).
      **kwargs: ``EngineConfig`` fields, and vLLM's ``EngineArgs`` keywords as ``LLMEngine`` takes them.

    Attributes:
      client: the ``MPClient``; info: core 0's ``CoreInfo``; input_processor, output_processor, metrics:
      ``FrontEnd``'s; dead: why the cores died (None while they run).

    Raises:
      ValueError: a config value out of range (named), a bad model path.
      EngineDeadError: a core failed to start.
    """

    def __init__(self, model: Union[str, os.PathLike], tokenizer: Union[Tokenizer, str, os.PathLike, None] = None, *,
                 served_model_name: Optional[str] = None, params: Optional[Any] = None, **kwargs: Any) -> None:
        from jaxllm.entrypoints.vllm_flags import vllm_engine_kwargs

        tokenizer, kwargs = tokenizer_config(tokenizer, vllm_engine_kwargs(kwargs))
        config = EngineConfig(**kwargs)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
        super().__init__(tokenizer, MPClient(model, config, params=params), config, served_model_name or str(model))
        self.info = self.client.infos[0]
        self.dead: Optional[str] = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._output_task: Optional[asyncio.Task] = None

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: Any = None) -> "AsyncLLM":
        """vLLM's ``AsyncLLM.from_engine_args``: the engine ``engine_args`` (``jaxllm.AsyncEngineArgs``, or
        ``EngineArgs``) describe. ``start_engine_loop``, ``usage_context`` and ``stat_loggers`` are accepted without
        effect (the output loop starts with the first request; the stats go to jaxllm's metrics). Raises as
        :class:`AsyncLLM`."""
        return cls(**engine_args.engine_kwargs())

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: Optional[str] = None, priority: int = 0, cache_salt: Optional[str] = None,
                    lora_request: Optional[Any] = None, data_parallel_rank: Optional[int] = None,
                    admitted: bool = False) -> AsyncIterator[RequestOutput]:
        """Validate and start one request (``lora_request``: a ``LoRARequest`` or None; ``data_parallel_rank``: the
        core to run it; ``admitted``: as ``FrontEnd._queue``); returns the iterator of its ``RequestOutput``s
        (closing it cancels the request; :meth:`cancel` ends it with a RuntimeError, :meth:`abort` with an "abort"
        output). Raises ValueError (bad request, duplicate id), QueueFullError, EngineDeadError."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._queue(request_id, prompt_token_ids, params, prompt=prompt, priority=priority, cache_salt=cache_salt,
                    lora_request=lora_request, data_parallel_rank=data_parallel_rank, admitted=admitted)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._start()
        return self._outputs(request_id, queue)

    async def generate(self, prompt: PromptType, sampling_params: Optional[SamplingParams], request_id: str, *,
                       prompt_text: Optional[str] = None, lora_request: Optional[LoRARequest] = None,
                       tokenization_kwargs: Optional[dict[str, Any]] = None,
                       trace_headers: Optional[Mapping[str, str]] = None, priority: int = 0,
                       data_parallel_rank: Optional[int] = None) -> AsyncIterator[RequestOutput]:
        """vLLM's ``AsyncLLM.generate``: start one request and yield its ``RequestOutput``s as they come, of the
        kind ``sampling_params.output_kind`` asks for; leaving the loop early (or cancelling it) aborts it.

        Args:
          prompt: any of vLLM's prompt forms (``InputProcessor.parse_prompt``): text, token ids, or a
            ``TextPrompt`` / ``TokensPrompt`` dict. sampling_params: None is ``SamplingParams()``.
          prompt_text: the text the outputs report for a token-id prompt.
          tokenization_kwargs: for a text prompt, ``{"add_special_tokens": False}`` leaves out the tokenizer's
            special tokens; other keys are refused. trace_headers: accepted, not used (jaxllm has no tracing).

        Raises (from the first iteration, as vLLM's):
          ValueError: a bad prompt or request, a duplicate id. QueueFullError, EngineDeadError.
        """
        text, ids, salt = self.input_processor.parse_prompt(prompt, None, add_special_tokens(tokenization_kwargs))
        outputs = self.add_request(request_id, ids, sampling_params if sampling_params is not None else
                                   SamplingParams(), prompt=text if text is not None else prompt_text,
                                   priority=priority, cache_salt=salt, lora_request=lora_request,
                                   data_parallel_rank=data_parallel_rank)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    async def _outputs(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self.cancel(request_id)

    async def kv_cache_report(self, core: int = 0, block_map: bool = True) -> dict[str, Any]:
        """KV diagnostics of one core, between its steps. Raises ValueError (bad ``core``), EngineDeadError."""
        if not 0 <= core < len(self.client.infos):
            raise ValueError(f"core={core} must be in [0, {len(self.client.infos)})")
        return await self.client.call_utility_async(core, "kv_cache_report", block_map)

    async def kv_cache_compact(self) -> list[dict[str, Any]]:
        """``LLMEngine.kv_cache_compact`` of every core, between its steps; one report per core."""
        return await self._each_core("kv_cache_compact")

    async def kv_cache_resize(self, num_blocks: int) -> list[dict[str, Any]]:
        """``LLMEngine.kv_cache_resize`` of every core, between its steps; one report per core (same raises)."""
        reports = await self._each_core("kv_cache_resize", num_blocks)
        self._note_kv_resize(num_blocks)
        return reports

    async def get_params(self) -> dict[str, Any]:
        """Host numpy copies of the weights core 0 runs (``LLMEngine.get_params``)."""
        return unflatten(decode_params(await self.client.call_utility_async(0, "host_params")))

    async def update_weights(self, params: Any) -> dict[str, int]:
        """Replace every core's weights between its steps (``LLMEngine.update_weights``).
        Raises ValueError: a leaf that does not fit (named); nothing changes then."""
        return (await self._each_core("update_weights_encoded", encode_params(params)))[0]

    async def update_weights_from_path(self, path: Union[str, os.PathLike]) -> dict[str, int]:
        """:meth:`update_weights` from the checkpoint at ``path`` (``LLMEngine.update_weights_from_path``)."""
        return (await self._each_core("update_weights_from_path", str(path)))[0]

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into every core now (vLLM's ``add_lora``); True. Raises ValueError as
        ``EngineCore.add_lora`` (rank above ``max_lora_rank``, an unknown target module, no adapter at the path,
        an id or name taken); the cores that took it forget it then."""
        done = []
        try:
            for core in range(len(self.client.infos)):
                await self.client.call_utility_async(core, "add_lora", lora_request)
                done.append(core)
        except BaseException:
            for core in done:
                await self.client.call_utility_async(core, "remove_lora", lora_request.lora_int_id)
            raise
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter in every core (``EngineCore.remove_lora``: requests running under it finish under
        it); False when core 0 did not know it."""
        return (await self._each_core("remove_lora", lora_int_id))[0]

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters core 0 knows, by id (vLLM's ``list_loras``)."""
        return [LoRARequest(*r) for r in await self.client.call_utility_async(0, "list_loras")]

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix in every core (``LLMEngine.reset_prefix_cache``); True."""
        return all(await self._each_core("reset_prefix_cache", bool(reset_running_requests), bool(reset_connector)))

    async def sleep(self, level: int = 1, mode: str = "abort", reset_connector: bool = True) -> list[dict[str, Any]]:
        """Free device memory (``LLMEngine.sleep``): no step runs until :meth:`wake_up`; at levels 1 and 2 new
        requests are refused (``EngineSleepingError``), at level 0 they queue. One report per core.

        Args:
          mode: open requests: "abort", each finishes now with finish_reason "abort", reported before the cores
            sleep; "wait", the cores sleep once they have finished (new ones refused meanwhile); "keep", they wait
            and go on after :meth:`wake_up`.
          reset_connector: accepted (jaxllm has no KV connector).

        Raises:
          ValueError: ``enable_sleep_mode`` off, ``level`` not 0, 1 or 2, or another mode; nothing changes then.
          RuntimeError: mode "wait" while requests wait in a sleeping engine (they cannot finish).
          EngineDeadError.
        """
        if not self.config.enable_sleep_mode:
            raise ValueError(SLEEP_MODE_OFF)
        if level not in (0, 1, 2) or mode not in PAUSE_MODES:
            raise ValueError(f"sleep(level={level!r}, mode={mode!r}): level must be 0, 1 or 2 and mode one of "
                             f"{list(PAUSE_MODES)}")
        was_sleeping, self.sleeping = self.sleeping, True
        try:
            await self._settle_open_requests(mode)
            reports = await self._each_core("sleep", level, mode)
        except BaseException:
            self.sleeping = was_sleeping
            raise
        self.sleeping = level > 0 or was_sleeping
        return reports

    async def release_kv_cache_memory(self, reset_connector: bool = True) -> list[int]:
        """``LLMEngine.release_kv_cache_memory``: requests are refused from now until :meth:`wake_up`."""
        freed = await self._each_core("release_kv_cache_memory")
        self.sleeping = True
        return freed

    async def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        """Bring back what :meth:`sleep` freed (``LLMEngine.wake_up``); whether everything is back. Fully awake,
        the engine also leaves a :meth:`pause_generation` pause, as vLLM's does."""
        awake = all(await self._each_core("wake_up", tags))
        self.sleeping = not awake
        if awake:
            self.paused = None
        return awake

    async def is_sleeping(self) -> bool:
        """True from :meth:`sleep` until :meth:`wake_up` has brought everything back."""
        return any(await self._each_core("is_sleeping"))

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True,
                               wait_for_inflight_requests: Optional[bool] = None) -> None:
        """Pause generation, as for a weight update (vLLM's ``pause_generation``), until :meth:`resume_generation`.

        Args:
          mode: "abort": every open request finishes now with finish_reason "abort" (its tokens so far kept), and
            this returns once all are reported; "wait": this returns once the open requests have finished;
            "keep": the cores run no step, open requests keep their place and KV, and new ones are queued.
            In "abort" and "wait" modes new requests are refused (``EnginePausedError``; 503 on the server).
          clear_cache: reset the prefix cache once nothing runs (not in "keep" mode).
          wait_for_inflight_requests: older vLLM's switch: True is mode "wait", False mode "abort".

        Raises:
          ValueError: another mode. EngineDeadError.
        """
        if wait_for_inflight_requests is not None:
            mode = "wait" if wait_for_inflight_requests else "abort"
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r} must be one of {list(PAUSE_MODES)}")
        was_paused, self.paused = self.paused, mode
        try:
            await self._settle_open_requests(mode)
        except BaseException:
            self.paused = was_paused
            raise
        if clear_cache and mode != "keep":
            await self._each_core("reset_prefix_cache", False, False)

    async def resume_generation(self) -> None:
        """Take requests and run steps again after :meth:`pause_generation` (vLLM's)."""
        self.paused = None
        await self._each_core("resume_scheduler")

    async def is_paused(self) -> bool:
        """True from :meth:`pause_generation` until :meth:`resume_generation` (vLLM's)."""
        return self.paused is not None

    async def abort_in_flight(self, request_ids: Optional[list[str]] = None) -> int:
        """Finish open requests now with finish_reason "abort", their tokens so far kept (vLLM's
        ``/abort_requests``), without pausing; returns once they are reported.

        Args:
          request_ids: the engine requests of these ids, and of ids that begin with one of them and "-" (a server
            response's id names its requests so: ``cmpl-X`` runs ``cmpl-X-0``, ``cmpl-X-1``...); None or empty: all.

        Returns:
          the requests aborted.
        """
        open_ids = list(self.output_processor.requests)
        if request_ids:
            open_ids = [rid for rid in open_ids if any(rid == w or rid.startswith(f"{w}-") for w in request_ids)]
        await self._abort_reported(open_ids)
        return len(open_ids)

    async def _abort_reported(self, request_ids: list[str]) -> None:
        """Finish these open requests with "abort" in the cores (``EngineCore.finish_aborted``); return once their
        outputs have come back."""
        if not request_ids:
            return
        await self._each_core("finish_aborted", request_ids)
        await self._until_closed(request_ids)

    async def _until_closed(self, request_ids: Optional[list[str]] = None) -> None:
        """Return once none of these requests (None: no request) is open, or the cores have died."""
        def still_open() -> bool:
            requests = self.output_processor.requests
            return bool(requests) if request_ids is None else any(rid in requests for rid in request_ids)

        while still_open() and self.dead is None:
            await asyncio.sleep(DRAIN_POLL_SECONDS)

    async def _settle_open_requests(self, mode: str) -> None:
        """Set every core's pause to ``mode`` (``EngineCore.pause_scheduler``); with "abort" or "wait", return once
        no request is open. Raises RuntimeError: "wait" while open requests wait in a sleeping core."""
        if mode == "wait" and self.output_processor.requests and await self.is_sleeping():
            raise RuntimeError(f"mode 'wait': {len(self.output_processor.requests)} requests wait in a sleeping "
                               "engine and cannot finish; wake_up() first, or use mode 'abort' or 'keep'")
        await self._each_core("pause_scheduler", mode)
        if mode != "keep":
            await self._until_closed()

    async def start_profile(self, profile_prefix: Optional[str] = None, *, delay_iterations: Optional[int] = None,
                            max_iterations: Optional[int] = None,
                            profiler_kwargs: Optional[dict[str, Any]] = None) -> None:
        """Record a ``jax.profiler`` trace of the coming engine steps in every core (``LLMEngine.start_profile``).
        Raises ValueError: a bad override (named); RuntimeError: profiling off, a session active, or JAX refused."""
        args = (profile_prefix, delay_iterations, max_iterations, profiler_kwargs)
        check_profile_request(*args)
        for core in range(len(self.client.infos)):
            try:
                await self.client.call_utility_async(core, "start_profile", *args)
            except Exception:
                for started in range(core):
                    await self.client.call_utility_async(started, "stop_profile")
                raise

    async def stop_profile(self) -> None:
        """End the profile session in every core, writing the traces (``LLMEngine.stop_profile``); every core
        stops before the first failure is raised (RuntimeError)."""
        errors = []
        for core in range(len(self.client.infos)):
            try:
                await self.client.call_utility_async(core, "stop_profile")
            except RuntimeError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    async def _each_core(self, method: str, *args: Any) -> list[Any]:
        return [await self.client.call_utility_async(d, method, *args) for d in range(len(self.client.infos))]

    async def check_health(self) -> None:
        """vLLM's ``check_health``: returns while the engine cores run. Raises EngineDeadError once they died."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    async def abort(self, request_id: Union[str, Iterable[str]], internal: bool = False) -> None:
        """vLLM's ``abort``: each open request of these ids finishes now with finish_reason "abort", its stream's
        last output, its tokens so far kept; unknown ids are ignored, ``internal`` is accepted (jaxllm's ids are
        the callers'). Returns once the aborts are reported."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self._abort_reported([rid for rid in dict.fromkeys(ids) if rid in self.output_processor.requests])

    def cancel(self, request_id: str) -> None:
        """End a request now if it is open, without an output (its blocks are freed in the core's next loop turn):
        its output iterator is forgotten, ending with a RuntimeError if someone still reads it. What a consumer
        leaving its stream, or the server losing its client, does."""
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(RuntimeError(f"request {request_id!r} was cancelled"))
        try:
            self._abort([request_id])
        except EngineDeadError:
            pass  # nothing runs any more

    def _start(self) -> None:
        if self._output_task is None:
            self._output_task = asyncio.get_running_loop().create_task(self._handle_outputs())

    async def _handle_outputs(self) -> None:
        """Read the cores' steps for as long as they live; hand each request its outputs."""
        try:
            while True:
                for core_outputs in await self.client.get_outputs_async():
                    for out in self._process_core_outputs(core_outputs):
                        queue = self._queues.get(out.request_id)
                        if queue is not None:
                            queue.put_nowait(out)
                # Let the requests' tasks write what they were given before the next step's outputs.
                await asyncio.sleep(0)
        except Exception as e:  # a dead core, or a bug here: either way no request may hang
            if not isinstance(e, EngineDeadError):
                logger.exception("output processing failed")
                e = EngineDeadError(f"output processing failed: {e!r}")
            self.dead = str(e)
            for queue in self._queues.values():
                queue.put_nowait(e)

    def shutdown(self, timeout: float = 10.0) -> None:
        """End every open stream (with a RuntimeError), stop the output task and the core processes (killed after
        ``timeout`` seconds; they abort what runs). A plain call, not awaited, as vLLM's, from any thread; from the
        event loop's own, it blocks the loop until the cores have stopped."""
        loop = None if self._output_task is None else self._output_task.get_loop()
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:  # no loop runs in this thread
            on_loop = False
        if loop is None or on_loop or not loop.is_running():
            self._end_streams()
        else:  # the streams, the task and its socket belong to the loop's thread: let the task end there first
            try:
                asyncio.run_coroutine_threadsafe(self._end_output_task(), loop).result(timeout)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass  # the loop stopped meanwhile, or is stuck: the cores are stopped all the same
        self.client.shutdown(timeout)
        self.metrics.close()

    async def _end_output_task(self) -> None:
        self._end_streams()
        try:
            await self._output_task
        except (asyncio.CancelledError, EngineDeadError):
            pass

    def _end_streams(self) -> None:
        # Closed here only: the cores abort what they run when they stop.
        for request_id in self.output_processor.abort_requests(list(self.output_processor.requests)):
            self.metrics.forget(request_id)
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(RuntimeError(f"request {request_id!r} ended: the engine was shut down"))
        self._queues.clear()
        if self._output_task is not None:
            self._output_task.cancel()
