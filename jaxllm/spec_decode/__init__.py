"""Speculative decoding: proposers of draft tokens, verified by the target model in its compiled step.

A proposer drafts up to ``num_speculative_tokens`` tokens per sequence after each step; the scheduler puts them
on the sequence's next decode row (``Scheduler.update_draft_token_ids``); the step computes the row's last token
and its drafts together and the sampler (``jaxllm.sample.sampler.sample_or_verify``) keeps the drafts the target agrees
with plus one token of its own; the scheduler takes the rejected drafts back.

* ``ngram``: prompt lookup on the host (``NgramProposer``).
* ``draft``: a draft model on the device (``DraftRunner``), which the engine core builds for ``method="draft_model"``.
"""

from jaxllm.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer"]
