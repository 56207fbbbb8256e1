"""Checkpoint loading: a HF folder (safetensors), a GGUF file or a jaxllm orbax folder -> ``(ModelConfig, params)``.

:func:`load_model` gives host numpy arrays; :func:`load_sharded` places them on a mesh, each device reading
only its own slice.
"""

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
from jaxllm.worker.weights import place_params

if TYPE_CHECKING:
    from jaxllm.models.common import Params


def read_model_config(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """The model config of ``path`` and its HF-style config dict, read without weights.

    ``eos_token_ids`` come from ``generation_config.json`` then ``config.json`` (a GGUF's metadata).

    Raises:
      ValueError: ``path`` is not a model, or its architecture is unsupported (named).
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
    """Load weights and config from ``path`` (a HF folder or a GGUF file) as host arrays.

    Args:
      dtype: numpy dtype of the parameters (``ml_dtypes.bfloat16`` for bf16).
      quantization: None, "int8" or "fp8" weight-only quantization of the dense projections ("int8" keeps a
        GGUF's Q8_0 blocks).

    Returns:
      (model config, parameter pytree of numpy arrays, the HF config dict).

    Raises:
      ValueError: as :func:`read_model_config`, a missing tensor (named), or an unknown ``quantization``.
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
    """Load weights from ``path`` straight into their shardings on ``mesh``, slice by slice.

    A GGUF, and a folder quantized at load, are read whole on the host first.

    Args:
      path: a HF folder, a ``.gguf`` file, or an orbax folder (with a ``params/`` tree).
      dtype: dtype of the device arrays (quantized weights keep theirs). mesh: the ``(data, model)`` mesh.
      quantization: as :func:`load_model`; a quantized orbax checkpoint restores as written.

    Returns:
      (model config, pytree of sharded ``jax.Array``s, HF config dict, the ModelSharding used).

    Raises:
      ValueError: as :func:`load_model`, heads that do not split over ``model``, or a quantized orbax
        checkpoint asked for another quantization.
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
            params = place_params(sharding, host, dtype)
        return cfg, params, hf_config, sharding
    if model_format(p) == "gguf" or quantization is not None:
        return cfg, place_params(sharding, load_model(p, dtype, quantization)[1], dtype), hf_config, sharding
    lazy = params_from_hf(cfg, iter_lazy_safetensors(p), dtype, source=str(p), convert=_lazy, stack=LazyStack)
    return cfg, place_params(sharding, lazy, dtype), hf_config, sharding
