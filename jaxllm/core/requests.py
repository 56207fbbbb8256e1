"""The engine core's record of each request: one ``CoreRequest`` per request id, holding its sequences.

A request with ``n`` sequences runs in the scheduler as ``n`` ``Request``s (and, for ``n > 1``, first a prefill
parent that computes the shared prompt; ``EngineCore`` says how it forks). Each of those is a
:class:`CoreSequence`: the scheduler's ``Request`` carrying the core's state of it (its sampling state and slot,
its grammar, its unreported logprobs), so a scheduled row leads to everything the core knows of it without a
lookup, and a row of a request aborted meanwhile can never be mistaken for a new request that reuses its id.
The core indexes the records once, by request id; forgetting a request is one ``pop`` of that index (its
sequences then give their sampling slots back).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jaxllm.core.messages import SampleLogprobs
from jaxllm.core.prompt_logprobs import PromptLogprobs
from scheduler import Request


class CoreSequence(Request):
    """One sequence of a request as the scheduler runs it, with the engine core's state of it.

    Args:
      record: the request it belongs to.
      index: its index among the request's ``n`` sequences; -1 for the prefill parent.
      *args, **kwargs: ``scheduler.Request``'s.

    Attributes (beyond ``Request``'s):
      record, index: as given.
      sampling: its host sampling state (``sample.slots.SequenceSampling``); None for a prefill parent, which
        samples greedily and whose sample is never used.
      slot: its sampling slot, a row of the sampler's device tables; 0 (padding) while it holds none.
      grammar: its structured-output matcher state (``structured_output.SequenceGrammar``), None when
        unconstrained.
      prompt_logprobs: the request's prompt-logprobs tracker while this sequence computes the prompt and some
        position is not recorded yet; None otherwise.
      logprobs: sample logprobs not reported yet; None when the request asks for none.
      num_logprobs: sample logprobs recorded so far.
      num_reported: output tokens reported to the front end so far.
      done: True once reported finished, forked (a parent) or aborted: nothing more is recorded or reported.
    """

    __slots__ = ("record", "index", "sampling", "slot", "grammar", "prompt_logprobs", "logprobs", "num_logprobs",
                 "num_reported", "done")

    def __init__(self, record: "CoreRequest", index: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record = record
        self.index = index
        # Typed in the docstring: the modules that set these annotate their methods with CoreSequence.
        self.sampling: Any = None
        self.slot = 0
        self.grammar: Any = None
        self.prompt_logprobs: Optional[PromptLogprobs] = None
        self.logprobs: Optional[list[SampleLogprobs]] = None
        self.num_logprobs = 0
        self.num_reported = 0
        self.done = False


@dataclasses.dataclass(eq=False)
class CoreRequest:
    """One request in the engine core: its sequences and what the core reports of it.

    Attributes:
      request_id: the front end's id.
      seqs: its ``n`` sequences, by index.
      parent: its prefill parent until it forks (``n > 1`` and a prompt of two tokens or more); None otherwise.
      prompt_logprobs: its prompt logprobs (``SamplingParams.prompt_logprobs``), None when not asked for.
      num_prompt_logprobs_reported: prompt positions reported so far.
      num_cached_tokens: prompt tokens read from the prefix cache, known when its prompt is first scheduled
        (vLLM's ``num_cached_tokens``); None before.
      num_live: sequences not reported finished yet.
    """

    request_id: str
    seqs: list[CoreSequence] = dataclasses.field(default_factory=list)
    parent: Optional[CoreSequence] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    num_prompt_logprobs_reported: int = 0
    num_cached_tokens: Optional[int] = None
    num_live: int = 0

    @property
    def prefill(self) -> CoreSequence:
        """The sequence that computes the prompt: the prefill parent, or the first sequence."""
        return self.parent if self.parent is not None else self.seqs[0]

    def forget(self) -> None:
        """Drop the links to its sequences once the core has forgotten it: a sequence links back to its record,
        and the cycle would otherwise keep both (and their token lists) until a full garbage collection."""
        self.seqs = []
        self.parent = None

    def live_sequences(self) -> list[CoreSequence]:
        """The parent (until it forks) and the sequences not done yet."""
        return [s for s in ([self.parent] if self.parent is not None else []) + self.seqs if not s.done]
