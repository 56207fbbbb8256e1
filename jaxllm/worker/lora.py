"""LoRA adapters on the device: preallocated slots read by every step (:class:`LoRASlots`) and the host side
that fills them (:class:`LoRAManager`: known adapters, a host LRU, slot assignment per step).

Slot layout, per targeted projection ``key`` (``jaxllm.lora.peft.LORA_TARGETS`` the family has)::

    "<key>_lora_a": [L, max_loras, in, max_lora_rank]    "<key>_lora_b": [L, max_loras, max_lora_rank, out]

in the compute dtype, an adapter's rank zero-padded to ``max_lora_rank`` and its scale folded into B, so the
projection adds ``(x A_slot) B_slot`` for each token row of a slot (``jaxllm.models.common.lora_delta``: a loop
over the slots the step's rows use) with one fixed shape whatever the adapters: loading, evicting or switching
one compiles nothing (vLLM's punica slots). Under tensor parallelism A and B split as their projection
(``jaxllm.worker.sharding``: A on a row-parallel projection's input axis, B on a column-parallel one's output).
"""

from __future__ import annotations

import collections
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.core.messages import flatten
from jaxllm.lora import LoRARequest
from jaxllm.lora.peft import LORA_TARGETS, LoRAWeights, read_peft_adapter
from jaxllm.models import Family, param_layout
from jaxllm.models.common import LORA_A, LORA_B
from jaxllm.models.config import ModelConfig
from jaxllm.worker.programs import CompileStats, abstract
from jaxllm.worker.sharding import ModelSharding


def _write_slot(leaves: dict[str, jax.Array], slot: jax.Array, new: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """``leaves`` with slot ``slot`` (int32[]) of every leaf replaced by ``new``'s (each leaf without its slot axis)."""
    return {key: jax.lax.dynamic_update_slice_in_dim(leaf, new[key][:, None].astype(leaf.dtype), slot, axis=1)
            for key, leaf in leaves.items()}


class LoRASlots:
    """The device arrays of ``max_loras`` adapter slots and the one program that writes a slot.

    Args:
      cfg: the model. layer_keys: its family's layer keys (targets it lacks get no slot). dtype: compute dtype.
      max_loras: slots. max_lora_rank: padded rank R. sharding: the model's ``ModelSharding`` (each leaf split
        as its projection, ``ModelSharding.param_shardings``).
      stats: the runner's ``CompileStats`` (the write program is counted there).

    Attributes:
      leaves: ``{"<key>_lora_a": [L, N, in, R], "<key>_lora_b": [L, N, R, out]}`` device arrays.
      shapes: target key -> the projection's ``(in, out)``.
    """

    def __init__(self, cfg: ModelConfig, layer_keys: set[str], dtype: Any, *, max_loras: int, max_lora_rank: int,
                 sharding: ModelSharding, stats: CompileStats):
        layout = param_layout(cfg, dtype)
        self.num_layers, self.max_loras, self.max_lora_rank = cfg.num_layers, max_loras, max_lora_rank
        self.shapes = {key: layout[f"layers/{key}"][0][1:] for key in LORA_TARGETS if key in layer_keys}
        self.dtype, self._replicated, self._stats = np.dtype(dtype), sharding.replicated, stats
        shapes = self._leaf_shapes(with_slots=True)
        self._shardings = sharding.param_shardings(
            {"layers": {name: jax.ShapeDtypeStruct(shape, self.dtype) for name, shape in shapes.items()}})["layers"]
        self.leaves = jax.device_put({name: np.zeros(shape, self.dtype) for name, shape in shapes.items()},
                                     self._shardings)
        self._write: Optional[Any] = None
        # Device-array adapters (``LoRAManager.update``): each slot's index as a device scalar, made at warm-up so a
        # write under a host-transfer guard moves nothing through the host; (targets, rank, scale) -> the jitted
        # pad-and-scale program.
        self._slot_index: list[jax.Array] = []
        self._pad: dict[tuple[Any, ...], Any] = {}

    def _leaf_shapes(self, with_slots: bool) -> dict[str, tuple[int, ...]]:
        slots, rank, layers = (self.max_loras,) if with_slots else (), self.max_lora_rank, self.num_layers
        shapes = {}
        for key, (fan_in, fan_out) in self.shapes.items():
            shapes[key + LORA_A] = (layers, *slots, fan_in, rank)
            shapes[key + LORA_B] = (layers, *slots, rank, fan_out)
        return shapes

    def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The leaves as ShapeDtypeStructs with shardings (what a step program takes)."""
        return abstract(self.leaves)

    def warmup(self) -> None:
        """Build the slot-write program (once)."""
        if self._write is None:
            new = {name: jax.ShapeDtypeStruct(shape, self.dtype, sharding=self._replicated)
                   for name, shape in self._leaf_shapes(with_slots=False).items()}
            slot = jax.ShapeDtypeStruct((), np.int32, sharding=self._replicated)
            fn = jax.jit(_write_slot, donate_argnums=(0,), out_shardings=self._shardings)
            self._write = self._stats.compile(fn, self.abstract(), slot, new)
            self._slot_index = [jax.device_put(np.int32(s), self._replicated) for s in range(self.max_loras)]

    def write(self, slot: int, weights: Optional[LoRAWeights]) -> None:
        """Fill slot ``slot`` with ``weights`` (rank padded, scale folded into B), or zeros for None. Weights
        held as device arrays are padded and scaled on the devices (nothing through the host)."""
        self.warmup()
        if weights is not None and any(isinstance(x, jax.Array) for pair in weights.tensors.values() for x in pair):
            self.leaves = self._write(self.leaves, self._slot_index[slot], self._padded_on_device(weights))
            return
        new = {name: np.zeros(shape, self.dtype) for name, shape in self._leaf_shapes(with_slots=False).items()}
        for key, (a, b) in ({} if weights is None else weights.tensors).items():
            rank = a.shape[-1]
            new[key + LORA_A][..., :rank] = a
            new[key + LORA_B][:, :rank] = b * np.float32(weights.scale)
        self.leaves = self._write(self.leaves, np.int32(slot), jax.device_put(new, self._replicated))

    def _padded_on_device(self, weights: LoRAWeights) -> dict[str, jax.Array]:
        """``weights`` (device arrays, per target ``A [L, in, r]`` and ``B [L, r, out]``, any float dtype) as one
        slot's leaves (``_leaf_shapes(with_slots=False)``: rank padded to ``max_lora_rank``, B times the scale,
        in the slots' dtype), computed on the devices. The program is built once per targets, rank, scale and
        input dtypes, through the runner's ``CompileStats`` (so it is counted)."""
        placed = {t: tuple(jax.device_put(x, self._replicated) for x in pair) for t, pair in weights.tensors.items()}
        targets = tuple(sorted(placed))
        key = (targets, weights.rank, weights.scale,
               tuple((x.shape, str(x.dtype)) for t in targets for x in placed[t]))
        if key not in self._pad:
            shapes, rank, dtype = self._leaf_shapes(with_slots=False), self.max_lora_rank, self.dtype

            def pad(tensors: dict[str, tuple[jax.Array, jax.Array]]) -> dict[str, jax.Array]:
                new = {name: jnp.zeros(shape, dtype) for name, shape in shapes.items()}
                for target, (a, b) in tensors.items():
                    fill = rank - a.shape[-1]
                    new[target + LORA_A] = jnp.pad(a.astype(jnp.float32), ((0, 0), (0, 0), (0, fill))).astype(dtype)
                    new[target + LORA_B] = jnp.pad(b.astype(jnp.float32) * np.float32(weights.scale),
                                                   ((0, 0), (0, fill), (0, 0))).astype(dtype)
                return new

            self._pad[key] = self._stats.compile(jax.jit(pad, out_shardings=self._replicated), abstract(placed))
        return self._pad[key](placed)


class LoRAManager:
    """Known adapters, a host LRU of their weights, and which adapter each device slot holds.

    Args:
      slots: the runner's ``LoRASlots``. cfg, family: the model's, to read PEFT names.
      max_cpu_loras: adapters kept on the host at most (least recently used dropped, re-read from their path
        when needed again; an adapter changed by :meth:`update` is never dropped).

    Attributes:
      known: adapter id -> its ``LoRARequest``, the removed ones still in use (:attr:`retiring`) included.
      retiring: ids :meth:`remove` was asked to forget while requests use them: unnamed (not listed, not
        resolved, their names free), dropped by :meth:`drop_retired` once unused.
      epochs: times each adapter changed (:meth:`update`, :meth:`remove`), part of its prefix-cache key.
    """

    def __init__(self, slots: LoRASlots, cfg: ModelConfig, family: Family, max_cpu_loras: int):
        self.slots, self.cfg, self.family, self.max_cpu_loras = slots, cfg, family, max_cpu_loras
        self.known: dict[int, LoRARequest] = {}
        self._host: collections.OrderedDict[int, LoRAWeights] = collections.OrderedDict()
        self._pinned: set[int] = set()
        # Per device slot: the adapter id it holds (0: none) and the step that last used it.
        self.slot_ids = [0] * slots.max_loras
        self._last_used = [0] * slots.max_loras
        self._tick = 0
        self.retiring: set[int] = set()
        self.epochs: dict[int, int] = collections.defaultdict(int)

    def add(self, request: LoRARequest, revive: bool = True) -> None:
        """Know ``request``'s adapter, reading it now (so a bad folder fails its request at once).

        A removed adapter still in use (:attr:`retiring`) given again as it was is named again with ``revive``;
        without it (a request naming it), it stays removed and the request runs under it.

        Raises:
          ValueError: the id already names another adapter (name or path), the name another id, or
            ``read_peft_adapter``'s errors.
        """
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path) and request.lora_path:
                raise ValueError(f"LoRARequest {request.lora_name!r}: lora_int_id={request.lora_int_id} already "
                                 f"names adapter {known.lora_name!r} ({known.lora_path})")
            if revive:
                self.retiring.discard(request.lora_int_id)
            return
        other = next((i for i, r in self.known.items()
                      if r.lora_name == request.lora_name and i not in self.retiring), None)
        if other is not None:
            raise ValueError(f"LoRARequest {request.lora_name!r}: the name already has lora_int_id={other}, not "
                             f"{request.lora_int_id}")
        self._keep(request.lora_int_id, self._read(request))
        self.known[request.lora_int_id] = request

    def _read(self, request: LoRARequest) -> LoRAWeights:
        if not request.lora_path:
            raise ValueError(f"LoRARequest {request.lora_name!r} has no lora_path and the engine does not know "
                             f"lora_int_id={request.lora_int_id}")
        return read_peft_adapter(request.lora_path, name=request.lora_name, hf_layer_names=self.family.hf_layer_names,
                                 hf_layer_prefix=self.family.hf_layer_prefix, shapes=self.slots.shapes,
                                 num_layers=self.cfg.num_layers, max_rank=self.slots.max_lora_rank)

    def _keep(self, lora_id: int, weights: LoRAWeights) -> None:
        """Put ``weights`` in the host LRU, dropping the least recently used unpinned ones past the limit."""
        self._host[lora_id] = weights
        self._host.move_to_end(lora_id)
        for old in [i for i in self._host if i not in self._pinned][:max(len(self._host) - self.max_cpu_loras, 0)]:
            del self._host[old]

    def weights(self, lora_id: int) -> LoRAWeights:
        """The adapter's host weights (read again from its folder when the LRU dropped them)."""
        found = self._host.get(lora_id)
        if found is None:
            found = self._read(self.known[lora_id])
        self._keep(lora_id, found)
        return found

    def list_loras(self) -> list[LoRARequest]:
        """The adapters the engine knows, by id (not the removed ones still in use)."""
        return [self.known[i] for i in sorted(self.known) if i not in self.retiring]

    def remove(self, lora_id: int, in_use: bool) -> bool:
        """Forget adapter ``lora_id`` (vLLM's ``remove_lora``): at once, or, while requests use it (``in_use``),
        once they end (:meth:`drop_retired`); they finish under it. Returns False for an id not known."""
        if lora_id not in self.known or lora_id in self.retiring:
            return False
        self.retiring.add(lora_id)
        if not in_use:  # only this one: other removed adapters may still have requests running under them
            self.drop_retired(self.retiring - {lora_id})
        return True

    def drop_retired(self, in_use: set[int]) -> None:
        """Drop the removed adapters no request uses any more (ids ``in_use`` are kept): their host weights and
        device slot go, and their id's prefix-cache key changes (an adapter added later under the id never reads
        their blocks)."""
        for lora_id in self.retiring - in_use:
            self.retiring.discard(lora_id)
            del self.known[lora_id]
            self._host.pop(lora_id, None)
            self._pinned.discard(lora_id)
            if lora_id in self.slot_ids:
                slot = self.slot_ids.index(lora_id)
                self.slot_ids[slot], self._last_used[slot] = 0, 0
            self.epochs[lora_id] += 1

    def resolve(self, name_or_id: Union[str, int]) -> int:
        """The id of a known adapter given by name or id. Raises ValueError: unknown (the known ones named)."""
        for lora_id, request in self.known.items():
            if name_or_id in (lora_id, request.lora_name) and not isinstance(name_or_id, bool) \
                    and lora_id not in self.retiring:
                return lora_id
        raise ValueError(f"LoRA adapter {name_or_id!r} is not known to the engine; it knows "
                         f"{[(r.lora_name, r.lora_int_id) for r in self.list_loras()]}")

    def row_slots(self, lora_ids: Sequence[int], num_rows: int) -> np.ndarray:
        """Each row's slot, int32[num_rows] (-1: base model, and padding), loading the adapters of ``lora_ids``
        (at most ``max_loras`` distinct, the scheduler's rule) into slots, evicting the least recently used
        adapters these rows do not use. Raises RuntimeError: more distinct adapters than slots."""
        self._tick += 1
        wanted = sorted({i for i in lora_ids if i})
        if len(wanted) > self.slots.max_loras:
            raise RuntimeError(f"a step has {len(wanted)} LoRA adapters; max_loras={self.slots.max_loras}")
        slot_of = {lora_id: s for s, lora_id in enumerate(self.slot_ids) if lora_id in wanted}
        for lora_id in wanted:
            if lora_id not in slot_of:
                free = [s for s in range(self.slots.max_loras) if s not in slot_of.values()]
                slot = min(free, key=lambda s: (self.slot_ids[s] != 0, self._last_used[s]))
                self.slots.write(slot, self.weights(lora_id))
                self.slot_ids[slot] = lora_id
                slot_of[lora_id] = slot
        for slot in slot_of.values():
            self._last_used[slot] = self._tick
        out = np.full(num_rows, -1, np.int32)
        out[:len(lora_ids)] = [slot_of.get(i, -1) for i in lora_ids]
        return out

    def update(self, name_or_id: Union[str, int], tree: Any) -> dict[str, Any]:
        """Replace a known adapter's A and B (``LLM.update_lora``): the host copy (pinned from now on), and its
        device slot if it holds one; its prefix-cache key changes (:attr:`epochs`).

        Args:
          tree: ``{"layers": {"<key>_lora_a": [L, in, r], "<key>_lora_b": [L, r, out]}}`` (or those paths), any
            subset of the adapter's targets, in PEFT's values (unscaled; ``r`` the adapter's rank).

        Returns:
          ``{"lora_int_id", "num_leaves"}``.

        Raises:
          ValueError: an unknown adapter, or a leaf not of the adapter or of the wrong shape (named); nothing
            changes then.
        """
        lora_id = self.resolve(name_or_id)
        old = self.weights(lora_id)
        given = flatten(tree)
        rank = old.rank
        updated = dict(old.tensors)  # pairs are replaced, never written into
        for path, leaf in given.items():
            key, _, which = path.removeprefix("layers/").rpartition("_lora_")
            if not path.startswith("layers/") or which not in ("a", "b") or key not in self.slots.shapes:
                raise ValueError(f"update_lora leaf {path!r} is not a LoRA leaf; they are "
                                 f"{sorted(f'layers/{k}{s}' for k in self.slots.shapes for s in (LORA_A, LORA_B))}")
            fan_in, fan_out = self.slots.shapes[key]
            want = (self.cfg.num_layers, fan_in, rank) if which == "a" else (self.cfg.num_layers, rank, fan_out)
            # A device array stays where it is (the slot write pads it there), so an RL trainer's sync needs no
            # host round trip; anything else becomes float32 numpy.
            value = leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
            if tuple(value.shape) != want or not jnp.issubdtype(value.dtype, jnp.floating):
                raise ValueError(f"update_lora leaf {path!r} has shape {tuple(value.shape)} and dtype {value.dtype}; "
                                 f"adapter {self.known[lora_id].lora_name!r} (rank {rank}) expects {want}, float")
            if not isinstance(value, jax.Array):
                value = value.astype(np.float32)
            if key not in updated:
                updated[key] = (np.zeros((want[0], fan_in, rank), np.float32),
                                np.zeros((want[0], rank, fan_out), np.float32))
            a, b = updated[key]
            updated[key] = (value, b) if which == "a" else (a, value)
        weights = LoRAWeights(rank, old.scale, updated)
        self._pinned.add(lora_id)
        self._keep(lora_id, weights)
        if lora_id in self.slot_ids:
            self.slots.write(self.slot_ids.index(lora_id), weights)
        self.epochs[lora_id] += 1
        return {"lora_int_id": lora_id, "num_leaves": len(given)}
