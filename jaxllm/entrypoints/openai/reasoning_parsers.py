"""Reasoning parsers (vLLM's ``--reasoning-parser``): the ``<think>...</think>`` text apart from the answer.

They read text, not ids, so multi-token tags work. ``deepseek_r1`` reads reasoning until ``</think>`` even
without an opening tag; ``qwen3`` only inside a block the prompt or the text opens.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

THINK_START, THINK_END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class Split:
    """A reasoning parser's decision so far: ``reasoning`` (None: none), ``content`` and whether it ``ended``."""

    reasoning: Optional[str]
    content: str
    ended: bool


def opens_reasoning(prompt: str) -> bool:
    """Whether ``prompt`` ends inside a think block (its last ``<think>`` comes after its last ``</think>``)."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


class ReasoningParser:
    """The ``<think>...</think>`` split of a generated text.

    Args:
      prompt_opens: the prompt ends inside a think block (``opens_reasoning``).
    """

    always_reasoning = False  # the text is reasoning until THINK_END, whatever the prompt

    def __init__(self, prompt_opens: bool) -> None:
        self.prompt_opens = prompt_opens

    def split(self, text: str, final: bool) -> Split:
        """The split of ``text`` decided so far; before ``final``, a tail that may begin a tag is held back."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            return self._inside(stripped[len(THINK_START):], final)
        if not final and THINK_START.startswith(stripped):
            return Split(None, "", False)  # it may yet open a block
        if self.prompt_opens or self.always_reasoning:
            return self._inside(text, final)
        return Split(None, text, False)

    def span(self, text: str) -> Optional[tuple[int, int]]:
        """The reasoning's characters ``[start, end)`` in the whole ``text``, tags excluded (what ``split`` of the
        final text gives as ``reasoning``); None when it has none."""
        lead = len(text) - len(text.lstrip())
        if text.startswith(THINK_START, lead):
            start = lead + len(THINK_START)
        elif self.prompt_opens or self.always_reasoning:
            start = 0
        else:
            return None
        end = text.find(THINK_END, start)
        return start, end if end >= 0 else len(text)

    @staticmethod
    def _inside(text: str, final: bool) -> Split:
        """The split of a text that starts inside a think block."""
        at = text.find(THINK_END)
        if at >= 0:
            return Split(text[:at], text[at + len(THINK_END):], True)
        held = 0 if final else max((k for k in range(1, len(THINK_END)) if text.endswith(THINK_END[:k])), default=0)
        return Split(text[:len(text) - held], "", False)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """``deepseek_r1``: reasoning until ``</think>``, with or without an opening tag."""

    always_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """``qwen3``: reasoning only inside a think block the prompt or the text opens."""


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
