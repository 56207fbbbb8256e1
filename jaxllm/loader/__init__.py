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
from jaxllm.loader.orbax import is_orbax_checkpoint, restore_params
from jaxllm.loader.params import params_from_hf
from jaxllm.loader.safetensors import LazyStack, LazyTensor, iter_lazy_safetensors, iter_safetensors, read_hf_config
from jaxllm.model_path import model_format, read_generation_config
from jaxllm.models.common import Params
from jaxllm.sharding import ModelSharding


def read_model_config(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """The model config of ``path`` and its HF-style config dict, read
    without any weights (a GGUF's metadata, a folder's config.json).

    The model config's ``eos_token_ids`` are those of the folder's
    ``generation_config.json`` then ``config.json`` (a GGUF's from its
    ``tokenizer.ggml.eos/eot/eom_token_id``), tokenizer files or not.

    Raises:
      ValueError: ``path`` is not a model (``jaxllm.model_path.model_format``:
        missing, a file that is not a GGUF, a folder without config.json), or
        its config holds an unsupported architecture (named).
    """
    p = Path(path)
    if model_format(p) == "gguf":
        from jaxllm.loader.gguf import read_gguf_config

        hf_config = read_gguf_config(p)
        return ModelConfig.from_hf_config(hf_config), hf_config
    hf_config = read_hf_config(p)
    return ModelConfig.from_hf_config(hf_config, read_generation_config(p)), hf_config


def load_model(path: str | os.PathLike, dtype: Any = np.float32) -> tuple[ModelConfig, Params, dict]:
    """Load weights and config from ``path``.

    Args:
      path: a HF model folder (config.json + safetensors) or a GGUF file.
      dtype: numpy dtype of the parameters (``ml_dtypes.bfloat16`` for bf16).

    Returns:
      (model config as :func:`read_model_config`, parameter pytree of numpy
      arrays, the HF config dict).

    Raises:
      ValueError: as :func:`read_model_config`, or a missing tensor (named).
    """
    p = Path(path)
    cfg, hf_config = read_model_config(p)
    if model_format(p) == "gguf":
        from jaxllm.loader.gguf import load_gguf

        tensors = load_gguf(p, dtype=np.float32)[1].items()
    else:
        tensors = iter_safetensors(p)
    return cfg, params_from_hf(cfg, tensors, dtype, source=str(p)), hf_config


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
    cfg, hf_config = read_model_config(p)
    sharding = ModelSharding(cfg, mesh)
    if model_format(p) == "gguf":
        return cfg, sharding.place_params(load_model(p, dtype)[1], dtype), hf_config, sharding
    if is_orbax_checkpoint(p):
        return cfg, restore_params(p, sharding, dtype), hf_config, sharding
    lazy = params_from_hf(cfg, iter_lazy_safetensors(p), dtype, source=str(p), convert=_lazy, stack=LazyStack)
    return cfg, sharding.place_params(lazy, dtype), hf_config, sharding
