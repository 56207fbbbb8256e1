"""Checkpoint loading: a HF folder (safetensors), a GGUF file or a jaxllm orbax
folder, to a ``(ModelConfig, params)`` pair. :func:`load_model` gives host
numpy arrays; :func:`load_sharded` places them on a device mesh, each device
reading only its own slice. Each format loader yields an HF-style config dict
and HF-named tensors; a folder's ``generation_config.json`` adds its eos ids
to the model config's. ``jaxllm.loader.nnx`` converts a Flax NNX model's state to the same pytree."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh

from jaxllm.loader.orbax import is_orbax_checkpoint, restore_params
from jaxllm.loader.params import params_from_hf
from jaxllm.loader.safetensors import LazyStack, LazyTensor, iter_lazy_safetensors, iter_safetensors, read_hf_config
from jaxllm.models.config import ModelConfig
from jaxllm.paths import model_format, read_generation_config
from jaxllm.worker.quantization import check_quantization, quantize_params, weight_quantization
from jaxllm.worker.sharding import ModelSharding

if TYPE_CHECKING:
    from jaxllm.models.common import Params


def read_model_config(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """The model config of ``path`` and its HF-style config dict, read
    without any weights (a GGUF's metadata, a folder's config.json).

    The model config's ``eos_token_ids`` are those of the folder's
    ``generation_config.json`` then ``config.json`` (a GGUF's from its
    ``tokenizer.ggml.eos/eot/eom_token_id``), tokenizer files or not.

    Raises:
      ValueError: ``path`` is not a model (``jaxllm.paths.model_format``:
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


def load_model(path: str | os.PathLike, dtype: Any = np.float32,
               quantization: Optional[str] = None) -> tuple[ModelConfig, Params, dict]:
    """Load weights and config from ``path``.

    Args:
      path: a HF model folder (config.json + safetensors) or a GGUF file.
      dtype: numpy dtype of the parameters (``ml_dtypes.bfloat16`` for bf16).
      quantization: None, "int8" or "fp8": weight-only quantization of the
        dense projections (``jaxllm.worker.quantization``). With "int8", a GGUF's
        Q8_0 projections keep their int8 values and block scales.

    Returns:
      (model config as :func:`read_model_config`, parameter pytree of numpy
      arrays, the HF config dict).

    Raises:
      ValueError: as :func:`read_model_config`, a missing tensor (named), or
        an unknown ``quantization``.
    """
    check_quantization(quantization)
    p = Path(path)
    cfg, hf_config = read_model_config(p)
    if model_format(p) == "gguf":
        from jaxllm.loader.gguf import load_gguf

        tensors = load_gguf(p, dtype=np.float32, keep_q8_0=quantization == "int8")[1].items()
    else:
        tensors = iter_safetensors(p)
    return cfg, params_from_hf(cfg, tensors, dtype, source=str(p), quantization=quantization), hf_config


def _lazy(tensor: LazyTensor, transpose: bool, dtype: Any) -> LazyTensor:
    return tensor.as_transposed() if transpose else tensor


def load_sharded(path: str | os.PathLike, dtype: Any, mesh: Mesh,
                 quantization: Optional[str] = None) -> tuple[ModelConfig, Params, dict, ModelSharding]:
    """Load weights from ``path`` straight into their shardings on ``mesh``.

    A safetensors folder is read slice by slice (``get_slice``) and an orbax
    folder restored into the target shardings, so no device (and no host
    buffer) ever holds a whole sharded tensor. A GGUF file is dequantized on
    the host first (its quantized blocks do not slice), then placed slice by
    slice; so are the weights of a safetensors folder that is quantized at
    load (a per-channel scale needs the whole input axis).

    Args:
      path: a HF folder, a ``.gguf`` file, or an orbax folder
        (``jaxllm.loader.orbax``; detected by its ``params/`` tree).
      dtype: dtype of the device arrays (quantized weights keep theirs).
      mesh: the replica's ``(data, model)`` mesh.
      quantization: None, "int8" or "fp8" (:func:`load_model`). An orbax
        checkpoint written quantized restores as it was written (None or its
        own quantization asked for); an unquantized one is quantized after
        restoring.

    Returns:
      (model config, pytree of sharded ``jax.Array``s, HF config dict, the
      ModelSharding used).

    Raises:
      ValueError: as :func:`load_model`, heads that do not split over the
        mesh's ``model`` axis, or a quantized orbax checkpoint asked for
        another quantization (both named).
    """
    check_quantization(quantization)
    p = Path(path)
    cfg, hf_config = read_model_config(p)
    sharding = ModelSharding(cfg, mesh)
    if is_orbax_checkpoint(p):
        params = restore_params(p, sharding, dtype)
        stored = weight_quantization(params)
        if stored is not None and quantization not in (None, stored):
            raise ValueError(f"{p} holds {stored} weights; quantization={quantization!r} cannot be applied to "
                             f"them (convert the source again with --quantization {quantization})")
        if stored is None and quantization is not None:
            host = quantize_params(jax.device_get(params), quantization, dtype)
            params = sharding.place_params(host, dtype)
        return cfg, params, hf_config, sharding
    if model_format(p) == "gguf" or quantization is not None:
        return cfg, sharding.place_params(load_model(p, dtype, quantization)[1], dtype), hf_config, sharding
    lazy = params_from_hf(cfg, iter_lazy_safetensors(p), dtype, source=str(p), convert=_lazy, stack=LazyStack)
    return cfg, sharding.place_params(lazy, dtype), hf_config, sharding
