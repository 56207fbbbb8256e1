"""Name maps from NNX model classes to jaxllm's parameter pytree, declared once per family, converted on the device.

A :class:`NameMap` lists, per NNX leaf path (a layer's relative to ``layers.<i>.``), the jaxllm leaf it becomes and
how its axes move, as an axis spec: ``"e n h -> e (n h)"`` merges a ``[E, N, H]`` einsum kernel into jaxllm's ``[in, out]``;
a leaf listing several jaxllm keys is a fused kernel, split along the spec's first output axis into them in order
(Gemma's ``[3, N, E, H]`` qkv einsum -> ``wq, wk, wv``). jaxllm's leaves (``layers/<key>``
stacked ``[L, ...]``) are in ``jaxllm.models.layout``. :data:`NAME_MAPS` holds tunix's Llama 3, Qwen 2, Qwen 3
(dense) and Gemma 3 text models, keyed by class (``module.QualName``); their axes follow tunix's
``models/<family>/params.py`` loaders, whose HF checkpoints jaxllm reads with the same numbers.

The same map converts a qwix LoRA actor's adapter (:func:`jaxllm_lora_leaves`): qwix names a kernel's pair
``<kernel>_lora_a`` (the kernel's input axes, then the rank) and ``<kernel>_lora_b`` (the rank, then its output axes),
which become the engine's ``layers/<key>_lora_a [L, in, r]`` and ``layers/<key>_lora_b [L, r, out]``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Iterator, Mapping, Union

import jax
import jax.numpy as jnp

Keys = Union[str, tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class NameMap:
    """NNX leaf path -> ``(jaxllm key or keys, axis spec)``.

    ``top``: leaves outside the layers, to top-level keys (``embed``, ``final_norm``, ``lm_head``).
    ``layer``: leaves under ``<layers>.<i>.`` (``layers`` names the module list), to layer keys (``wq``, ...).
    """

    top: Mapping[str, tuple[Keys, str]]
    layer: Mapping[str, tuple[Keys, str]]
    layers: str = "layers"


def _parse(spec: str) -> tuple[list[str], list[list[str]]]:
    lhs, rhs = (side.strip() for side in spec.split("->"))
    groups = [group.split() for group in re.findall(r"\(([^)]*)\)|(\S+)", rhs) for group in [group[0] or group[1]]]
    return lhs.split(), groups


@functools.lru_cache(maxsize=None)
def _converter(spec: str, split: bool, num_layers: int):
    """A jitted ``(*per-layer arrays) -> stacked leaf (or leaves, split)`` for ``spec``."""
    lhs, groups = _parse(spec)
    order = [lhs.index(axis) for group in groups for axis in group]

    def one(x: jax.Array) -> jax.Array:
        sizes = dict(zip(lhs, x.shape))
        shape = [math.prod(sizes[a] for a in group) for group in groups]
        return jnp.transpose(x, order).reshape(shape)

    def convert(*arrays: jax.Array) -> Any:
        out = jnp.stack([one(a) for a in arrays]) if num_layers else one(arrays[0])
        if split:
            return tuple(out[:, j] if num_layers else out[j] for j in range(out.shape[1 if num_layers else 0]))
        return out

    return jax.jit(convert)


def _check_spec(path: str, keys: Keys, spec: str, shape: tuple[int, ...]) -> None:
    lhs, _ = _parse(spec)
    split = isinstance(keys, tuple)
    if len(lhs) != len(shape) or (split and shape[0] != len(keys)):
        raise ValueError(f"NNX leaf {path!r} has shape {shape}; its name map expects axes {' '.join(lhs)}"
                         + (f" with {len(keys)} fused along the first" if split else ""))


def jaxllm_leaves(flat: Mapping[str, jax.Array], name_map: NameMap, num_layers: int
                  ) -> Iterator[tuple[str, jax.Array]]:
    """``(jaxllm path, device array)`` per jaxllm leaf (``"embed"``, ``"layers/wq"``, ...), one leaf kind at a time.

    Args:
      flat: NNX dotted path -> array (``[in..., out...]`` as the NNX module holds it), on any devices.
      name_map: the model's :class:`NameMap`. num_layers: the decoder's layer count.

    Yields:
      each jaxllm leaf once, in the map's order, computed on the leaves' devices (jitted transposes and reshapes,
      no host copy); extra memory at a time is one stacked leaf.

    Raises:
      ValueError: a leaf the map does not name, a missing layer leaf, or a shape that does not fit the spec
        (the NNX path named).
    """
    prefix = re.compile(rf"{re.escape(name_map.layers)}\.(\d+)\.(.+)")
    top: dict[str, jax.Array] = {}
    per_layer: dict[str, dict[int, jax.Array]] = {}
    for path, array in flat.items():
        match = prefix.fullmatch(path)
        if match and match.group(2) in name_map.layer:
            per_layer.setdefault(match.group(2), {})[int(match.group(1))] = array
        elif not match and path in name_map.top:
            top[path] = array
        else:
            known = sorted(name_map.top) + [f"{name_map.layers}.*.{p}" for p in sorted(name_map.layer)]
            raise ValueError(f"NNX leaf {path!r} is not in the model's name map (known: {known})")
    for path, array in top.items():
        keys, spec = name_map.top[path]
        _check_spec(path, keys, spec, tuple(array.shape))
        yield from _named(keys, _converter(spec, isinstance(keys, tuple), 0)(array), "")
    for path, arrays in per_layer.items():
        keys, spec = name_map.layer[path]
        missing = [i for i in range(num_layers) if i not in arrays]
        if missing:
            raise ValueError(f"NNX leaf {name_map.layers}.{missing[0]}.{path} is missing ({num_layers} layers)")
        _check_spec(f"{name_map.layers}.0.{path}", keys, spec, tuple(arrays[0].shape))
        stacked = _converter(spec, isinstance(keys, tuple), num_layers)(*(arrays[i] for i in range(num_layers)))
        yield from _named(keys, stacked, "layers/")


def _lora_specs(spec: str, split: bool) -> tuple[str, str]:
    """Axis specs of a qwix LoRA pair from its kernel's ``spec``: A holds the kernel's input axes (those of the
    jaxllm leaf's ``in`` group, in the kernel's order) then the rank ``r``; B the rank then the other axes."""
    lhs, groups = _parse(spec)
    fused, (fan_in, fan_out) = (groups[0], groups[1:]) if split else ([], groups)
    a_axes = [axis for axis in lhs if axis in fan_in]
    b_axes = [axis for axis in lhs if axis not in fan_in]
    group = lambda axes: "(" + " ".join(axes) + ")"  # noqa: E731
    fused_out = group(fused) + " " if fused else ""
    return (f"{' '.join(a_axes)} r -> {group(fan_in)} r",
            f"r {' '.join(b_axes)} -> {fused_out}r {group(fan_out)}")


def jaxllm_lora_leaves(flat: Mapping[str, jax.Array], name_map: NameMap, num_layers: int
                       ) -> Iterator[tuple[str, jax.Array]]:
    """``(jaxllm path, device array)`` per LoRA leaf of the engine (``"layers/wq_lora_a"`` ``[L, in, r]``,
    ``"layers/wq_lora_b"`` ``[L, r, out]``) from a qwix LoRA model's ``nnx.LoRAParam`` leaves, unscaled.

    Args:
      flat: NNX dotted path -> array (``layers.<i>.<kernel>_lora_a`` / ``_lora_b``, as qwix names them), on any
        devices. name_map: the model's :class:`NameMap` (its layer kernels). num_layers: the decoder's layers.

    Yields:
      each engine leaf once, converted on the leaves' devices (jitted, no host copy); a fused kernel's pair
      (Gemma's qkv) gives each of its keys the shared A and its own slice of B.

    Raises:
      ValueError: a leaf that is not the LoRA pair of a layer kernel of the map (an embedding's, the head's), a
        missing layer or half of a pair, or a shape that does not fit the kernel's axes (the NNX path named).
    """
    prefix = re.compile(rf"{re.escape(name_map.layers)}\.(\d+)\.(.+)_lora_([ab])")
    per_layer: dict[tuple[str, str], dict[int, jax.Array]] = {}
    for path, array in flat.items():
        match = prefix.fullmatch(path)
        if not match or match.group(2) not in name_map.layer:
            known = [f"{name_map.layers}.*.{p}_lora_a" for p in sorted(name_map.layer)]
            raise ValueError(f"NNX LoRA leaf {path!r} is not the LoRA pair of a layer kernel the engine adapts "
                             f"(known: {known}, and their _lora_b)")
        per_layer.setdefault((match.group(2), match.group(3)), {})[int(match.group(1))] = array
    for (kernel, which), arrays in per_layer.items():
        where = f"{name_map.layers}.{{}}.{kernel}_lora_{which}"
        missing = [i for i in range(num_layers) if i not in arrays]
        if missing or (kernel, "ab"[which == "a"]) not in per_layer:
            raise ValueError(f"NNX LoRA leaf {where.format(missing[0] if missing else 0)}"
                             + (f" is missing ({num_layers} layers)" if missing else
                                f" has no {'ab'[which == 'a']} half"))
        keys, spec = name_map.layer[kernel]
        split = isinstance(keys, tuple)
        lora_spec = _lora_specs(spec, split)[which == "b"]
        lhs, _ = _parse(lora_spec)
        shape = tuple(arrays[0].shape)
        if len(lhs) != len(shape) or (split and which == "b" and shape[1] != len(keys)):
            raise ValueError(f"NNX LoRA leaf {where.format(0)} has shape {shape}; its kernel's name map expects "
                             f"axes {' '.join(lhs)}")
        stacked = _converter(lora_spec, split and which == "b", num_layers)(*(arrays[i] for i in range(num_layers)))
        if split and which == "a":
            stacked = (stacked,) * len(keys)
        yield from _named(tuple(f"{k}_lora_{which}" for k in keys) if split else f"{keys}_lora_{which}", stacked,
                          "layers/")


def _named(keys: Keys, value: Any, prefix: str) -> Iterator[tuple[str, jax.Array]]:
    if isinstance(keys, tuple):
        yield from ((prefix + key, part) for key, part in zip(keys, value))
    else:
        yield prefix + keys, value


_LLAMA_TOP = {"embedder.input_embedding": ("embed", "v e -> v e"), "final_norm.w": ("final_norm", "e -> e"),
              "lm_head.w": ("lm_head", "e v -> e v")}
_LLAMA_LAYER = {
    "input_layernorm.w": ("attn_norm", "e -> e"), "post_attention_layernorm.w": ("mlp_norm", "e -> e"),
    "attn.q_proj.w": ("wq", "e n h -> e (n h)"), "attn.k_proj.w": ("wk", "e n h -> e (n h)"),
    "attn.v_proj.w": ("wv", "e n h -> e (n h)"), "attn.o_proj.w": ("wo", "n h e -> (n h) e"),
    "mlp.gate_proj.kernel": ("w_gate", "e f -> e f"), "mlp.up_proj.kernel": ("w_up", "e f -> e f"),
    "mlp.down_proj.kernel": ("w_down", "f e -> f e"),
}
LLAMA3 = NameMap(top=_LLAMA_TOP, layer=_LLAMA_LAYER)
QWEN2 = NameMap(top=_LLAMA_TOP, layer={**_LLAMA_LAYER, "attn.q_bias": ("bq", "x -> x"),
                                       "attn.k_bias": ("bk", "x -> x"), "attn.v_bias": ("bv", "x -> x")})
QWEN3 = NameMap(top=_LLAMA_TOP, layer={**_LLAMA_LAYER, "attn.q_norm.w": ("q_norm", "h -> h"),
                                       "attn.k_norm.w": ("k_norm", "h -> h")})
GEMMA3 = NameMap(
    top={"embedder.input_embedding": ("embed", "v e -> v e"), "final_norm.scale": ("final_norm", "e -> e")},
    layer={
        "pre_attention_norm.scale": ("attn_norm", "e -> e"), "post_attention_norm.scale": ("post_attn_norm", "e -> e"),
        "pre_ffw_norm.scale": ("mlp_norm", "e -> e"), "post_ffw_norm.scale": ("post_mlp_norm", "e -> e"),
        "attn._query_norm.scale": ("q_norm", "h -> h"), "attn._key_norm.scale": ("k_norm", "h -> h"),
        # Fused when the heads are as many as the KV heads, else q apart and k, v fused.
        "attn.qkv_einsum.w": (("wq", "wk", "wv"), "s n e h -> s e (n h)"),
        "attn.q_einsum.w": ("wq", "n e h -> e (n h)"),
        "attn.kv_einsum.w": (("wk", "wv"), "s k e h -> s e (k h)"),
        "attn.attn_vec_einsum.w": ("wo", "n h e -> (n h) e"),
        "mlp.gate_proj.kernel": ("w_gate", "e f -> e f"), "mlp.up_proj.kernel": ("w_up", "e f -> e f"),
        "mlp.down_proj.kernel": ("w_down", "f e -> f e"),
    })

# NNX model class (``type(model).__module__ + "." + __qualname__``) -> its name map.
NAME_MAPS: dict[str, NameMap] = {
    "tunix.models.llama3.model.Llama3": LLAMA3,
    "tunix.models.qwen2.model.Qwen2": QWEN2,
    "tunix.models.qwen3.model.Qwen3": QWEN3,
    "tunix.models.gemma3.model.Gemma3": GEMMA3,
}


def name_map_of(model: Any) -> NameMap | None:
    """The :data:`NAME_MAPS` entry of ``model``'s class or of the nearest base class that has one (qwix's LoRA and
    quantized models are instances of a subclass it makes), or None."""
    return next((NAME_MAPS[f"{cls.__module__}.{cls.__qualname__}"] for cls in type(model).__mro__
                 if f"{cls.__module__}.{cls.__qualname__}" in NAME_MAPS), None)
