"""Speculative decoding: proposers of draft tokens (``ngram`` on the host, ``draft`` on the device), verified
by the target in its step (``sampler.sample_or_verify``); ``config`` holds ``SpeculativeConfig``.
"""

from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig"]
