"""The request front end ``LLMEngine`` and ``AsyncLLM`` share (vLLM's ``vllm/v1/engine`` split): input
processor, output processor and metrics, none touching the device.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from jaxllm.core.client import QueueFullError, check_waiting_limit
from jaxllm.core.messages import EngineCoreOutputs
from jaxllm.frontend.input_processor import InputProcessor
from jaxllm.frontend.metrics import EngineMetrics
from jaxllm.frontend.output_processor import OutputProcessor
from jaxllm.frontend.prefix_warmup import preload_token_ids
from jaxllm.outputs import RequestOutput
from scheduler import SamplingParams


def tokenizer_config(tokenizer: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(the front end's tokenizer, the ``EngineConfig`` keywords) for a ``tokenizer`` argument: a path or name is
    loaded (``tokenizer.load_named_tokenizer``, vLLM's ``tokenizer``), and one read from a file sets the keywords'
    ``tokenizer`` to that file, so that the engine core reads prompts and grammars with the same one.
    Raises ValueError: no tokenizer where a path or name points."""
    from jaxllm.tokenizer import load_named_tokenizer

    if isinstance(tokenizer, (str, os.PathLike)):
        revision = kwargs.get("tokenizer_revision") or kwargs.get("revision")
        tokenizer = load_named_tokenizer(tokenizer, revision, kwargs.get("download_dir"))
    if getattr(tokenizer, "source", None) is not None:
        kwargs = {**kwargs, "tokenizer": str(tokenizer.source)}
    return tokenizer, kwargs


class EngineSleepingError(RuntimeError):
    """A request was refused: the engine sleeps (``sleep()``) until ``wake_up()`` (the server answers 503)."""


class EnginePausedError(RuntimeError):
    """A request was refused: generation is paused (``AsyncLLM.pause_generation`` in "abort" or "wait" mode) until
    ``resume_generation()`` (the server answers 503)."""


class FrontEnd:
    """The front-end parts of one engine over ``client``'s cores.

    Args:
      tokenizer: the engine's ``Tokenizer``. client: ``InprocClient`` or ``MPClient``.
      config: the ``EngineConfig`` (``preload_prompts`` are computed into the cores here).
      model_name: the metrics' ``model_name`` label.

    Raises:
      ValueError: a preload prompt the input processor refuses.
    """

    def __init__(self, tokenizer: Any, client: Any, config: Any, model_name: str = "") -> None:
        self.config, self.tokenizer, self.client = config, tokenizer, client
        # Set by the engines' sleep / wake_up: no request is queued while the cores sleep.
        self.sleeping = False
        # AsyncLLM.pause_generation's mode until resume_generation; "abort" and "wait" refuse new requests.
        self.paused: Optional[str] = None
        scheduling, observability = config.scheduler, config.observability
        self.input_processor = InputProcessor(tokenizer, client.infos[0], config.seed, scheduling.scheduling_policy,
                                              config.max_logprobs)
        self.output_processor = OutputProcessor(tokenizer)
        self.metrics = EngineMetrics(log_stats=observability.log_stats, metrics_port=observability.metrics_port,
                                     max_num_seqs=scheduling.max_num_seqs,
                                     max_num_batched_tokens=scheduling.max_num_batched_tokens,
                                     max_model_len=client.infos[0].max_model_len,
                                     namespace=observability.metrics_namespace, model_name=model_name)
        self._log_stats = not observability.disable_log_stats
        if config.preload_prompts is not None:
            client.preload_prefixes(preload_token_ids(config.preload_prompts, self.input_processor))

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer (vLLM's ``get_tokenizer``); None for a model without one."""
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished or aborted (vLLM's ``get_num_unfinished_requests``)."""
        return len(self.output_processor.requests)

    def get_metrics(self) -> list[Any]:
        """The engine's Prometheus series now, as vLLM's ``get_metrics`` returns them (``EngineMetrics.snapshot``:
        ``Counter``, ``Gauge``, ``Histogram``, ``Vector`` of ``jaxllm.frontend.metrics``).
        Raises RuntimeError: ``disable_log_stats``, which records none (vLLM's asserts)."""
        if not self._log_stats:
            raise RuntimeError("get_metrics: this engine records no stats (disable_log_stats=True)")
        return self.metrics.snapshot()

    def do_log_stats(self) -> None:
        """Log the stats summary line now (vLLM's ``do_log_stats``); nothing with ``disable_log_stats``, which
        records no stats."""
        if self._log_stats:
            self.metrics.log_now()

    def _queue(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
               prompt: Optional[str] = None, priority: int = 0, arrival_time: Optional[float] = None,
               cache_salt: Optional[str] = None, data_parallel_rank: Optional[int] = None,
               lora_request: Optional[Any] = None, admitted: bool = False) -> None:
        """Validate a request and hand it to the cores; nothing changes when it is refused. ``admitted``: a later
        step of work admitted already (a beam search's), not held to ``max_waiting_requests`` again.
        Raises EngineSleepingError, EnginePausedError (a paused engine takes only a request already admitted, and
        only in "wait" mode); ValueError (duplicate id, bad request or rank, a LoRA request without
        ``enable_lora`` or that the core refuses); QueueFullError."""
        if lora_request is not None and not self.config.enable_lora:
            raise ValueError(f"lora_request for adapter {getattr(lora_request, 'lora_name', lora_request)!r}: the "
                             "engine was started without enable_lora=True (--enable-lora)")
        if self.sleeping:
            raise EngineSleepingError("the engine is sleeping (sleep()); call wake_up() before adding requests")
        if self.paused == "abort" or (self.paused == "wait" and not admitted):
            raise EnginePausedError(f"generation is paused (pause_generation mode={self.paused!r}); call "
                                    "resume_generation() before adding requests")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        try:
            check_waiting_limit(None if admitted else self.config.scheduler.max_waiting_requests,
                                self.output_processor.num_open_sequences, self.client.infos, self.metrics.core_stats)
        except QueueFullError:
            if self._log_stats:
                self.metrics.request_refused.inc()
            raise
        request = self.input_processor.process(request_id, prompt_token_ids, params, priority=priority,
                                               arrival_time=arrival_time, cache_salt=cache_salt,
                                               lora_request=lora_request)
        self.output_processor.add_request(request, prompt)
        try:
            self.client.add_request(request, data_parallel_rank)
        except BaseException:
            self.output_processor.abort_requests([request_id])
            raise

    def _note_kv_resize(self, num_blocks: int) -> None:
        """The cores' pools now have ``num_blocks`` blocks: core infos and the router follow."""
        for info in self.client.infos:
            info.num_blocks = num_blocks
        router = getattr(self.client, "router", None)  # only the multiprocess client routes
        if router is not None:
            router.resize(num_blocks)

    def _process_core_outputs(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        """One core step's outputs as ``RequestOutput``s; stop-string hits and finishes are passed to the core."""
        request_outputs, to_stop, touched = self.output_processor.process_outputs(core_outputs.outputs)
        if to_stop:
            self.client.stop_sequences(to_stop)
        finished = [out.request_id for out in request_outputs if out.finished]
        if finished:
            self.client.requests_finished(finished)
        if self._log_stats:
            self.metrics.on_step(core_outputs.stats, touched, core_outputs.core_index)
        else:  # admission's waiting limit reads the cores' latest stats
            self.metrics.core_stats[core_outputs.core_index] = core_outputs.stats
        return request_outputs

    def _abort(self, request_ids: Sequence[str]) -> list[str]:
        """Close the open ones of ``request_ids`` here and abort them in the cores; returns those."""
        open_ids = self.output_processor.abort_requests(request_ids)
        for rid in open_ids:
            self.metrics.forget(rid)
        if open_ids:
            self.client.abort_requests(open_ids)
        return open_ids
