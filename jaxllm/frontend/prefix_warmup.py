"""Prefix-cache warm-up: common prompts computed at start-up (``EngineConfig.preload_prompts``).

Each core computes them (``EngineCore.preload_prefixes``) and, under graceful degradation, pins their full
blocks until KV pressure releases them into the LRU cache.
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
    """The prompts of a warm-up file: a ``.json`` list of strings, or one prompt per non-empty line.

    Raises:
      ValueError: the file is missing or unreadable, malformed, or holds no prompt (path named).
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
    """The warm-up prompts of ``path`` as token ids, each checked as a request's prompt.

    Raises:
      ValueError: as :func:`read_preload_prompts`, or a prompt the model cannot take (index named).
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
