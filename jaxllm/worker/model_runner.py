"""ModelRunner: device parameters, the paged KV cache and the compiled steps.

The model step and the sampler form one jitted function. It is compiled ahead
of time (``jit(...).lower(abstract shapes).compile()``) once per ``(T, S, W)``
bucket, from the same shardings, dtypes and pytree structure the live step
uses, and the executables are kept in a table: serving looks a program up by
the batch's bucket and never traces. The KV cache is donated to every step so
the device holds one copy. Block ids are the scheduler's (one process, as in
nano-vllm).

Parameters, KV cache and step inputs live on the replica's mesh
(``jaxllm.worker.sharding.ModelSharding``); the batch and sampling arrays are
replicated there, and the abstract arguments of the compiled programs carry
those same shardings.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring

from jaxllm.logger import init_logger
from jaxllm.models.config import ModelConfig
from jaxllm.worker.kv_cache import allocate_kv_cache
from jaxllm.models import (
    AttentionOps,
    KVCache,
    Params,
    compute_logits,
    hidden_states,
    loop_storage,
    with_head_panels,
)
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
from jaxllm.worker.sharding import ModelSharding
from jaxllm.worker.step_batch import StepBatch
from jaxllm.worker.weights import Layout, flatten, unflatten
from jaxllm.structured_output import bitmask_words
from kernels_pallas.ops import HEAD_PANELS
from kernels_pallas.storage import BITS_STORAGE, CompressedKV, from_storage, quantize_blocks, to_storage
from scheduler import BatchDescriptor, BucketTable
from scheduler.block_moves import order_block_moves

logger = init_logger(__name__)

# Block copies (swap, copy-on-write, compaction) run in fixed-size chunks so
# that they compile once; a swap chunk's unused entries move null block 0 onto
# itself, a copy chunk's repeat its first copy.
BLOCK_CHUNK = 16

# A background warm-up starts a program only once the engine has been idle (no step dispatched, counting from the
# end of the start-up warm-up) for IDLE_SECONDS, so a short script, whose calls and exit follow each other closely,
# never shares the CPU with compiles it does not need nor waits at exit for one; an engine busy for
# BUSY_GRACE_SECONDS without a pause is a long job, which the remaining buckets pay for, and then builds them anyway.
IDLE_SECONDS = 1.0
BUSY_GRACE_SECONDS = 15.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """A step's outputs: on the device from :meth:`ModelRunner.dispatch`, on the host from :meth:`fetch_rows`.

      sampled: the sampler's :class:`SamplerOutput`, ``[S]`` rows
        (``[S, num_positions]`` and ``num_emitted`` when the step verifies drafts).
      prompt: the prompt logprobs, ``[T]`` rows (``sampler.prompt_logprobs``);
        None once fetched without them.
      draft_token_ids: int32[S, K] the draft model's drafts from this step's
        samples (``DraftRunner.propose_async``); None without a draft model.
    """

    sampled: SamplerOutput
    prompt: Optional[PromptLogprobRows]
    draft_token_ids: Optional[jax.Array] = None

    def fetch_rows(self, num_rows: int, num_token_rows: int = 0) -> "StepOutput":
        """The outputs on the host (numpy), in one transfer: the per-row ones cut to ``num_rows`` rows, the
        prompt logprobs to ``num_token_rows``. With ``num_token_rows=0`` the prompt logprobs are not fetched
        (``prompt`` None): a step without prompt targets has none to read, and they are ``[T, 20]`` arrays."""
        host = jax.device_get(dataclasses.replace(self, prompt=self.prompt if num_token_rows else None))

        def first(n: int, tree: Any) -> Any:
            return jax.tree_util.tree_map(lambda v: v[:n], tree)

        return StepOutput(first(num_rows, host.sampled), first(num_token_rows, host.prompt),
                          first(num_rows, host.draft_token_ids))


def _step(params: Params, kv_cache: KVCache, batch: StepBatch, sampling: SamplingArrays, tables: SamplerTables,
          prev_tokens: jax.Array, bitmask: jax.Array, compressed: Optional[CompressedKV], *, cfg: ModelConfig,
          ops: AttentionOps, num_positions: int = 1) -> tuple[StepOutput, jax.Array, KVCache, SamplerTables]:
    """Model + sampler + prompt logprobs. Input ids marked in
    ``batch.prev_token_index`` come from the previous step's samples
    (``prev_tokens``, still on the device); the samples are also returned
    padded to ``prev_tokens``' length for the next step. ``bitmask``
    (int32[S, ceil(V/32)]) holds each row's allowed tokens (structured
    output). The prompt logprobs are those of ``batch.prompt_target_ids``.
    With ``num_positions > 1`` (speculative decoding) the sampler verifies
    each row's drafts (``sampler.sample_or_verify``); a row's bitmask
    applies to its first position (constrained rows carry no drafts).
    ``compressed`` (the pool of compressed KV blocks, or None) is only read."""
    from_prev = batch.prev_token_index
    input_ids = jnp.where(from_prev >= 0, prev_tokens[jnp.maximum(from_prev, 0)], batch.input_ids)
    hidden, kv_cache = hidden_states(params, kv_cache, dataclasses.replace(batch, input_ids=input_ids),
                                     cfg=cfg, ops=ops, compressed=compressed)
    head = functools.partial(compute_logits, params, cfg=cfg, native_kernels=True)
    if num_positions == 1:
        logits = head(hidden[batch.logits_indices], num_rows=batch.num_seqs)  # on the kernels: padding rows 0
        sampled, tables = sample(logits, sampling, tables, bitmask)
        first = sampled.token_ids
    else:
        sampled, tables = sample_or_verify(head, hidden, input_ids, batch.logits_indices, batch.num_spec_tokens,
                                           sampling, tables, num_positions, bitmask)
        first = sampled.token_ids[:, 0]
    # Prompt logprobs map the head over rows one at a time (vmapped): XLA's dot, which batches them, not the
    # kernels (an FFI call has no batching rule).
    rows_head = functools.partial(compute_logits, params, cfg=cfg)
    out = StepOutput(sampled, prompt_logprobs(rows_head, hidden, batch.prompt_target_ids))
    next_prev = jnp.zeros_like(prev_tokens).at[: first.shape[0]].set(first)
    return out, next_prev, kv_cache, tables


# Block ops act on every layer at once: block ids index axis 1 of the caches.
def _gather_blocks(kv_cache: KVCache, ids: jax.Array) -> KVCache:
    return tuple(c[:, ids] for c in kv_cache)


def _scatter_blocks(kv_cache: KVCache, ids: jax.Array, blocks: KVCache) -> KVCache:
    return tuple(c.at[:, ids].set(b) for c, b in zip(kv_cache, blocks))


def _copy_blocks(kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    return tuple(c.at[:, dst].set(c[:, src]) for c in kv_cache)


def _compress_blocks(kv_cache: KVCache, pool: CompressedKV, src: jax.Array, dst: jax.Array) -> CompressedKV:
    """Device blocks ``src`` of every layer re-encoded into slots ``dst`` of the compressed pool."""
    (k, k_scale), (v, v_scale) = (quantize_blocks(c[:, src], p.dtype) for c, p in zip(kv_cache, pool[:2]))
    return CompressedKV(pool.k.at[:, dst].set(k), pool.v.at[:, dst].set(v), pool.k_scale.at[:, dst].set(k_scale),
                        pool.v_scale.at[:, dst].set(v_scale))


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


# Persistent-cache hits seen by the compile running on this thread (see
# ModelRunner._compiled): JAX reports them as process-wide events, recorded on
# the thread that asked for the compilation.
_compile_events = threading.local()


def _on_jax_event(event: str, **kwargs: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits" and getattr(_compile_events, "hits", None) is not None:
        _compile_events.hits += 1


monitoring.register_event_listener(_on_jax_event)


def _chunks(pairs: np.ndarray, repeat_first: bool = False) -> Iterable[np.ndarray]:
    """Split ``pairs: int32[K, 2]`` into ``[BLOCK_CHUNK, 2]`` chunks padded with (0, 0), or with ``repeat_first``
    with the chunk's first pair (a copy written twice writes one value, so a chunk may then write block 0, the
    scratch block of ``order_block_moves``, without a (0, 0) pad racing it)."""
    for start in range(0, len(pairs), BLOCK_CHUNK):
        part = pairs[start:start + BLOCK_CHUNK]
        chunk = np.repeat(part[:1], BLOCK_CHUNK, axis=0) if repeat_first else np.zeros((BLOCK_CHUNK, 2), np.int32)
        chunk[: len(part)] = part
        yield chunk, len(part)


def _resized(kv_cache: KVCache, num_blocks: int) -> KVCache:
    """The caches with ``num_blocks`` blocks: the old ones' first blocks, zeros past them."""
    out = []
    for c in kv_cache:
        n = min(num_blocks, c.shape[1])
        out.append(jnp.zeros((c.shape[0], num_blocks) + c.shape[2:], c.dtype).at[:, :n].set(c[:, :n]))
    return tuple(out)


class ModelRunner:
    """Runs compiled model steps for the engine.

    Args:
      cfg: model configuration.
      params: parameter pytree, already placed by ``sharding``.
      num_blocks: KV blocks including the null block 0.
      block_size: tokens per block.
      dtype: compute dtype (and the KV cache's unless ``kv_cache_dtype``).
      ops: attention implementation (Pallas kernels or jnp references),
        already wrapped by ``sharding.attention_ops``.
      buckets: the (T, S, W) shapes steps are padded to.
      sharding: the replica's mesh and partition rules.
      num_host_blocks: host swap pool size in blocks (0 = no swap space).
      num_offload_blocks: blocks of the prefix cache's host tier, held in the host pool after the swap pool's
        (``scheduler.kv.host_tier``); 0: none.
      num_sampling_slots: rows of the sampler's per-sequence tables (slot 0
        is padding), so at least ``max_num_seqs + 1``.
      max_model_len: tokens per sequence at most (the fixed length slot fills
        are padded to).
      float_bits_storage: hold bfloat16 layer weights and KV caches as uint16
        bit patterns, float8_e4m3fn ones as uint8 (``models.loop_storage``):
        for XLA's CPU backend, with the jnp attention ops
        (``kernels_pallas.storage`` says why).
      kv_cache_dtype: the KV cache's numbers: ``dtype`` (None), or int8 /
        float8_e4m3fn for a quantized cache, whose scales are the
        ``k_scale``/``v_scale`` layer leaves of ``params`` (ValueError
        without them).
      num_positions: positions each row's sampler handles: 1, or 1 +
        ``num_speculative_tokens`` when the steps verify draft tokens
        (sampling arrays then have ``S * num_positions`` rows,
        ``SamplingArrays.repeat``).
      num_compressed_blocks: slots of the pool of compressed KV blocks
        (``kv_cache_compression``; the null slot 0 included), 0 for none.
      compressed_dtype: its numbers, int8 or float8_e4m3fn (with
        ``num_compressed_blocks``).

    Attributes:
      ops: the attention ops the step runs (as given).
      num_positions, float_bits_storage: as given.
      params: the parameter pytree on the devices (bfloat16 and float8 layer
        leaves as uint16 and uint8 with ``float_bits_storage``), and
        ``kernels_pallas.ops.HEAD_PANELS`` where ``models.with_head_panels`` adds them.
      kv_cache: ``(k, v)``, each ``[num_layers, num_blocks, block_size,
        sharding.num_cache_heads, head_dim]``, split over heads; of
        ``kv_cache_dtype``, as uint16 / uint8 bits with ``float_bits_storage``.
      compressed: the pool of compressed KV blocks
        (``kernels_pallas.storage.CompressedKV``: ``k, v: [num_layers,
        num_compressed_blocks, block_size, heads, head_dim]`` of
        ``compressed_dtype``, float8 as uint8 bits with ``float_bits_storage``;
        ``k_scale, v_scale: float32[num_layers, num_compressed_blocks, heads]``),
        split over heads like the cache; None without compression.
      sampler_tables: the sampler's per-slot tables (:class:`SamplerTables`),
        replicated on the mesh and donated to every step like the KV cache.
      num_compilations: programs this runner has built (steps and block
        copies), whether compiled or loaded from JAX's persistent cache; once
        :meth:`warmup` has finished it stays constant while serving.
      num_cache_hits: of those, programs loaded from the persistent cache.
      compile_seconds: wall time spent compiling programs, seconds.
      cache_load_seconds: wall time spent building programs the persistent
        cache held (tracing, lowering and loading), seconds.
    """

    def __init__(self, cfg: ModelConfig, params: Params, *, num_blocks: int, block_size: int, dtype: Any,
                 ops: AttentionOps, buckets: BucketTable, sharding: ModelSharding, num_host_blocks: int = 0,
                 num_offload_blocks: int = 0, num_sampling_slots: int = 1, max_model_len: int = 1, float_bits_storage: bool = False,
                 kv_cache_dtype: Any = None, num_positions: int = 1, num_compressed_blocks: int = 0,
                 compressed_dtype: Any = None):
        self.cfg = cfg
        self.ops = ops
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.buckets = buckets
        self.num_positions = num_positions
        self.float_bits_storage = float_bits_storage
        self._param_layout = {path: _abstract(leaf) for path, leaf in flatten(params).items()}
        self.params = with_head_panels(loop_storage(params) if float_bits_storage else params, cfg)
        self._storage_layout = {path: _abstract(leaf) for path, leaf in flatten(self.params).items()}
        self._host_params: Optional[dict[str, np.ndarray]] = None
        kv_dtype = np.dtype(dtype if kv_cache_dtype is None else kv_cache_dtype)
        if kv_dtype.itemsize == 1 and "k_scale" not in params["layers"]:
            raise ValueError(f"kv_cache_dtype={kv_dtype.name} needs the per-layer k_scale/v_scale leaves in "
                             "params['layers'] (jaxllm.worker.kv_cache.calibrate_kv_scales)")
        if float_bits_storage:
            kv_dtype = BITS_STORAGE.get(kv_dtype, kv_dtype)
        self.kv_cache = allocate_kv_cache(num_blocks, block_size, kv_dtype, sharding)
        self._replicated = sharding.replicated
        self._kv_sharding = sharding.kv_cache_sharding
        self.compressed: Optional[CompressedKV] = None
        if num_compressed_blocks:
            storage = np.dtype(compressed_dtype)
            storage = BITS_STORAGE.get(storage, storage) if float_bits_storage else storage
            k, v = allocate_kv_cache(num_compressed_blocks, block_size, storage, sharding)
            scales = _zeros((cfg.num_layers, num_compressed_blocks, sharding.num_cache_heads), np.dtype(np.float32),
                            sharding.compressed_scale_sharding)
            self.compressed = CompressedKV(k, v, scales(), scales())
            self._compressed_sharding = CompressedKV(self._kv_sharding, self._kv_sharding,
                                                     sharding.compressed_scale_sharding,
                                                     sharding.compressed_scale_sharding)
        self.sampler_tables = jax.device_put(init_tables(num_sampling_slots, cfg.vocab_size), self._replicated)
        self.max_model_len = max_model_len
        self.num_compilations = 0
        self.num_cache_hits = 0
        self._no_prev_tokens = jax.device_put(np.zeros(buckets.seq_buckets[-1], np.int32), self._replicated)
        self.bitmask_words = bitmask_words(cfg.vocab_size)
        # Per row bucket S: an all-ones bitmask kept on the device, passed by steps without a constrained row.
        self._all_allowed: dict[int, jax.Array] = {}
        self.compile_seconds = 0.0
        self.cache_load_seconds = 0.0
        self._lock = threading.Lock()
        # Token buckets whose programs (every width) are built; None: build on first use.
        self._ready_tokens: Optional[set[int]] = None
        self._background: Optional[threading.Thread] = None
        self._stop_background = threading.Event()
        # Monotonic seconds of the last dispatch (or of the end of the start-up warm-up) and of the first dispatch
        # since the engine was last idle (None before any).
        self._last_dispatch = time.monotonic()
        self._busy_since: Optional[float] = None
        self._step_jit = self._jit_step()
        self._steps: dict[tuple[int, int, int], Callable] = {}
        self._block_ops: dict[str, Callable] = {}
        # Host swap space, then the host tier: (k, v), each [num_layers, num_host_blocks + num_offload_blocks,
        # block_size, heads, head_dim], in the cache's dtype (a quantized cache's scales are per layer, in params).
        self.num_offload_blocks = num_offload_blocks
        num_host = num_host_blocks + num_offload_blocks
        pool_shape = (cfg.num_layers, num_host) + self.kv_cache[0].shape[2:]
        pool_dtype = self.kv_cache[0].dtype
        self.host_pool = (np.zeros(pool_shape, pool_dtype), np.zeros(pool_shape, pool_dtype)) if num_host else None

    # ------------------------------------------------------------ compilation

    # Programs besides the steps that every warm-up builds.
    WARMUP_OPS: tuple[str, ...] = ("copy", "fill", "rows")

    def _jit_step(self) -> Any:
        """The jitted step function that :meth:`compile_step` lowers with :meth:`step_arguments`."""
        # Outputs pinned to the inputs' shardings: the donated KV cache and
        # sampler tables come back laid out as the next step was compiled for.
        return jax.jit(functools.partial(_step, cfg=self.cfg, ops=self.ops, num_positions=self.num_positions),
                       donate_argnums=(1, 4),
                       out_shardings=(self._replicated, self._replicated, self._kv_sharding, self._replicated))

    def _compiled(self, fn: Any, *abstract_args: Any) -> Callable:
        start = time.perf_counter()
        _compile_events.hits = 0
        try:
            exe = fn.lower(*abstract_args).compile()
            hit = _compile_events.hits > 0
        finally:
            _compile_events.hits = None
        seconds = time.perf_counter() - start
        with self._lock:
            self.num_compilations += 1
            if hit:
                self.num_cache_hits += 1
                self.cache_load_seconds += seconds
            else:
                self.compile_seconds += seconds
        return exe

    def step_arguments(self, shape: tuple[int, int, int]) -> tuple:
        """Abstract ``(params, kv_cache, batch, sampling, sampler_tables, prev_tokens, bitmask, compressed)`` of bucket
        ``shape``: exactly the structure, dtypes and shardings :meth:`dispatch` passes."""
        s, rep = shape[1], self._replicated
        sampling = jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep),
                                          SamplingArrays.empty(s * self.num_positions))
        bitmask = jax.ShapeDtypeStruct((s, self.bitmask_words), np.int32, sharding=rep)
        return (_abstract(self.params), _abstract(self.kv_cache), StepBatch.abstract(shape, rep), sampling,
                _abstract(self.sampler_tables), _abstract(self._no_prev_tokens), bitmask, _abstract(self.compressed))

    def compile_step(self, shape: tuple[int, int, int], announce: bool = False) -> Callable:
        """Compile (once) and return the step program of bucket ``shape``; with ``announce``, log the wait (a step
        that needs a program nobody has built: lazy mode)."""
        exe = self._steps.get(shape)
        if exe is None:
            if announce:
                logger.info(f"building the step program for {shape[0]} tokens x {shape[1]} rows (first use)...")
            start = time.perf_counter()
            exe = self._steps[shape] = self._compiled(self._step_jit, *self.step_arguments(shape))
            if announce:
                logger.info(f"built it in {time.perf_counter() - start:.1f} s")
        return exe

    def may_build_in_background(self) -> bool:
        """Whether a background warm-up may start its next program now: the engine is idle, or has been busy for
        ``BUSY_GRACE_SECONDS`` without a pause (see ``IDLE_SECONDS``)."""
        now = time.monotonic()
        with self._lock:
            last, since = self._last_dispatch, self._busy_since
        return now - last >= IDLE_SECONDS or (since is not None and now - since >= BUSY_GRACE_SECONDS)

    def _note_dispatch(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._busy_since is None or now - self._last_dispatch >= IDLE_SECONDS:
                self._busy_since = now
            self._last_dispatch = now

    def token_bucket_shapes(self, tokens: int) -> list[tuple[int, int, int]]:
        """The bucket shapes of token bucket ``tokens`` (one per block-table width)."""
        return [shape for shape in self.buckets.all_shapes() if shape[0] == tokens]

    def _build_token_bucket(self, tokens: int) -> None:
        for shape in self.token_bucket_shapes(tokens):
            self.compile_step(shape)
        self._mark_ready(tokens)

    def _mark_ready(self, tokens: int) -> None:
        with self._lock:
            if self._ready_tokens is not None:
                self._ready_tokens.add(tokens)

    def serving_buckets(self) -> BucketTable:
        """The buckets a step may use now: all of them once warm-up is over
        (or when compiling lazily); during a background warm-up, only the
        token buckets already built, so no step waits on a compile (a batch
        then pads up to the smallest ready bucket that holds it)."""
        with self._lock:
            ready = self._ready_tokens
            if ready is None or len(ready) == len(self.buckets.token_buckets):
                return self.buckets
            return BucketTable(tuple(sorted(ready)), self.buckets.seq_buckets, self.buckets.width_buckets)

    def _block_op(self, name: str) -> Callable:
        exe = self._block_ops.get(name)
        if exe is not None:
            return exe
        kv = _abstract(self.kv_cache)
        rep = self._replicated
        ids = jax.ShapeDtypeStruct((BLOCK_CHUNK,), np.int32, sharding=rep)
        tables = _abstract(self.sampler_tables)
        scalar = jax.ShapeDtypeStruct((), np.int32, sharding=rep)
        vocab = self.cfg.vocab_size
        if name == "fill":
            tokens = jax.ShapeDtypeStruct((self.max_model_len,), np.int32, sharding=rep)
            fill = jax.jit(fill_slot, donate_argnums=(0,), out_shardings=rep)
            exe = self._compiled(fill, tables, scalar, tokens, scalar, scalar)
        elif name == "rows":
            rows = (jax.ShapeDtypeStruct((vocab,), np.float32, sharding=rep),
                    jax.ShapeDtypeStruct((vocab,), np.bool_, sharding=rep))
            exe = self._compiled(jax.jit(set_slot_rows, donate_argnums=(0,), out_shardings=rep), tables, scalar,
                                 *rows)
        elif name == "gather":
            exe = self._compiled(jax.jit(_gather_blocks), kv, ids)
        elif name == "compress":
            compress = jax.jit(_compress_blocks, donate_argnums=(1,), out_shardings=self._compressed_sharding)
            exe = self._compiled(compress, kv, _abstract(self.compressed), ids, ids)
        elif name == "scatter":
            blocks = tuple(jax.ShapeDtypeStruct((c.shape[0], BLOCK_CHUNK) + c.shape[2:], c.dtype, sharding=c.sharding)
                           for c in kv)
            scatter = jax.jit(_scatter_blocks, donate_argnums=(0,), out_shardings=self._kv_sharding)
            exe = self._compiled(scatter, kv, ids, blocks)
        else:
            copy = jax.jit(_copy_blocks, donate_argnums=(0,), out_shardings=self._kv_sharding)
            exe = self._compiled(copy, kv, ids, ids)
        self._block_ops[name] = exe
        return exe

    def warmup(self, progress: bool = True, swap: bool = False, background: bool = False) -> float:
        """Build every bucket's step program (and the block-copy and slot-fill programs).

        Args:
          progress: show a tqdm bar on stderr.
          swap: also build the swap-out/in programs.
          background: build only two token buckets now: the largest (it
            holds any step) and the smallest of at least 16 tokens (it serves
            short prompts and decode steps; the smaller ones only speed up a
            few decode rows), and the others in a background thread, smallest
            first, one program at a time while :meth:`may_build_in_background`;
            :meth:`serving_buckets` tracks what is ready, and
            :meth:`wait_for_warmup` waits for the rest. At interpreter exit the
            thread stops after the program it is building (XLA cannot be left
            mid-compile: the process would abort).

        Returns:
          Seconds spent before returning.
        """
        from tqdm import tqdm

        start = time.perf_counter()
        tokens = self.buckets.token_buckets
        first = sorted({tokens[-1], next((t for t in tokens if t >= 16), tokens[0])}, reverse=True) if background \
            else list(tokens)
        with self._lock:
            self._ready_tokens = set()
        for t in tqdm(first, desc="compiling buckets", unit="bucket", disable=not progress):
            self._build_token_bucket(t)
        for name in self.WARMUP_OPS + (("gather", "scatter") if swap else ()) + (
                ("compress",) if self.compressed is not None else ()):
            self._block_op(name)
        rest = [t for t in tokens if t not in first]
        with self._lock:
            self._last_dispatch = time.monotonic()
        if rest:
            # The thread holds the runner only while it builds a program, so a
            # runner nobody uses any more is freed and its warm-up ends.
            runner = weakref.ref(self)
            self._background = threading.Thread(target=_build_in_background, args=(runner, [(t, self.token_bucket_shapes(t)) for t in rest]),
                                                name="jaxllm-warmup", daemon=True)
            self._background.start()
            # At interpreter exit, let the thread finish its program: a daemon thread that Python stops inside an
            # XLA compile aborts the process ("FATAL: exception not rethrown").
            atexit.register(lambda: runner() is not None and runner().stop_warmup())
        return time.perf_counter() - start

    def num_pending_programs(self) -> int:
        """Step programs a background warm-up has still to build (0 when compiling lazily)."""
        with self._lock:
            if self._ready_tokens is None:
                return 0
            return len(self.buckets) - sum(1 for shape in self.buckets.all_shapes() if shape[0] in self._ready_tokens)

    def wait_for_warmup(self, timeout: Optional[float] = None) -> bool:
        """Wait for a background warm-up to finish; True once every program is built."""
        if self._background is not None:
            self._background.join(timeout)
        return self._background is None or not self._background.is_alive()

    def stop_warmup(self) -> None:
        """Stop a background warm-up after the program it is building (at shutdown); the persistent compilation
        cache keeps the programs it finished."""
        self._stop_background.set()
        self.wait_for_warmup()

    # ---------------------------------------------------------------- serving

    def dispatch(self, batch: BatchDescriptor, sampling: SamplingArrays, prev_tokens: Optional[jax.Array] = None,
                 prompt_target_ids: Optional[np.ndarray] = None,
                 bitmask: Optional[np.ndarray] = None) -> tuple[StepOutput, jax.Array]:
        """Launch one step without waiting for it.

        Args:
          batch: bucket-shaped (T, S, W) arrays; a bucket not compiled yet is
            compiled first (lazy mode).
          sampling: per-row sampling controls, ``[S]`` each (``[S * num_positions]``).
          prev_tokens: the previous dispatch's padded samples, for rows whose
            input is a sample still on the device (async scheduling).
          prompt_target_ids: int32[T] the prompt token following each token
            row whose prompt logprob is wanted, -1 elsewhere; None: none wanted.
          bitmask: int32[S, ceil(V/32)] the tokens each row may sample
            (``structured_output``); None: every token, from an all-ones
            array kept on the device (no transfer).

        Returns:
          (the step's :class:`StepOutput` on the device; the sampled ids
          padded to int32[max S bucket] for the next dispatch). The KV cache
          and the sampler tables are updated in place (donated).
        """
        exe = self.compile_step(batch.shape, announce=self._ready_tokens is None)
        self._note_dispatch()
        if bitmask is None:
            bitmask = self._all_ones(batch.shape[1])
        device_batch, device_sampling, bitmask = jax.device_put(
            (StepBatch.from_descriptor(batch, prompt_target_ids), sampling, bitmask), self._replicated)
        prev = self._no_prev_tokens if prev_tokens is None else prev_tokens
        out, next_prev, self.kv_cache, self.sampler_tables = exe(
            self.params, self.kv_cache, device_batch, device_sampling, self.sampler_tables, prev, bitmask,
            self.compressed,
        )
        return out, next_prev

    def _all_ones(self, num_rows: int) -> jax.Array:
        ones = self._all_allowed.get(num_rows)
        if ones is None:
            ones = self._all_allowed[num_rows] = jax.device_put(
                np.full((num_rows, self.bitmask_words), -1, np.int32), self._replicated)
        return ones

    def fill_slot(self, slot: int, token_ids: Sequence[int], num_prompt: int) -> None:
        """Reset sampling slot ``slot`` for a sequence (re)admitted with ``token_ids`` (prompt then output)."""
        padded = np.zeros(self.max_model_len, np.int32)
        padded[: len(token_ids)] = token_ids
        self.sampler_tables = self._block_op("fill")(
            self.sampler_tables, np.int32(slot), padded, np.int32(num_prompt), np.int32(len(token_ids))
        )

    def set_slot_rows(self, slot: int, bias: np.ndarray, stop: np.ndarray) -> None:
        """Write slot ``slot``'s bias row (float32[V]) and min_tokens stop row (bool[V])."""
        self.sampler_tables = self._block_op("rows")(self.sampler_tables, np.int32(slot), bias, stop)

    def copy_blocks(self, pairs: Sequence[Sequence[int]]) -> None:
        """Device-side block copies: ``pairs`` of (src, dst) block ids, in ``BLOCK_CHUNK`` chunks (each reads its
        sources before writing, but a later chunk reads what an earlier one wrote: :meth:`move_blocks` orders
        moves that chain)."""
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        for chunk, _ in _chunks(pairs, repeat_first=True):
            self.kv_cache = self._block_op("copy")(self.kv_cache, chunk[:, 0], chunk[:, 1])

    def compress_blocks(self, pairs: Sequence[Sequence[int]]) -> None:
        """Re-encode device blocks into the compressed pool: ``pairs`` of (device block, compressed slot), in
        ``BLOCK_CHUNK`` chunks of the program built at warm-up (a chunk's unused entries re-encode null block 0 into
        the null slot 0, which nothing reads). Call it before anything writes the device blocks."""
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        for chunk, _ in _chunks(pairs):
            self.compressed = self._block_op("compress")(self.kv_cache, self.compressed, chunk[:, 0], chunk[:, 1])

    def move_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Block copies done as if every source were read first, whatever the chains and cycles among them
        (``scheduler.block_moves.order_block_moves``: round by round, each round in chunks of the copy program
        built at warm-up, so nothing compiles). A compaction's moves are one round."""
        for moves in order_block_moves(pairs):
            self.copy_blocks(moves)

    def resize_kv_cache(self, num_blocks: int) -> int:
        """Give the KV cache ``num_blocks`` blocks (the null block included): new arrays holding the old ones'
        first ``min(old, new)`` blocks (zeros past them), the old ones let go, then every program that takes the
        cache rebuilt for its new shape -- the step programs built so far and the block-copy ones -- so serving
        afterwards compiles nothing more. A background warm-up is waited for first. Old and new arrays coexist
        during the copy (a shape change cannot reuse the buffer): the device needs both sizes at once.

        Returns:
          the programs built (the copy into the new arrays included).

        Raises:
          RuntimeError: the KV cache is released (sleep).
        """
        if not isinstance(self.kv_cache[0], jax.Array):
            raise RuntimeError("resize_kv_cache: the KV cache is released (sleep); wake_up() first")
        self.wait_for_warmup()
        before = self.num_compilations
        resize = jax.jit(functools.partial(_resized, num_blocks=num_blocks), out_shardings=self._kv_sharding)
        old, self.kv_cache = self.kv_cache, self._compiled(resize, _abstract(self.kv_cache))(self.kv_cache)
        for c in old:
            c.delete()
        self.num_blocks = num_blocks
        shapes, ops = list(self._steps), [name for name in ("copy", "gather", "scatter") if name in self._block_ops]
        self._steps = {}
        for name in ops:
            del self._block_ops[name]
            self._block_op(name)
        for shape in shapes:
            self.compile_step(shape)
        return self.num_compilations - before

    def swap_out(self, pairs: Sequence[Sequence[int]]) -> None:
        """Copy device blocks to the host pool: ``pairs`` of (device, host) ids; returns once the pool holds them."""
        self.finish_swap_out(self.start_swap_out(pairs))

    def start_swap_out(self, pairs: Sequence[Sequence[int]]) -> list[tuple[np.ndarray, KVCache]]:
        """The first half of :meth:`swap_out`: dispatch the gathers of the device blocks of ``pairs`` ((device, host)
        ids) without waiting for them. They read the KV cache as it is now (programs dispatched later, which may
        overwrite those blocks, run after them), into arrays of their own.

        Returns:
          per chunk of ``BLOCK_CHUNK`` pairs: its host ids (int32[n]) and its gathered blocks (K and V, each
          ``[num_layers, BLOCK_CHUNK, block_size, num_kv_heads, head_dim]`` on the device), for
          :meth:`finish_swap_out`.
        """
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        return [(chunk[:n, 1], self._block_op("gather")(self.kv_cache, chunk[:, 0])) for chunk, n in _chunks(pairs)]

    def finish_swap_out(self, pending: list[tuple[np.ndarray, KVCache]]) -> None:
        """Write what :meth:`start_swap_out` gathered into the host pool (waits for those gathers only)."""
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
            self.kv_cache = self._block_op("scatter")(self.kv_cache, chunk[:, 1], tuple(blocks))

    # ------------------------------------------------------ weights and sleep

    def param_layout(self) -> Layout:
        """Every parameter leaf by path (``jaxllm.worker.weights``): its shape, its dtype as numbers (bfloat16, not
        the uint16 bits ``float_bits_storage`` holds) and its sharding, which a new leaf must match."""
        return dict(self._param_layout)

    @property
    def weights_state(self) -> str:
        """"device" (serving), "offloaded" (a host copy, ``release_params(offload=True)``) or "discarded"."""
        if all(isinstance(leaf, jax.Array) for leaf in flatten(self.params).values()):
            return "device"
        return "offloaded" if self._host_params is not None else "discarded"

    def get_params(self) -> Params:
        """The parameters the steps run: a new tree of the device arrays, in the layout's dtypes (bfloat16 leaves
        held as bits are converted back, into new arrays) with their shardings.

        Raises:
          RuntimeError: the weights are not on the devices (``weights_state``).
        """
        self._need_weights("get_params")
        flat = {path: leaf if leaf.dtype == self._param_layout[path].dtype else _number_cast(leaf.sharding)(leaf)
                for path, leaf in flatten(self.params).items() if path in self._param_layout}
        return unflatten(flat)

    def set_param(self, path: str, leaf: jax.Array) -> None:
        """Replace leaf ``path`` by ``leaf`` between steps. The old array is let go at once, so a tree replaced
        leaf by leaf holds one leaf more at most (memory others keep alive, e.g. a tree from :meth:`get_params`,
        stays theirs); the compiled steps are not rebuilt.

        Args:
          path: a leaf of :meth:`param_layout`.
          leaf: placed, of exactly its shape, dtype and sharding; with ``float_bits_storage`` a bfloat16 / float8
            leaf is donated to its conversion to bits. A new ``embed`` is packed again into the lm_head's
            ``kernels_pallas.ops.HEAD_PANELS`` where the runner holds them.

        Raises:
          ValueError: ``leaf`` does not match the layout (the compiled programs would not take it).
        """
        want = self._param_layout[path]
        if _abstract(leaf) != want:
            raise ValueError(f"set_param({path!r}): {_abstract(leaf)} does not match the compiled layout {want}")
        stored = self._storage_layout[path]
        if stored.dtype != leaf.dtype:
            leaf = _storage_cast(stored.sharding, stored.dtype)(leaf)
        flat = flatten(self.params)
        flat[path] = leaf
        if path == "embed" and HEAD_PANELS in flat:
            # The lm_head's panels of the new embedding. The old ones go first, so this holds one leaf more at most;
            # meanwhile their abstract leaf keeps the tree's structure for a program the background warm-up builds.
            flat[HEAD_PANELS] = self._storage_layout[HEAD_PANELS]
            self.params = unflatten(flat)
            flat[HEAD_PANELS] = with_head_panels({"embed": leaf}, self.cfg)[HEAD_PANELS]
        self.params = unflatten(flat)

    def release_params(self, offload: bool) -> int:
        """Let the parameters' device arrays go (sleep): with ``offload`` a host copy is kept for
        :meth:`restore_params`; the programs still build from their avals meanwhile.

        Returns:
          the bytes of the arrays let go (whole arrays, all shards).
        """
        if self.weights_state != "device":
            if not offload:
                self._host_params = None  # a deeper sleep discards the host copy of a lighter one
            return 0
        flat = flatten(self.params)
        self._host_params = jax.device_get(flat) if offload else None
        self.params = unflatten(self._storage_layout)
        return sum(leaf.nbytes for leaf in flat.values())

    def restore_params(self) -> None:
        """Put the host copy of :meth:`release_params` back on the devices (nothing to do when they are there).

        Raises:
          RuntimeError: the weights were discarded, and some leaves have not been set again since.
        """
        if self._host_params is not None:
            host, self._host_params = self._host_params, None
            self.params = unflatten({path: jax.device_put(leaf, self._storage_layout[path].sharding)
                                     for path, leaf in host.items()})
        self._need_weights("restore_params")

    def release_kv_cache(self) -> int:
        """Free the KV cache's device memory, the compressed pool's too (sleep); its avals stay, so programs still
        build, and
        :meth:`allocate_kv_cache` makes the same arrays again. Returns the bytes freed (0 if already free)."""
        caches = self.kv_cache
        if not isinstance(caches[0], jax.Array):
            return 0
        self.kv_cache = tuple(_abstract(c) for c in caches)
        arrays = list(caches)
        if self.compressed is not None:
            arrays += list(self.compressed)
            self.compressed = _abstract(self.compressed)
        freed = sum(c.nbytes for c in arrays)
        for c in arrays:
            c.delete()
        return freed

    def allocate_kv_cache(self) -> None:
        """Zeroed KV cache arrays of the compiled shapes and shardings again (wake up); nothing if allocated."""
        if not isinstance(self.kv_cache[0], jax.Array):
            self.kv_cache = tuple(_zeros(a.shape, a.dtype, a.sharding)() for a in self.kv_cache)
            if self.compressed is not None:
                self.compressed = CompressedKV(*(_zeros(a.shape, a.dtype, a.sharding)() for a in self.compressed))

    def _need_weights(self, what: str) -> None:
        state = self.weights_state
        if state != "device":
            raise RuntimeError(f"{what}: the weights are {state} (sleep); wake_up() first"
                               + (", after restoring them with update_weights or update_weights_from_path"
                                  if state == "discarded" else ""))


@functools.lru_cache(maxsize=None)
def _storage_cast(sharding: jax.sharding.Sharding, storage: np.dtype) -> Callable:
    """A leaf (donated) as stored with ``float_bits_storage``, on the same sharding: one program per pair."""
    return jax.jit(lambda a: to_storage(a, storage), donate_argnums=0, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _number_cast(sharding: jax.sharding.Sharding) -> Callable:
    """A stored leaf as numbers (bfloat16 of uint16 bits), on the same sharding."""
    return jax.jit(from_storage, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding) -> Callable:
    """A program making a zeroed array laid out by ``sharding`` shard by shard (a KV cache woken up)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _build_in_background(runner_ref: "weakref.ref[ModelRunner]",
                         buckets: list[tuple[int, list[tuple[int, int, int]]]]) -> None:
    """Build the step programs of ``buckets`` (token bucket, its shapes) one by one, each when the runner allows it
    (``ModelRunner.may_build_in_background``), while the runner lives and is not stopped."""
    for tokens, shapes in buckets:
        for shape in shapes:
            if not _wait_for_turn(runner_ref):
                return
            runner = runner_ref()
            if runner is None:
                return
            runner.compile_step(shape)
            del runner
        runner = runner_ref()
        if runner is None:
            return
        runner._mark_ready(tokens)
        del runner


def _wait_for_turn(runner_ref: "weakref.ref[ModelRunner]", poll: float = 0.05) -> bool:
    """Wait until the runner may build its next program; False once it is stopped or gone. The runner is held
    only while it is asked, so one nobody uses any more is freed meanwhile."""
    while True:
        runner = runner_ref()
        if runner is None or runner._stop_background.is_set():
            return False
        if runner.may_build_in_background():
            return True
        stop = runner._stop_background
        del runner
        stop.wait(poll)


def enable_persistent_compilation_cache(path: Optional[str]) -> None:
    """Point JAX's persistent compilation cache at ``path`` (every program
    cached, however quick to compile), unless the process already set one."""
    if path is None or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

