"""Paths: what a model path holds (a GGUF file by its magic bytes, or a folder with ``config.json``: HF or orbax),
found without reading weights or importing JAX, and jaxllm's cache folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Optional

GGUF_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file (llama.cpp's gguf spec)


def model_format(path: str | os.PathLike) -> Literal["gguf", "folder"]:
    """Whether ``path`` is a GGUF file or a model folder.
    Raises ValueError: missing, a non-GGUF file, or a folder without ``config.json`` (the message says which)."""
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


# generation_config.json keys vLLM takes as sampling defaults -> SamplingParams fields.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                          "frequency_penalty": "frequency_penalty", "skip_special_tokens": "skip_special_tokens",
                          "max_new_tokens": "max_tokens"}


def generation_config_defaults(generation_config: dict) -> dict[str, Any]:
    """The ``SamplingParams`` values a model's ``generation_config.json`` dict sets, as vLLM's
    ``generation_config="auto"`` takes them (``max_new_tokens`` as ``max_tokens``)."""
    return {field: generation_config[key] for key, field in GENERATION_CONFIG_KEYS.items()
            if generation_config.get(key) is not None}


def sampling_defaults(model: Optional[str | os.PathLike], generation_config: str = "auto",
                      override_generation_config: Optional[dict] = None) -> dict[str, Any]:
    """Default ``SamplingParams`` fields as vLLM's ``generation_config`` option gives them: ``"auto"`` from the
    ``model`` folder's ``generation_config.json`` (none for a ``.gguf`` file or weights in memory, ``model``
    None), ``"vllm"`` none, else from that folder's; then ``override_generation_config`` (the file's keys, e.g.
    ``{"temperature": 0.6}``) over them.

    Raises:
      ValueError: ``generation_config`` neither "auto", "vllm" nor a folder; an override that is not a dict;
        a malformed file (:func:`read_generation_config`).
    """
    if generation_config in ("auto", "vllm"):
        source = model if generation_config == "auto" else None
    elif Path(generation_config).is_dir():
        source = generation_config
    else:
        raise ValueError(f"generation_config={generation_config!r} must be 'auto' (the model's), 'vllm' (none) or a "
                         "folder holding a generation_config.json")
    if override_generation_config is not None and not isinstance(override_generation_config, dict):
        raise ValueError(f"override_generation_config={override_generation_config!r} must be a dict of "
                         "generation_config.json keys")
    config = read_generation_config(source) if source is not None else {}
    return generation_config_defaults({**config, **(override_generation_config or {})})


def read_generation_config(path: str | os.PathLike) -> dict:
    """A model folder's ``generation_config.json``, or ``{}`` when ``path`` is not a folder or has none.
    Raises ValueError: the file is not a JSON object (named)."""
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
    """The ``eos_token_id`` entries (int, list of ints, or None) of HF config dicts, in order, without repeats."""
    ids: dict[int, None] = {}
    for cfg in configs:
        eos = cfg.get("eos_token_id")
        for e in eos if isinstance(eos, (list, tuple)) else [eos]:
            if e is not None:
                ids[int(e)] = None
    return tuple(ids)


def cache_dir() -> Path:
    """The jaxllm cache folder: `$JAXLLM_CACHE` if set, else `~/.cache/jaxllm` (not created)."""
    env = os.environ.get("JAXLLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxllm"
