"""ModelRunner: device parameters, the paged KV cache and the jitted step.

One jitted function runs the model and the sampler for a bucketed batch; it is
traced once per ``(T, S, W)`` bucket shape, and the KV cache is donated to it
so the device holds one copy. The scheduler's block ids index the cache
directly (one process, as in nano-vllm).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.kv_cache import allocate_kv_cache
from jaxllm.models.llama import AttentionOps, KVCache, Params, forward
from jaxllm.sampling import SamplingArrays, sample
from scheduler import BatchDescriptor

BATCH_KEYS = (
    "input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
    "query_start_loc", "logits_indices",
)


def _step(params: Params, kv_caches: KVCache, batch: dict, sampling: dict, *, cfg: ModelConfig,
          ops: AttentionOps) -> tuple[jax.Array, KVCache]:
    logits, kv_caches = forward(params, kv_caches, batch, cfg=cfg, ops=ops)
    return sample(logits, sampling), kv_caches


def _pad_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _gather_blocks(kv_caches: KVCache, ids: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    return [(k[ids], v[ids]) for k, v in kv_caches]


def _scatter_blocks(kv_caches: KVCache, ids: jax.Array, blocks: list) -> KVCache:
    return [(k.at[ids].set(bk), v.at[ids].set(bv)) for (k, v), (bk, bv) in zip(kv_caches, blocks)]


def _copy_blocks(kv_caches: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    return [(k.at[dst].set(k[src]), v.at[dst].set(v[src])) for k, v in kv_caches]


class ModelRunner:
    """Runs model steps for the engine.

    Args:
      cfg: model configuration.
      params: parameter pytree (numpy or device arrays).
      num_blocks: KV blocks including the null block 0.
      block_size: tokens per block.
      dtype: compute and KV dtype.
      ops: attention implementation (Pallas kernels or jnp references).
      num_host_blocks: host swap pool size in blocks (0 = no swap space).

    The device cache is ``self.kv_caches`` (list over layers of ``(k, v)``,
    each ``[num_blocks, block_size, num_kv_heads, head_dim]``).
    """

    def __init__(self, cfg: ModelConfig, params: Params, *, num_blocks: int, block_size: int, dtype: Any,
                 ops: AttentionOps, num_host_blocks: int = 0):
        self.cfg = cfg
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.params = jax.device_put(params)
        self.kv_caches = allocate_kv_cache(cfg, num_blocks, block_size, dtype)
        self._step = jax.jit(functools.partial(_step, cfg=cfg, ops=ops), donate_argnums=(1,))
        self._gather = jax.jit(_gather_blocks)
        self._scatter = jax.jit(_scatter_blocks, donate_argnums=(0,))
        self._copy = jax.jit(_copy_blocks, donate_argnums=(0,))
        block_shape = (num_host_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.host_pool = [(np.zeros(block_shape, dtype), np.zeros(block_shape, dtype))
                          for _ in range(cfg.num_layers if num_host_blocks else 0)]

    def execute(self, batch: BatchDescriptor, sampling: SamplingArrays) -> np.ndarray:
        """Run one step; returns int32[num_seqs] sampled token ids.

        ``batch`` arrays are bucket-shaped (T, S, W); the KV cache is updated
        in place (donated).
        """
        arrays = {key: getattr(batch, key) for key in BATCH_KEYS}
        arrays["num_seqs"] = np.int32(batch.num_seqs)
        device_batch, device_sampling = jax.device_put((arrays, sampling.as_dict()))
        tokens, self.kv_caches = self._step(self.params, self.kv_caches, device_batch, device_sampling)
        return np.asarray(tokens)[: batch.num_seqs]

    def swap_out(self, pairs: Sequence[Sequence[int]]) -> None:
        """Copy device blocks to the host pool: ``pairs`` of (device, host) ids."""
        if len(pairs) == 0:
            return
        pairs = np.asarray(pairs, np.int32)
        ids = np.zeros(_pad_pow2(len(pairs)), np.int32)
        ids[: len(pairs)] = pairs[:, 0]
        blocks = jax.device_get(self._gather(self.kv_caches, ids))
        for (hk, hv), (bk, bv) in zip(self.host_pool, blocks):
            hk[pairs[:, 1]] = bk[: len(pairs)]
            hv[pairs[:, 1]] = bv[: len(pairs)]

    def swap_in(self, pairs: Sequence[Sequence[int]]) -> None:
        """Copy host-pool blocks back to the device: ``pairs`` of (host, device) ids.

        Padding entries of the power-of-two id array target the null block 0.
        """
        if len(pairs) == 0:
            return
        pairs = np.asarray(pairs, np.int32)
        padded = _pad_pow2(len(pairs))
        ids = np.zeros(padded, np.int32)
        ids[: len(pairs)] = pairs[:, 1]
        blocks = []
        for hk, hv in self.host_pool:
            bk = np.zeros((padded,) + hk.shape[1:], hk.dtype)
            bv = np.zeros_like(bk)
            bk[: len(pairs)] = hk[pairs[:, 0]]
            bv[: len(pairs)] = hv[pairs[:, 0]]
            blocks.append((bk, bv))
        self.kv_caches = self._scatter(self.kv_caches, jnp.asarray(ids), blocks)

    def copy_blocks(self, pairs: Sequence[Sequence[int]]) -> None:
        """Copy device blocks onto device blocks: ``pairs`` of (src, dst) ids, dsts distinct.

        The scheduler's copy-on-write of a fully cached prompt's last block;
        done after the swaps, before the step. Padding entries of the
        power-of-two id arrays copy the null block 0 onto itself.
        """
        if len(pairs) == 0:
            return
        pairs = np.asarray(pairs, np.int32)
        ids = np.zeros((2, _pad_pow2(len(pairs))), np.int32)
        ids[:, : len(pairs)] = pairs.T
        self.kv_caches = self._copy(self.kv_caches, ids[0], ids[1])
