"""The paged KV cache: sizing from a memory budget, the arrays and their block copies (:class:`CacheEngine`), and
the scales of a quantized cache (:func:`calibrate_kv_scales`).

``k_cache, v_cache: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]``, vLLM's "NHD" layout stacked over
layers; block 0 is the null block padded slots write into. docs/design/worker.md has the details.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxllm.config import KV_CACHE_DTYPES
from jaxllm.logger import init_logger
from jaxllm.models import hidden_states
from jaxllm.models.config import ModelConfig
from jaxllm.models.common import KVCache, Params
from jaxllm.worker.programs import CompileStats, abstract
from jaxllm.worker.step_batch import StepBatch
from kernels_pallas.storage import BITS_STORAGE, KV_QUANT_MAX, ScaledKV, quantize_blocks
from scheduler.block_moves import order_block_moves
from scheduler.kv.tier import BlockCopy, CopyKind

if TYPE_CHECKING:
    from jaxllm.worker.sharding import ModelSharding

logger = init_logger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: Any) -> int:
    """Device bytes one block takes over all layers, K and V together."""
    return cfg.kv_bytes_per_token * block_size * np.dtype(dtype).itemsize


def default_kv_cache_bytes(device: Any, gpu_memory_utilization: float) -> int:
    """The default KV budget in bytes: ``gpu_memory_utilization`` of ``device``'s memory (JAX's ``bytes_limit``)
    minus the bytes in use (the weights, placed before this is read), as vLLM sizes its cache; 1 GiB on CPU."""
    if device.platform == "cpu":
        return CPU_DEFAULT_KV_BYTES
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit", 0)
    in_use = stats.get("bytes_in_use", 0)
    return max(int(limit * gpu_memory_utilization) - in_use, 0)


def _budget(kv_cache_memory_bytes: Optional[int], device: Any, gpu_memory_utilization: float) -> tuple[int, str]:
    """The KV budget in bytes and how to name it in a message."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes, f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
    budget = default_kv_cache_bytes(device, gpu_memory_utilization)
    if device.platform == "cpu":
        return budget, f"kv_cache_memory_bytes={budget} (the default on cpu)"
    return budget, (f"kv_cache_memory_bytes={budget} (gpu_memory_utilization={gpu_memory_utilization} of "
                    f"{device.platform}'s memory less what is in use)")


# What a message about a KV budget too small for max_model_len tells the user to change (LLM keyword, CLI flag).
_KV_FLAGS = ("max_model_len (--max-model-len), kv_cache_memory_bytes (--kv-cache-memory-bytes) or "
             "kv_cache_dtype='fp8' (--kv-cache-dtype fp8, one byte a number)")


def fit_max_model_len(cfg: ModelConfig, *, block_size: int, dtype: Any, kv_cache_memory_bytes: Optional[int],
                      max_model_len: int, device: Any, gpu_memory_utilization: float) -> int:
    """The ``max_model_len`` for an unset one (vLLM's ``-1``): the model's ``max_model_len`` when the
    budget holds one such sequence, else ``(blocks - 1) * block_size`` (logged); arguments as
    :func:`resolve_num_blocks`.

    Raises:
      ValueError: the budget holds fewer than 2 blocks.
    """
    per_block = bytes_per_block(cfg, block_size, dtype)
    budget, budget_name = _budget(kv_cache_memory_bytes, device, gpu_memory_utilization)
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
    gpu_memory_utilization: float,
) -> int:
    """KV blocks, null block included: ``num_kv_blocks``, else the budget over :func:`bytes_per_block`,
    capped at ``max_num_seqs`` sequences of ``max_model_len`` tokens. The budget is ``kv_cache_memory_bytes``,
    else :func:`default_kv_cache_bytes` of ``device`` and ``gpu_memory_utilization``.

    Raises:
      ValueError: the budget holds fewer blocks than one ``max_model_len`` sequence needs.
    """
    if num_kv_blocks is not None:
        return num_kv_blocks
    per_block = bytes_per_block(cfg, block_size, dtype)
    budget, budget_name = _budget(kv_cache_memory_bytes, device, gpu_memory_utilization)
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


def check_pool_backend(config: Any, backend: str) -> None:
    """Raise ValueError where ``config`` (an ``EngineConfig`` or its ``cache`` view) asks for a compressed pool on
    attention ``backend`` ``"pallas"``, whose kernels read one pool (the default on GPU)."""
    if config.kv_cache_compression is not None and backend == "pallas":
        raise ValueError(f"kv_cache_compression={config.kv_cache_compression!r} cannot be used with the pallas "
                         "attention backend (the default on GPU; its kernels read one pool): set "
                         "attention_backend='xla' (--attention-backend xla)")


def size_kv_pools(cfg: ModelConfig, config: Any, **sizes: Any) -> tuple[int, int, Optional[np.dtype]]:
    """``(num_blocks, num_pool_blocks, pool_dtype)`` of ``config``'s (an ``EngineConfig`` or its ``cache`` view) KV budget: all of it
    device blocks (:func:`resolve_num_blocks`, no pool: 0 and None), or with ``kv_cache_compression`` split by
    :func:`split_kv_budget`. ``sizes``: :func:`resolve_num_blocks`'s keywords. Raises as those two."""
    if config.kv_cache_compression is None:
        return resolve_num_blocks(cfg, **sizes), 0, None
    num_blocks, num_compressed = split_kv_budget(cfg, fraction=config.kv_cache_compression_fraction, **sizes)
    return num_blocks, num_compressed, KV_QUANT_DTYPES[config.kv_cache_compression]


def describe_pool(config: Any, cache: "CacheEngine", num_blocks: int) -> Optional[str]:
    """The start-up line about ``cache``'s compressed pool beside its ``num_blocks`` device blocks; None without."""
    if cache.scaled_pool is None:
        return None
    return (f"KV compression ({config.kv_cache_compression}): {cache.scaled_pool.k.shape[1]} compressed blocks "
            f"beside the {num_blocks} device blocks "
            f"(kv_cache_compression_fraction={config.kv_cache_compression_fraction})")


def compressed_bytes_per_block(cfg: ModelConfig, block_size: int) -> int:
    """Device bytes of one compressed block over all layers: one-byte K and V plus their float32 scales."""
    return cfg.kv_bytes_per_token * block_size + 2 * 4 * cfg.num_layers * cfg.num_kv_heads


def split_kv_budget(cfg: ModelConfig, *, block_size: int, dtype: Any, fraction: float, num_kv_blocks: Optional[int],
                    kv_cache_memory_bytes: Optional[int], max_num_seqs: int, max_model_len: int,
                    device: Any, gpu_memory_utilization: float) -> tuple[int, int]:
    """``(num_blocks, num_pool_blocks)`` of one KV budget, ``fraction`` of its bytes to the
    compressed pool, each with its null block / slot.

    Raises:
      ValueError: the device share holds no ``max_model_len`` sequence, or the compressed share fewer than 2 slots.
    """
    if num_kv_blocks is not None:
        budget = num_kv_blocks * bytes_per_block(cfg, block_size, dtype)
    else:
        budget = _budget(kv_cache_memory_bytes, device, gpu_memory_utilization)[0]
    num_blocks = resolve_num_blocks(cfg, block_size=block_size, dtype=dtype, num_kv_blocks=None,
                                    kv_cache_memory_bytes=int(budget * (1 - fraction)), max_num_seqs=max_num_seqs,
                                    max_model_len=max_model_len, device=device,
                                    gpu_memory_utilization=gpu_memory_utilization)
    per_slot = compressed_bytes_per_block(cfg, block_size)
    num_compressed = int(budget * fraction) // per_slot
    if num_compressed < 2:
        raise ValueError(f"kv_cache_compression_fraction={fraction} of a {budget}-byte KV budget holds "
                         f"{num_compressed} compressed blocks of {per_slot} bytes; it needs 2 or more (the null "
                         "slot and one): raise the fraction or the budget")
    return num_blocks, num_compressed


def kv_cache_avals(num_blocks: int, block_size: int, dtype: Any, sharding: "ModelSharding") -> KVCache:
    """``(k_cache, v_cache)`` as ShapeDtypeStructs: ``[num_layers, num_blocks, block_size, num_cache_heads,
    head_dim]`` of ``dtype``, heads split by ``kv_cache_sharding``."""
    cfg = sharding.cfg
    shape = (cfg.num_layers, num_blocks, block_size, sharding.num_cache_heads, cfg.head_dim)
    aval = jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=sharding.kv_cache_sharding)
    return aval, aval


def zero_fill(avals: Sequence[jax.ShapeDtypeStruct]) -> Callable[[], tuple[jax.Array, ...]]:
    """A compiled program returning zeroed arrays of ``avals``' shapes, dtypes and shardings: built once, it
    allocates again (wake_up) without compiling."""
    avals = tuple(avals)
    fill = jax.jit(lambda: tuple(jnp.zeros(a.shape, a.dtype) for a in avals),
                   out_shardings=tuple(a.sharding for a in avals))
    return fill.lower().compile()


def allocate_kv_cache(num_blocks: int, block_size: int, dtype: Any, sharding: "ModelSharding") -> KVCache:
    """Zeroed ``(k_cache, v_cache)`` of :func:`kv_cache_avals`."""
    return zero_fill(kv_cache_avals(num_blocks, block_size, dtype, sharding))()


def storage_dtype(dtype: Any, float_bits_storage: bool) -> np.dtype:
    """The dtype ``dtype`` numbers are stored in: with ``float_bits_storage``, their bits (``BITS_STORAGE``)."""
    dtype = np.dtype(dtype)
    return BITS_STORAGE.get(dtype, dtype) if float_bits_storage else dtype


# Block copies (swap, copy-on-write, compaction) run in fixed-size chunks so that they compile once; a swap chunk's
# unused entries move null block 0 onto itself, a copy chunk's repeat its first copy.
BLOCK_CHUNK = 16


# Block ops act on every layer at once: block ids index axis 1 of the caches.
def _gather_blocks(kv_cache: KVCache, ids: jax.Array) -> KVCache:
    return tuple(c[:, ids] for c in kv_cache)


def _scatter_blocks(kv_cache: KVCache, ids: jax.Array, blocks: KVCache) -> KVCache:
    return tuple(c.at[:, ids].set(b) for c, b in zip(kv_cache, blocks))


def _copy_blocks(kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    return tuple(c.at[:, dst].set(c[:, src]) for c in kv_cache)


def _compress_blocks(kv_cache: KVCache, pool: ScaledKV, src: jax.Array, dst: jax.Array) -> ScaledKV:
    (k, k_scale), (v, v_scale) = (quantize_blocks(c[:, src], p.dtype) for c, p in zip(kv_cache, pool[:2]))
    return ScaledKV(pool.k.at[:, dst].set(k), pool.v.at[:, dst].set(v), pool.k_scale.at[:, dst].set(k_scale),
                        pool.v_scale.at[:, dst].set(v_scale))


def _resized(kv_cache: KVCache, num_blocks: int) -> KVCache:
    out = []
    for c in kv_cache:
        n = min(num_blocks, c.shape[1])
        out.append(jnp.zeros((c.shape[0], num_blocks) + c.shape[2:], c.dtype).at[:, :n].set(c[:, :n]))
    return tuple(out)


def _chunks(pairs: np.ndarray, repeat_first: bool = False) -> Iterable[tuple[np.ndarray, int]]:
    """``int32[K, 2]`` pairs as ``[BLOCK_CHUNK, 2]`` chunks (with real counts), padded with (0, 0) or the first pair."""
    for start in range(0, len(pairs), BLOCK_CHUNK):
        part = pairs[start:start + BLOCK_CHUNK]
        chunk = np.repeat(part[:1], BLOCK_CHUNK, axis=0) if repeat_first else np.zeros((BLOCK_CHUNK, 2), np.int32)
        chunk[: len(part)] = part
        yield chunk, len(part)


class CacheEngine:
    """One model's paged KV cache: device arrays, host pool, compressed pool and the block copies between them,
    each a program built once (vLLM's ``CacheEngine``).

    Args:
      num_blocks: device blocks, null block 0 included.
      dtype: the stored dtype (numbers, or their bits: ``BITS_STORAGE``).
      num_host_blocks, num_offload_blocks: host swap blocks, then prefix-cache host-tier blocks (0: none).
      num_pool_blocks, pool_dtype: the compressed pool's slots, null slot included (0: none).

    Attributes:
      kv_cache: ``(k, v)``, each ``[num_layers, num_blocks, block_size, heads, head_dim]`` of ``dtype``, split over
        heads; ``jax.ShapeDtypeStruct`` while released.
      scaled_pool: ``ScaledKV`` (``k, v`` as the cache; ``k_scale, v_scale: float32[num_layers, slots, heads]``)
        or None.
      host_pool: numpy ``(k, v)`` of ``num_host_blocks + num_offload_blocks`` blocks, or None.
    """

    def __init__(self, cfg: ModelConfig, *, num_blocks: int, block_size: int, dtype: Any, sharding: "ModelSharding",
                 stats: CompileStats, num_host_blocks: int = 0, num_offload_blocks: int = 0,
                 num_pool_blocks: int = 0, pool_dtype: Any = None):
        self.num_blocks = num_blocks
        self.num_offload_blocks = num_offload_blocks
        self._fill_kv = zero_fill(kv_cache_avals(num_blocks, block_size, dtype, sharding))
        self.kv_cache = self._fill_kv()
        self._fill_pool: Optional[Callable[[], tuple[jax.Array, ...]]] = None
        self._sharding = sharding.kv_cache_sharding
        self._replicated = sharding.replicated
        self._stats = stats
        self._ops: dict[str, Callable] = {}
        self.scaled_pool: Optional[ScaledKV] = None
        if num_pool_blocks:
            scale = jax.ShapeDtypeStruct((cfg.num_layers, num_pool_blocks, sharding.num_cache_heads),
                                         np.dtype(np.float32), sharding=sharding.pool_scale_sharding)
            avals = kv_cache_avals(num_pool_blocks, block_size, pool_dtype, sharding) + (scale, scale)
            self._fill_pool = zero_fill(avals)
            self.scaled_pool = ScaledKV(*self._fill_pool())
            scale_sharding = sharding.pool_scale_sharding
            self._pool_sharding = ScaledKV(self._sharding, self._sharding, scale_sharding, scale_sharding)
        num_host = num_host_blocks + num_offload_blocks
        shape = (cfg.num_layers, num_host) + self.kv_cache[0].shape[2:]
        self.host_pool = (np.zeros(shape, dtype), np.zeros(shape, dtype)) if num_host else None

    @property
    def allocated(self) -> bool:
        """Whether the device arrays exist (not released)."""
        return isinstance(self.kv_cache[0], jax.Array)

    def abstract(self) -> tuple[KVCache, Optional[ScaledKV]]:
        """``(kv_cache, compressed)`` as ShapeDtypeStructs with their shardings: what a step program takes."""
        return abstract(self.kv_cache), abstract(self.scaled_pool)

    def sharding(self) -> jax.sharding.Sharding:
        """The sharding of each ``kv_cache`` array."""
        return self._sharding

    def warmup(self, swap: bool) -> None:
        """Build the copy program, with ``swap`` the gather/scatter ones, and compress if pooled."""
        for name in ("copy",) + (("gather", "scatter") if swap else ()) + (
                ("compress",) if self.scaled_pool is not None else ()):
            self._op(name)

    def _op(self, name: str) -> Callable:
        exe = self._ops.get(name)
        if exe is not None:
            return exe
        kv = abstract(self.kv_cache)
        ids = jax.ShapeDtypeStruct((BLOCK_CHUNK,), np.int32, sharding=self._replicated)
        if name == "gather":
            exe = self._stats.compile(jax.jit(_gather_blocks), kv, ids)
        elif name == "compress":
            compress = jax.jit(_compress_blocks, donate_argnums=(1,), out_shardings=self._pool_sharding)
            exe = self._stats.compile(compress, kv, abstract(self.scaled_pool), ids, ids)
        elif name == "scatter":
            blocks = tuple(jax.ShapeDtypeStruct((c.shape[0], BLOCK_CHUNK) + c.shape[2:], c.dtype, sharding=c.sharding)
                           for c in kv)
            scatter = jax.jit(_scatter_blocks, donate_argnums=(0,), out_shardings=self._sharding)
            exe = self._stats.compile(scatter, kv, ids, blocks)
        else:
            exe = self._stats.compile(jax.jit(_copy_blocks, donate_argnums=(0,), out_shardings=self._sharding),
                                      kv, ids, ids)
        self._ops[name] = exe
        return exe

    def copy_blocks(self, pairs: Sequence[Sequence[int]]) -> None:
        """Device copies of (src, dst) ``pairs``; a later chunk sees an earlier one's writes."""
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        for chunk, _ in _chunks(pairs, repeat_first=True):
            self.kv_cache = self._op("copy")(self.kv_cache, chunk[:, 0], chunk[:, 1])

    def compress_blocks(self, pairs: Sequence[Sequence[int]]) -> None:
        """Re-encode (device block, compressed slot) ``pairs``; call before the device blocks are written."""
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        for chunk, _ in _chunks(pairs):
            self.scaled_pool = self._op("compress")(self.kv_cache, self.scaled_pool, chunk[:, 0], chunk[:, 1])

    def move_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Block copies as if every source were read first (``order_block_moves``)."""
        for moves in order_block_moves(pairs):
            self.copy_blocks(moves)

    def swap_out(self, pairs: Sequence[Sequence[int]]) -> None:
        """Copy device blocks to the host pool: ``pairs`` of (device, host) ids; returns once the pool holds them."""
        self.finish_swap_out(self.start_swap_out(pairs))

    def start_swap_out(self, pairs: Sequence[Sequence[int]]) -> list[tuple[np.ndarray, KVCache]]:
        """Dispatch gathers of (device, host) ``pairs`` reading the cache as it is now, without waiting;
        returns per chunk the host ids and gathered blocks, for :meth:`finish_swap_out`."""
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        return [(chunk[:n, 1], self._op("gather")(self.kv_cache, chunk[:, 0])) for chunk, n in _chunks(pairs)]

    def finish_swap_out(self, pending: list[tuple[np.ndarray, KVCache]]) -> None:
        """Write :meth:`start_swap_out`'s gathers into the host pool (waits for them only)."""
        if not pending:
            return
        for (host_ids, _), blocks in zip(pending, jax.device_get([blocks for _, blocks in pending])):
            for pool, block in zip(self.host_pool, blocks):
                pool[:, host_ids] = block[:, :len(host_ids)]

    def swap_in(self, pairs: Sequence[Sequence[int]]) -> None:
        """Copy host-pool blocks back to the device: ``pairs`` of (host, device) ids."""
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        for chunk, n in _chunks(pairs):
            blocks = []
            for pool in self.host_pool:
                block = np.zeros((pool.shape[0], BLOCK_CHUNK) + pool.shape[2:], pool.dtype)
                block[:, :n] = pool[:, chunk[:n, 0]]
                blocks.append(block)
            self.kv_cache = self._op("scatter")(self.kv_cache, chunk[:, 1], tuple(blocks))

    def resize(self, num_blocks: int) -> None:
        """Give the cache ``num_blocks`` blocks keeping the first ``min(old, new)``; rebuilds the copy programs.

        Raises:
          RuntimeError: the cache is released (sleep).
        """
        if not self.allocated:
            raise RuntimeError("resize_kv_cache: the KV cache is released (sleep); wake_up() first")
        resize = jax.jit(functools.partial(_resized, num_blocks=num_blocks), out_shardings=self._sharding)
        old, self.kv_cache = self.kv_cache, self._stats.compile(resize, abstract(self.kv_cache))(self.kv_cache)
        for c in old:
            c.delete()
        self._fill_kv = zero_fill(abstract(self.kv_cache))
        self.num_blocks = num_blocks
        for name in [name for name in ("copy", "gather", "scatter") if name in self._ops]:
            del self._ops[name]
            self._op(name)

    def release(self) -> int:
        """Free the device arrays (sleep), keeping avals; returns the bytes freed."""
        if not self.allocated:
            return 0
        arrays = list(self.kv_cache)
        self.kv_cache = abstract(self.kv_cache)
        if self.scaled_pool is not None:
            arrays += list(self.scaled_pool)
            self.scaled_pool = abstract(self.scaled_pool)
        freed = sum(c.nbytes for c in arrays)
        for c in arrays:
            c.delete()
        return freed

    def allocate(self) -> None:
        """Zeroed arrays of the released shapes again (wake up); nothing if allocated."""
        if not self.allocated:
            self.kv_cache = self._fill_kv()
            if self.scaled_pool is not None:
                self.scaled_pool = ScaledKV(*self._fill_pool())


class CacheEngines:
    """The KV caches of one replica's runners (target first), sharing block ids: each :class:`CacheEngine`
    block operation runs on every cache."""

    def __init__(self, caches: Sequence[CacheEngine]):
        self.caches = list(caches)

    def apply(self, copies: Sequence[BlockCopy]) -> tuple[list[list], float, float]:
        """Run ``copies`` (a ``SchedulerOutput.block_copies``, in ``CopyKind`` order) on every cache, compressions
        on the target's only (``kv_cache_compression`` refuses a draft model), the host tier's offloads only
        gathered on the device.

        Returns:
          (the offloads' host writes, one list per cache, for :meth:`finish_swap_out`; seconds spent gathering
          offloads; seconds spent loading from the host tier).
        """
        runs = [(kind, [(c.src, c.dst) for c in run]) for kind, run in itertools.groupby(copies, lambda c: c.kind)]
        pending, offload_seconds, load_seconds = [], 0.0, 0.0
        for cache in self.caches:
            pending.append([])
            for kind, pairs in runs:
                start = time.perf_counter()
                if kind is CopyKind.ENCODE:
                    if cache is self.caches[0]:
                        cache.compress_blocks(pairs)
                elif kind is CopyKind.SWAP_OUT:
                    cache.swap_out(pairs)
                elif kind is CopyKind.OFFLOAD:
                    pending[-1] = cache.start_swap_out(pairs)
                    offload_seconds += time.perf_counter() - start
                elif kind is CopyKind.COPY:
                    cache.copy_blocks(pairs)
                else:
                    cache.swap_in(pairs)
                    if kind is CopyKind.LOAD:
                        load_seconds += time.perf_counter() - start
        return pending, offload_seconds, load_seconds

    def move_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """:meth:`CacheEngine.move_blocks` on every cache; returns once the copies are done."""
        for cache in self.caches:
            cache.move_blocks(pairs)
        jax.block_until_ready([cache.kv_cache for cache in self.caches])

    def finish_swap_out(self, pending: list[list]) -> None:
        """:meth:`CacheEngine.finish_swap_out` of each cache's part of ``pending`` (:meth:`apply`)."""
        for cache, writes in zip(self.caches, pending):
            cache.finish_swap_out(writes)

    def release(self) -> int:
        """Free every cache's device memory; returns the bytes freed."""
        return sum(cache.release() for cache in self.caches)

    def allocate(self) -> None:
        """Every released cache allocated again (zeroed)."""
        for cache in self.caches:
            cache.allocate()

    @property
    def nbytes(self) -> int:
        """Bytes of the device arrays of every cache, K and V."""
        return sum(c.nbytes for cache in self.caches for c in cache.kv_cache)

    @property
    def host_block_bytes(self) -> int:
        """Bytes one host-pool block copy moves, K and V, over every cache."""
        return sum(2 * cache.host_pool[0][:, 0].nbytes for cache in self.caches if cache.host_pool is not None)


KV_QUANT_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
                   "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn)}
# Calibrated |k|, |v| maxima are mapped to the type's largest value divided by this: room for
# keys and values larger than the calibration text's (clipped beyond), at the cost of
# log2(margin) bits of int8 resolution. Chosen from the perplexity of the default model
# (docs/quantization.md).
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
    """A KV cache's number dtype: ``dtype`` for "auto", else int8 or float8_e4m3fn (raises ValueError if unknown)."""
    if kv_cache_dtype == "auto":
        return np.dtype(dtype)
    if kv_cache_dtype not in KV_QUANT_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
    return KV_QUANT_DTYPES[kv_cache_dtype]


def calibration_ids(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """int32 ids of :data:`CALIBRATION_TEXT`, or without a tokenizer 256 seeded random ids."""
    if tokenizer is not None:
        return np.asarray(tokenizer.encode(CALIBRATION_TEXT), np.int32)
    return np.random.default_rng(0).integers(0, vocab_size, size=256).astype(np.int32)


def calibrate_kv_scales(cfg: ModelConfig, params: Params, token_ids: np.ndarray, *, ops: Any, sharding: Any,
                        kv_dtype: Any, block_size: int = 16,
                        margin: float = KV_SCALE_MARGIN) -> tuple[jax.Array, jax.Array]:
    """Per-layer, per-head K and V scales of a quantized cache from one float32 forward pass over
    ``token_ids`` (int32[N]); ``kv_dtype`` int8 or float8_e4m3fn.

    Returns:
      ``(k_scale, v_scale)``: float32 ``[num_layers, num_cache_heads]``, split like the cache; a head's largest
      ``|k|`` / ``|v|`` times ``margin`` over the type's largest value (1 for an all-zero head).
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
