"""Speculative decoding: proposers of draft tokens (``ngram`` on the host, ``draft`` on the device), verified
by the target in its step (``sampler.sample_or_verify``); ``SpeculativeConfig`` lives in ``jaxllm.config``."""

from jaxllm.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer"]
