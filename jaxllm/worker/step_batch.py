"""StepBatch: the batch arrays of one compiled step, declared once: each field names its shape in ``(T, S, W)``, from
which come the host arrays (:meth:`StepBatch.from_descriptor`) and their place in a step's packed inputs.

StepInputs: a step's host inputs (its ``StepBatch`` and ``SamplingArrays``) packed into one int32 buffer, so that they
reach the device in one transfer, and unpacked inside the compiled step at offsets fixed by the bucket shape (its
abstract argument: :meth:`StepInputs.abstract`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

from jaxllm.sample.sampler import SamplingArrays
from scheduler import BatchDescriptor


def _int32(*dims: str) -> Any:
    """A field holding int32 of shape ``dims`` (``"T"``, ``"S"``, ``"W"``, ``"S+1"``; none: a scalar)."""
    return dataclasses.field(metadata={"dims": dims})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """The batch of one step padded to a bucket ``(T, S, W)``: int32 arrays, numpy or ``jax.Array`` (a pytree), in
    vLLM v1's flattened ragged layout (fields as ``scheduler.BatchDescriptor``'s).

      input_ids, positions, slot_mapping: int32[T].
      block_tables: int32[S, W]; seq_lens: int32[S]; query_start_loc: int32[S + 1].
      logits_indices: int32[S] each row's last query token.
      prev_token_index: int32[T] the previous step's row whose sample is the input id, -1 elsewhere.
      prompt_target_ids: int32[T] the next prompt token where a prompt logprob is wanted, -1 elsewhere.
      num_spec_tokens: int32[S] draft tokens each row verifies.
      num_seqs: int32[] real rows.
      lora_slots: int32[S] each row's LoRA slot (``jaxllm.worker.lora``), -1 for the base model and padding;
        None in batches built outside a runner (read only where the params hold adapter slots).
    """

    input_ids: jax.Array = _int32("T")
    positions: jax.Array = _int32("T")
    slot_mapping: jax.Array = _int32("T")
    block_tables: jax.Array = _int32("S", "W")
    seq_lens: jax.Array = _int32("S")
    query_start_loc: jax.Array = _int32("S+1")
    logits_indices: jax.Array = _int32("S")
    prev_token_index: jax.Array = _int32("T")
    prompt_target_ids: jax.Array = _int32("T")
    num_spec_tokens: jax.Array = _int32("S")
    num_seqs: jax.Array = _int32()
    lora_slots: Optional[jax.Array] = dataclasses.field(default=None, metadata={"dims": ("S",)})

    @classmethod
    def from_descriptor(cls, batch: BatchDescriptor, prompt_target_ids: Optional[np.ndarray] = None,
                        lora_slots: Optional[np.ndarray] = None) -> "StepBatch":
        """The host arrays of ``batch``, with ``prompt_target_ids`` (int32[T]; None: no prompt logprob wanted) and
        ``lora_slots`` (int32[S]; None: every row on the base model)."""
        if prompt_target_ids is None:
            prompt_target_ids = np.full(batch.input_ids.shape, -1, np.int32)
        if lora_slots is None:
            lora_slots = np.full(batch.seq_lens.shape, -1, np.int32)
        given = ("prompt_target_ids", "lora_slots")
        arrays = {f.name: np.asarray(getattr(batch, f.name), np.int32)
                  for f in dataclasses.fields(cls) if f.name not in given}
        return cls(**arrays, prompt_target_ids=prompt_target_ids, lora_slots=lora_slots)


class _Entry(NamedTuple):
    """One array's place in a packed buffer: ``words[start:start + size]``, of ``shape`` and ``dtype``."""

    name: str
    start: int
    size: int
    shape: tuple[int, ...]
    dtype: np.dtype


class _Layout(NamedTuple):
    """A packed buffer's ``StepBatch`` entries, then its ``SamplingArrays`` entries (field order, back to back), and
    its length in words."""

    batch: tuple[_Entry, ...]
    sampling: tuple[_Entry, ...]
    size: int


# The dtypes a word holds, one element each (as its bits; bool as 0 or 1).
_PACKED_DTYPES = tuple(np.dtype(d) for d in (np.int32, np.float32, np.uint32, np.bool_))


@functools.lru_cache(maxsize=None)
def _layout(shape: tuple[int, int, int], num_sampling_rows: int) -> _Layout:
    """The packed layout of bucket ``shape`` with ``num_sampling_rows`` (TypeError: a field of another dtype)."""
    t, s, w = shape
    sizes = {"T": t, "S": s, "W": w, "S+1": s + 1}
    empty = SamplingArrays.empty(num_sampling_rows)
    fields = ([(f.name, tuple(sizes[d] for d in f.metadata["dims"]), np.dtype(np.int32))
               for f in dataclasses.fields(StepBatch)],
              [(f.name, getattr(empty, f.name).shape, getattr(empty, f.name).dtype)
               for f in dataclasses.fields(SamplingArrays)])
    start, groups = 0, []
    for group in fields:
        entries = []
        for name, dims, dtype in group:
            if dtype not in _PACKED_DTYPES:
                raise TypeError(f"{name}: {dtype} does not pack into int32 words")
            size = int(np.prod(dims, dtype=np.int64))
            entries.append(_Entry(name, start, size, dims, dtype))
            start += size
        groups.append(tuple(entries))
    return _Layout(groups[0], groups[1], start)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["words"], meta_fields=["shape", "num_sampling_rows"])
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """A step's ``StepBatch`` and ``SamplingArrays`` in one int32 buffer (a pytree of one array, numpy or
    ``jax.Array``), so that one transfer carries them.

    The layout is static, a function of the bucket ``shape`` ``(T, S, W)`` and ``num_sampling_rows`` (``S *
    num_positions``), which are the pytree's metadata: a program compiled for a bucket takes that bucket's buffers
    only and unpacks them at constant offsets, so packing adds no program. Fields lie back to back in declaration
    order (``StepBatch``'s, then ``SamplingArrays``'), one word an element: int32 as is, float32 and uint32 as their
    bits, bool as 0 or 1.

    Attributes:
      words: int32[n], n the elements of every field of both: ``5 T + S (W + 5) + 2`` of the batch, ``15 +
        MAX_BANNED_IDS`` a sampling row.
      shape: ``(T, S, W)``; num_sampling_rows: the sampling arrays' rows.
    """

    words: Any
    shape: tuple[int, int, int]
    num_sampling_rows: int

    @classmethod
    def pack(cls, batch: StepBatch, sampling: SamplingArrays) -> "StepInputs":
        """The numpy buffer of host arrays ``batch`` (``lora_slots`` set) and ``sampling``.

        Raises:
          ValueError: an array whose shape is not its field's in ``batch``'s bucket.
        """
        shape = (batch.input_ids.shape[0], *batch.block_tables.shape)
        num_rows = sampling.slot.shape[0]
        layout = _layout(shape, num_rows)
        words = np.empty(layout.size, np.int32)
        # A view of the buffer per dtype: assigning through it stores the elements' bits (bool as 0 or 1).
        views = {np.dtype(np.int32): words, np.dtype(np.bool_): words, np.dtype(np.float32): words.view(np.float32),
                 np.dtype(np.uint32): words.view(np.uint32)}
        for source, entries in ((batch, layout.batch), (sampling, layout.sampling)):
            for e in entries:
                value = getattr(source, e.name)
                if np.shape(value) != e.shape:
                    raise ValueError(f"{e.name} has shape {np.shape(value)}; a step of bucket {shape} with {num_rows} "
                                     f"sampling rows packs {e.shape}")
                views[e.dtype][e.start:e.start + e.size] = np.ravel(value)
        return cls(words, shape, num_rows)

    @classmethod
    def abstract(cls, shape: tuple[int, int, int], num_sampling_rows: int, sharding: Any) -> "StepInputs":
        """The ``ShapeDtypeStruct`` buffer of bucket ``shape`` placed by ``sharding``."""
        size = _layout(shape, num_sampling_rows).size
        return cls(jax.ShapeDtypeStruct((size,), np.int32, sharding=sharding), shape, num_sampling_rows)

    def unpack(self) -> tuple[StepBatch, SamplingArrays]:
        """``(StepBatch, SamplingArrays)`` sliced from ``words`` at the layout's offsets (inside a traced step)."""
        def read(e: _Entry) -> jax.Array:
            part = self.words[e.start:e.start + e.size].reshape(e.shape)
            if e.dtype == np.bool_:
                return part != 0
            return part if e.dtype == np.int32 else jax.lax.bitcast_convert_type(part, e.dtype)

        layout = _layout(self.shape, self.num_sampling_rows)
        return (StepBatch(**{e.name: read(e) for e in layout.batch}),
                SamplingArrays(**{e.name: read(e) for e in layout.sampling}))
