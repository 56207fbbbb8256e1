"""The weights a runner serves (:class:`WeightStore`) and how every leaf gets there: the one place that decides a
leaf's stored dtype (``quantization.leaf_dtype``: quantized weights keep theirs, scales float32, floats the compute
dtype) and sharding (``ModelSharding.param_shardings``) for a checkpoint read (:func:`place_params`), an orbax
restore (:func:`param_targets`) and weights handed in (:func:`place_given_params`, ``LLM.update_weights``: checked
against the engine's layout, cast or quantized to it). Leaves are named by ``/``-joined paths (``"layers/wq"``)."""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.core.messages import flatten, unflatten
from jaxllm.logger import init_logger
from jaxllm.models import Params, loop_storage, param_layout, with_head_panels
from jaxllm.models.config import ModelConfig
from jaxllm.worker.programs import abstract
from jaxllm.worker.quantization import SCALE_SUFFIX, is_quantized_dtype, leaf_dtype, quantize_weight
from jaxllm.worker.sharding import ModelSharding
from kernels_pallas.ops import HEAD_PANELS
from kernels_pallas.storage import from_storage, to_storage

logger = init_logger(__name__)

# Leaves a level-2 sleep keeps on the host (a few numbers per layer and head): the quantized KV cache's calibrated
# scales, which a trainer's update does not give.
KEPT_THROUGH_DISCARD = ("layers/k_scale", "layers/v_scale")

__all__ = ["Layout", "WeightStore", "device_bytes_in_use", "flatten", "layout_of", "param_targets", "place_given_params",
           "place_leaf", "place_params", "prepare_params", "unflatten"]

# Path -> the expected leaf: its shape, dtype and (at update) sharding.
Layout = dict[str, jax.ShapeDtypeStruct]
_QUANTIZATION_OF = {"int8": "int8", "float8_e4m3fn": "fp8"}


def layout_of(shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> Layout:
    """A :data:`Layout` (no shardings) of ``jaxllm.models.param_layout``'s ``{path: (shape, dtype)}``."""
    return {path: jax.ShapeDtypeStruct(shape, dtype) for path, (shape, dtype) in shapes.items()}


def prepare_params(params: Any, expected: Layout, *, partial: bool,
                   optional: Collection[str] = ()) -> dict[str, Any]:
    """Check ``params`` (nested dicts or ``{path: leaf}``) against ``expected`` and bring each leaf to its
    expected dtype: floats cast, or quantized per channel (with their scale) where the engine holds int8 / fp8;
    ``partial`` accepts a subset, else only the ``optional`` paths may be missing.

    Returns:
      ``{path: leaf}`` in ``expected``'s order; numpy stays numpy, device arrays stay on their devices.

    Raises:
      ValueError: the first unknown, missing or mismatched leaf; nothing is converted then.
    """
    given = {path: _as_array(leaf) for path, leaf in flatten(params).items()}
    unknown = [path for path in given if path not in expected]
    if unknown:
        raise ValueError(f"params leaf {unknown[0]!r} is not a parameter of this engine; its leaves are "
                         f"{list(expected)}")
    if not partial:
        missing = [path for path in expected if path not in given and path not in optional
                   and not _made_by_quantization(path, given, expected)]
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
    """A quantized weight's scale that a float weight given in its place brings."""
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


def param_targets(sharding: ModelSharding, leaves: Any, dtype: Any) -> Any:
    """Each leaf's stored form: a pytree of ``jax.ShapeDtypeStruct`` (shape, ``leaf_dtype`` of the leaf's dtype
    and the compute ``dtype``, the ``NamedSharding`` of ``sharding.param_shardings``) for ``leaves`` with ``.shape``
    and ``.dtype`` (an orbax checkpoint's metadata). Raises ValueError: a family's declared axes that do not fit."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf, s: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf_dtype(path[-1].key, leaf.dtype, dtype),
                                                   sharding=s),
        leaves, sharding.param_shardings(leaves))


def place_params(sharding: ModelSharding, params: Any, dtype: Any) -> Params:
    """Put ``params`` (host arrays, or lazy tensors with ``read(index)``) on ``sharding``'s mesh one device slice
    at a time, each slice in its ``leaf_dtype`` (as :func:`param_targets`; a lazy tensor's dtype is known once
    read); returns ``jax.Array``s sharded by ``sharding.param_specs``."""
    def place(path, leaf, leaf_sharding):
        read = leaf.read if hasattr(leaf, "read") else leaf.__getitem__

        def shard(index):
            array = np.asarray(read(index))
            return array.astype(leaf_dtype(path[-1].key, array.dtype, dtype), copy=False)

        return jax.make_array_from_callback(tuple(leaf.shape), leaf_sharding, shard)

    return jax.tree_util.tree_map_with_path(place, params, sharding.param_shardings(params),
                                            is_leaf=lambda x: hasattr(x, "read"))


def place_given_params(cfg: ModelConfig, params: Any, dtype: Any, sharding: ModelSharding,
                       quantization: Optional[str]) -> Params:
    """Check a whole in-memory tree (``LLM(params=...)``) against ``cfg``'s layout (:func:`prepare_params`:
    cast to ``dtype``, quantized with ``quantization``) and place it by ``sharding``; returns the placed pytree.

    Raises:
      ValueError: the first unknown, missing or mismatched leaf.
    """
    layout = layout_of(param_layout(cfg, dtype, quantization))
    flat = prepare_params(params, layout, partial=False)
    shardings = flatten(sharding.param_shardings(unflatten(layout)))
    return unflatten({path: place_leaf(leaf, shardings[path]) for path, leaf in flat.items()})


def place_leaf(leaf: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """``leaf`` on ``sharding``'s devices: a ``jax.Array`` already so sharded as it is, else transferred."""
    if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
        return leaf
    return jax.device_put(leaf, sharding)


def device_bytes_in_use(device: jax.Device) -> Optional[int]:
    """``bytes_in_use`` of ``device.memory_stats()``, or None where there is none (CPU)."""
    stats = device.memory_stats()
    return None if not stats else int(stats.get("bytes_in_use", 0))


class WeightStore:
    """The parameters a runner's steps read; each leaf's layout (numbers: :meth:`param_layout`; stored form:
    bits with ``float_bits_storage``, plus ``HEAD_PANELS``) is fixed at construction and kept through updates and sleep.
    ``params`` is the stored pytree, abstract while released; released, the weights live on the host (the copy
    ``release(offload=True)`` took, or leaves given by :meth:`stage`) until :meth:`restore` places them."""

    def __init__(self, cfg: ModelConfig, params: Params, *, float_bits_storage: bool):
        self.cfg = cfg
        self.float_bits_storage = float_bits_storage
        self._param_layout = {path: abstract(leaf) for path, leaf in flatten(params).items()}
        self.params = with_head_panels(loop_storage(params) if float_bits_storage else params, cfg)
        self._storage_layout = {path: abstract(leaf) for path, leaf in flatten(self.params).items()}
        # Released: every stored leaf as host numpy, in its stored dtype (HEAD_PANELS may be missing: packed from
        # the embedding at restore); None while on the devices or discarded.
        self._host_params: Optional[dict[str, np.ndarray]] = None
        # Discarded: the leaves of KEPT_THROUGH_DISCARD, on the host. Woken from discarded: the leaves still zeros.
        self._kept: dict[str, np.ndarray] = {}
        self._zeroed: set[str] = set()

    def abstract(self) -> Params:
        """The stored tree as ShapeDtypeStructs with shardings: what a step program takes."""
        return abstract(self.params)

    @property
    def kept_through_discard(self) -> tuple[str, ...]:
        """The leaves a level-2 sleep kept (:data:`KEPT_THROUGH_DISCARD`), which an update may leave out."""
        return tuple(self._kept)

    def param_layout(self) -> Layout:
        """Every leaf by path with its shape, number dtype and sharding."""
        return dict(self._param_layout)

    @property
    def state(self) -> str:
        """"device" (serving), "offloaded" (released, every leaf held on the host for :meth:`restore`) or
        "discarded" (released, ``release(offload=False)``, and not every leaf given again)."""
        if all(isinstance(leaf, jax.Array) for leaf in flatten(self.params).values()):
            return "device"
        return "offloaded" if self._host_params is not None else "discarded"

    def get_params(self) -> Params:
        """A new tree in the layout's number dtypes: the device arrays with their shardings; released, read-only
        host numpy views of the weights held for :meth:`restore`. Raises RuntimeError: discarded, or woken from
        discarded with leaves no update gave yet."""
        self._need_weights("get_params")
        if self._zeroed:
            raise RuntimeError(f"get_params: {len(self._zeroed)} leaves are zeros since sleep(level=2), "
                               f"{sorted(self._zeroed)[0]!r} among them; give them with update_weights first")
        if self._host_params is not None:
            return unflatten({path: _read_only(self._host_params[path].view(want.dtype))
                              for path, want in self._param_layout.items()})
        flat = {path: leaf if leaf.dtype == self._param_layout[path].dtype else _number_cast(leaf.sharding)(leaf)
                for path, leaf in flatten(self.params).items() if path in self._param_layout}
        return unflatten(flat)

    def stage(self, flat: Mapping[str, Any]) -> int:
        """Replace leaves while released, on the host (a device leaf is copied to the host; nothing goes to a
        device): each takes the place of the held one, or fills the discarded weights, and :meth:`restore`
        places it. Returns the bytes held for them.

        Args:
          flat: ``{path: leaf}`` as :func:`prepare_params` gives them (the layout's shapes and number dtypes);
            every leaf when discarded.

        Raises:
          RuntimeError: the weights are on the devices (:meth:`set_param` replaces those).
          ValueError: discarded and ``flat`` lacks a leaf (named).
        """
        if self.state == "device":
            raise RuntimeError("stage: the weights are on the devices; set_param replaces them")
        if self._host_params is None:
            missing = [path for path in self._param_layout if path not in flat and path not in self._kept]
            if missing:
                raise ValueError(f"stage: the weights were discarded and leaf {missing[0]!r} is not given")
        held = self._host_params if self._host_params is not None else dict(self._kept)
        num_bytes = 0
        for path, leaf in flat.items():
            # A numpy leaf is copied: the caller may change its array before restore reads it.
            host = leaf.copy() if isinstance(leaf, np.ndarray) else np.asarray(jax.device_get(leaf))
            # The stored form of a bits-stored float: the same bits, viewed as their unsigned type.
            held[path] = host.view(self._storage_layout[path].dtype)
            num_bytes += host.nbytes
        if "embed" in flat:
            held.pop(HEAD_PANELS, None)  # packed from the new embedding at restore
        self._host_params = held
        return num_bytes

    def set_param(self, path: str, leaf: jax.Array) -> None:
        """Replace leaf ``path`` by ``leaf`` (placed, of exactly its layout; donated to a bits conversion)
        between steps, the old array let go at once; programs are not rebuilt.

        Raises:
          ValueError: ``leaf`` does not match the layout.
        """
        want = self._param_layout[path]
        if abstract(leaf) != want:
            raise ValueError(f"set_param({path!r}): {abstract(leaf)} does not match the compiled layout {want}")
        stored = self._storage_layout[path]
        if stored.dtype != leaf.dtype:
            leaf = _storage_cast(stored.sharding, stored.dtype)(leaf)
        flat = flatten(self.params)
        flat[path] = leaf
        self._zeroed.discard(path)
        if path == "embed" and HEAD_PANELS in flat:
            # The lm_head's panels of the new embedding. The old ones go first, so this holds one leaf more at most;
            # meanwhile their abstract leaf keeps the tree's structure for a program the background warm-up builds.
            flat[HEAD_PANELS] = self._storage_layout[HEAD_PANELS]
            self.params = unflatten(flat)
            flat[HEAD_PANELS] = with_head_panels({"embed": leaf}, self.cfg)[HEAD_PANELS]
        self.params = unflatten(flat)

    def release(self, offload: bool) -> int:
        """Let the device arrays go (sleep), with ``offload`` keeping a host copy for :meth:`restore`;
        returns the bytes let go."""
        if self.state != "device":
            if not offload and self._host_params is not None:  # a deeper sleep discards what a lighter one kept
                self._kept = {p: self._host_params[p] for p in KEPT_THROUGH_DISCARD if p in self._host_params}
                self._host_params = None
            return 0
        flat = flatten(self.params)
        self._host_params = jax.device_get(flat) if offload else None
        if not offload:
            self._kept = {p: np.asarray(jax.device_get(flat[p])) for p in KEPT_THROUGH_DISCARD if p in flat}
        self.params = unflatten(self._storage_layout)
        return sum(leaf.nbytes for leaf in flat.values())

    def restore(self) -> None:
        """Place the weights held on the host with their stored dtypes and shardings (no compilation); nothing
        when on the devices. Discarded, every leaf is placed as zeros (but :data:`KEPT_THROUGH_DISCARD`'s, kept),
        with a warning, and :meth:`get_params` refuses until updates have given the others: vLLM's order after
        ``sleep(level=2)`` wakes the weights first and then updates them."""
        if self.state == "discarded":
            logger.warning("the weights were discarded (sleep(level=2)): they are zeros until an update gives them")
            self.params = unflatten({path: jax.device_put(self._kept[path], leaf.sharding) if path in self._kept
                                     else jnp.zeros(leaf.shape, leaf.dtype, device=leaf.sharding)
                                     for path, leaf in self._storage_layout.items()})
            self._zeroed = set(self._param_layout) - set(self._kept)
            return
        if self._host_params is None:
            return
        host, self._host_params = self._host_params, None
        flat = {path: jax.device_put(leaf, self._storage_layout[path].sharding) for path, leaf in host.items()}
        if HEAD_PANELS in self._storage_layout and HEAD_PANELS not in flat:
            flat[HEAD_PANELS] = with_head_panels({"embed": flat["embed"]}, self.cfg)[HEAD_PANELS]
        self.params = unflatten(flat)

    def _need_weights(self, what: str) -> None:
        if self.state == "discarded":
            raise RuntimeError(f"{what}: the weights are discarded (sleep(level=2)); give every leaf again with "
                               "update_weights or update_weights_from_path first")


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@functools.lru_cache(maxsize=None)
def _storage_cast(sharding: jax.sharding.Sharding, storage: np.dtype) -> Callable:
    return jax.jit(lambda a: to_storage(a, storage), donate_argnums=0, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _number_cast(sharding: jax.sharding.Sharding) -> Callable:
    return jax.jit(from_storage, out_shardings=sharding)
