"""Device meshes and partition rules: where every parameter and KV block lives.

Tensor parallelism follows Megatron-LM (column-parallel q/k/v and gate/up, row-parallel o and down, vocabulary-split
embedding and lm_head; experts split over their FFN dimension); declared as in jax-llm-examples: each parameter names
logical axes (:data:`PARAM_AXES`), one table maps them to mesh axes (:meth:`ModelSharding.logical_rules`). The mesh is
``(data, model)``: engine replicas by tensor-parallel devices. With fewer KV heads than devices, the cache holds one
head per device, a copy of the KV head its q heads read (as vLLM). docs/design/worker.md has the details.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.models import family
from jaxllm.models.common import LORA_A, LORA_B
from jaxllm.models.config import ModelConfig
from kernels_pallas.ops import AttentionOps

if TYPE_CHECKING:
    from jaxllm.models.common import Params

try:
    from jax import shard_map
except ImportError:  # JAX releases that ship shard_map only under jax.experimental
    from jax.experimental.shard_map import shard_map

DATA_AXIS = "data"
MODEL_AXIS = "model"

# Logical axes of every parameter, by pytree key (layer keys and top-level
# keys share one namespace). None: an axis that is never split.
PARAM_AXES: dict[str, tuple[Optional[str], ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    "wq": ("embed", "heads"),
    "wk": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"),
    "bq": ("heads",),
    "bk": ("kv_heads",),
    "bv": ("kv_heads",),
    "bo": ("embed",),
    "q_norm": (None,),
    "k_norm": (None,),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "b_gate": ("mlp",),
    "b_up": ("mlp",),
    "b_down": ("embed",),
    "post_attn_norm": ("embed",),
    "post_mlp_norm": ("embed",),
    # Mixture of experts: split over each expert's FFN dimension, never over the experts (models/moe.py).
    "router": ("embed", None),
    "experts_gate": (None, "embed", "mlp"),
    "experts_up": (None, "embed", "mlp"),
    "experts_down": (None, "mlp", "embed"),
    # A quantized KV cache's scales [num_cache_heads] per layer: split like the cache's heads.
    "k_scale": ("cache_heads",),
    "v_scale": ("cache_heads",),
}
# A quantized weight's "<key>_scale" takes the weight's axes: all of them for group scales
# [..., G, out] (groups of input rows split with those rows), all but the input axis for
# per-channel scales [..., out] (jaxllm.worker.quantization).
SCALE_SUFFIX = "_scale"


def _axes(key: str, ndim: int, table: dict[str, tuple[Optional[str], ...]]) -> tuple[Optional[str], ...]:
    """Logical axes of parameter ``key`` in ``table`` (a ``_scale`` takes its weight's, a LoRA slot leaf its
    projection's input or output axis; unknown: replicated)."""
    if key in table:
        return table[key]
    if key.endswith(SCALE_SUFFIX) and key[: -len(SCALE_SUFFIX)] in table:
        return table[key[: -len(SCALE_SUFFIX)]]
    # A LoRA slot leaf of a projection (jaxllm.worker.lora): A [N, in, R] takes the projection's input axis, B
    # [N, R, out] its output axis, so a column-parallel projection's B splits with its columns (A replicated) and a
    # row-parallel one's A with its rows (B replicated; x A is a partial sum reduced like the projection's own).
    if key.endswith(LORA_A) and key[: -len(LORA_A)] in table:
        return (None, table[key[: -len(LORA_A)]][0], None)
    if key.endswith(LORA_B) and key[: -len(LORA_B)] in table:
        return (None, None, table[key[: -len(LORA_B)]][-1])
    return (None,) * ndim


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Join a multi-host run (``jax.distributed.initialize``), first thing, one process per host;
    ``process_id`` in ``[0, num_processes)``, ``coordinator_address`` ``"host:port"`` of process 0."""
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A ``(data, model)`` mesh of ``data_parallel_size x tensor_parallel_size`` devices in ``jax.devices()``
    order (ValueError for a size below 1 or too few devices)."""
    for name, value in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    devices = list(jax.devices() if devices is None else devices)
    need = tensor_parallel_size * data_parallel_size
    if need > len(devices):
        # On CPU, JAX shows one device unless told at start-up how many to make of the host.
        hint = (f" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={need} makes {need})"
                if devices and devices[0].platform == "cpu" else "")
        raise ValueError(
            f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tensor_parallel_size} needs "
            f"{need} devices; {len(devices)} {'is' if len(devices) == 1 else 'are'} available{hint}"
        )
    grid = np.asarray(devices[:need], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ``(1, tp)`` mesh per row of ``mesh``'s ``data`` axis: a replica's devices."""
    return [Mesh(mesh.devices[d:d + 1], mesh.axis_names) for d in range(mesh.devices.shape[0])]


def check_tensor_parallel(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """Raise ValueError unless q heads divide over ``tensor_parallel_size`` and KV heads divide it or
    are divided by it."""
    tp = tensor_parallel_size
    if cfg.num_q_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={cfg.num_q_heads}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} and num_key_value_heads={cfg.num_kv_heads}: one must divide the other"
        )


@dataclasses.dataclass(frozen=True)
class ModelSharding:
    """Shardings of one replica's parameters, KV cache and step inputs on ``mesh`` (``(data, model)``, data
    of size 1); ValueError where heads do not split (:func:`check_tensor_parallel`)."""

    cfg: ModelConfig
    mesh: Mesh

    def __post_init__(self) -> None:
        check_tensor_parallel(self.cfg, self.tensor_parallel_size)

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh.shape[MODEL_AXIS]

    @property
    def kv_heads_replicated(self) -> bool:
        """True when devices outnumber KV heads, so each KV head lives on several devices."""
        return self.cfg.num_kv_heads < self.tensor_parallel_size

    @property
    def num_cache_heads(self) -> int:
        """Heads of the (global) KV cache: ``num_kv_heads``, or one per device when replicated."""
        return max(self.cfg.num_kv_heads, self.tensor_parallel_size)

    def logical_rules(self) -> dict[Optional[str], Optional[str]]:
        """Logical axis -> mesh axis (None: replicated)."""
        return {
            "vocab": MODEL_AXIS,
            "embed": None,
            "heads": MODEL_AXIS,
            "kv_heads": None if self.kv_heads_replicated else MODEL_AXIS,
            "cache_heads": MODEL_AXIS,
            "mlp": MODEL_AXIS,
            None: None,
        }

    def spec(self, logical_axes: Sequence[Optional[str]], shape: Sequence[int]) -> P:
        """The PartitionSpec of an array with ``logical_axes`` and ``shape``; an axis ``model`` does not
        divide is replicated."""
        rules = self.logical_rules()
        tp = self.tensor_parallel_size
        mesh_axes = [rules[name] for name in logical_axes]
        return P(*[axis if axis is None or size % tp == 0 else None for axis, size in zip(mesh_axes, shape)])

    def param_specs(self, params: Any) -> Any:
        """PartitionSpecs of a parameter pytree (leaves with ``.shape``): :data:`PARAM_AXES` plus the
        family's ``param_axes``; the ``"layers"`` axis and unnamed leaves replicated; scales split with their weights.
        """
        declared = family(self.cfg).param_axes
        table = {**PARAM_AXES, **declared}

        def one(path, leaf):
            key = path[-1].key
            stacked = path[0].key == "layers"
            axes = _axes(key, len(leaf.shape) - stacked, table)
            if key in declared:
                self._check_declared_axes(key, axes, leaf.shape[stacked:])
            if key.endswith(SCALE_SUFFIX) and key not in table and len(leaf.shape) < len(axes) + stacked:
                axes = axes[:-2] + axes[-1:]  # per output channel: the weight's axes without its input axis
            return self.spec(((None,) if stacked else ()) + axes, leaf.shape)

        return jax.tree_util.tree_map_with_path(one, params)

    def _check_declared_axes(self, key: str, axes: tuple[Optional[str], ...], shape: tuple[int, ...]) -> None:
        """Raise ValueError unless ``param_axes[key]`` names one known axis per leaf axis."""
        unknown = [a for a in axes if a not in self.logical_rules()]
        if unknown or len(axes) != len(shape):
            raise ValueError(f"Family.param_axes[{key!r}]={axes} must name one logical axis of "
                             f"{sorted(a for a in self.logical_rules() if a)} or None per axis of the leaf, "
                             f"shape {tuple(shape)} (without the layer axis)")

    def param_shardings(self, params: Any) -> Any:
        """NamedShardings of a parameter pytree, as :meth:`param_specs`."""
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), self.param_specs(params))

    def per_device_config(self) -> ModelConfig:
        """``cfg`` with the KV heads one device stores: sizes the KV cache from a per-device budget."""
        return dataclasses.replace(self.cfg, num_kv_heads=self.num_cache_heads // self.tensor_parallel_size)

    @property
    def kv_cache_sharding(self) -> NamedSharding:
        """Sharding of each ``[num_layers, num_blocks, block_size, num_cache_heads, head_dim]`` array."""
        return NamedSharding(self.mesh, P(None, None, None, MODEL_AXIS, None))

    @property
    def kv_scale_sharding(self) -> NamedSharding:
        """Sharding of a quantized cache's ``[num_layers, num_cache_heads]`` scales."""
        return NamedSharding(self.mesh, P(None, MODEL_AXIS))

    @property
    def pool_scale_sharding(self) -> NamedSharding:
        """Sharding of the scaled block pool's ``[num_layers, num_pooled, num_cache_heads]`` scales."""
        return NamedSharding(self.mesh, P(None, None, MODEL_AXIS))

    @property
    def replicated(self) -> NamedSharding:
        """Every device holds the whole array."""
        return NamedSharding(self.mesh, P())

    def attention_ops(self, ops: AttentionOps) -> AttentionOps:
        """``ops`` per device under ``shard_map`` over ``model``: local q heads against local cache
        heads (replicated KV cut to the stored head before the write); scales and the scaled block pool split like the
        cache."""
        heads = P(None, MODEL_AXIS, None)
        cache = P(None, None, MODEL_AXIS, None)
        rep = P()
        cache_heads = P(MODEL_AXIS)
        group_devices = self.tensor_parallel_size // self.cfg.num_kv_heads

        def scale_args(k_scale, v_scale):
            """(the scales to pass, their specs, scales -> the op's keywords)."""
            if k_scale is None:
                return (), (), lambda: {}
            return (k_scale, v_scale), (cache_heads, cache_heads), lambda k, v: dict(k_scale=k, v_scale=v)

        def write(k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None):
            scales, specs, keywords = scale_args(k_scale, v_scale)

            def write_local(k_cache, v_cache, k, v, slot_mapping, *scales):
                if self.kv_heads_replicated:
                    head = jax.lax.axis_index(MODEL_AXIS) // group_devices
                    k = jax.lax.dynamic_slice_in_dim(k, head, 1, axis=1)
                    v = jax.lax.dynamic_slice_in_dim(v, head, 1, axis=1)
                return ops.kv_cache_write(k_cache, v_cache, k, v, slot_mapping, **keywords(*scales))

            kv_spec = rep if self.kv_heads_replicated else heads
            return shard_map(write_local, mesh=self.mesh, in_specs=(cache, cache, kv_spec, kv_spec, rep) + specs,
                             out_specs=(cache, cache), check_vma=False)(k_cache, v_cache, k, v, slot_mapping, *scales)

        def sharded(attention):
            """``attention`` (the ragged signature) per device."""
            def attend(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, k_scale=None,
                       v_scale=None, scaled_pool=None, **static):
                scales, specs, keywords = scale_args(k_scale, v_scale)
                # The scaled pool's blocks and per-block scales split over heads like the cache's.
                pool, pool_specs = ((), ()) if scaled_pool is None else (
                    tuple(scaled_pool), (cache, cache, P(None, MODEL_AXIS), P(None, MODEL_AXIS)))

                def local(*args):
                    extra = args[7 + len(specs):]
                    pools = {"scaled_pool": type(scaled_pool)(*extra)} if extra else {}
                    return attention(*args[:7], **keywords(*args[7:7 + len(specs)]), **pools, **static)

                return shard_map(local, mesh=self.mesh,
                                 in_specs=(heads, cache, cache, rep, rep, rep, rep) + specs + pool_specs,
                                 out_specs=heads, check_vma=False)(
                    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *scales, *pool)

            return attend

        return AttentionOps(ragged_paged_attention=sharded(ops.ragged_paged_attention), kv_cache_write=write,
                            decode_attention=None if ops.decode_attention is None else sharded(ops.decode_attention))
