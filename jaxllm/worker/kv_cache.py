"""The paged KV cache: sizing from a memory budget, device allocation, and the scales of a quantized cache.

Layout: ``k_cache, v_cache: [num_layers, num_blocks, block_size, num_kv_heads,
head_dim]``, each layer in vLLM's "NHD" paged layout, stacked so the model's
scan over layers carries one array per K and V. Block 0 (of every layer) is
the null block that padded token slots write into; the scheduler never hands
it out.

KV caches (``LLM(kv_cache_dtype="int8" | "fp8_e4m3")``). One float32 scale
per layer and KV head, for K and for V (``kernels_pallas.storage`` states
how the write and attention use them). They are calibrated when the engine
starts, by :func:`calibrate_kv_scales`: one forward pass over
:data:`CALIBRATION_TEXT` with a float32 cache gives each head's largest
``|k|`` and ``|v|``, and the scale maps that, times :data:`KV_SCALE_MARGIN`,
to the type's largest value (per-tensor static scales are vLLM's fp8 KV
cache, which TensorRT-LLM calibrates the same way for int8).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxllm.config import KV_CACHE_DTYPES
from jaxllm.logger import init_logger
from jaxllm.models import hidden_states
from jaxllm.models.common import KVCache, Params
from jaxllm.models.config import ModelConfig
from jaxllm.worker.step_batch import StepBatch
from kernels_pallas.storage import KV_QUANT_MAX

if TYPE_CHECKING:
    from jaxllm.worker.sharding import ModelSharding

logger = init_logger(__name__)
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


def _budget(kv_cache_memory_bytes: Optional[int], device: Any) -> tuple[int, str]:
    """The KV budget in bytes and how to name it in a message."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes, f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
    budget = default_kv_cache_bytes(device)
    return budget, f"kv_cache_memory_bytes={budget} (the default on {device.platform})"


# What a message about a KV budget too small for max_model_len tells the user to change (LLM keyword, CLI flag).
_KV_FLAGS = ("max_model_len (--max-model-len), kv_cache_memory_bytes (--kv-cache-memory-bytes) or "
             "kv_cache_dtype='fp8' (--kv-cache-dtype fp8, one byte a number)")


def fit_max_model_len(cfg: ModelConfig, *, block_size: int, dtype: Any, kv_cache_memory_bytes: Optional[int],
                      max_model_len: int, device: Any) -> int:
    """The ``max_model_len`` to serve when the user left it unset (vLLM's ``max_model_len=-1``).

    Args:
      max_model_len: the model's own length (``max_position_embeddings``), in tokens.
      the rest: as :func:`resolve_num_blocks`.

    Returns:
      ``max_model_len`` when the KV budget (``kv_cache_memory_bytes``, or :func:`default_kv_cache_bytes` of
      ``device``) holds one sequence of it; else the largest length it holds, ``(blocks - 1) * block_size``
      tokens (block 0 is the null block), logged as a warning that names both lengths and the budget.

    Raises:
      ValueError: the budget holds fewer than 2 blocks, so no length fits (named with the budget and the flags
        that change it).
    """
    per_block = bytes_per_block(cfg, block_size, dtype)
    budget, budget_name = _budget(kv_cache_memory_bytes, device)
    blocks = budget // per_block
    fit = (blocks - 1) * block_size
    if fit >= max_model_len:
        return max_model_len
    if fit < 1:
        raise ValueError(f"{budget_name} holds {blocks} KV blocks of {per_block} bytes, and a sequence needs 2 or "
                         f"more (the null block and one of {block_size} tokens); raise kv_cache_memory_bytes "
                         f"(--kv-cache-memory-bytes) or use kv_cache_dtype='fp8' (--kv-cache-dtype fp8)")
    need = math.ceil(max_model_len / block_size) + 1
    logger.warning(f"max_model_len={fit}, below the model's {max_model_len}: {budget_name} holds {blocks} KV "
                   f"blocks of {block_size} tokens and one {max_model_len}-token sequence needs {need} (null block "
                   f"included); for the model's full length give kv_cache_memory_bytes >= {need * per_block} "
                   f"(--kv-cache-memory-bytes) or kv_cache_dtype='fp8' (--kv-cache-dtype fp8), or set max_model_len "
                   "(--max-model-len) to choose the length")
    return fit


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
      ValueError: the budget holds fewer blocks than one ``max_model_len``
        sequence needs: named with both numbers, the largest
        ``max_model_len`` that fits and the flags that change them (an unset
        ``max_model_len`` is fitted before, by :func:`fit_max_model_len`).
    """
    if num_kv_blocks is not None:
        return num_kv_blocks
    per_block = bytes_per_block(cfg, block_size, dtype)
    budget, budget_name = _budget(kv_cache_memory_bytes, device)
    blocks_per_seq = math.ceil(max_model_len / block_size)
    num_blocks = min(budget // per_block, max_num_seqs * blocks_per_seq + 1)
    if num_blocks < blocks_per_seq + 1:
        fit = (budget // per_block - 1) * block_size
        fits = f"the largest max_model_len that fits is {fit}" if fit >= 1 else "no max_model_len fits"
        raise ValueError(
            f"{budget_name} holds {budget // per_block} KV blocks of {per_block} bytes ({block_size} tokens); "
            f"one max_model_len={max_model_len} sequence needs {blocks_per_seq + 1} (null block included), "
            f"{(blocks_per_seq + 1) * per_block} bytes: {fits}. Change {_KV_FLAGS}"
        )
    return int(num_blocks)


def compressed_bytes_per_block(cfg: ModelConfig, block_size: int) -> int:
    """Device bytes one compressed block takes over all layers: K and V of one byte a number, and their float32
    scales, one per layer and KV head each."""
    return cfg.kv_bytes_per_token * block_size + 2 * 4 * cfg.num_layers * cfg.num_kv_heads


def split_kv_budget(cfg: ModelConfig, *, block_size: int, dtype: Any, fraction: float, num_kv_blocks: Optional[int],
                    kv_cache_memory_bytes: Optional[int], max_num_seqs: int, max_model_len: int,
                    device: Any) -> tuple[int, int]:
    """The device blocks and the compressed pool's slots of one KV budget (``kv_cache_compression``).

    The budget is ``num_kv_blocks`` blocks of ``dtype`` when given, else ``kv_cache_memory_bytes`` (or its
    default, :func:`default_kv_cache_bytes`). ``fraction`` of it goes to the compressed pool
    (:func:`compressed_bytes_per_block` a slot), the rest to the device blocks (:func:`resolve_num_blocks` of it),
    so a comparison with compression off at the same budget is one of equal bytes.

    Returns:
      ``(num_blocks, num_compressed_blocks)``, each with its null block / slot.

    Raises:
      ValueError: the device share holds no ``max_model_len`` sequence (as :func:`resolve_num_blocks`), or the
        compressed share holds fewer than 2 slots (named with the fraction).
    """
    if num_kv_blocks is not None:
        budget = num_kv_blocks * bytes_per_block(cfg, block_size, dtype)
    else:
        budget = _budget(kv_cache_memory_bytes, device)[0]
    num_blocks = resolve_num_blocks(cfg, block_size=block_size, dtype=dtype, num_kv_blocks=None,
                                    kv_cache_memory_bytes=int(budget * (1 - fraction)), max_num_seqs=max_num_seqs,
                                    max_model_len=max_model_len, device=device)
    per_slot = compressed_bytes_per_block(cfg, block_size)
    num_compressed = int(budget * fraction) // per_slot
    if num_compressed < 2:
        raise ValueError(f"kv_cache_compression_fraction={fraction} of a {budget}-byte KV budget holds "
                         f"{num_compressed} compressed blocks of {per_slot} bytes; it needs 2 or more (the null "
                         "slot and one): raise the fraction or the budget")
    return num_blocks, num_compressed


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


KV_QUANT_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
                   "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn)}
# Calibrated |k|, |v| maxima are mapped to the type's largest value divided by this: room for
# keys and values larger than the calibration text's (clipped beyond), at the cost of
# log2(margin) bits of int8 resolution. Chosen from the perplexity of the default model
# (README, "Quantization").
KV_SCALE_MARGIN = 2.0

# Fixed English text of the KV calibration pass (written for this purpose).
CALIBRATION_TEXT = (
    "The harbour town woke slowly. Fishing boats knocked against the wooden pier while gulls argued over "
    "the morning catch, and the baker on Quay Street pulled the first loaves from her oven. Children ran "
    "past the lighthouse on their way to school, counting the steps as they always did: one hundred and "
    "twelve, never more, never fewer. At the town hall, the mayor read a letter twice before folding it "
    "into her coat. The railway company wanted to build a station on the hill above the bay, and the "
    "council would vote on Thursday. Some said the trains would bring visitors, money and work for the "
    "young; others feared the noise, the smoke and the end of a quiet life. In the library, an old "
    "sailor explained to anyone who would listen how the tides are pulled by the moon, why the water "
    "rises twice a day, and how his grandfather had once sailed to Lisbon with nothing but a compass, a "
    "clock and a map drawn by hand. \"Numbers never lie,\" he said, \"but people who read them often do.\""
)


def kv_number_dtype(kv_cache_dtype: str, dtype: Any) -> np.dtype:
    """The dtype of the numbers a KV cache holds: ``dtype`` (the compute dtype) for "auto",
    int8 for "int8", float8_e4m3fn for "fp8" / "fp8_e4m3" (vLLM's names).

    Raises:
      ValueError: an unknown ``kv_cache_dtype`` (named with the allowed ones).
    """
    if kv_cache_dtype == "auto":
        return np.dtype(dtype)
    if kv_cache_dtype not in KV_QUANT_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
    return KV_QUANT_DTYPES[kv_cache_dtype]


def calibration_ids(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """Token ids of :data:`CALIBRATION_TEXT` (int32), or, for a model without a tokenizer,
    a fixed pseudo-random sequence of as many ids (seed 0)."""
    if tokenizer is not None:
        return np.asarray(tokenizer.encode(CALIBRATION_TEXT), np.int32)
    return np.random.default_rng(0).integers(0, vocab_size, size=256).astype(np.int32)


def calibrate_kv_scales(cfg: ModelConfig, params: Params, token_ids: np.ndarray, *, ops: Any, sharding: Any,
                        kv_dtype: Any, block_size: int = 16,
                        margin: float = KV_SCALE_MARGIN) -> tuple[jax.Array, jax.Array]:
    """Per-layer, per-head K and V scales of a quantized KV cache, from one forward pass.

    Runs the decoder (``jaxllm.models.hidden_states``, the engine's attention ops) over
    ``token_ids`` as one sequence with a float32 cache, and takes each cache head's largest
    ``|k|`` (after rope) and ``|v|`` over the sequence.

    Args:
      cfg: the model configuration.
      params: the parameter pytree on ``sharding``'s devices (quantized weights or not).
      token_ids: int32[N] the calibration tokens (:func:`calibration_ids`).
      ops: the engine's attention ops (``ModelSharding.attention_ops`` of a backend).
      sharding: the replica's ``ModelSharding``.
      kv_dtype: int8 or float8_e4m3fn, the cache's numbers.
      margin: the maximum maps to the type's largest value divided by this.

    Returns:
      (k_scale, v_scale): float32 ``[num_layers, sharding.num_cache_heads]`` on the devices,
      split over the cache heads as the cache is; ``max * margin / type max`` (1 for a head
      that saw only zeros).
    """
    n = len(token_ids)
    num_blocks = -(-n // block_size) + 1
    kv = allocate_kv_cache(num_blocks, block_size, jnp.float32, sharding)
    positions = np.arange(n, dtype=np.int32)
    none = np.full(n, -1, np.int32)
    batch = StepBatch(input_ids=token_ids.astype(np.int32), positions=positions, slot_mapping=positions + block_size,
                      block_tables=np.arange(1, num_blocks, dtype=np.int32)[None], seq_lens=np.asarray([n], np.int32),
                      query_start_loc=np.asarray([0, n], np.int32), logits_indices=np.asarray([n - 1], np.int32),
                      prev_token_index=none, prompt_target_ids=none, num_spec_tokens=np.zeros(1, np.int32),
                      num_seqs=np.int32(1))
    batch = jax.device_put(batch, sharding.replicated)
    limit = KV_QUANT_MAX[jnp.dtype(kv_dtype)]

    @functools.partial(jax.jit, out_shardings=sharding.kv_scale_sharding)
    def scales(params, kv, batch):
        _, (k_cache, v_cache) = hidden_states(params, kv, batch, cfg=cfg, ops=ops)
        return tuple(jnp.where(m > 0, m * margin / limit, 1.0)
                     for m in (jnp.max(jnp.abs(c), axis=(1, 2, 4)) for c in (k_cache, v_cache)))

    return scales(params, kv, batch)
