"""jaxllm: a JAX/XLA-compiled LLM inference engine.

``from jaxllm import LLM, SamplingParams`` is the offline API (vLLM's names);
``jaxllm.engine.LLMEngine`` is the step-by-step one.
"""

from jaxllm.engine import LLM, LLMEngine
from jaxllm.outputs import CompletionOutput, RequestOutput
from scheduler.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
