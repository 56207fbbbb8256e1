"""Prefix-cache warm-up: compute common prompts (system prompts, few-shot headers) at start-up
(``EngineConfig.preload_prompts``, ``jaxllm serve --preload-prompts PATH``), so that the first real request that
shares one already reads its full blocks from the prefix cache.

The front end reads and tokenizes the prompts (as it would a request's, special tokens included) and hands the
token ids to each engine core (``EngineCore.preload_prefixes``), which computes them as one-token requests before
serving, then pins their full blocks (``Scheduler.pin_prefix``) while graceful degradation is on: pinned blocks
are never evicted until KV pressure makes degradation release them into the LRU cache, where they stay revivable
like any other cached block. Without degradation nothing is pinned. Only whole blocks are cached: the tokens past
a prompt's last full block are computed again by each request.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Union

from jaxllm.config import read_preload_prompts
from scheduler import SamplingParams

if TYPE_CHECKING:
    from jaxllm.frontend.input_processor import InputProcessor


def preload_token_ids(path: Union[str, os.PathLike], input_processor: "InputProcessor") -> list[list[int]]:
    """The warm-up prompts of ``path`` as token ids, each checked as a request's prompt would be.

    Raises:
      ValueError: as ``jaxllm.config.read_preload_prompts``, or a prompt the model cannot take (longer than
        ``max_model_len``, no tokenizer); the message names the prompt's index.
    """
    ids = []
    for i, prompt in enumerate(read_preload_prompts(path)):
        try:
            _, tokens = input_processor.encode_prompt(prompt)
            input_processor.process(f"preload-{i}", tokens, SamplingParams(max_tokens=1))
        except ValueError as e:
            raise ValueError(f"preload_prompts={str(path)!r}, prompt {i}: {e}") from None
        ids.append(tokens)
    return ids
