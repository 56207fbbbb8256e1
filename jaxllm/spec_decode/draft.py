"""Draft-model proposer: a smaller model with the target's vocabulary drafts tokens greedily on the device, right
after the target's step on the same batch. Its KV cache shares the target's block ids (every block operation runs on
both caches); drafts write into the rows' lookahead slots. docs/design/spec-decode.md has the details."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models import AttentionOps, KVCache, Params, family, forward, hidden_states
from jaxllm.models.config import ModelConfig
from jaxllm.sample.sampler import SamplerOutput, argmax_rows
from jaxllm.worker.kv_cache import CacheEngine, storage_dtype
from jaxllm.worker.programs import CompileStats, ProgramTable, Warmup, shared_jit
from jaxllm.worker.sharding import ModelSharding
from jaxllm.worker.step_batch import StepInputs
from jaxllm.worker.weights import WeightStore
from scheduler import BatchDescriptor, BucketTable


def propose(params: Params, kv_cache: KVCache, inputs: StepInputs, tokens: jax.Array, num_emitted: jax.Array, *,
            cfg: ModelConfig, ops: AttentionOps, num_speculative_tokens: int,
            decode_only: bool = False) -> tuple[jax.Array, KVCache]:
    """The draft model's step: compute the target step's query tokens, then draft greedily.

    Args:
      params, kv_cache: the draft model's (cache donated).
      inputs: the target step's packed inputs, already on the device; its batch: ``[T]`` tokens, ``[S]`` rows.
      tokens: int32[S, P] the target's emitted tokens, first ``num_emitted`` (int32[S]) valid.
      cfg, ops, num_speculative_tokens (K): static; decode_only (static): the target step's every row has one new
        token. The draft steps are one token a row: ``ops.decode_attention`` where there is one.

    Returns:
      ``(drafts int32[S, K], the updated cache)``; each row continues its last emitted token.
    """
    batch, _ = inputs.unpack()
    _, kv_cache = hidden_states(params, kv_cache, batch, cfg=cfg, ops=ops.for_decode_steps() if decode_only else ops)
    block_tables, num_seqs = batch.block_tables, batch.num_seqs
    num_rows, width = block_tables.shape
    block_size = kv_cache[0].shape[2]
    rows = jnp.arange(num_rows)
    real = rows < num_seqs
    last = tokens[rows, num_emitted - 1]
    start = batch.seq_lens - batch.num_spec_tokens + num_emitted - 1
    # Every draft step is one token per row: S query tokens, none fed from a previous step, no prompt target,
    # no draft to verify.
    no_token = jnp.full(num_rows, -1, jnp.int32)
    decode = dataclasses.replace(batch, query_start_loc=jnp.arange(num_rows + 1, dtype=jnp.int32), logits_indices=rows,
                                 prev_token_index=no_token, prompt_target_ids=no_token,
                                 num_spec_tokens=jnp.zeros(num_rows, jnp.int32))

    def one(carry: tuple[KVCache, jax.Array, jax.Array], _: Any) -> tuple[tuple[KVCache, jax.Array, jax.Array], jax.Array]:
        cache, token, position = carry
        block = position // block_size
        has_slot = real & (block < width)
        slot = block_tables[rows, jnp.minimum(block, width - 1)] * block_size + position % block_size
        step = dataclasses.replace(decode, input_ids=token, positions=position,
                                   slot_mapping=jnp.where(has_slot, slot, 0), seq_lens=jnp.where(real, position + 1, 0))
        logits, cache = forward(params, cache, step, cfg=cfg, ops=ops.for_decode_steps(), all_logits=True)
        draft = argmax_rows(logits)
        return (cache, draft, position + 1), draft

    (kv_cache, _, _), drafts = jax.lax.scan(one, (kv_cache, last, start), None, length=num_speculative_tokens)
    return drafts.T, kv_cache


def _propose_arguments(shape: tuple[int, int, int], *, weights: WeightStore, cache: CacheEngine, num_positions: int,
                       replicated: jax.sharding.Sharding) -> tuple:
    """Abstract arguments of bucket ``shape``, as :meth:`DraftRunner.propose_async` passes them."""
    s = shape[1]
    return (weights.abstract(), cache.abstract()[0], StepInputs.abstract(shape, s * num_positions, replicated),
            jax.ShapeDtypeStruct((s, num_positions), np.int32, sharding=replicated),
            jax.ShapeDtypeStruct((s,), np.int32, sharding=replicated))


class DraftRunner:
    """The draft model's weight store, KV cache and program table of compiled :func:`propose` steps.

    ``num_blocks``, ``block_size``, ``buckets``, ``num_host_blocks``, ``num_offload_blocks`` are the target's (shared
    block ids); ``cfg``, ``params``, ``ops``, ``sharding`` the draft model's; ``dtype`` is the compute and KV dtype;
    ``num_positions`` is ``1 + num_speculative_tokens``. Attributes as ``ModelRunner``'s.
    """

    def __init__(self, cfg: ModelConfig, params: Params, *, num_speculative_tokens: int, num_positions: int,
                 num_blocks: int, block_size: int, dtype: Any, ops: AttentionOps, buckets: BucketTable,
                 sharding: ModelSharding, num_host_blocks: int = 0, num_offload_blocks: int = 0,
                 float_bits_storage: bool = False):
        self.cfg, self.ops, self.dtype, self.buckets = cfg, ops, dtype, buckets
        self.num_speculative_tokens, self.num_positions = num_speculative_tokens, num_positions
        self._replicated = sharding.replicated
        self.compile_stats = CompileStats()
        self.weights = WeightStore(cfg, params, float_bits_storage=float_bits_storage)
        self.cache_engine = CacheEngine(cfg, num_blocks=num_blocks, block_size=block_size,
                                        dtype=storage_dtype(dtype, float_bits_storage), sharding=sharding,
                                        stats=self.compile_stats, num_host_blocks=num_host_blocks,
                                        num_offload_blocks=num_offload_blocks)
        step_fns = {decode_only: shared_jit(propose, donate_argnums=(1,), traced_from=family(cfg),
                                            out_shardings=(self._replicated, self.cache_engine.sharding()),
                                            cfg=cfg, ops=ops, num_speculative_tokens=num_speculative_tokens,
                                            decode_only=decode_only)
                    for decode_only in (False, True)}
        arguments = functools.partial(_propose_arguments, weights=self.weights, cache=self.cache_engine,
                                      num_positions=num_positions, replicated=self._replicated)
        self.programs = ProgramTable(buckets, step_fns.__getitem__, arguments, self.compile_stats)

    def warmup(self, progress: bool = True, swap: bool = False, background: bool = False) -> Warmup:
        """Build every bucket's step program and the block-copy (with ``swap`` the swap) programs; returns
        what was built and the seconds spent."""
        return self.programs.warmup(functools.partial(self.cache_engine.warmup, swap), progress=progress,
                                    background=background)

    def resize_kv_cache(self, num_blocks: int) -> int:
        """As ``ModelRunner.resize_kv_cache``: returns the programs built."""
        return self.programs.rebuild_after(functools.partial(self.cache_engine.resize, num_blocks))

    def propose_async(self, batch: BatchDescriptor, inputs: StepInputs, target_out: SamplerOutput) -> jax.Array:
        """Launch the draft step after the target's on ``batch``, from the target step's ``inputs`` on the device
        (no transfer) and ``target_out`` (``token_ids [S, P]``, ``num_emitted [S]`` on the device); returns the
        drafts int32[S, K] on the device."""
        exe = self.programs.step_program(batch.program)
        cache = self.cache_engine
        drafts, cache.kv_cache = exe(self.weights.params, cache.kv_cache, inputs, target_out.token_ids,
                                     target_out.num_emitted)
        return drafts
