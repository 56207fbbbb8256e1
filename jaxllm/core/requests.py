"""The engine core's record of each request: a ``CoreRequest`` per id, holding its :class:`CoreSequence`s (the
scheduler's ``Request`` carrying the core's state of it)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jaxllm.core.messages import SampleLogprobs
from jaxllm.core.prompt_logprobs import PromptLogprobs
from scheduler import Request


class CoreSequence(Request):
    """One sequence of a request as the scheduler runs it, with the engine core's state of it.

    Args:
      record: its ``CoreRequest``. index: among the ``n`` sequences; -1 for the prefill parent.
      *args, **kwargs: ``scheduler.Request``'s.

    Attributes (beyond ``Request``'s):
      sampling: ``SequenceSampling`` (None for a prefill parent). slot: its sampling slot (0 while none).
      grammar: ``SequenceGrammar`` or None. prompt_logprobs: the tracker while it computes the prompt.
      logprobs: unreported sample logprobs or None. num_logprobs, num_reported: counts.
      done: reported finished, forked or aborted.
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
      request_id; seqs: by index; parent: the prefill parent until it forks, else None; prompt_logprobs;
      num_prompt_logprobs_reported; num_cached_tokens: None until first scheduled; num_live: not finished.
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
        """Drop the links to its sequences (they link back: a cycle only a full collection would free)."""
        self.seqs = []
        self.parent = None

    def live_sequences(self) -> list[CoreSequence]:
        """The parent (until it forks) and the sequences not done yet."""
        return [s for s in ([self.parent] if self.parent is not None else []) + self.seqs if not s.done]
