"""Flax NNX models to jaxllm's parameter pytree (``pip install jaxllm[nnx]``).

An ``nnx.Module`` whose submodules carry the names of the HF model's modules (an NNX Llama with
``model.embed_tokens``, ``model.layers[i].self_attn.q_proj``, ``model.layers[i].input_layernorm``, ...,
``model.norm``, ``lm_head``) converts leaf by leaf: each ``nnx.Param``'s path, joined with dots, names a HF
tensor, and :func:`jaxllm.loader.params.params_from_hf` places it as for a checkpoint of the model's family
(every tensor the family needs is required, shapes are checked)::

    NNX leaf (path.to.module.<leaf>)              HF tensor                    jaxllm leaf
    <module>.kernel     [in, out]  (nnx.Linear)   <module>.weight [out, in]    e.g. layers.wq [L, in, out]
    <module>.bias       [out]      (nnx.Linear)   <module>.bias
    <module>.embedding  [V, E]     (nnx.Embed)    <module>.weight              embed [V, E]
    <module>.scale      [E]        (nnx.RMSNorm)  <module>.weight              e.g. layers.attn_norm [L, E]

NNX kernels are ``[in, out]``, jaxllm's orientation, so the numbers are not changed, only stacked over the
layers. A model named otherwise passes ``rename``: its NNX dotted paths -> HF's module paths, the leaf name
kept (None drops the leaf). Kernels
must be 2-D (``nnx.Linear``; reshape an ``nnx.LinearGeneral``'s before converting). The config is the HF
``config.json`` dict of the same model (``ModelConfig.from_hf_config``).

:func:`save_nnx_as_hf` writes the same tensors as a HF folder (config.json + model.safetensors), which
``LLM`` and ``jaxllm serve`` load like any checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from jaxllm.loader.params import params_from_hf
from jaxllm.models.common import Params
from jaxllm.models.config import ModelConfig

# The last names of nnx.Linear's, nnx.Embed's and the norms' leaves -> the HF tensor's last name.
NNX_LEAVES = {"kernel": "weight", "bias": "bias", "embedding": "weight", "scale": "weight"}


def _nnx():
    try:
        from flax import nnx
    except ImportError as e:
        raise ImportError("converting an NNX model needs flax: pip install 'jaxllm[nnx]'") from e
    return nnx


def hf_tensors_from_nnx(model: Any, rename: Optional[Callable[[str], Optional[str]]] = None
                        ) -> Iterator[tuple[str, np.ndarray]]:
    """``(HF name, array in HF orientation)`` of every ``nnx.Param`` of ``model`` (module docstring).

    Args:
      model: an ``nnx.Module``, or its ``nnx.State`` (``nnx.state(module)``; other variables than
        ``nnx.Param`` are skipped).
      rename: NNX dotted path (``decoder.blocks.0.attn.wq.kernel``) -> the path of a module named as
        HF's, leaf name kept (``model.layers.0.self_attn.q_proj.kernel``), or None to drop the leaf;
        :data:`NNX_LEAVES` then renames the leaf.

    Raises:
      ValueError: a leaf whose last part is none of :data:`NNX_LEAVES` (without ``rename``), or a kernel
        that is not 2-D (both named with their path).
    """
    nnx = _nnx()
    state = model if isinstance(model, nnx.State) else nnx.state(model, nnx.Param)
    for path, variable in nnx.to_flat_state(state):
        if not isinstance(variable, nnx.Param):
            continue
        dotted = ".".join(str(part) for part in path)
        renamed = rename(dotted) if rename is not None else dotted
        if renamed is None:
            continue
        name = _hf_name(renamed)
        array = np.asarray(variable.get_value())
        if renamed.endswith(".kernel"):
            if array.ndim != 2:
                raise ValueError(f"NNX leaf {dotted!r} has shape {array.shape}: kernels must be 2-D [in, out]")
            array = array.T
        yield name, array


def _hf_name(dotted: str) -> str:
    module, _, leaf = dotted.rpartition(".")
    if leaf not in NNX_LEAVES:
        raise ValueError(f"NNX leaf {dotted!r}: the last name must be one of {sorted(NNX_LEAVES)} "
                         "(nnx.Linear, nnx.Embed, nnx.RMSNorm), or pass rename")
    return f"{module}.{NNX_LEAVES[leaf]}"


def params_from_nnx(model: Any, hf_config: dict[str, Any], dtype: Any = np.float32,
                    rename: Optional[Callable[[str], Optional[str]]] = None) -> tuple[ModelConfig, Params]:
    """The ``(ModelConfig, parameter pytree)`` of an NNX model, as ``jaxllm.loader.load_model`` gives them.

    Args:
      model: an ``nnx.Module`` or its ``nnx.State`` (:func:`hf_tensors_from_nnx`).
      hf_config: the model's HF ``config.json`` dict (its architecture picks the family).
      dtype: numpy dtype of the leaves (``ml_dtypes.bfloat16`` for bf16).
      rename: as :func:`hf_tensors_from_nnx`.

    Returns:
      The model config and the pytree of host numpy arrays (``jaxllm.models.common``), for
      ``jaxllm.models.forward`` or the engine.

    Raises:
      ValueError: as :func:`hf_tensors_from_nnx`, an unsupported config, or a tensor the family needs that
        the model lacks, or of the wrong shape (``params_from_hf``).
    """
    cfg = ModelConfig.from_hf_config(hf_config)
    return cfg, params_from_hf(cfg, hf_tensors_from_nnx(model, rename), dtype, source="the NNX model")


def save_nnx_as_hf(model: Any, hf_config: dict[str, Any], folder: Any,
                   rename: Optional[Callable[[str], Optional[str]]] = None) -> Path:
    """Write an NNX model as a HF folder: ``config.json`` (``hf_config``) and ``model.safetensors``
    (:func:`hf_tensors_from_nnx`'s tensors); add the tokenizer files to serve it. Returns the folder.

    Raises:
      ValueError: as :func:`params_from_nnx` (the tensors are checked against the config before writing).
    """
    from safetensors.numpy import save_file

    params_from_nnx(model, hf_config, rename=rename)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    tensors = {name: np.ascontiguousarray(a) for name, a in hf_tensors_from_nnx(model, rename)}
    save_file(tensors, str(out / "model.safetensors"))
    return out
