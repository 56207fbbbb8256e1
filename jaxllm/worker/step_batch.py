"""StepBatch: the batch arrays of one compiled step, declared once: each field names its shape in ``(T, S, W)``, from
which come the host arrays (:meth:`StepBatch.from_descriptor`) and the abstract arguments (:meth:`StepBatch.abstract`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

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

    @classmethod
    def abstract(cls, shape: tuple[int, int, int], sharding: Any) -> "StepBatch":
        """``ShapeDtypeStruct``s of bucket ``shape`` placed by ``sharding``."""
        t, s, w = shape
        sizes = {"T": t, "S": s, "W": w, "S+1": s + 1}
        return cls(**{f.name: jax.ShapeDtypeStruct(tuple(sizes[d] for d in f.metadata["dims"]), np.int32,
                                                   sharding=sharding)
                      for f in dataclasses.fields(cls)})
