"""Flax NNX models to jaxllm's parameter pytree (``pip install jaxllm[nnx]``).

An ``nnx.Module`` whose submodules carry the HF model's module names converts leaf by leaf through
:func:`jaxllm.loader.params.params_from_hf`::

    NNX leaf                          HF tensor                    jaxllm leaf
    <module>.kernel [in, out]         <module>.weight [out, in]    e.g. layers.wq [L, in, out]
    <module>.bias [out]               <module>.bias
    <module>.embedding [V, E]         <module>.weight              embed [V, E]
    <module>.scale [E]                <module>.weight              e.g. layers.attn_norm [L, E]

Other names pass ``rename``; kernels must be 2-D. :func:`save_nnx_as_hf` writes a loadable HF folder.

A model whose class has a name map (``jaxllm.loader.nnx_names``: tunix's Llama 3, Qwen 2/3, Gemma 3), or one given
``name_map``, converts instead on its own devices, fused and einsum kernels included, with no host copy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from jaxllm.loader.nnx_names import NameMap, jaxllm_leaves, name_map_of
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
    """``(HF name, array in HF orientation)`` of every ``nnx.Param`` of ``model`` (a Module or its State).

    ``rename``: NNX dotted path -> HF module path with the leaf name kept, or None to drop the leaf.

    Raises:
      ValueError: an unknown leaf name (without ``rename``) or a kernel that is not 2-D (path named).
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
                    rename: Optional[Callable[[str], Optional[str]]] = None,
                    name_map: Optional[NameMap] = None) -> tuple[ModelConfig, Params]:
    """The ``(ModelConfig, parameter pytree)`` of an NNX model, as ``jaxllm.loader.load_model`` gives them.

    Args:
      model, rename: as :func:`hf_tensors_from_nnx`. hf_config: the HF ``config.json`` dict.
      dtype: dtype of the leaves (``ml_dtypes.bfloat16`` / ``jnp.bfloat16`` for bf16).
      name_map: the model's names (default: its class's entry in ``jaxllm.loader.nnx_names.NAME_MAPS``, unless
        ``rename`` is given); with one, the leaves are device arrays computed where the model's are.

    Returns:
      host numpy leaves through ``rename`` / HF names, or device arrays through a name map.

    Raises:
      ValueError: as :func:`hf_tensors_from_nnx` or ``nnx_names.jaxllm_leaves``, an unsupported config, or a
        missing or misshapen tensor.
    """
    cfg = ModelConfig.from_hf_config(hf_config)
    if name_map is None and rename is None:
        name_map = name_map_of(model)
    if name_map is None:
        return cfg, params_from_hf(cfg, hf_tensors_from_nnx(model, rename), dtype, source="the NNX model")
    return cfg, params_from_mapped_nnx(model, cfg, name_map, dtype)


def nnx_param_arrays(model: Any, lora: bool = False) -> dict[str, Any]:
    """NNX dotted path -> array of every ``nnx.Param`` of ``model`` (a Module or a State) but its
    ``nnx.LoRAParam`` leaves (a LoRA model's base weights), or with ``lora`` of those only; no copies."""
    nnx = _nnx()
    state = model if isinstance(model, nnx.State) else nnx.state(model, nnx.Param)
    return {".".join(str(part) for part in path): variable.get_value()
            for path, variable in nnx.to_flat_state(state)
            if isinstance(variable, nnx.Param) and isinstance(variable, nnx.LoRAParam) == lora}


def params_from_mapped_nnx(model: Any, cfg: ModelConfig, name_map: NameMap, dtype: Any) -> Params:
    """The parameter pytree of a Module or State through ``name_map``, as device arrays of ``dtype``.

    Raises:
      ValueError: as ``nnx_names.jaxllm_leaves``, or a leaf of ``cfg``'s family that the model lacks (named).
    """
    from jaxllm.models import family

    params: dict[str, Any] = {"layers": {}}
    for path, leaf in jaxllm_leaves(nnx_param_arrays(model), name_map, cfg.num_layers):
        where, _, key = path.rpartition("/")
        (params["layers"] if where else params)[key] = leaf.astype(dtype)
    if cfg.tie_word_embeddings:
        params.pop("lm_head", None)
    want_top = {"embed", "final_norm"} | (set() if cfg.tie_word_embeddings else {"lm_head"})
    missing = sorted(want_top - params.keys()) + sorted(
        f"layers/{k}" for k in family(cfg).layer_keys(cfg) - params["layers"].keys())
    if missing:
        raise ValueError(f"the NNX model lacks leaves {cfg.architecture} needs: {missing}")
    return params


def save_nnx_as_hf(model: Any, hf_config: dict[str, Any], folder: Any,
                   rename: Optional[Callable[[str], Optional[str]]] = None) -> Path:
    """Write an NNX model as a HF folder (``config.json`` and ``model.safetensors``); returns the folder.

    Raises:
      ValueError: as :func:`params_from_nnx` (checked before writing).
    """
    from safetensors.numpy import save_file

    params_from_nnx(model, hf_config, rename=rename)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    tensors = {name: np.ascontiguousarray(a) for name, a in hf_tensors_from_nnx(model, rename)}
    save_file(tensors, str(out / "model.safetensors"))
    return out
