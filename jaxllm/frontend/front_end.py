"""The request front end that ``LLMEngine`` and ``AsyncLLM`` both put before their engine cores.

It follows vLLM's split (``vllm/v1/engine``): an input processor validates and
tokenizes requests, an output processor detokenizes and builds
``RequestOutput``s, and the metrics record what the cores report; none of them
touches the device.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxllm.core.client import QueueFullError, check_waiting_limit
from jaxllm.frontend.input_processor import InputProcessor
from jaxllm.frontend.metrics import EngineMetrics
from jaxllm.frontend.output_processor import OutputProcessor
from jaxllm.frontend.prefix_warmup import preload_token_ids


class FrontEnd(NamedTuple):
    """The front-end parts of one engine (all in the caller's process)."""

    input_processor: InputProcessor
    output_processor: OutputProcessor
    metrics: EngineMetrics


def build_front_end(tokenizer: Any, client: Any, config: Any) -> FrontEnd:
    """Build the front end for ``client``'s cores and preload ``config.preload_prompts`` into their prefix caches.

    Args:
      tokenizer: the engine's ``Tokenizer``.
      client: an ``InprocClient`` or ``MPClient`` (its first core's ``infos[0]`` gives the limits requests are
        checked against).
      config: the ``EngineConfig`` (seed, metrics settings, ``preload_prompts``).

    Raises:
      ValueError: a preload prompt the input processor refuses (``prefix_warmup.preload_token_ids``).
    """
    input_processor = InputProcessor(tokenizer, client.infos[0], config.seed)
    metrics = EngineMetrics(log_stats=config.log_stats, metrics_port=config.metrics_port,
                            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens)
    if config.preload_prompts is not None:
        client.preload_prefixes(preload_token_ids(config.preload_prompts, input_processor))
    return FrontEnd(input_processor, OutputProcessor(tokenizer), metrics)


def refuse_when_full(config: Any, client: Any, output_processor: OutputProcessor, metrics: EngineMetrics) -> None:
    """Refuse a new request when ``config.max_waiting_requests`` sequences already wait
    (``client.check_waiting_limit`` over ``client``'s cores), counting it in ``metrics.request_refused``.

    Raises:
      QueueFullError: the queue is full; nothing was queued.
    """
    try:
        check_waiting_limit(config.max_waiting_requests, output_processor.num_open_sequences, client.infos,
                            metrics.core_stats)
    except QueueFullError:
        metrics.request_refused.inc()
        raise
