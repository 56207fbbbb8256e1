"""The weights a runner serves (:class:`WeightStore`: each leaf's stored dtype and sharding, update, sleep), and
weights handed in by the caller (``LLM(params=...)``, ``LLM.update_weights``): named leaves checked against the
engine's layout, brought to its dtypes and quantization, then placed by its shardings.

A parameter tree is nested dicts of arrays (``jaxllm.models.common``'s layout); a leaf is named by its path, the
keys joined by ``/`` (``"layers/wq"``), and a flat dict of such paths is accepted as the same tree. One function,
:func:`prepare_params`, checks a tree given at start-up and a tree given as an update, so both refuse the same
things with the same message: the first bad leaf's path, its shape and dtype, and the expected ones.

Dtypes: a float leaf of any float dtype is cast to the expected one (the engine's compute dtype; float32 for
quantization scales). Where the engine holds a quantized weight (int8 / float8_e4m3fn), a float leaf is quantized
on the way in (per output channel, ``jaxllm.worker.quantization.quantize_weight``, its ``_scale`` sibling made with
it); a leaf of the quantized dtype itself is taken as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.core.messages import flatten, unflatten
from jaxllm.models import Params, loop_storage, with_head_panels
from jaxllm.models.config import ModelConfig
from jaxllm.worker.programs import abstract
from jaxllm.worker.quantization import SCALE_SUFFIX, is_quantized_dtype, quantize_weight
from kernels_pallas.ops import HEAD_PANELS
from kernels_pallas.storage import from_storage, to_storage

__all__ = ["Layout", "WeightStore", "device_bytes_in_use", "flatten", "layout_of", "place_leaf", "prepare_params",
           "unflatten"]

# Path -> the expected leaf: its shape, dtype and (at update) sharding.
Layout = dict[str, jax.ShapeDtypeStruct]
_QUANTIZATION_OF = {"int8": "int8", "float8_e4m3fn": "fp8"}


def layout_of(shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> Layout:
    """A :data:`Layout` (no shardings) of ``jaxllm.models.param_layout``'s ``{path: (shape, dtype)}``."""
    return {path: jax.ShapeDtypeStruct(shape, dtype) for path, (shape, dtype) in shapes.items()}


def prepare_params(params: Any, expected: Layout, *, partial: bool) -> dict[str, Any]:
    """Check ``params`` against ``expected`` and bring each leaf to its expected dtype (and quantization).

    Args:
      params: a tree (nested dicts, or ``{path: leaf}``) of numpy arrays or ``jax.Array``s.
      expected: the engine's leaves, by path.
      partial: accept a subset of the leaves (an update); otherwise every leaf must be given.

    Returns:
      ``{path: leaf}`` in ``expected``'s order, each of its expected shape and dtype: host leaves stay numpy (cast
      on the host), device leaves stay ``jax.Array``s (cast on their devices); quantized weights come with their
      scales.

    Raises:
      ValueError: the first leaf whose path is unknown, is missing (without ``partial``), or whose shape or dtype
        does not fit, named with its shape and dtype and the expected ones; nothing is converted then.
    """
    given = {path: _as_array(leaf) for path, leaf in flatten(params).items()}
    unknown = [path for path in given if path not in expected]
    if unknown:
        raise ValueError(f"params leaf {unknown[0]!r} is not a parameter of this engine; its leaves are "
                         f"{list(expected)}")
    if not partial:
        missing = [path for path in expected if path not in given and not _made_by_quantization(path, given, expected)]
        if missing:
            want = expected[missing[0]]
            raise ValueError(f"params is missing leaf {missing[0]!r} (shape {want.shape}, dtype {want.dtype.name})")
    for path, leaf in given.items():
        _check_leaf(path, leaf, expected, given)
    out: dict[str, Any] = {}
    for path, want in expected.items():
        if path in given and path not in out:
            out.update(_convert(path, given[path], want, expected))
    return {path: out[path] for path in expected if path in out}


def _as_array(leaf: Any) -> Any:
    return leaf if hasattr(leaf, "shape") and hasattr(leaf, "dtype") else np.asarray(leaf)


def _made_by_quantization(path: str, given: Mapping[str, Any], expected: Layout) -> bool:
    """A quantized weight's scale, which a float weight given in its place brings with it."""
    if not path.endswith(SCALE_SUFFIX):
        return False
    weight = given.get(path[: -len(SCALE_SUFFIX)])
    return weight is not None and _is_float(weight.dtype) and is_quantized_dtype(expected[path[: -len(SCALE_SUFFIX)]].dtype)


def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating)) and not is_quantized_dtype(dtype)


def _check_leaf(path: str, leaf: Any, expected: Layout, given: Mapping[str, Any]) -> None:
    """Raise ValueError unless ``leaf`` can stand for ``expected[path]``."""
    want = expected[path]
    quantize = is_quantized_dtype(want.dtype) and _is_float(leaf.dtype)
    fits = tuple(leaf.shape) == tuple(want.shape) and (
        np.dtype(leaf.dtype) == np.dtype(want.dtype) or (_is_float(leaf.dtype) and _is_float(want.dtype)) or quantize)
    if not fits:
        kind = " (or any float dtype, cast to it)" if _is_float(want.dtype) else (
            " (or a float one, quantized on the way in)" if is_quantized_dtype(want.dtype) else "")
        raise ValueError(f"params leaf {path!r} has shape {tuple(leaf.shape)} and dtype {np.dtype(leaf.dtype).name}; "
                         f"the engine expects shape {tuple(want.shape)} and dtype {np.dtype(want.dtype).name}{kind}")
    if quantize and path + SCALE_SUFFIX in given:
        raise ValueError(f"params leaf {path!r} is {np.dtype(leaf.dtype).name}, to be quantized on the way in, and "
                         f"{path + SCALE_SUFFIX!r} is given too: give a float weight alone, or a "
                         f"{np.dtype(want.dtype).name} one with its scale")


def _convert(path: str, leaf: Any, want: jax.ShapeDtypeStruct, expected: Layout) -> dict[str, Any]:
    """``{path: leaf}`` in ``want``'s dtype; a float leaf for a quantized weight with its scale."""
    if is_quantized_dtype(want.dtype) and _is_float(leaf.dtype):
        q, scale = quantize_weight(np.asarray(jax.device_get(leaf)), _QUANTIZATION_OF[np.dtype(want.dtype).name])
        scale_want = expected.get(path + SCALE_SUFFIX)
        if scale_want is None or tuple(scale_want.shape) != scale.shape:
            raise ValueError(f"params leaf {path!r}: the engine holds it with a "
                             f"{'missing' if scale_want is None else tuple(scale_want.shape)} scale, so a float "
                             f"weight quantized per output channel (scale {scale.shape}) cannot replace it; give "
                             f"{np.dtype(want.dtype).name} values with their scale")
        return {path: q, path + SCALE_SUFFIX: scale}
    if np.dtype(leaf.dtype) == np.dtype(want.dtype):
        return {path: leaf}
    return {path: leaf.astype(want.dtype)}


def place_leaf(leaf: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """``leaf`` (numpy or ``jax.Array``, already of its dtype) on ``sharding``'s devices: a ``jax.Array`` that
    already has that sharding is used as it is (no copy), anything else is transferred (a host array shard by
    shard, each device receiving only its slice)."""
    if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
        return leaf
    return jax.device_put(leaf, sharding)


def device_bytes_in_use(device: jax.Device) -> Optional[int]:
    """``bytes_in_use`` of ``device.memory_stats()``, or None where the backend keeps no such count (CPU)."""
    stats = device.memory_stats()
    return None if not stats else int(stats.get("bytes_in_use", 0))


class WeightStore:
    """The parameters a runner's steps read, on the devices: each leaf's layout decided once, at construction, and
    kept through updates and sleep.

    A leaf has two layouts, both with the sharding it was placed with: its numbers (:meth:`param_layout`: shape and
    dtype, bfloat16 say, which a new leaf must match) and its stored form (with ``float_bits_storage``, bfloat16 and
    float8 layer leaves held as uint16 and uint8 bits: ``models.loop_storage``), plus ``kernels_pallas.ops.HEAD_PANELS`` where
    ``models.with_head_panels`` adds them.

    Args:
      cfg: the model's configuration.
      params: the parameter pytree, already placed by the replica's ``ModelSharding``.
      float_bits_storage: hold bfloat16 / float8 layer leaves as bits (for XLA's CPU backend with the jnp attention
        ops; ``kernels_pallas.storage`` says why).

    Attributes:
      params: the stored parameter pytree the steps take; abstract leaves while released (sleep).
      float_bits_storage: as given.
    """

    def __init__(self, cfg: ModelConfig, params: Params, *, float_bits_storage: bool):
        self.cfg = cfg
        self.float_bits_storage = float_bits_storage
        self._param_layout = {path: abstract(leaf) for path, leaf in flatten(params).items()}
        self.params = with_head_panels(loop_storage(params) if float_bits_storage else params, cfg)
        self._storage_layout = {path: abstract(leaf) for path, leaf in flatten(self.params).items()}
        self._host_params: Optional[dict[str, np.ndarray]] = None

    def abstract(self) -> Params:
        """The stored tree as ShapeDtypeStructs with shardings: what a step program takes."""
        return abstract(self.params)

    def param_layout(self) -> Layout:
        """Every parameter leaf by path: its shape, its dtype as numbers (bfloat16, not the uint16 bits
        ``float_bits_storage`` holds) and its sharding, which a new leaf must match."""
        return dict(self._param_layout)

    @property
    def state(self) -> str:
        """"device" (serving), "offloaded" (a host copy, ``release(offload=True)``) or "discarded"."""
        if all(isinstance(leaf, jax.Array) for leaf in flatten(self.params).values()):
            return "device"
        return "offloaded" if self._host_params is not None else "discarded"

    def get_params(self) -> Params:
        """The parameters the steps run: a new tree of the device arrays, in the layout's dtypes (bfloat16 leaves
        held as bits are converted back, into new arrays) with their shardings.

        Raises:
          RuntimeError: the weights are not on the devices (:attr:`state`).
        """
        self._need_weights("get_params")
        flat = {path: leaf if leaf.dtype == self._param_layout[path].dtype else _number_cast(leaf.sharding)(leaf)
                for path, leaf in flatten(self.params).items() if path in self._param_layout}
        return unflatten(flat)

    def set_param(self, path: str, leaf: jax.Array) -> None:
        """Replace leaf ``path`` by ``leaf`` between steps. The old array is let go at once, so a tree replaced
        leaf by leaf holds one leaf more at most (memory others keep alive, e.g. a tree from :meth:`get_params`,
        stays theirs); the compiled steps are not rebuilt.

        Args:
          path: a leaf of :meth:`param_layout`.
          leaf: placed, of exactly its shape, dtype and sharding; with ``float_bits_storage`` a bfloat16 / float8
            leaf is donated to its conversion to bits. A new ``embed`` is packed again into the lm_head's
            ``kernels_pallas.ops.HEAD_PANELS`` where the store holds them.

        Raises:
          ValueError: ``leaf`` does not match the layout (the compiled programs would not take it).
        """
        want = self._param_layout[path]
        if abstract(leaf) != want:
            raise ValueError(f"set_param({path!r}): {abstract(leaf)} does not match the compiled layout {want}")
        stored = self._storage_layout[path]
        if stored.dtype != leaf.dtype:
            leaf = _storage_cast(stored.sharding, stored.dtype)(leaf)
        flat = flatten(self.params)
        flat[path] = leaf
        if path == "embed" and HEAD_PANELS in flat:
            # The lm_head's panels of the new embedding. The old ones go first, so this holds one leaf more at most;
            # meanwhile their abstract leaf keeps the tree's structure for a program the background warm-up builds.
            flat[HEAD_PANELS] = self._storage_layout[HEAD_PANELS]
            self.params = unflatten(flat)
            flat[HEAD_PANELS] = with_head_panels({"embed": leaf}, self.cfg)[HEAD_PANELS]
        self.params = unflatten(flat)

    def release(self, offload: bool) -> int:
        """Let the parameters' device arrays go (sleep): with ``offload`` a host copy is kept for :meth:`restore`;
        the programs still build from their avals meanwhile.

        Returns:
          the bytes of the arrays let go (whole arrays, all shards).
        """
        if self.state != "device":
            if not offload:
                self._host_params = None  # a deeper sleep discards the host copy of a lighter one
            return 0
        flat = flatten(self.params)
        self._host_params = jax.device_get(flat) if offload else None
        self.params = unflatten(self._storage_layout)
        return sum(leaf.nbytes for leaf in flat.values())

    def restore(self) -> None:
        """Put the host copy of :meth:`release` back on the devices (nothing to do when they are there).

        Raises:
          RuntimeError: the weights were discarded, and some leaves have not been set again since.
        """
        if self._host_params is not None:
            host, self._host_params = self._host_params, None
            self.params = unflatten({path: jax.device_put(leaf, self._storage_layout[path].sharding)
                                     for path, leaf in host.items()})
        self._need_weights("restore_params")

    def _need_weights(self, what: str) -> None:
        state = self.state
        if state != "device":
            raise RuntimeError(f"{what}: the weights are {state} (sleep); wake_up() first"
                               + (", after restoring them with update_weights or update_weights_from_path"
                                  if state == "discarded" else ""))


@functools.lru_cache(maxsize=None)
def _storage_cast(sharding: jax.sharding.Sharding, storage: np.dtype) -> Callable:
    """A leaf (donated) as stored with ``float_bits_storage``, on the same sharding: one program per pair."""
    return jax.jit(lambda a: to_storage(a, storage), donate_argnums=0, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _number_cast(sharding: jax.sharding.Sharding) -> Callable:
    """A stored leaf as numbers (bfloat16 of uint16 bits), on the same sharding."""
    return jax.jit(from_storage, out_shardings=sharding)
