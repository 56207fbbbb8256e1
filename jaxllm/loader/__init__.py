"""Checkpoint loading: a HF folder (safetensors) or a GGUF file, to a ``(ModelConfig, params)`` pair of
host numpy arrays. Each format loader yields an HF-style config dict and HF-named numpy arrays."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.loader.safetensors import iter_safetensors, read_hf_config
from jaxllm.models.llama import Params, params_from_hf


def load_model(path: str | os.PathLike, dtype: Any = np.float32) -> tuple[ModelConfig, Params, dict]:
    """Load weights and config from ``path``.

    Args:
      path: a HF model folder (config.json + safetensors) or a ``.gguf`` file.
      dtype: numpy dtype of the parameters (``ml_dtypes.bfloat16`` for bf16).

    Returns:
      (model config, parameter pytree of numpy arrays, the HF config dict).

    Raises:
      ValueError: the path does not exist, lacks config.json, holds an
        unsupported architecture, or misses a tensor (each named).
    """
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from jaxllm.loader.gguf import load_gguf

        hf_config, tensors = load_gguf(p, dtype=np.float32)
        cfg = ModelConfig.from_hf_config(hf_config)
        return cfg, params_from_hf(cfg, tensors.items(), dtype, source=str(p)), hf_config
    if not p.exists():
        raise ValueError(f"model path {str(p)!r} does not exist")
    hf_config = read_hf_config(p)
    cfg = ModelConfig.from_hf_config(hf_config)
    return cfg, params_from_hf(cfg, iter_safetensors(p), dtype, source=str(p)), hf_config
