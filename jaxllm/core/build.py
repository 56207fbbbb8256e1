"""Start-up of an engine core: read the model, place it on the mesh, size and calibrate the KV cache, build the
runners (target and draft) and warm their programs up, then make the ``EngineCore`` from those parts.

Each stage is a function of its own, so a caller holding some of the parts (weights already in memory, a mesh of
its own) can build a core from them; ``build_engine_core`` is the whole start-up from a model path.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Optional, Union

import jax
import ml_dtypes
import numpy as np

from jaxllm.config import CacheConfig, CompilationConfig, EngineConfig, LoRAConfig, SpeculativeConfig
from jaxllm.core.engine_core import EngineCore
from jaxllm.loader import load_sharded, read_model_config
from jaxllm.logger import init_logger
from jaxllm.models import family
from jaxllm.models.config import ModelConfig
from jaxllm.paths import cache_dir
from jaxllm.spec_decode import NgramProposer
from jaxllm.spec_decode.draft import DraftRunner
from jaxllm.structured_output import StructuredOutputManager
from jaxllm.tokenizer import load_named_tokenizer, load_tokenizer
from jaxllm.worker.host_malloc import tune_host_malloc
from jaxllm.worker.kv_cache import (bytes_per_block, calibrate_kv_scales, calibration_ids, check_pool_backend,
                                    describe_pool, fit_max_model_len, kv_number_dtype, size_kv_pools)
from jaxllm.worker.lora import LoRAManager
from jaxllm.worker.model_runner import ModelRunner
from jaxllm.worker.programs import CompileStats, Warmup, enable_persistent_compilation_cache
from jaxllm.worker.quantization import weight_quantization
from jaxllm.worker.sharding import ModelSharding, make_mesh
from jaxllm.worker.weights import place_given_params
from kernels_pallas.cpu_features import describe_cpu
from kernels_pallas.ops import HEAD_PANELS, AttentionOps, default_attention_backend, get_attention_ops
from scheduler import BucketTable

logger = init_logger(__name__)
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def resolve_dtype(name: str) -> Any:
    """The compute dtype of ``EngineConfig.dtype``: "auto" is float32 on CPU (docs/design/worker.md says why) and
    bfloat16 on accelerators; other names map directly."""
    if name == "auto":
        return np.float32 if jax.default_backend() == "cpu" else ml_dtypes.bfloat16
    return _DTYPES[name]


def model_length(cfg: ModelConfig, config: EngineConfig) -> int:
    """The longest sequence ``cfg`` serves under ``config``: its ``max_position_embeddings``, capped with
    ``disable_sliding_window`` at its narrowest sliding window, inside which every layer attends to every token
    (vLLM's rule). Raises ValueError: a ``max_model_len`` set above that window."""
    windows = [w for w in cfg.sliding_windows if w]
    if not (config.disable_sliding_window and windows):
        return cfg.max_position_embeddings
    window = min(windows)
    if config.max_model_len is not None and config.max_model_len > window:
        raise ValueError(f"max_model_len={config.max_model_len} is longer than the model's sliding window, {window} "
                         "tokens, which disable_sliding_window caps it to")
    return min(cfg.max_position_embeddings, window)


def build_engine_core(model: Union[str, os.PathLike, ModelConfig], config: EngineConfig, *,
                      mesh: Optional[jax.sharding.Mesh] = None, core_index: int = 0,
                      params: Optional[Any] = None) -> EngineCore:
    """Start an engine core for ``model``, every start-up stage logged.

    Args:
      model: a HF model folder, a ``.gguf`` file or a jaxllm orbax folder; or, with ``params``, a ``ModelConfig``
        (prompts are token ids then).
      config: the ``EngineConfig`` (``data_parallel_size`` 1: one core is one replica).
      params: weights to serve instead of the model's own (``weights.place_given_params``).
      mesh: this replica's ``(data, model)`` mesh; default ``make_mesh(tensor_parallel_size)``.
      core_index: this core's data-parallel rank.

    Raises:
      ValueError: a bad model path or architecture, a config value out of range, heads that do not split, a draft model
        that does not fit, a KV budget holding no ``max_model_len`` sequence, or ``data_parallel_size > 1``.
    """
    parallel, cache, compilation = config.parallel, config.cache, config.compilation
    if parallel.data_parallel_size > 1:
        raise ValueError(f"data_parallel_size={parallel.data_parallel_size}: an EngineCore is one replica; "
                         "LLM and the server run one core per replica")
    # Before JAX's CPU client starts its threads (make_mesh, the weights): see host_malloc.
    logger.info(tune_host_malloc())
    path = None if isinstance(model, ModelConfig) else Path(model)
    if path is None and params is None:
        raise ValueError("model is a ModelConfig: pass its weights as params=")
    cfg = model if path is None else read_model_config(path)[0]
    # The config is checked before any weight is read: the scheduler's knobs against the model's length too.
    max_model_len = config.resolve_max_model_len(model_length(cfg, config))
    config.scheduler_config(num_blocks=2, max_model_len=max_model_len)
    dtype = resolve_dtype(config.dtype)
    mesh = mesh if mesh is not None else make_mesh(parallel.tensor_parallel_size)
    if params is None:
        cfg, params, _, sharding = load_sharded(path, dtype, mesh, quantization=config.quantization)
    else:
        sharding = ModelSharding(cfg, mesh)
        params = place_given_params(cfg, params, dtype, sharding, config.quantization)
    if config.tokenizer is not None:  # the front end's: a missing one is an error, not a model without one
        tokenizer = (lambda: load_named_tokenizer(config.tokenizer, config.tokenizer_revision or config.revision,
                                                  config.download_dir))
    else:
        tokenizer = (lambda: load_tokenizer(path)) if path is not None else (lambda: None)
    backend = compilation.attention_backend or default_attention_backend()
    check_pool_backend(cache, backend)
    ops = attention_ops(sharding, backend, compilation.interpret)
    enable_persistent_compilation_cache(compilation_cache_path(compilation))
    kv_dtype = kv_number_dtype(cache.kv_cache_dtype, dtype)
    if config.max_model_len is None and cache.num_kv_blocks is None:
        # Sized from a memory budget (measured now that the weights are placed): a model whose own length
        # outgrows it serves the longest length it holds, as vLLM's max_model_len=-1.
        max_model_len = fit_max_model_len(sharding.per_device_config(), block_size=cache.block_size,
                                          dtype=kv_dtype, kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
                                          max_model_len=max_model_len, device=sharding.mesh.devices.flat[0],
                                          gpu_memory_utilization=cache.gpu_memory_utilization)
    if kv_dtype != np.dtype(dtype):
        ids = calibration_ids(tokenizer(), cfg.vocab_size)[:max_model_len]
        k_scale, v_scale = calibrate_kv_scales(cfg, params, ids, ops=ops, sharding=sharding, kv_dtype=kv_dtype)
        params = {**params, "layers": {**params["layers"], "k_scale": k_scale, "v_scale": v_scale}}
    spec = config.speculative
    buckets = step_buckets(config.bucket_ladders(max_model_len, backend), ops)
    runner = build_runner(cfg, params, cache, spec, sharding=sharding, ops=ops, backend=backend, dtype=dtype,
                          kv_dtype=kv_dtype, max_model_len=max_model_len, buckets=buckets,
                          max_num_seqs=config.scheduler.max_num_seqs, lora=config.lora,
                          logprobs_mode=config.logprobs_mode)
    drafter = proposer = None
    if spec is not None and spec.method == "draft_model":
        drafter = build_drafter(spec, cache, compilation, runner, mesh=sharding.mesh, backend=backend,
                                max_model_len=max_model_len)
    elif spec is not None:
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    structured = StructuredOutputManager(tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    lora = None if runner.lora is None else LoRAManager(runner.lora, cfg, family(cfg),
                                                         config.max_cpu_loras or config.max_loras)
    core = EngineCore(config, runner, sharding=sharding, max_model_len=max_model_len, kv_cache_dtype=kv_dtype,
                      structured=structured, drafter=drafter, proposer=proposer,
                      core_index=core_index, lora=lora)
    _log_start_up(core, backend, weight_quantization(params))
    warm_up(core)
    return core


@functools.lru_cache(maxsize=64)
def attention_ops(sharding: ModelSharding, backend: str, interpret: bool) -> AttentionOps:
    """``backend``'s attention ops (``get_attention_ops``) run per device by ``sharding``; the same object for equal
    arguments (``ModelSharding`` compares its config and mesh), so that the runners of one process share their step
    programs (``programs.shared_jit``)."""
    return sharding.attention_ops(get_attention_ops(backend, interpret=interpret))


def compilation_cache_path(compilation: CompilationConfig) -> Optional[str]:
    """The folder of JAX's persistent compilation cache ``compilation.compilation_cache`` names ("default":
    ``<jaxllm cache>/xla``), or None: off."""
    path = compilation.compilation_cache
    return str(cache_dir() / "xla") if path == "default" else path


def step_buckets(ladders: tuple[tuple[int, ...], ...], ops: AttentionOps) -> BucketTable:
    """The bucket table of ``ladders`` (T, S, W), with decode-only programs where ``ops`` has a decode-only
    attention (``AttentionOps.decode_attention``)."""
    table = BucketTable(*ladders)
    return table.with_decode_programs() if ops.decode_attention is not None else table


def build_runner(cfg: ModelConfig, params: Any, cache: CacheConfig, spec: Optional[SpeculativeConfig], *,
                 sharding: ModelSharding, ops: AttentionOps, backend: str, dtype: Any, kv_dtype: np.dtype,
                 max_model_len: int, buckets: BucketTable, max_num_seqs: int, lora: LoRAConfig,
                 logprobs_mode: str = "raw_logprobs") -> ModelRunner:
    """The target model's runner over placed ``params``, its KV cache sized from ``cache``
    (``kv_cache.size_kv_pools``) for ``max_num_seqs`` rows, its steps padded to ``buckets``; ``spec``'s draft
    positions (None: one position a row); ``lora``'s adapter slots (none unless ``enable_lora``);
    ``logprobs_mode`` as ``EngineConfig``'s.

    Raises:
      ValueError: no ``max_model_len`` sequence fits, or a pool share below 2 blocks.
    """
    sizes = dict(block_size=cache.block_size, dtype=kv_dtype, num_kv_blocks=cache.num_kv_blocks,
                 kv_cache_memory_bytes=cache.kv_cache_memory_bytes, max_num_seqs=max_num_seqs,
                 max_model_len=max_model_len, device=sharding.mesh.devices.flat[0],
                 gpu_memory_utilization=cache.gpu_memory_utilization)
    num_blocks, num_pool_blocks, pool_dtype = size_kv_pools(sharding.per_device_config(), cache, **sizes)
    offload_bytes = int(cache.kv_offloading_size * 2**30)
    return ModelRunner(
        cfg, params, num_blocks=num_blocks, block_size=cache.block_size, dtype=dtype, ops=ops,
        buckets=buckets, sharding=sharding,
        num_host_blocks=cache.num_host_blocks, num_sampling_slots=max_num_seqs + 1,
        num_offload_blocks=offload_bytes // bytes_per_block(cfg, cache.block_size, kv_dtype),
        max_model_len=max_model_len,
        float_bits_storage=backend != "pallas" and sharding.mesh.devices.flat[0].platform == "cpu",
        kv_cache_dtype=kv_dtype, num_positions=1 + (spec.num_speculative_tokens if spec is not None else 0),
        num_pool_blocks=num_pool_blocks, pool_dtype=pool_dtype,
        max_loras=lora.max_loras if lora.enable_lora else 0, max_lora_rank=lora.max_lora_rank,
        logprobs_mode=logprobs_mode,
    )


def build_drafter(spec: SpeculativeConfig, cache: CacheConfig, compilation: CompilationConfig, target: ModelRunner,
                  *, mesh: jax.sharding.Mesh, backend: str, max_model_len: int) -> DraftRunner:
    """The draft model's runner of ``spec.model`` (the target's block count and buckets, ``cache``'s block size
    and host blocks) on ``mesh``.

    Raises:
      ValueError: a bad path, a vocabulary unlike the target's, or positions short of ``max_model_len``.
    """
    cfg, params, _, sharding = load_sharded(Path(spec.model), target.dtype, mesh)
    if cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"speculative_config model={spec.model!r} has vocab_size={cfg.vocab_size}; the target "
                         f"has {target.cfg.vocab_size}, and drafts must be the target's token ids")
    if cfg.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config model={spec.model!r} has max_position_embeddings="
                         f"{cfg.max_position_embeddings}, below max_model_len={max_model_len}")
    ops = attention_ops(sharding, backend, compilation.interpret)
    return DraftRunner(
        cfg, params, num_speculative_tokens=spec.num_speculative_tokens, num_positions=target.num_positions,
        num_blocks=target.cache_engine.num_blocks, block_size=cache.block_size, dtype=target.dtype, ops=ops,
        buckets=target.buckets, sharding=sharding, num_host_blocks=cache.num_host_blocks,
        num_offload_blocks=target.cache_engine.num_offload_blocks,
        float_bits_storage=target.weights.float_bits_storage,
    )


def warm_up(core: EngineCore) -> None:
    """Build the step programs of every runner now, or start building them in the background
    (``CompilationConfig.precompile``), and log what was built."""
    precompile = core.config.compilation.precompile
    if not precompile:
        logger.info("step programs are built on first use (precompile=False)")
        return
    for r in [core.runner] + ([core.drafter] if core.drafter is not None else []):
        swap = core.config.scheduler.preemption_mode == "swap" or r.cache_engine.num_offload_blocks > 0
        done = r.warmup(swap=swap, background=precompile == "background")
        logger.info(_describe_warmup(done, r.compile_stats, len(r.programs.buckets), r is core.drafter))


def _describe_warmup(done: Warmup, c: CompileStats, num_step_programs: int, draft: bool) -> str:
    """One line on a runner's warm-up: which programs it built, how (compiled, loaded, reused), and what is left
    to the background thread. ``c`` may have counted a background build already, so the split by kind is read
    from ``done`` alone."""
    model = "the draft model's " if draft else ""
    compiled = c.num_compilations - c.num_cache_hits - c.num_reused
    line = (f"built {done.step_programs} of {model}{num_step_programs} step programs and {done.other_programs} "
            f"other programs (KV block copies, sampling slots; swaps, LoRA when used) in {done.seconds:.1f} s; so "
            f"far {compiled} compiled "
            f"({c.compile_seconds:.1f} s), {c.num_cache_hits} loaded from the persistent cache "
            f"({c.cache_load_seconds:.1f} s)")
    if c.num_reused:
        line += f", {c.num_reused} reused from this process's earlier engines ({c.reuse_seconds:.1f} s)"
    if done.background:
        line += (f"; the other {done.background} step programs are building in the background, and until each is "
                 "ready, steps are padded to a built one")
    return line


def _log_start_up(core: EngineCore, backend: str, quantization: Optional[str]) -> None:
    pb, b = core.param_bytes, core.buckets
    quantized = (f" ({pb['quantized'] / 2**20:.1f} MiB of {quantization} weights and scales, "
                 f"{pb['quantized_as_float32'] / 2**20:.1f} MiB as float32)" if pb["quantized"] else "")
    panels = core.runner.weights.params.get(HEAD_PANELS)
    packed = (f" ({panels.nbytes / 2**20:.1f} MiB of them the tied embedding packed again for the CPU lm_head)"
              if panels is not None else "")
    on_cpu = core.sharding.mesh.devices.flat[0].platform == "cpu"
    why = ", float32 on CPU: bfloat16 is no faster there" if on_cpu and core.config.dtype == "auto" else ""
    logger.info(f"parameters: {pb['total'] / 2**20:.1f} MiB{quantized}{packed}, {np.dtype(core.dtype).name} (dtype="
                f"{core.config.dtype!r}{why})" + (f"; CPU: {describe_cpu()}" if on_cpu else ""))
    rows = [b.seq_bucket_for(t) for t in b.token_buckets]
    decode = len(b.decode_token_buckets) * len(b.width_buckets)
    decode_only = (f"{decode} of them for decode-only steps, tokens {list(b.decode_token_buckets)}" if decode else
                   f"decode-only steps run these too: the {backend} attention needs no programs of its own for them")
    logger.info(f"{len(b)} step programs (tokens {list(b.token_buckets)}, rows {rows}, block-table widths "
                f"{list(b.width_buckets)}; {decode_only}); attention {backend}; tensor parallel "
                f"{core.sharding.tensor_parallel_size}")
    logger.info(describe_kv_cache(core))
    pool = describe_pool(core.config.cache, core.runner.cache_engine, core.num_blocks)
    if pool is not None:
        logger.info(pool)


def describe_kv_cache(core: EngineCore) -> str:
    """The start-up line on the KV cache: its blocks, tokens, bytes and dtype, and how many ``max_model_len``
    requests it holds at once (vLLM's "maximum concurrency"), with why it is no larger when it was capped."""
    config, bs, usable = core.config, core.config.cache.block_size, core.num_blocks - 1
    per_request = -(-core.max_model_len // bs)
    target_bytes = sum(c.nbytes for c in core.runner.cache_engine.kv_cache)  # a draft model's cache not counted
    line = (f"KV cache: {usable} blocks of {bs} tokens ({usable * bs:,} tokens) and the null block, "
            f"{core.kv_cache_dtype.name}, {target_bytes / 2**20:,.1f} MiB; maximum concurrency for "
            f"{core.max_model_len:,}-token requests: {usable / per_request:.2f}x")
    if config.num_kv_blocks is None and usable == config.max_num_seqs * per_request:
        line += (f" (max_num_seqs={config.max_num_seqs} requests of max_model_len={core.max_model_len}: the budget "
                 "would hold more, and no step could use them)")
    return line
