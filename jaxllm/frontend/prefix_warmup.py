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

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Union

from scheduler import SamplingParams

if TYPE_CHECKING:
    from jaxllm.frontend.input_processor import InputProcessor


def read_preload_prompts(path: Union[str, os.PathLike]) -> list[str]:
    """The prompts of a warm-up file: a ``.json`` file holding a list of strings, or any other file as text with
    one prompt per line (empty lines skipped; use JSON for prompts that contain newlines).

    Raises:
      ValueError: the file is missing or unreadable, a ``.json`` file is not a list of non-empty strings, or the
        file holds no prompt; the message names the path.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"preload_prompts={str(path)!r}: cannot read it ({e.strerror or e})") from None
    if path.suffix.lower() == ".json":
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"preload_prompts={str(path)!r} is not valid JSON: {e}") from None
        if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts):
            raise ValueError(f"preload_prompts={str(path)!r} must hold a JSON list of non-empty strings")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"preload_prompts={str(path)!r} holds no prompt")
    return prompts


def preload_token_ids(path: Union[str, os.PathLike], input_processor: "InputProcessor") -> list[list[int]]:
    """The warm-up prompts of ``path`` as token ids, each checked as a request's prompt would be.

    Raises:
      ValueError: as :func:`read_preload_prompts`, or a prompt the model cannot take (longer than
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
