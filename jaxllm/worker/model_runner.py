"""ModelRunner: the target model's compiled steps (model and sampler in one program per ``(T, S, W, decode_only)``,
KV cache and sampler tables donated) over a ``WeightStore``, a ``CacheEngine`` and a ``ProgramTable``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models import AttentionOps, KVCache, Params, compute_logits, family, hidden_states
from jaxllm.models.config import ModelConfig
from jaxllm.sample.sampler import (
    PromptLogprobRows,
    SamplerOutput,
    SamplerTables,
    SamplingArrays,
    fill_slot,
    init_tables,
    prompt_logprobs,
    sample,
    sample_or_verify,
    set_slot_rows,
)
from jaxllm.structured_output import bitmask_words
from jaxllm.worker.kv_cache import CacheEngine, storage_dtype
from jaxllm.worker.lora import LoRASlots
from jaxllm.worker.programs import CompileStats, ProgramTable, Shape, Warmup, abstract, shared_jit
from jaxllm.worker.sharding import ModelSharding
from jaxllm.worker.step_batch import StepBatch, StepInputs
from jaxllm.worker.weights import WeightStore
from kernels_pallas.storage import ScaledKV
from scheduler import BatchDescriptor, BucketTable


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """A step's outputs, on the device from :meth:`ModelRunner.dispatch` or on the host from :meth:`fetch_rows`:
    ``sampled`` (``[S]`` rows, ``[S, num_positions]`` when verifying), ``prompt`` (prompt logprobs, ``[T]`` rows, or
    None) and ``draft_token_ids`` (int32[S, K] or None)."""

    sampled: SamplerOutput
    prompt: Optional[PromptLogprobRows]
    draft_token_ids: Optional[jax.Array] = None

    def fetch_rows(self, num_rows: int, num_token_rows: int = 0, logprobs: bool = True) -> "StepOutput":
        """The outputs as numpy in one transfer, cut to ``num_rows`` rows and the prompt logprobs to
        ``num_token_rows`` (0: not fetched, ``prompt`` None); ``logprobs`` False leaves the sampled logprobs,
        ranks and top entries on the device (None here): a step no row asked them of reads back its tokens alone.
        """
        sampled = self.sampled
        if not logprobs:
            sampled = dataclasses.replace(sampled, logprobs=None, ranks=None, top_ids=None, top_logprobs=None)
        host = jax.device_get(dataclasses.replace(self, sampled=sampled,
                                                  prompt=self.prompt if num_token_rows else None))

        def first(n: int, tree: Any) -> Any:
            return jax.tree_util.tree_map(lambda v: v[:n], tree)

        return StepOutput(first(num_rows, host.sampled), first(num_token_rows, host.prompt),
                          first(num_rows, host.draft_token_ids))


def _step(params: Params, kv_cache: KVCache, inputs: StepInputs, tables: SamplerTables, prev_tokens: jax.Array,
          bitmask: jax.Array, scaled_pool: Optional[ScaledKV], *, cfg: ModelConfig, ops: AttentionOps,
          num_positions: int = 1, decode_only: bool = False,
          logprobs_mode: str = "raw_logprobs") -> tuple[StepOutput, jax.Array, KVCache, SamplerTables]:
    """Model + sampler + prompt logprobs on the batch and sampling arrays packed in ``inputs``; inputs marked by
    ``batch.prev_token_index`` come from ``prev_tokens``; ``decode_only`` (static): every row has one new token,
    attended by ``ops.decode_attention``; ``logprobs_mode`` (static): what the sampled logprobs hold
    (``EngineConfig.logprobs_mode``). Returns ``(StepOutput, samples padded to prev_tokens' length, kv_cache,
    tables)``."""
    if decode_only:
        ops = ops.for_decode_steps()
    batch, sampling = inputs.unpack()
    from_prev = batch.prev_token_index
    input_ids = jnp.where(from_prev >= 0, prev_tokens[jnp.maximum(from_prev, 0)], batch.input_ids)
    hidden, kv_cache = hidden_states(params, kv_cache, dataclasses.replace(batch, input_ids=input_ids),
                                     cfg=cfg, ops=ops, scaled_pool=scaled_pool)
    head = functools.partial(compute_logits, params, cfg=cfg, native_kernels=True)
    if num_positions == 1:
        logits = head(hidden[batch.logits_indices], num_rows=batch.num_seqs)  # on the kernels: padding rows 0
        sampled, tables = sample(logits, sampling, tables, bitmask, logprobs_mode)
        first = sampled.token_ids
    else:
        sampled, tables = sample_or_verify(head, hidden, input_ids, batch.logits_indices, batch.num_spec_tokens,
                                           sampling, tables, num_positions, bitmask, logprobs_mode)
        first = sampled.token_ids[:, 0]
    # Prompt logprobs map the head over rows one at a time (vmapped): XLA's dot, which batches them, not the
    # kernels (an FFI call has no batching rule).
    rows_head = functools.partial(compute_logits, params, cfg=cfg)
    out = StepOutput(sampled, prompt_logprobs(rows_head, hidden, batch.prompt_target_ids))
    next_prev = jnp.zeros_like(prev_tokens).at[: first.shape[0]].set(first)
    return out, next_prev, kv_cache, tables


def with_lora(params: Params, leaves: dict[str, Any]) -> Params:
    """``params`` with the adapter slot leaves (``LoRASlots.leaves``) among its layer leaves, as steps read them."""
    return {**params, "layers": {**params["layers"], **leaves}}


def _step_arguments(shape: Shape, *, weights: WeightStore, cache: CacheEngine, tables: SamplerTables,
                    prev_tokens: jax.ShapeDtypeStruct, num_positions: int, num_words: int,
                    replicated: jax.sharding.Sharding, lora: Optional[LoRASlots] = None) -> tuple:
    """Abstract step arguments of bucket ``shape``, exactly as :meth:`ModelRunner.dispatch` passes them."""
    s = shape[1]
    bitmask = jax.ShapeDtypeStruct((s, num_words), np.int32, sharding=replicated)
    kv_cache, scaled_pool = cache.abstract()
    params = weights.abstract() if lora is None else with_lora(weights.abstract(), lora.abstract())
    return (params, kv_cache, StepInputs.abstract(shape, s * num_positions, replicated), tables, prev_tokens,
            bitmask, scaled_pool)


class ModelRunner:
    """The target model's runner: dispatches compiled steps over its weight store, KV cache and program table.

    Args:
      params: parameter pytree, already placed by ``sharding``; ``ops`` already wrapped by ``sharding.attention_ops``.
      num_blocks: KV blocks including the null block 0.
      dtype: compute dtype (and the KV cache's unless ``kv_cache_dtype``: int8 / float8_e4m3fn, with
        ``k_scale``/``v_scale`` layer leaves).
      buckets: the (T, S, W) shapes steps are padded to.
      num_sampling_slots: sampler table rows (slot 0 padding), at least ``max_num_seqs + 1``.
      max_model_len: tokens per sequence at most (slot fills are padded to it).
      float_bits_storage: hold bfloat16 / float8 weights and KV as their bits (``kernels_pallas.storage``).
      num_positions: 1, or 1 + ``num_speculative_tokens`` when verifying drafts.
      max_loras, max_lora_rank: LoRA adapter slots every step reads (``LoRASlots``, ``enable_lora``); 0: none.
      logprobs_mode: one of ``jaxllm.config.LOGPROBS_MODES`` (``EngineConfig.logprobs_mode``), fixed in the programs.
      the rest: as :class:`CacheEngine`.

    Raises:
      ValueError: a one-byte ``kv_cache_dtype`` without the scale leaves.

    Attributes:
      weights, cache_engine, programs: the three parts; compile_stats: the programs they built.
      lora: the ``LoRASlots``, or None.
      sampler_tables: the per-slot tables, donated to every step; bitmask_words: int32 words of a bitmask row.
    """

    def __init__(self, cfg: ModelConfig, params: Params, *, num_blocks: int, block_size: int, dtype: Any,
                 ops: AttentionOps, buckets: BucketTable, sharding: ModelSharding, num_host_blocks: int = 0,
                 num_offload_blocks: int = 0, num_sampling_slots: int = 1, max_model_len: int = 1,
                 float_bits_storage: bool = False, kv_cache_dtype: Any = None, num_positions: int = 1,
                 num_pool_blocks: int = 0, pool_dtype: Any = None, max_loras: int = 0,
                 max_lora_rank: int = 0, logprobs_mode: str = "raw_logprobs"):
        kv_dtype = np.dtype(dtype if kv_cache_dtype is None else kv_cache_dtype)
        if kv_dtype.itemsize == 1 and "k_scale" not in params["layers"]:
            raise ValueError(f"kv_cache_dtype={kv_dtype.name} needs the per-layer k_scale/v_scale leaves in "
                             "params['layers'] (jaxllm.worker.kv_cache.calibrate_kv_scales)")
        self.cfg, self.ops, self.dtype, self.buckets = cfg, ops, dtype, buckets
        self.num_positions, self.max_model_len = num_positions, max_model_len
        self._replicated = replicated = sharding.replicated
        self.compile_stats = CompileStats()
        self.lora = lora = None if not max_loras else LoRASlots(
            cfg, family(cfg).layer_keys(cfg), dtype, max_loras=max_loras, max_lora_rank=max_lora_rank,
            sharding=sharding, stats=self.compile_stats)
        self.weights = WeightStore(cfg, params, float_bits_storage=float_bits_storage)
        self.cache_engine = CacheEngine(
            cfg, num_blocks=num_blocks, block_size=block_size, dtype=storage_dtype(kv_dtype, float_bits_storage),
            sharding=sharding, stats=self.compile_stats, num_host_blocks=num_host_blocks,
            num_offload_blocks=num_offload_blocks, num_pool_blocks=num_pool_blocks,
            pool_dtype=storage_dtype(pool_dtype, float_bits_storage) if num_pool_blocks else None)
        self.sampler_tables = jax.device_put(init_tables(num_sampling_slots, cfg.vocab_size), replicated)
        self._no_prev_tokens = jax.device_put(np.zeros(buckets.seq_buckets[-1], np.int32), replicated)
        self.bitmask_words = bitmask_words(cfg.vocab_size)
        # Per row bucket S: an all-ones bitmask kept on the device, passed by steps without a constrained row.
        self._all_allowed = {s: jax.device_put(np.full((s, self.bitmask_words), -1, np.int32), replicated)
                             for s in buckets.seq_buckets}
        self._slot_ops: dict[str, Callable] = {}
        # Outputs pinned to the inputs' shardings: the donated KV cache and sampler tables come back laid out as
        # the next step was compiled for.
        step_fns = {decode_only: shared_jit(_step, donate_argnums=(1, 3), traced_from=family(cfg),
                                            out_shardings=(replicated, replicated, self.cache_engine.sharding(),
                                                           replicated),
                                            cfg=cfg, ops=ops, num_positions=num_positions, decode_only=decode_only,
                                            logprobs_mode=logprobs_mode)
                    for decode_only in (False, True)}
        arguments = functools.partial(_step_arguments, weights=self.weights, cache=self.cache_engine,
                                      tables=abstract(self.sampler_tables), prev_tokens=abstract(self._no_prev_tokens),
                                      num_positions=num_positions, num_words=self.bitmask_words, replicated=replicated,
                                      lora=lora)
        self.programs = ProgramTable(buckets, step_fns.__getitem__, arguments, self.compile_stats)

    def warmup(self, progress: bool = True, swap: bool = False, background: bool = False) -> Warmup:
        """Build every bucket's step program and the block-copy, slot-fill and (``swap``) swap programs
        (``ProgramTable.warmup`` for ``background``). Returns what was built and the seconds spent."""
        def others() -> None:
            self.cache_engine.warmup(swap)
            if self.lora is not None:
                self.lora.warmup()
            for name in ("fill", "rows"):
                self._slot_op(name)

        return self.programs.warmup(others, progress=progress, background=background)

    def resize_kv_cache(self, num_blocks: int) -> int:
        """Resize the KV cache and rebuild the programs taking it; returns the programs built
        (RuntimeError while released)."""
        return self.programs.rebuild_after(functools.partial(self.cache_engine.resize, num_blocks))

    def dispatch(self, batch: BatchDescriptor, sampling: SamplingArrays, prev_tokens: Optional[jax.Array] = None,
                 prompt_target_ids: Optional[np.ndarray] = None,
                 bitmask: Optional[np.ndarray] = None,
                 lora_slots: Optional[np.ndarray] = None) -> tuple[StepOutput, jax.Array, StepInputs]:
        """Launch one step without waiting for it. Its host inputs travel in one transfer (``StepInputs``), two with a
        ``bitmask``, which is not packed: always in the buffer it would add ``S * ceil(V / 32)`` words to every step
        (4.9 MB at 256 rows of a 151,936-token vocabulary), and packed only when present it would need a second
        program per bucket. A step without one passes an all-ones bitmask kept on the device.

        Args:
          batch: bucket-shaped (T, S, W) arrays; sampling: ``[S * num_positions]`` row controls.
          prev_tokens: the previous dispatch's padded samples (async scheduling).
          prompt_target_ids: int32[T] next prompt token where a prompt logprob is wanted, else -1; None: none.
          bitmask: int32[S, ceil(V/32)] tokens each row may sample; None: all.
          lora_slots: int32[S] each row's LoRA slot, -1 none (``LoRAManager.row_slots``); None: all none.

        Returns:
          ``(StepOutput on the device, sampled ids as int32[max S bucket], the step's inputs on the device)`` (a draft
          model's step reads the same inputs); KV cache and sampler tables are donated.
        """
        exe = self.programs.step_program(batch.program)
        inputs = StepInputs.pack(StepBatch.from_descriptor(batch, prompt_target_ids, lora_slots), sampling)
        if bitmask is None:
            inputs, bitmask = jax.device_put(inputs, self._replicated), self._all_allowed[batch.shape[1]]
        else:
            inputs, bitmask = jax.device_put((inputs, bitmask), self._replicated)
        prev = self._no_prev_tokens if prev_tokens is None else prev_tokens
        cache = self.cache_engine
        params = self.weights.params if self.lora is None else with_lora(self.weights.params, self.lora.leaves)
        out, next_prev, cache.kv_cache, self.sampler_tables = exe(
            params, cache.kv_cache, inputs, self.sampler_tables, prev, bitmask, cache.scaled_pool,
        )
        return out, next_prev, inputs

    def fill_slot(self, slot: int, token_ids: Sequence[int], num_prompt: int) -> None:
        """Reset sampling slot ``slot`` for a sequence (re)admitted with ``token_ids`` (prompt then output)."""
        padded = np.zeros(self.max_model_len, np.int32)
        padded[: len(token_ids)] = token_ids
        self.sampler_tables = self._slot_op("fill")(
            self.sampler_tables, np.int32(slot), padded, np.int32(num_prompt), np.int32(len(token_ids))
        )

    def set_slot_rows(self, slot: int, bias: np.ndarray, stop: np.ndarray) -> None:
        """Write slot ``slot``'s bias row (float32[V]) and min_tokens stop row (bool[V])."""
        self.sampler_tables = self._slot_op("rows")(self.sampler_tables, np.int32(slot), bias, stop)

    def _slot_op(self, name: str) -> Callable:
        exe = self._slot_ops.get(name)
        if exe is None:
            rep = self._replicated
            tables = abstract(self.sampler_tables)
            scalar = jax.ShapeDtypeStruct((), np.int32, sharding=rep)
            if name == "fill":
                tokens = jax.ShapeDtypeStruct((self.max_model_len,), np.int32, sharding=rep)
                exe = self.compile_stats.compile(jax.jit(fill_slot, donate_argnums=(0,), out_shardings=rep),
                                                 tables, scalar, tokens, scalar, scalar)
            else:
                vocab = self.cfg.vocab_size
                rows = (jax.ShapeDtypeStruct((vocab,), np.float32, sharding=rep),
                        jax.ShapeDtypeStruct((vocab,), np.bool_, sharding=rep))
                exe = self.compile_stats.compile(jax.jit(set_slot_rows, donate_argnums=(0,), out_shardings=rep),
                                                 tables, scalar, *rows)
            self._slot_ops[name] = exe
        return exe
