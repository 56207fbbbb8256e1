"""jaxllm: a JAX/XLA-compiled LLM inference engine.

``from jaxllm import LLM, SamplingParams`` is the offline API (vLLM's names);
``LLMEngine`` is the step-by-step one, ``AsyncLLM`` the asyncio one, each also made by ``from_engine_args`` from
vLLM's ``EngineArgs`` / ``AsyncEngineArgs`` (``TextPrompt`` and ``TokensPrompt`` are
vLLM's prompt dicts); ``jaxllm.register_model`` serves an
architecture jaxllm does not ship (``jaxllm.models.register_model``). The names are imported on
first use, so ``import jaxllm`` (and the CLI's ``--help``) does not import JAX.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jaxllm.entrypoints.llm",
    "LLMEngine": "jaxllm.frontend.llm_engine",
    "AsyncLLM": "jaxllm.frontend.async_llm",
    "EngineArgs": "jaxllm.entrypoints.engine_args",
    "AsyncEngineArgs": "jaxllm.entrypoints.engine_args",
    "TextPrompt": "jaxllm.frontend.input_processor",
    "TokensPrompt": "jaxllm.frontend.input_processor",
    "SamplingParams": "scheduler.sampling_params",
    "StructuredOutputsParams": "scheduler.sampling_params",
    "RequestOutputKind": "scheduler.sampling_params",
    "RequestOutput": "jaxllm.outputs",
    "CompletionOutput": "jaxllm.outputs",
    "register_model": "jaxllm.models",
    "LoRARequest": "jaxllm.lora.request",
    "BeamSearchParams": "jaxllm.beam_search",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
