"""jaxllm: a JAX/XLA-compiled LLM inference engine."""

from scheduler.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
