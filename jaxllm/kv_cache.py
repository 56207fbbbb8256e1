"""The paged KV cache: sizing from a memory budget and device allocation.

Layout: ``k_cache, v_cache: [num_layers, num_blocks, block_size, num_kv_heads,
head_dim]``, each layer in vLLM's "NHD" paged layout, stacked so the model's
scan over layers carries one array per K and V. Block 0 (of every layer) is
the null block that padded token slots write into; the scheduler never hands
it out.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.models.common import KVCache

if TYPE_CHECKING:
    from jaxllm.sharding import ModelSharding

CPU_DEFAULT_KV_BYTES = 1 << 30
GPU_MEMORY_FRACTION = 0.9


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: Any) -> int:
    """Device bytes one block takes over all layers, K and V together."""
    return cfg.kv_bytes_per_token * block_size * np.dtype(dtype).itemsize


def default_kv_cache_bytes(device: Any) -> int:
    """The KV budget when none is given: on an accelerator, 90% of
    ``device``'s memory minus what is in use there (the parameters, already
    placed, included); on CPU, 1 GiB."""
    if device.platform == "cpu":
        return CPU_DEFAULT_KV_BYTES
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit", 0)
    in_use = stats.get("bytes_in_use", 0)
    return max(int(limit * GPU_MEMORY_FRACTION) - in_use, 0)


def resolve_num_blocks(
    cfg: ModelConfig,
    *,
    block_size: int,
    dtype: Any,
    num_kv_blocks: Optional[int],
    kv_cache_memory_bytes: Optional[int],
    max_num_seqs: int,
    max_model_len: int,
    device: Any,
) -> int:
    """Number of KV blocks, the null block included.

    ``num_kv_blocks`` wins when given. Otherwise the budget
    (``kv_cache_memory_bytes``, or :func:`default_kv_cache_bytes` of
    ``device``, this replica's first device) is divided
    by :func:`bytes_per_block`, capped at what ``max_num_seqs`` sequences of
    ``max_model_len`` tokens can use.

    Raises:
      ValueError: the budget holds fewer than 2 blocks, or fewer than one
        ``max_model_len`` sequence needs (named with both numbers).
    """
    if num_kv_blocks is not None:
        return num_kv_blocks
    per_block = bytes_per_block(cfg, block_size, dtype)
    budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else default_kv_cache_bytes(device)
    blocks_per_seq = math.ceil(max_model_len / block_size)
    num_blocks = min(budget // per_block, max_num_seqs * blocks_per_seq + 1)
    if num_blocks < blocks_per_seq + 1:
        raise ValueError(
            f"kv_cache_memory_bytes={budget} holds {budget // per_block} blocks of {per_block} bytes; "
            f"one max_model_len={max_model_len} sequence needs {blocks_per_seq + 1} (null block included)"
        )
    return int(num_blocks)


def allocate_kv_cache(num_blocks: int, block_size: int, dtype: Any, sharding: "ModelSharding") -> KVCache:
    """Zeroed ``(k_cache, v_cache)`` on ``sharding``'s devices.

    Each array: ``[num_layers, num_blocks, block_size,
    sharding.num_cache_heads, head_dim]`` of ``dtype``, split over the heads
    axis (``sharding.kv_cache_sharding``) and created shard by shard.
    """
    cfg = sharding.cfg
    shape = (cfg.num_layers, num_blocks, block_size, sharding.num_cache_heads, cfg.head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding.kv_cache_sharding)
    return zeros(), zeros()
