"""Host-side scheduler for jaxllm: requests, paged KV blocks, continuous batching.

Pure Python and numpy; never imports JAX (or jaxllm).
"""

from scheduler.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
