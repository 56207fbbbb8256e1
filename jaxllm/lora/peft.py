"""A PEFT LoRA folder read into the engine's layout (numpy only; PEFT's ``LoraConfig`` and tensor names).

PEFT stores ``lora_A.weight: [r, in]`` and ``lora_B.weight: [out, r]`` per targeted linear layer; the adapted
layer computes ``x W + scale * (x A^T) B^T`` with ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``). Here each target is one pair of stacked arrays in the engine's ``[in, out]`` orientation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Mapping

import numpy as np

# The engine's projection keys an adapter may target.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

# PEFT options that change the maths beyond plain (rs)LoRA on the projections: refused, named.
_UNSUPPORTED = {"use_dora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
                "fan_in_fan_out": False, "bias": "none", "layers_to_transform": None, "lora_bias": False}


@dataclasses.dataclass
class LoRAWeights:
    """One adapter on the host.

    Attributes:
      rank: PEFT's ``r``. scale: the factor applied to ``x A B`` (alpha / r, or alpha / sqrt(r) for rsLoRA).
      tensors: target key (``LORA_TARGETS``) -> ``(A float32 [L, in, rank], B float32 [L, rank, out])``, unscaled;
        a layer the adapter leaves alone has zeros. Numpy, or the device arrays ``LLM.update_lora`` was given.
    """

    rank: int
    scale: float
    tensors: dict[str, tuple[np.ndarray, np.ndarray]]

    def tree(self) -> dict[str, np.ndarray]:
        """The tensors as ``{"layers/<key>_lora_a": A, "layers/<key>_lora_b": B}``, the layout ``LLM.update_lora``
        and ``jaxllm.models.dense_forward``'s ``lora`` take."""
        return {f"layers/{key}_lora_{ab}": value for key, pair in self.tensors.items() for ab, value in zip("ab", pair)}


def lora_scale(rank: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's scaling: ``alpha / sqrt(rank)`` with rsLoRA, else ``alpha / rank``."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def read_peft_adapter(path: str, *, name: str, hf_layer_names: Mapping[str, tuple[str, bool]],
                      hf_layer_prefix: str, shapes: Mapping[str, tuple[int, int]], num_layers: int,
                      max_rank: int) -> LoRAWeights:
    """Read the PEFT LoRA folder ``path`` (``adapter_config.json``, ``adapter_model.safetensors``).

    Args:
      name: the adapter's name, for errors. hf_layer_names, hf_layer_prefix: the family's (``Family``).
      shapes: target key -> the projection's ``(in, out)``. num_layers: the model's layers.
      max_rank: the engine's ``max_lora_rank``.

    Raises:
      ValueError: a missing file (the message says "No adapter found", as vLLM's, which its server answers with
        404), ``r`` above ``max_rank``, a target module the engine cannot adapt, a PEFT option it does not run
        (named), or a tensor of the wrong shape (named).
    """
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for file in (config_file, weights_file):
        if not file.is_file():
            raise ValueError(f"LoRA adapter {name!r}: No adapter found at {path}: {file} is missing (a PEFT folder "
                             "has adapter_config.json and adapter_model.safetensors)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type={config['peft_type']!r} is not LORA")
    for option, default in _UNSUPPORTED.items():
        if config.get(option, default) not in (default, None, {}, False, "none"):
            raise ValueError(f"LoRA adapter {name!r}: {option}={config[option]!r} is not supported (plain LoRA on "
                             f"the attention and MLP projections only)")
    rank = int(config["r"])
    if not 1 <= rank <= max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank r={rank} is above max_lora_rank={max_rank}"
                         if rank > max_rank else f"LoRA adapter {name!r}: rank r={rank} must be >= 1")
    scale = lora_scale(rank, float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False)))
    adapted = sorted(m.rsplit('.weight', 1)[0] for m, (k, _) in hf_layer_names.items() if k in LORA_TARGETS)
    # A list names modules (a string is PEFT's regex, checked tensor by tensor below).
    if isinstance(config.get("target_modules"), list):
        short = {m.rsplit(".", 1)[-1] for m in adapted}
        unknown = [t for t in config["target_modules"] if t.rsplit(".", 1)[-1] not in short]
        if unknown:
            raise ValueError(f"LoRA adapter {name!r}: target module {unknown[0]!r} is not supported; the engine "
                             f"adapts {adapted} of the decoder layers")

    from safetensors.numpy import load_file

    lora_tensor = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
    in_layer = re.compile(rf"{re.escape(hf_layer_prefix)}(\d+)\.(.+)$")
    tensors: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for tensor_name, value in load_file(str(weights_file)).items():
        found = lora_tensor.search(tensor_name)
        if found is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {tensor_name!r} is not a LoRA A or B")
        module, which = found[1], found[2]
        layer_module = in_layer.search(module)
        key = None if layer_module is None else hf_layer_names.get(f"{layer_module[2]}.weight", (None,))[0]
        if key not in LORA_TARGETS:
            target = module if layer_module is None else layer_module[2]
            raise ValueError(f"LoRA adapter {name!r}: target module {target!r} is not supported; the engine adapts "
                             f"{adapted} of the decoder layers")
        layer = int(layer_module[1])
        if not 0 <= layer < num_layers:
            raise ValueError(f"LoRA adapter {name!r}: tensor {tensor_name!r} names layer {layer}; the model has "
                             f"{num_layers}")
        fan_in, fan_out = shapes[key]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(value.shape) != want:
            raise ValueError(f"LoRA adapter {name!r}: tensor {tensor_name!r} has shape {tuple(value.shape)}; "
                             f"expected {want}")
        if key not in tensors:
            tensors[key] = (np.zeros((num_layers, fan_in, rank), np.float32),
                            np.zeros((num_layers, rank, fan_out), np.float32))
        tensors[key][0 if which == "A" else 1][layer] = np.asarray(value, np.float32).T
    if not tensors:
        raise ValueError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA tensors")
    return LoRAWeights(rank, scale, tensors)
