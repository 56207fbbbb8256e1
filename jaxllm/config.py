"""The engine's configuration: ``EngineConfig`` (vLLM's option names and meanings, checked once when made) and
the typed sub-configs built from it. Each field's description is its ``help`` metadata (:func:`field_docs`).
Imports the standard library and ``scheduler`` only, so any process can read a config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence, TypeVar, Union

from scheduler.buckets import geometric_ladder, half_step_ladder
from scheduler.config import SchedulerConfig
from scheduler.degradation import GracefulDegradation
from scheduler.kv.compressed_pool import CompressedBlockPool
from scheduler.sampling_params import MAX_LOGPROBS

T = TypeVar("T")

# Weight-only quantizations and KV cache dtypes (jaxllm.worker.quantization), by vLLM's names.
WEIGHT_QUANTIZATIONS = ("int8", "fp8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")
# EngineConfig.dtype: the compute dtypes, and vLLM's other names for two of them.
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# EngineConfig.kv_cache_compression: the one-byte types compressed KV blocks are re-encoded in.
KV_COMPRESSION_DTYPES = ("int8", "fp8")
# SchedulerConfig fields that EngineConfig.scheduler_config fills in itself (enable_kv_cache_events from
# kv_events_config, the rest at start-up); every other one is an EngineConfig field of the same name (a test
# checks both).
SCHEDULER_FIELDS_FROM_START_UP = ("num_blocks", "max_model_len", "num_lookahead_tokens", "enable_kv_cache_events",
                                  "num_offload_blocks", "num_pool_blocks")
# Token buckets below the default ladder's first value (16): steps of a few decode rows.
SMALL_TOKEN_BUCKETS = (4, 8)
# EngineConfig.logprobs_mode values (vLLM's): what returned logprobs are taken from (jaxllm.sample.sampler).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# "vllm": the metrics under vLLM's names and labels (jaxllm.frontend.metrics).
METRICS_NAMESPACES = ("jaxllm", "vllm")
# SpeculativeConfig.method values.
SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's pause_generation modes: abort the open requests, wait for them, or keep them frozen in place.
PAUSE_MODES = ("abort", "wait", "keep")
# vLLM's wake_up tags: what a sleep freed or stopped.
SLEEP_TAGS = ("weights", "kv_cache", "scheduling")
# sleep() on an engine started without enable_sleep_mode (the core and AsyncLLM refuse it before anything changes).
SLEEP_MODE_OFF = "sleep: the engine was started without enable_sleep_mode=True (--enable-sleep-mode)"
# ProfilerConfig.profiler values: both record a jax.profiler trace ("torch" is vLLM's name; the model runs in JAX).
PROFILERS = ("jax", "torch")
# vLLM's ProfilerConfig keys for the torch and proton profilers' own options: accepted, no effect on a JAX trace.
PROFILER_ADVISORY_KEYS = (
    "torch_profiler_activities", "torch_profiler_with_stack", "torch_profiler_with_flops", "torch_profiler_use_gzip",
    "torch_profiler_dump_cuda_time_total", "torch_profiler_record_shapes", "torch_profiler_with_memory",
    "capture_torch_profiler", "detailed_trace_annotation", "ignore_frontend", "proton_profiler_dir",
    "proton_context", "proton_data", "proton_backend", "proton_mode", "proton_hook", "proton_output_format",
    "proton_graph_attribution")


def _option(default: Any, help: str) -> Any:
    """A dataclass field with ``default`` and its description (``metadata["help"]``, read by :func:`field_docs`)."""
    return dataclasses.field(default=default, metadata={"help": help})


class FieldDoc(NamedTuple):
    """One dataclass field as the CLI and the configuration reference print it: ``name``, ``type`` (the
    annotation as written), ``default`` (``dataclasses.MISSING`` when required), ``description`` (``help``)."""

    name: str
    type: str
    default: Any
    description: str


def field_docs(cls: type) -> list[FieldDoc]:
    """Each field of the dataclass ``cls``, in declaration order. Raises TypeError: not a dataclass."""
    docs = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        docs.append(FieldDoc(f.name, annotation, default, f.metadata.get("help", "")))
    return docs


def dataclass_from_json(cls: type[T], value: Any, name: str, required: Sequence[str] = ()) -> Optional[T]:
    """``cls`` built from ``value``: an instance, a dict of its fields, or that dict's JSON text; None stays None.
    ``name`` is the option's, for errors; ``required`` the keys the dict must have.

    Raises:
      ValueError: bad JSON, not a dict, an unknown key (named, with the fields), a missing required key, or what
        ``cls`` itself refuses.
    """
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} {value!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r} must be a dict (or its JSON)")
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{name} has unknown field {unknown[0]!r}; the fields are {fields}")
    missing = [key for key in required if key not in value]
    if missing:
        raise ValueError(f"{name} needs {' and '.join(repr(k) for k in required)}")
    return cls(**value)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings, vLLM's ``speculative_config`` keys (``jaxllm.spec_decode``).

    Raises:
      ValueError: an unknown method or key, a value out of range (named with its limit), a missing or extra ``model``.
    """

    method: str = dataclasses.field(metadata={"help": (
        '"ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the sequence\'s last n '
        'tokens) or "draft_model" (a smaller model with the same vocabulary proposes greedily).')})
    num_speculative_tokens: int = dataclasses.field(metadata={"help": (
        "Draft tokens per decode step, >= 1; a decode row then carries up to 1 + this many query tokens and emits "
        "up to that many tokens.")})
    prompt_lookup_min: Optional[int] = _option(None, (
        "Shortest n-gram tried (ngram only); as vLLM, one of min/max given alone sets both, neither given means 5."))
    prompt_lookup_max: Optional[int] = _option(None, "Longest n-gram tried, tried first (ngram only).")
    model: Optional[str] = _option(None, "The draft model: a HF folder, a .gguf or an orbax folder (draft_model only).")

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method={self.method!r} must be one of {list(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens={k!r} must be an int >= 1")
        if self.method == "ngram":
            self._check_ngram()
        else:
            if not self.model:
                raise ValueError("speculative_config method 'draft_model' needs model (a path to the draft model)")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("speculative_config prompt_lookup_min/max are for method 'ngram', not 'draft_model'")
            object.__setattr__(self, "model", str(self.model))

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise ValueError(f"speculative_config model={self.model!r} is for method 'draft_model', not 'ngram'")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"speculative_config {name}={value!r} must be an int >= 1")
        low = self.prompt_lookup_min if self.prompt_lookup_min is not None else self.prompt_lookup_max
        high = self.prompt_lookup_max if self.prompt_lookup_max is not None else self.prompt_lookup_min
        low, high = (5, 5) if low is None else (low, high)
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min={low} exceeds prompt_lookup_max={high}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def parse(cls, value: Union["SpeculativeConfig", dict[str, Any], str, None]) -> Optional["SpeculativeConfig"]:
        """A config from a dict, its JSON text, or itself; None stays None. Raises ValueError (see the class)."""
        return dataclass_from_json(cls, value, "speculative_config", required=("method", "num_speculative_tokens"))


@dataclasses.dataclass
class KVEventsConfig:
    """``--kv-events-config``: vLLM's ``KVEventsConfig`` fields; the publisher is ``jaxllm.core.kv_events``.
    Raises ValueError naming a field out of range."""

    enable_kv_cache_events: bool = _option(False, "Record and publish the events.")
    publisher: Optional[str] = _option(None, '"zmq", or "null" (record nothing); None: "zmq" when enabled, else '
                                             '"null".')
    endpoint: str = _option("tcp://*:5557", (
        "The PUB socket's address; one with *, ::, ipc:// or inproc:// is bound, any other connected to (a "
        "subscriber or proxy listening there), as vLLM does."))
    replay_endpoint: Optional[str] = _option(None, "A ROUTER address (bound) that replays buffered batches; None: no "
                                                   "replay.")
    buffer_steps: int = _option(10_000, "Batches kept for replay.")
    hwm: int = _option(100_000, "The PUB socket's high-water mark (ZMQ drops messages past it for a slow subscriber).")
    max_queue_size: int = _option(100_000, "Batches waiting for the publisher thread at most (the core waits past it).")
    topic: str = _option("", (
        "The first frame of every message; subscribers filter on its prefix (vllm-router's --kv-event-source reads "
        "only vLLM's default, the empty topic)."))

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config publisher={self.publisher!r} must be 'zmq' or 'null'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config {name}={value!r} must be a positive int")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events_config endpoint={self.endpoint!r} must be a tcp://, ipc:// or inproc:// "
                             "address")

    @property
    def publishes(self) -> bool:
        """Whether events are recorded and sent (enabled, with the "zmq" publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: Union["KVEventsConfig", dict[str, Any], str, None]) -> Optional["KVEventsConfig"]:
        """A config from a dict, its JSON text, or itself; None stays None. Raises ValueError: bad JSON, key or
        value."""
        return dataclass_from_json(cls, value, "kv_events_config")


@dataclasses.dataclass(frozen=True)
class ProfilerConfig:
    """``--profiler-config``: vLLM's ``ProfilerConfig`` keys. With a profiler, ``start_profile`` / ``stop_profile``
    record a ``jax.profiler`` trace of each engine core's steps (``jaxllm.core.profiler``); the keys of vLLM's torch
    and proton options (:data:`PROFILER_ADVISORY_KEYS`) are accepted and have no effect.

    Raises:
      ValueError: a profiler other than "jax" or "torch" (vLLM's "cuda" and "proton" drive CUDA's and Triton's
        profilers, which jaxllm does not run), no folder for it, or a count below 0 (named).
    """

    profiler: Optional[str] = _option(None, (
        '"jax" or "torch" (vLLM\'s name; the trace is JAX\'s either way): start_profile records a jax.profiler trace '
        "(TensorBoard's and Perfetto's format) of the engine's steps; None: profiling off."))
    torch_profiler_dir: str = _option("", (
        "The folder traces are written to (vLLM's name for it); each core writes <dir>/<prefix>_dp<rank>, or "
        "<dir>/dp<rank> without a prefix. Needed with a profiler."))
    delay_iterations: int = _option(0, "Engine steps after start_profile before the trace starts, >= 0.")
    max_iterations: int = _option(0, "Engine steps traced at most, then the trace stops by itself, >= 0; 0: until "
                                     "stop_profile.")
    wait_iterations: int = _option(0, "vLLM's profiler schedule, with warmup_iterations: when either is > 0, the "
                                      "trace skips wait + warmup steps more, then records active_iterations steps.")
    warmup_iterations: int = _option(0, "See wait_iterations.")
    active_iterations: int = _option(5, "See wait_iterations, >= 1.")

    def __post_init__(self) -> None:
        if self.profiler is not None and self.profiler not in PROFILERS:
            raise ValueError(f"profiler_config profiler={self.profiler!r} must be None or one of {list(PROFILERS)}: "
                             "jaxllm records JAX profiler traces (vLLM's 'cuda' and 'proton' profile CUDA and Triton "
                             "from PyTorch)")
        for name in ("delay_iterations", "max_iterations", "wait_iterations", "warmup_iterations",
                     "active_iterations"):
            value, low = getattr(self, name), int(name == "active_iterations")
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"profiler_config {name}={value!r} must be an int >= {low}")
        folder = self.torch_profiler_dir
        if not isinstance(folder, str):
            raise ValueError(f"profiler_config torch_profiler_dir={folder!r} must be a string")
        if self.profiler is None and folder:
            raise ValueError(f"profiler_config torch_profiler_dir={folder!r} needs a profiler (\"jax\" or \"torch\")")
        if self.profiler is not None and not folder:
            raise ValueError(f"profiler_config profiler={self.profiler!r} needs torch_profiler_dir, the folder traces "
                             "are written to")
        if folder and "://" not in folder:
            object.__setattr__(self, "torch_profiler_dir", str(Path(folder).expanduser().absolute()))

    @property
    def scheduled(self) -> bool:
        """Whether vLLM's schedule (wait, warmup, active) sets the traced steps."""
        return self.wait_iterations > 0 or self.warmup_iterations > 0

    @classmethod
    def parse(cls, value: Union["ProfilerConfig", dict[str, Any], str, None]) -> Optional["ProfilerConfig"]:
        """A config from a dict, its JSON text, or itself (:data:`PROFILER_ADVISORY_KEYS` dropped); None stays None.
        Raises ValueError (see the class)."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"profiler_config {value!r} is not JSON: {e}") from None
        if isinstance(value, dict):
            fields = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(value) - set(fields) - set(PROFILER_ADVISORY_KEYS))
            if unknown:
                raise ValueError(f"profiler_config has unknown field {unknown[0]!r}; the fields are {fields}, and "
                                 "vLLM's torch and proton options, accepted without effect: "
                                 f"{list(PROFILER_ADVISORY_KEYS)}")
            value = {k: v for k, v in value.items() if k not in PROFILER_ADVISORY_KEYS}
        return dataclass_from_json(cls, value, "profiler_config")


# start_profile's profile_prefix, vLLM's rule: 1-128 ASCII letters, digits, '.', '_' or '-', a letter or digit first.
_PROFILE_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# profiler_kwargs jaxllm honours: jax.profiler.start_trace's create_perfetto_trace (also write a Perfetto
# .trace.json.gz) and these jax.profiler.ProfileOptions fields.
TRACE_KWARGS = ("create_perfetto_trace",)
OPTION_KWARGS = ("host_tracer_level", "python_tracer_level", "enable_hlo_proto")
# torch.profiler.profile's keywords, which vLLM's torch profiler takes: accepted, no effect on a JAX trace.
TORCH_KWARGS = ("activities", "schedule", "on_trace_ready", "record_shapes", "profile_memory", "with_stack",
                "with_flops", "with_modules", "experimental_config", "execution_trace_observer", "acc_events",
                "use_cuda", "custom_trace_id_callback", "post_processing_timeout_s")


def check_profile_request(prefix: Optional[str], delay_iterations: Optional[int], max_iterations: Optional[int],
                          profiler_kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Check one ``start_profile``'s overrides (vLLM's rules); the ``profiler_kwargs`` jaxllm honours.

    Raises:
      ValueError: a prefix breaking vLLM's rule, a count not an int >= 0, a keyword neither jaxllm's nor
        torch.profiler's (named, with the accepted ones), or a value of the wrong type.
    """
    if prefix is not None and (not isinstance(prefix, str) or not _PROFILE_PREFIX.fullmatch(prefix)):
        raise ValueError(f"profile_prefix={prefix!r} must be 1-128 ASCII characters, start with a letter or digit, "
                         "and hold only letters, digits, '.', '_' or '-'")
    for name, value in (("delay_iterations", delay_iterations), ("max_iterations", max_iterations)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name}={value!r} must be an int >= 0")
    kwargs = dict(profiler_kwargs or {})
    unknown = sorted(set(kwargs) - set(TRACE_KWARGS + OPTION_KWARGS + TORCH_KWARGS))
    if unknown:
        raise ValueError(f"profiler_kwargs key {unknown[0]!r} is not known; jaxllm's are "
                         f"{list(TRACE_KWARGS + OPTION_KWARGS)} (and torch.profiler's, accepted without effect)")
    honoured = {k: v for k, v in kwargs.items() if k in TRACE_KWARGS + OPTION_KWARGS}
    for name, value in honoured.items():
        if name in ("create_perfetto_trace", "enable_hlo_proto"):
            if not isinstance(value, bool):
                raise ValueError(f"profiler_kwargs {name}={value!r} must be a bool")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"profiler_kwargs {name}={value!r} must be an int >= 0")
    return honoured


def read_preload_prompts(path: Union[str, Path]) -> list[str]:
    """The prompts of a warm-up file (``EngineConfig.preload_prompts``): a ``.json`` list of strings, else one
    prompt per line (empty lines skipped).

    Raises:
      ValueError: missing or unreadable, a bad ``.json`` list, or no prompt; the message names the path.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"preload_prompts={str(path)!r}: cannot read it ({e.strerror or e})") from None
    if path.suffix.lower() == ".json":
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"preload_prompts={str(path)!r} is not valid JSON: {e}") from None
        if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts):
            raise ValueError(f"preload_prompts={str(path)!r} must hold a JSON list of non-empty strings")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"preload_prompts={str(path)!r} holds no prompt")
    return prompts


# The typed sub-configs: each holds the EngineConfig fields of its names, as checked there (vLLM's groups).
@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV cache: its blocks, dtype, prefix caching and the tiers off the device pool (``EngineConfig.cache``)."""

    block_size: int
    num_kv_blocks: Optional[int]
    kv_cache_memory_bytes: Optional[int]
    gpu_memory_utilization: float
    kv_cache_dtype: str
    enable_prefix_caching: bool
    num_host_blocks: int
    kv_offloading_size: float
    kv_cache_compression: Optional[str]
    kv_cache_compression_fraction: float


@dataclasses.dataclass(frozen=True)
class SchedulingConfig:
    """The step's limits and the scheduler's policy (``EngineConfig.scheduler``; the scheduler's own
    ``SchedulerConfig`` adds what start-up learns: :meth:`EngineConfig.scheduler_config`)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    scheduling_policy: Any
    preemption_mode: str
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    async_scheduling: Optional[bool]
    batching: str
    graceful_degradation: Any
    aging_rate: float
    reserve_predicted_output: bool
    max_waiting_requests: Optional[int]


@dataclasses.dataclass(frozen=True)
class CompilationConfig:
    """The compiled step programs: attention backend, bucket ladders, when they compile and where they are cached
    (``EngineConfig.compilation``)."""

    attention_backend: Optional[str]
    interpret: bool
    token_buckets: Optional[Sequence[int]]
    seq_buckets: Optional[Sequence[int]]
    width_buckets: Optional[Sequence[int]]
    precompile: Union[bool, str]
    compilation_cache: Optional[str]


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Devices a step spans and engine replicas (``EngineConfig.parallel``)."""

    tensor_parallel_size: int
    data_parallel_size: int


@dataclasses.dataclass(frozen=True)
class ObservabilityConfig:
    """Stats logging, Prometheus metrics and KV cache events (``EngineConfig.observability``)."""

    log_stats: bool
    disable_log_stats: bool
    metrics_port: Optional[int]
    metrics_namespace: str
    kv_events_config: Optional[KVEventsConfig]
    profiler_config: Optional[ProfilerConfig]


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters: whether they are served and their limits (``EngineConfig.lora``, vLLM's ``LoRAConfig``)."""

    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: Optional[int]


SUB_CONFIGS = {"cache": CacheConfig, "scheduler": SchedulingConfig, "compilation": CompilationConfig,
               "parallel": ParallelConfig, "observability": ObservabilityConfig, "lora": LoRAConfig}


@dataclasses.dataclass
class EngineConfig:
    """Serving configuration, vLLM's names and meanings; each field's description is its ``help`` metadata.

    Checks every value when made; ``cache``, ``scheduler``, ``compilation``, ``parallel``, ``observability`` and
    ``lora`` are frozen views of its fields (:data:`SUB_CONFIGS`), ``speculative`` the parsed ``speculative_config``;
    the engine's build code reads these. :meth:`scheduler_config` builds the scheduler's config once start-up knows the block
    count.

    Raises:
      ValueError: a value out of range or settings that cannot be used together, naming them and the limit.
    """

    block_size: int = _option(16, "Tokens per KV block, a power of two.")
    num_kv_blocks: Optional[int] = _option(None, (
        "KV blocks in all, the null block 0 included, >= 2; None sizes the cache from kv_cache_memory_bytes."))
    kv_cache_memory_bytes: Optional[int] = _option(None, (
        "Device bytes for the KV cache (all layers, K and V); None: sized from gpu_memory_utilization on an "
        "accelerator, 1 GiB on CPU."))
    gpu_memory_utilization: float = _option(0.9, (
        "On an accelerator, the share of its memory (JAX's bytes_limit) the engine may hold, in (0, 1] (vLLM's): an "
        "unset kv_cache_memory_bytes is this share less the bytes in use once the weights are placed. Unused on "
        "CPU."))
    max_num_seqs: int = _option(64, "Sequences in one step at most.")
    max_num_batched_tokens: int = _option(512, "Tokens in one step at most (the token budget), >= max_num_seqs.")
    max_model_len: Optional[int] = _option(None, (
        "Prompt + output tokens per request at most. None: the model's max_position_embeddings, or, when the KV "
        "cache is sized from kv_cache_memory_bytes (or its default) and holds no sequence that long, the longest it "
        "holds, with a warning naming both (vLLM's max_model_len=-1). A value the cache cannot hold is an error "
        "naming the largest that fits."))
    dtype: str = _option("auto", (
        '"auto" (float32 on CPU, bfloat16 on accelerators), "float32", "bfloat16" or "float16" (vLLM\'s "float" '
        'and "half" name these two): the compute dtype, and the KV cache\'s unless kv_cache_dtype quantizes it.'))
    quantization: Optional[str] = _option(None, (
        'None, "int8" or "fp8": weight-only quantization of the dense projections and an untied lm_head, per output '
        "channel (jaxllm.worker.quantization); an orbax checkpoint converted quantized is served as converted."))
    kv_cache_dtype: str = _option("auto", (
        '"auto" (the compute dtype), "int8", or "fp8" / "fp8_e4m3" (float8_e4m3fn): the KV cache\'s numbers, '
        "quantized with per-layer, per-head scales calibrated at start-up."))
    seed: int = _option(0, "The seed of requests that set none.")
    max_logprobs: int = _option(MAX_LOGPROBS, (
        f"Top logprobs a request may ask for (logprobs, prompt_logprobs), 0 to {MAX_LOGPROBS} (vLLM's; jaxllm "
        f"computes at most {MAX_LOGPROBS}); -1, vLLM's 'the whole vocabulary', is {MAX_LOGPROBS} here."))
    logprobs_mode: str = _option("raw_logprobs", (
        "What the logprobs of sampled and top tokens are (vLLM's): \"raw_logprobs\", the log-softmax of the model's "
        'logits (a structured-output mask applied); "raw_logits", those logits; "processed_logprobs", the '
        "log-softmax of the logits each token was sampled from: after logit_bias, bad words, min_tokens and the "
        "penalties, then, for a sampled (temperature > 0) request, its temperature and min-p / top-k / top-p (-inf "
        'outside the kept set); "processed_logits", those logits. Prompt logprobs are raw logprobs in every mode.'))
    scheduling_policy: Any = _option("fcfs", (
        '"fcfs", "priority", "sjf", "aging", "load_aware", "predicted", or a scheduler.policy.Policy: the order in '
        "which waiting requests are admitted and running ones preempted."))
    preemption_mode: str = _option("recompute", (
        '"recompute" (free a preempted request\'s blocks and recompute them later) or "swap" (copy them to '
        "num_host_blocks host blocks and back)."))
    num_host_blocks: int = _option(0, (
        'Host blocks for preemption_mode="swap", >= 0; a victim that does not fit is recomputed instead.'))
    enable_prefix_caching: bool = _option(True, "Reuse computed full KV blocks across requests that share a prefix.")
    enable_chunked_prefill: bool = _option(True, (
        "Split long prompts across steps. Off, a prompt is computed in one step, so max_num_batched_tokens must be "
        ">= max_model_len."))
    long_prefill_token_threshold: int = _option(0, (
        "Prefill tokens of one request per step at most, so long prompts leave room for others; 0: no cap (nor "
        "with enable_chunked_prefill off)."))
    attention_backend: Optional[str] = _option(None, (
        '"pallas", "xla", "reference", or None: pallas on GPU, xla elsewhere (kernels_pallas.ops.get_attention_ops).'))
    interpret: bool = _option(False, "Run the Pallas kernels in interpret mode (testing them on CPU).")
    token_buckets: Optional[Sequence[int]] = _option(None, (
        "Token counts T a step is padded to, ascending, the last >= max_num_batched_tokens; None: 4 and 8, then "
        "16, 24, 32, 48, ... up to max_num_batched_tokens."))
    seq_buckets: Optional[Sequence[int]] = _option(None, (
        "Row counts S a step is padded to, the last >= max_num_seqs; None: each token bucket capped at "
        "max_num_seqs."))
    width_buckets: Optional[Sequence[int]] = _option(None, (
        "Block-table widths W a step is padded to, the last >= ceil(max_model_len / block_size); None: that width "
        "alone, or (reference attention) 4, 16, 64, ... up to it."))
    precompile: Union[bool, str] = _option("background", (
        'When the step programs compile: true, every bucket at start-up; "background", the largest token bucket '
        "and the smallest of at least 16 tokens at start-up, the rest in a background thread while the engine is "
        "idle (a step pads up to a compiled bucket meanwhile); false, each bucket on first use."))
    async_scheduling: Optional[bool] = _option(None, (
        "Schedule step N+1 while the device runs step N (same outputs). None: on unless speculative_config is set; "
        "true with speculative_config is an error (a step's drafts need the previous step's tokens)."))
    compilation_cache: Optional[str] = _option("default", (
        'Folder of JAX\'s persistent compilation cache; "default" is <jaxllm cache>/xla, None turns it off.'))
    tensor_parallel_size: int = _option(1, (
        "Devices one model step is split over (Megatron tensor parallelism, jaxllm.worker.sharding); it must divide "
        "the model's query heads, and the KV heads must divide it or be divisible by it."))
    data_parallel_size: int = _option(1, (
        "Engine replicas, each with its own scheduler and KV cache on tensor_parallel_size devices, in a process of "
        "its own (jaxllm.core.client.MPClient)."))
    batching: str = _option("continuous", (
        '"continuous", or "static": a new batch of up to max_num_seqs requests starts only when the previous one '
        "has finished (a baseline for benchmarks)."))
    log_stats: bool = _option(False, "Log a one-line stats summary every 5 seconds.")
    disable_log_stats: bool = _option(False, (
        "vLLM's: record no per-step stats, so no Prometheus series moves (the per-step metrics work, one pass over "
        "the step's requests, is skipped); not with log_stats or metrics_port. vLLM's LLM sets it by default, "
        "jaxllm's LLM does not."))
    metrics_port: Optional[int] = _option(None, "Serve the Prometheus metrics on this port; None: do not.")
    metrics_namespace: str = _option("jaxllm", (
        '"jaxllm", or "vllm": the series vLLM also has under vLLM\'s names, each with vLLM\'s model_name label '
        "(jaxllm.frontend.metrics)."))
    speculative_config: Union[SpeculativeConfig, dict, str, None] = _option(None, (
        'Speculative decoding, a dict (or its JSON text) of SpeculativeConfig fields: {"method": "ngram", '
        '"num_speculative_tokens": k} (and prompt_lookup_min/max) or {"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": k}; None: off. A draft model\'s weights and KV cache come on top of the memory '
        "the target's blocks were sized for: with a large draft on an accelerator, set kv_cache_memory_bytes or "
        "num_kv_blocks to leave room."))
    graceful_degradation: Union[bool, dict, str, GracefulDegradation] = _option(True, (
        "Under KV pressure lower the effective max_num_seqs and prefill budget step by step, and restore them when "
        "calm (scheduler.degradation). True: the default thresholds; false: off; a dict (or its JSON text) of "
        'GracefulDegradation fields, e.g. {"low_free_fraction": 0.2, "recover_steps": 4}.'))
    aging_rate: float = _option(1.0, 'For scheduling_policy="aging": priority units a waiting request gains per '
                                     "second, >= 0.")
    reserve_predicted_output: bool = _option(False, (
        "Admit a request beside running ones only when the free KV blocks also hold every running request's "
        "predicted output (scheduler.predictor)."))
    max_waiting_requests: Optional[int] = _option(None, (
        "Refuse a new request (QueueFullError; 503 at the server) while this many or more wait for a batch seat; "
        "None: no limit."))
    preload_prompts: Optional[str] = _option(None, (
        "A file of common prompts (a .json list of strings, or text with one prompt per line) computed at start-up, "
        "so the first request sharing one hits the prefix cache."))
    kv_events_config: Union[KVEventsConfig, dict, str, None] = _option(None, (
        "Publish the prefix cache's stored and evicted blocks as vLLM does: a dict (or its JSON text) of "
        'KVEventsConfig fields, e.g. {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}; None: off.'))
    profiler_config: Union[ProfilerConfig, dict, str, None] = _option(None, (
        "Allow start_profile() / stop_profile() (and the server's /start_profile, /stop_profile), which record a "
        "jax.profiler trace of the engine's steps: a dict (or its JSON text) of ProfilerConfig fields, vLLM's keys, "
        'e.g. {"profiler": "jax", "torch_profiler_dir": "/tmp/traces"}; None: off.'))
    enable_sleep_mode: bool = _option(False, "Allow sleep() / wake_up(), which free and restore the device memory.")
    kv_offloading_size: float = _option(0.0, (
        "GiB of host memory for a host tier of the prefix cache (vLLM's --kv-offloading-size), >= 0; 0: no tier. A "
        "hashed block about to be reused on the device is copied there first, and a prefix missing on the device "
        "is loaded back from there. It holds GiB * 2**30 // (bytes per block: all layers, K and V, in the KV cache's "
        "dtype) blocks. Needs enable_prefix_caching."))
    kv_cache_compression: Optional[str] = _option(None, (
        'None, "int8" or "fp8": when free KV blocks run short, before preempting, re-encode full blocks of running '
        "requests in this one-byte type (a scale per block and KV head) into a second pool and free their blocks. "
        'Needs kv_cache_dtype="auto" and the xla or reference attention; not with speculative_config, '
        'preemption_mode="swap", kv_offloading_size, tensor_parallel_size > 1 or batching="static". Requests with '
        "SamplingParams(allow_kv_compression=False) or priority < 0 are never compressed."))
    kv_cache_compression_fraction: float = _option(0.5, (
        "With kv_cache_compression, the share of the KV budget given to the compressed pool, in (0, 1); the device "
        "blocks get the rest."))
    enable_lora: bool = _option(False, (
        "Serve LoRA adapters (PEFT folders) on top of the base model, per request (LoRARequest), several in one "
        "step; not with tensor_parallel_size > 1, speculative_config or batching=\"static\"."))
    max_loras: int = _option(1, "With enable_lora: distinct adapters in one step at most (device slots).")
    max_lora_rank: int = _option(16, "With enable_lora: the largest adapter rank r served (slots are this wide).")
    max_cpu_loras: Optional[int] = _option(None, (
        "With enable_lora: adapters kept in host memory at most, >= max_loras (least recently used ones are read "
        "again from their folder when needed); None: max_loras."))
    revision: Optional[str] = _option(None, (
        "The branch, tag or commit of a model given as a Hugging Face Hub id (vLLM's); None: the default branch."))
    disable_sliding_window: bool = _option(False, (
        "Cap max_model_len to the model's sliding window, where every layer's attention is full attention (vLLM's); "
        "a model without one is unchanged."))
    tokenizer: Optional[str] = _option(None, (
        "Where the tokenizer is read from, if not the model (vLLM's): a folder with a tokenizer.json, a .gguf file, "
        "a named model or a Hub id; the engine reads prompts, stop strings and structured-output grammars with it."))
    tokenizer_revision: Optional[str] = _option(None, (
        "The branch, tag or commit of a tokenizer given as a Hub id (vLLM's); None: revision's."))
    download_dir: Optional[str] = _option(None, (
        "The folder Hub models are downloaded to and read from (vLLM's); None: the Hub's cache (HF_HUB_CACHE, or "
        "HF_HOME's)."))

    @property
    def cache(self) -> CacheConfig:
        """The KV cache's fields."""
        return _sub_config(CacheConfig, self)

    @property
    def scheduler(self) -> SchedulingConfig:
        """The step's limits and the scheduling policy's fields."""
        return _sub_config(SchedulingConfig, self)

    @property
    def speculative(self) -> Optional[SpeculativeConfig]:
        """Speculative decoding's config (``speculative_config`` parsed), or None: off."""
        return self.speculative_config

    @property
    def compilation(self) -> CompilationConfig:
        """The step programs' fields."""
        return _sub_config(CompilationConfig, self)

    @property
    def parallel(self) -> ParallelConfig:
        """The parallelism fields."""
        return _sub_config(ParallelConfig, self)

    @property
    def observability(self) -> ObservabilityConfig:
        """The stats, metrics and events fields."""
        return _sub_config(ObservabilityConfig, self)

    @property
    def lora(self) -> LoRAConfig:
        """The LoRA fields."""
        return _sub_config(LoRAConfig, self)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if isinstance(self.block_size, int) and self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive int (or None: the model's "
                             "max_position_embeddings)")
        if self.max_waiting_requests is not None and (
                not isinstance(self.max_waiting_requests, int) or self.max_waiting_requests < 0):
            raise ValueError(f"max_waiting_requests={self.max_waiting_requests!r} must be an int >= 0 (or None: no "
                             "limit)")
        if self.preload_prompts is not None:
            read_preload_prompts(self.preload_prompts)  # a missing or malformed file fails before any loading
        if self.kv_cache_memory_bytes is not None and (not isinstance(self.kv_cache_memory_bytes, int)
                                                       or self.kv_cache_memory_bytes < 1):
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes!r} must be a positive int (or None: "
                             "gpu_memory_utilization of the accelerator's memory less the weights, 1 GiB on CPU)")
        if (isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        if (isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int)
                or not -1 <= self.max_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be an int in [-1, {MAX_LOGPROBS}] (jaxllm "
                             f"computes at most {MAX_LOGPROBS} logprobs a token; -1: {MAX_LOGPROBS})")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 2 (block 0 is reserved)")
        if self.metrics_namespace not in METRICS_NAMESPACES:
            raise ValueError(f"metrics_namespace={self.metrics_namespace!r} must be one of {METRICS_NAMESPACES}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r} must be one of {LOGPROBS_MODES}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {DTYPES + tuple(DTYPE_ALIASES)}")
        if self.quantization is not None and self.quantization not in WEIGHT_QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} must be None or one of {WEIGHT_QUANTIZATIONS}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
        if self.preemption_mode == "swap" and self.num_host_blocks < 1:
            raise ValueError(f"preemption_mode='swap' needs host blocks to swap to: num_host_blocks="
                             f"{self.num_host_blocks} must be >= 1")
        size = self.kv_offloading_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size >= 0:
            raise ValueError(f"kv_offloading_size={size!r} must be a number of GiB >= 0 (0: no host tier)")
        if size and not self.enable_prefix_caching:
            raise ValueError(f"kv_offloading_size={size!r} needs enable_prefix_caching=True: the host tier holds "
                             "prefix-cache blocks")
        if self.precompile not in (True, False, "background"):
            raise ValueError(f"precompile={self.precompile!r} must be True, False or 'background'")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching={self.batching!r} must be 'continuous' or 'static'")
        if self.disable_log_stats and (self.log_stats or self.metrics_port is not None):
            wanted = "log_stats=True" if self.log_stats else f"metrics_port={self.metrics_port}"
            raise ValueError(f"disable_log_stats=True records no stats, so {wanted} would have none to show")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        spec = self.speculative_config
        if self.async_scheduling is None:
            self.async_scheduling = spec is None
        elif not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} must be True, False or None (on unless "
                             "speculative_config is set)")
        elif self.async_scheduling and spec is not None:
            raise ValueError("async_scheduling=True cannot be used with speculative_config: a step's drafts need "
                             "the previous step's tokens (leave async_scheduling unset, or turn it off)")
        self._check_compression()
        self._check_lora()
        self.graceful_degradation = _parse_degradation(self.graceful_degradation)
        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        self.profiler_config = ProfilerConfig.parse(self.profiler_config)
        # The scheduler's knobs are checked by SchedulerConfig, here rather than at start-up; the block count and
        # the model's length are not known yet (placeholders; the real config is built by the engine core).
        self.scheduler_config(num_blocks=2, max_model_len=self.max_model_len or 1)
        if spec is not None and spec.num_speculative_tokens >= self.max_num_batched_tokens:
            raise ValueError(f"speculative_config num_speculative_tokens={spec.num_speculative_tokens} must be below "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}: a decode row carries 1 + that "
                             "many")

    def _check_lora(self) -> None:
        """Raise ValueError for a LoRA limit out of range or a setting LoRA does not run with (named)."""
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras={cpu!r} must be an int >= max_loras={self.max_loras} (or None)")
        if not self.enable_lora:
            return
        refused = [f"{name}={getattr(self, name)!r}" for name, off in
                   (("speculative_config", None), ("batching", "continuous"))
                   if getattr(self, name) != off]
        if refused:
            raise ValueError(f"enable_lora=True cannot be used with {', '.join(refused)}")

    def _check_compression(self) -> None:
        """Raise ValueError for a bad ``kv_cache_compression`` (or fraction) or a setting it does not work with."""
        mode, fraction = self.kv_cache_compression, self.kv_cache_compression_fraction
        if mode is not None and mode not in KV_COMPRESSION_DTYPES:
            raise ValueError(f"kv_cache_compression={mode!r} must be None or one of {KV_COMPRESSION_DTYPES}")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            raise ValueError(f"kv_cache_compression_fraction={fraction!r} must be a number in (0, 1)")
        if mode is None:
            return
        refused = CompressedBlockPool.refuses(self)
        if refused:
            raise ValueError(f"kv_cache_compression={mode!r} cannot be used with {refused}")

    def scheduler_config(self, *, num_blocks: int, max_model_len: int,
                         num_offload_blocks: Optional[int] = None,
                         num_pool_blocks: Optional[int] = None) -> SchedulerConfig:
        """The scheduler's configuration: every ``SchedulerConfig`` field this config has, plus those known
        only at start-up (:data:`SCHEDULER_FIELDS_FROM_START_UP`).

        Args:
          num_blocks: device KV blocks, the null block included.
          max_model_len: the resolved ``max_model_len``.
          num_offload_blocks: the host tier's blocks; None before start-up: 1 when ``kv_offloading_size`` is set.
          num_pool_blocks: the compressed pool's slots; None: 2 when ``kv_cache_compression`` is set.

        Raises:
          ValueError: a scheduler knob out of range (``SchedulerConfig`` names it and its limit).
        """
        spec = self.speculative_config
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerConfig)
                  if f.name not in SCHEDULER_FIELDS_FROM_START_UP}
        # A draft model writes its proposals' K/V into slots its row reserves beyond the scheduled tokens.
        lookahead = spec.num_speculative_tokens if spec is not None and spec.method == "draft_model" else 0
        events = self.kv_events_config is not None and self.kv_events_config.publishes
        return SchedulerConfig(**shared, num_blocks=num_blocks, max_model_len=max_model_len,
                               num_lookahead_tokens=lookahead, enable_kv_cache_events=events,
                               num_offload_blocks=int(bool(self.kv_offloading_size)) if num_offload_blocks is None
                               else num_offload_blocks,
                               num_pool_blocks=(2 * bool(self.kv_cache_compression) if num_pool_blocks
                                                is None else num_pool_blocks))

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        """``max_model_len``, or the model's ``max_position_embeddings`` when None. Raises ValueError: above the
        model's positions."""
        if self.max_model_len is None:
            return max_position_embeddings
        if not 1 <= self.max_model_len <= max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} is out of range: the model has "
                f"max_position_embeddings={max_position_embeddings}"
            )
        return self.max_model_len

    def max_blocks_per_seq(self, max_model_len: int) -> int:
        """Block-table width that covers ``max_model_len`` tokens."""
        return math.ceil(max_model_len / self.block_size)

    def bucket_ladders(self, max_model_len: int, attention_backend: str) -> tuple[tuple[int, ...], ...]:
        """The (T, S, W) ladders steps are padded to, each ending exactly at its limit (defaults and why:
        ``docs/design/config.md``).

        Raises:
          ValueError: an explicit ladder that stops short of its limit (named with the limit).
        """
        max_width = self.max_blocks_per_seq(max_model_len)
        small = tuple(t for t in SMALL_TOKEN_BUCKETS if t < min(16, self.max_num_batched_tokens))
        tokens = self.token_buckets or small + half_step_ladder(16, self.max_num_batched_tokens)
        seqs = self.seq_buckets or tuple(sorted({min(t, self.max_num_seqs) for t in tokens}))
        if self.width_buckets:
            widths = self.width_buckets
        elif attention_backend == "reference":
            widths = geometric_ladder(4, max_width, 4)
        else:
            widths = (max_width,)
        limits = (("token_buckets", tokens, self.max_num_batched_tokens, "max_num_batched_tokens"),
                  ("seq_buckets", seqs, self.max_num_seqs, "max_num_seqs"),
                  ("width_buckets", widths, max_width, "ceil(max_model_len / block_size)"))
        for name, ladder, limit, limit_name in limits:
            if max(ladder) < limit:
                raise ValueError(f"{name}={list(ladder)} must reach {limit_name}={limit}: a step that size "
                                 "would have no bucket")
        return tuple(tokens), tuple(seqs), tuple(widths)


def _sub_config(cls: type[T], config: EngineConfig) -> T:
    """``cls`` (one of :data:`SUB_CONFIGS`) holding ``config``'s fields of its field names."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


def _parse_degradation(value: Any) -> Union[bool, GracefulDegradation]:
    """``graceful_degradation`` as the scheduler takes it: True, False or a ``GracefulDegradation``.
    Raises ValueError: not a bool, "true"/"false", a dict/JSON of its fields (unknown ones named) or an instance.
    """
    if isinstance(value, (bool, GracefulDegradation)):
        return value
    if isinstance(value, str):
        if value.lower() in ("true", "false"):
            return value.lower() == "true"
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"graceful_degradation={value!r} must be true, false or a JSON object of "
                             f"GracefulDegradation fields: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"graceful_degradation={value!r} must be a bool, a dict or JSON object of "
                         "GracefulDegradation fields, or a GracefulDegradation")
    known = [f.name for f in dataclasses.fields(GracefulDegradation)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"graceful_degradation has unknown field {unknown[0]!r}; the fields are {known}")
    try:
        return GracefulDegradation(**value)
    except TypeError as e:  # a threshold of the wrong type, e.g. "0.2" for a fraction
        raise ValueError(f"graceful_degradation={value!r}: {e}") from None
