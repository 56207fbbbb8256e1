"""Prefix-cache warm-up: common prompts computed at start-up by each core (``EngineConfig.preload_prompts``);
under graceful degradation their blocks stay pinned until KV pressure releases them."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Union

from jaxllm.config import read_preload_prompts
from scheduler import SamplingParams

if TYPE_CHECKING:
    from jaxllm.frontend.input_processor import InputProcessor


def preload_token_ids(path: Union[str, os.PathLike], input_processor: "InputProcessor") -> list[list[int]]:
    """The warm-up prompts of ``path`` as token ids, each checked as a request's prompt.
    Raises ValueError: as ``read_preload_prompts``, or a prompt the model cannot take (index named)."""
    ids = []
    for i, prompt in enumerate(read_preload_prompts(path)):
        try:
            _, tokens = input_processor.encode_prompt(prompt)
            input_processor.process(f"preload-{i}", tokens, SamplingParams(max_tokens=1))
        except ValueError as e:
            raise ValueError(f"preload_prompts={str(path)!r}, prompt {i}: {e}") from None
        ids.append(tokens)
    return ids
