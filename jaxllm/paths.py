"""Paths: what a model path holds, found without reading weights or importing JAX (the CLI checks
its flags with it before it loads anything), and jaxllm's cache folder.

A model is a GGUF file (recognised by its magic bytes, whatever its name) or a folder with a
``config.json``: a Hugging Face model folder (safetensors) or a jaxllm orbax checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

GGUF_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file (llama.cpp's gguf spec)


def model_format(path: str | os.PathLike) -> Literal["gguf", "folder"]:
    """Whether ``path`` is a GGUF file or a model folder.

    Raises:
      ValueError: the path does not exist, is a file that is not a GGUF, or is
        a folder without ``config.json``; the message says which, and what a
        model is.
    """
    p = Path(path)
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:
            raise ValueError(f"model path {str(p)!r} is a file but not a GGUF model (it does not start with "
                             f"{GGUF_MAGIC!r}); a model is a .gguf file or a Hugging Face model folder")
        return "gguf"
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"model folder {str(p)!r} has no config.json, so it is not a Hugging Face model "
                             "folder; a model is a .gguf file or a folder with config.json and *.safetensors")
        return "folder"
    raise ValueError(f"model path {str(p)!r} does not exist (a model is a .gguf file, a model folder, a named model "
                     "such as gemma3-270m, or a Hugging Face Hub id such as Qwen/Qwen3-0.6B)")


def read_generation_config(path: str | os.PathLike) -> dict:
    """``generation_config.json`` of a model folder (HF's ``GenerationConfig``
    file: ``eos_token_id``, ``temperature``, ``top_p``, ...), or ``{}`` when
    ``path`` is not a folder or has none.

    Raises:
      ValueError: the file is not a JSON object (the file is named).
    """
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(file)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(file)!r} holds a {type(config).__name__}, not a JSON object")
    return config


def eos_token_ids(*configs: dict[str, Any]) -> tuple[int, ...]:
    """The ``eos_token_id`` entries (each an int, a list of ints, or None) of
    HF config dicts, in order, without repeats."""
    ids: dict[int, None] = {}
    for cfg in configs:
        eos = cfg.get("eos_token_id")
        for e in eos if isinstance(eos, (list, tuple)) else [eos]:
            if e is not None:
                ids[int(e)] = None
    return tuple(ids)


def cache_dir() -> Path:
    """The jaxllm cache folder: `$JAXLLM_CACHE` if set, else `~/.cache/jaxllm`.

    Returns the path without creating it.
    """
    env = os.environ.get("JAXLLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxllm"
