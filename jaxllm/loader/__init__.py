"""Checkpoint loading: a HF folder (safetensors), a GGUF file or a jaxllm orbax
folder, to a ``(ModelConfig, params)`` pair. :func:`load_model` gives host
numpy arrays; :func:`load_sharded` places them on a device mesh, each device
reading only its own slice. Each format loader yields an HF-style config dict
and HF-named tensors; a folder's ``generation_config.json`` adds its eos ids
to the model config's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxllm.config import ModelConfig
from jaxllm.loader.orbax import is_orbax_checkpoint, read_config, restore_params
from jaxllm.loader.safetensors import (
    LazyTensor,
    iter_lazy_safetensors,
    iter_safetensors,
    read_generation_config,
    read_hf_config,
)
from jaxllm.models.llama import Params, params_from_hf
from jaxllm.sharding import ModelSharding


def load_model(path: str | os.PathLike, dtype: Any = np.float32) -> tuple[ModelConfig, Params, dict]:
    """Load weights and config from ``path``.

    Args:
      path: a HF model folder (config.json + safetensors) or a ``.gguf`` file.
      dtype: numpy dtype of the parameters (``ml_dtypes.bfloat16`` for bf16).

    Returns:
      (model config, parameter pytree of numpy arrays, the HF config dict).
      The model config's ``eos_token_ids`` are those of the folder's
      ``generation_config.json`` and ``config.json`` (a GGUF's from its
      ``tokenizer.ggml.eos/eot/eom_token_id``), tokenizer files or not.

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
    cfg = ModelConfig.from_hf_config(hf_config, read_generation_config(p))
    return cfg, params_from_hf(cfg, iter_safetensors(p), dtype, source=str(p)), hf_config


def _lazy(tensor: LazyTensor, transpose: bool, dtype: Any) -> LazyTensor:
    return tensor.as_transposed() if transpose else tensor


def load_sharded(path: str | os.PathLike, dtype: Any, mesh: Mesh) -> tuple[ModelConfig, Params, dict, ModelSharding]:
    """Load weights from ``path`` straight into their shardings on ``mesh``.

    A safetensors folder is read slice by slice (``get_slice``) and an orbax
    folder restored into the target shardings, so no device (and no host
    buffer) ever holds a whole sharded tensor. A GGUF file is dequantized on
    the host first (its quantized blocks do not slice), then placed slice by
    slice.

    Args:
      path: a HF folder, a ``.gguf`` file, or an orbax folder
        (``jaxllm.loader.orbax``; detected by its ``params/`` tree).
      dtype: dtype of the device arrays.
      mesh: the replica's ``(data, model)`` mesh.

    Returns:
      (model config, pytree of sharded ``jax.Array``s, HF config dict, the
      ModelSharding used).

    Raises:
      ValueError: as :func:`load_model`, or heads that do not split over the
        mesh's ``model`` axis.
    """
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        cfg, params, hf_config = load_model(p, dtype)
        sharding = ModelSharding(cfg, mesh)
        return cfg, sharding.place_params(params, dtype), hf_config, sharding
    if is_orbax_checkpoint(p):
        hf_config = read_config(p)
        cfg = ModelConfig.from_hf_config(hf_config, read_generation_config(p))
        sharding = ModelSharding(cfg, mesh)
        return cfg, restore_params(p, sharding, dtype), hf_config, sharding
    hf_config = read_hf_config(p)
    cfg = ModelConfig.from_hf_config(hf_config, read_generation_config(p))
    sharding = ModelSharding(cfg, mesh)
    lazy = params_from_hf(cfg, iter_lazy_safetensors(p), dtype, source=str(p), convert=_lazy)
    return cfg, sharding.place_params(lazy, dtype), hf_config, sharding
