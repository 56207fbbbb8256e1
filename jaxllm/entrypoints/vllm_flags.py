"""What jaxllm does with each flag of vLLM's ``vllm serve`` that jaxllm has no flag of the same name for, and
with each ``vllm.LLM`` keyword that is not an ``EngineConfig`` field: the one table.

The flags are vLLM 0.34.0's (its ``make_arg_parser``: ``FrontendArgs`` and ``EngineArgs``); the keywords are its
``EngineArgs`` fields, which ``vllm.LLM(**kwargs)`` takes. Each has a :class:`Rule`:

- ``alias``: another name for a jaxllm setting (``num_gpu_blocks_override`` is ``num_kv_blocks``), or a cap on one;
- ``server``: read by ``jaxllm serve`` itself (CORS, TLS, the chat role, ...); not an ``LLM`` keyword;
- ``advisory``: accepted and not acted on, because no value of it changes what a client gets from jaxllm (a CUDA
  kernel choice, a multi-node setting, a metrics option); each one given is logged once, with the reason;
- any rule may refuse some values (``refuses``): those whose loss would change what the client gets, or that ask
  jaxllm to import and run a class or plugin. The error names the flag, the value and why.

vLLM's flags that jaxllm has under the same name (``--max-num-seqs``, ``--enable-prefix-caching``, ...) are
``EngineConfig`` fields or the server's own flags and are not listed. As vLLM's parser does, :func:`normalize_argv`
reads ``--max_num_seqs`` as ``--max-num-seqs``, and ``--config FILE`` reads flags from a YAML file (the command
line wins).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from jaxllm.logger import init_logger

logger = init_logger(__name__)

ALIAS = "alias"
SERVER = "server"
ADVISORY = "advisory"

SWITCH, VALUE, VALUES, APPEND = "switch", "value", "values", "append"  # how the command line gives a flag


def _never(_: Any) -> bool:
    return False


def _truthy(value: Any) -> bool:
    return value not in (None, False, "", "false", "False", [], {}, "{}", "[]")


def _given(value: Any) -> bool:
    return value is not None and value not in ("", [], {}, "{}", "[]")


def _json_keys_set(*allowed: str) -> Callable[[Any], bool]:
    """A ``refuses`` predicate for a JSON object (text or dict): a key other than ``allowed`` with a truthy value."""
    def refuses(value: Any) -> bool:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return True
        if not isinstance(value, dict):
            return _given(value)
        return any(_truthy(v) for k, v in value.items() if k not in allowed)

    return refuses


def _outside(*allowed: Any) -> Callable[[Any], bool]:
    """A ``refuses`` predicate: a value given and not one of ``allowed`` (compared as text)."""
    names = {str(a) for a in allowed}

    def refuses(value: Any) -> bool:
        return value is not None and str(value).lower() not in names

    refuses.allowed = ", ".join(map(str, allowed))  # type: ignore[attr-defined]
    return refuses


@dataclasses.dataclass(frozen=True)
class Rule:
    """One flag's decision.

    kind: ``ALIAS``, ``SERVER`` or ``ADVISORY``. reason: why (logged for an advisory flag given; the error for a
    refused value). form: ``SWITCH`` (``--x`` / ``--no-x``), ``VALUE``, ``VALUES`` (one or more) or ``APPEND``
    (repeatable). engine: an ``EngineArgs`` keyword (``LLM`` takes it) rather than a server-only flag.
    target: for an alias, the ``EngineConfig`` field (or the server's ``model``) it sets. cap: the alias lowers
    its target to the smaller of the two instead of replacing it. key: the alias sets this key of its target's
    dict. convert: the alias's value from the command line's text. refuses: True for refused values.
    """

    kind: str
    reason: str
    form: str = VALUE
    engine: bool = True
    target: Optional[str] = None
    cap: bool = False
    key: Optional[str] = None
    convert: Callable[[Any], Any] = str
    refuses: Callable[[Any], bool] = _never
    const: Any = None  # a VALUE flag that may be given bare takes this value then (vLLM's nargs="?")


def _advisory(reason: str, names: str, form: str = VALUE, engine: bool = True,
              refuses: Callable[[Any], bool] = _never) -> dict[str, Rule]:
    return {name: Rule(ADVISORY, reason, form, engine, refuses=refuses) for name in names.split()}


def _server(reason: str, names: str, form: str = VALUE, engine: bool = False) -> dict[str, Rule]:
    return {name: Rule(SERVER, reason, form, engine) for name in names.split()}


def _count(value: Any) -> int:
    """An alias's count: an int (a whole float too, from a YAML file or a caller), or a size such as ``8k``."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else human_readable_int(str(value))


def human_readable_int(value: str) -> int:
    """vLLM's sizes on the command line: ``"8k"`` 8,000 and ``"25.6k"`` 25,600 (k, m, g, t: powers of 1,000),
    ``"8K"`` 8,192 (K, M, G, T: powers of 1,024, whole numbers only), or a plain int. Raises ValueError naming the
    value."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", value.strip())
    if match is None:
        return int(value)
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise ValueError(f"{value!r}: a binary suffix ({suffix}) takes a whole number; {number}{suffix.lower()} is "
                         "decimal")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


_PLUGIN = "imports and runs a class or plugin by name, which jaxllm does not do"
_NO_MM = "multimodal inputs only; jaxllm serves text models"
_CUDA = "a CUDA/ROCm kernel, graph or allocator setting of vLLM's; jaxllm's steps are XLA programs with its own kernels"
_PARALLEL = ("a vLLM parallelism or multi-node setting; jaxllm shards over --tensor-parallel-size and "
             "--data-parallel-size on one host, and outputs do not depend on the layout")
_METRICS = "a vLLM tracing, metrics or logging option; jaxllm's metrics are its own (docs/features/metrics.md)"
_LOAD = "how vLLM reads weight files; jaxllm reads safetensors and GGUF its own way, to the same weights"
_SCHEDULING = "a vLLM scheduling or cache tuning knob; it changes when rows run, not what they return"

RULES: dict[str, Rule] = {
    # Honoured under another name.
    "model": Rule(ALIAS, "the model to serve (the positional MODEL)", target="model"),
    "num_gpu_blocks_override": Rule(ALIAS, "--num-kv-blocks: KV blocks in all", target="num_kv_blocks",
                                    convert=_count),
    "max_num_active_seqs": Rule(ALIAS, "caps --max-num-seqs (jaxllm sizes its steps per bucket, so a lower "
                                       "admission limit is a lower max_num_seqs)", target="max_num_seqs", cap=True,
                                convert=_count),
    "max_num_scheduled_tokens": Rule(ALIAS, "caps --max-num-batched-tokens", target="max_num_batched_tokens",
                                     cap=True, convert=_count),
    "spec_method": Rule(ALIAS, "--speculative-config's method", target="speculative_config", key="method"),
    "spec_model": Rule(ALIAS, "--speculative-config's model", target="speculative_config", key="model"),
    "spec_tokens": Rule(ALIAS, "--speculative-config's num_speculative_tokens", target="speculative_config",
                        key="num_speculative_tokens", convert=_count),
    # Read by the server.
    **_server("CORS (Starlette's CORSMiddleware)", "allowed_origins allowed_methods allowed_headers"),
    **_server("CORS credentials", "allow_credentials", SWITCH),
    **_server("TLS (uvicorn's)", "ssl_keyfile ssl_certfile ssl_ca_certs ssl_cert_reqs ssl_ciphers"),
    **_server("a Unix domain socket to listen on instead of --host/--port (uvicorn's)", "uds"),
    **_server("the ASGI root path behind a proxy (FastAPI's root_path)", "root_path"),
    **_server("uvicorn's access log off", "disable_uvicorn_access_log", SWITCH),
    **_server("no /docs, /redoc or /openapi.json", "disable_fastapi_docs", SWITCH),
    **_server("uvicorn's limit on one HTTP event's bytes", "h11_max_incomplete_event_size"),
    **_server("the role of a chat completion's message", "response_role"),
    **_server("every request's default of return_tokens_as_token_ids", "return_tokens_as_token_ids", SWITCH),
    **_server("usage in every streamed response, as if stream_options.include_usage", "enable_force_include_usage",
              SWITCH),
    **_server("chat template variables under every request's chat_template_kwargs (a JSON object)",
              "default_chat_template_kwargs"),
    **_server("an X-Request-Id header on every response (the client's, else a new one)",
              "enable_request_id_headers", SWITCH),
    **_server("logs each request's id, prompt length and sampling parameters", "enable_log_requests", SWITCH),
    **_server("a chat with tool_choice 'none' is rendered without its tools", "exclude_tools_when_tool_choice_none",
              SWITCH),
    **_server("'auto': the model's generation_config.json gives default sampling parameters; 'vllm': none; a folder: "
              "that folder's generation_config.json", "generation_config", engine=True),
    **_server("sampling defaults (a JSON object) over the generation config's", "override_generation_config",
              engine=True),
    "hf_token": Rule(SERVER, "the access token for Hub downloads (HF_TOKEN; bare: the token the Hub's login "
                             "saved)", const=True),
    # Accepted with the values jaxllm's behaviour matches; other values refused.
    "runner": Rule(ADVISORY, "jaxllm runs generative models only", refuses=_outside("auto", "generate")),
    "convert": Rule(ADVISORY, "jaxllm runs generative models only (no embedding or classification adapters)",
                    refuses=_outside("auto", "none")),
    "tokenizer_mode": Rule(ADVISORY, "jaxllm tokenizes with the model's fast (Hugging Face tokenizers) tokenizer",
                           refuses=_outside("auto", "hf", "slow")),
    "config_format": Rule(ADVISORY, "jaxllm reads Hugging Face config.json and GGUF metadata",
                          refuses=_outside("auto", "hf")),
    "load_format": Rule(ADVISORY, "jaxllm reads safetensors and GGUF files", refuses=_outside(
        "auto", "safetensors", "gguf", "hf", "fastsafetensors", "instanttensor")),
    **_server("how message content reaches the chat template: 'string' (text parts joined by newlines), 'openai' "
              "(a list of text parts), or 'auto' (the one the template reads, as vLLM detects it)",
              "chat_template_content_format"),
    "skip_tokenizer_init": Rule(ADVISORY, "jaxllm always loads the model's tokenizer (prompts may still be token "
                                          "ids)", SWITCH, refuses=_truthy),
    "tokens_only": Rule(ADVISORY, "jaxllm serves the token endpoints and the text ones beside them", SWITCH),
    "headless": Rule(ADVISORY, "jaxllm's engine cores always run under its API server", SWITCH, engine=False,
                     refuses=_truthy),
    "grpc": Rule(ADVISORY, "jaxllm serves HTTP only", SWITCH, engine=False, refuses=_truthy),
    "grpc_port": Rule(ADVISORY, "jaxllm serves HTTP only", engine=False, refuses=_given),
    "hf_overrides": Rule(ADVISORY, "overriding the model's config is not implemented", refuses=_given),
    "hf_config_path": Rule(ADVISORY, "a config from elsewhere than the model is not implemented", refuses=_given),
    "quantization_config": Rule(ADVISORY, "jaxllm quantizes with --quantization int8 or fp8 only", refuses=_given),
    "kv_cache_dtype_skip_layers": Rule(ADVISORY, "every layer's KV cache has --kv-cache-dtype", VALUES,
                                       refuses=_given),
    "lora_target_modules": Rule(ADVISORY, "an adapter applies to every module it has weights for", VALUES,
                                refuses=_given),
    "pooler_config": Rule(ADVISORY, "jaxllm runs generative models only", refuses=_given),
    "reasoning_effort_map": Rule(ADVISORY, "reasoning_effort goes to the chat template as given", engine=False,
                                 refuses=_given),
    "reasoning_config": Rule(ADVISORY, "a reasoning token budget is not implemented", refuses=_given),
    "watermark_config": Rule(ADVISORY, "watermarking is not implemented", refuses=_given),
    "diffusion_config": Rule(ADVISORY, "diffusion language models are not implemented", refuses=_given),
    "kv_transfer_config": Rule(ADVISORY, "disaggregated prefill (KV transfer) is not implemented", refuses=_given),
    "ec_transfer_config": Rule(ADVISORY, "encoder-cache transfer is not implemented", refuses=_given),
    "tool_server": Rule(ADVISORY, "the Responses API's built-in tools are not implemented", engine=False,
                        refuses=_given),
    **{name: Rule(ADVISORY, _PLUGIN, VALUES if name == "logits_processors" else VALUE, refuses=_given)
       for name in ("logits_processors", "io_processor_plugin", "model_class_overrides", "scheduler_cls",
                    "reasoning_parser_plugin")},
    "worker_cls": Rule(ADVISORY, _PLUGIN, refuses=_outside("auto")),
    "worker_extension_cls": Rule(ADVISORY, _PLUGIN, refuses=_given),
    "tool_parser_plugin": Rule(ADVISORY, _PLUGIN, engine=False, refuses=_given),
    "middleware": Rule(ADVISORY, _PLUGIN, APPEND, engine=False, refuses=_given),
    # Accepted, whatever the value.
    **_advisory("jaxllm runs its own model code, never a repository's", "trust_remote_code", SWITCH),
    **_advisory("jaxllm runs its own model code, never a repository's", "code_revision model_impl"),
    **_advisory("jaxllm's steps are always compiled XLA programs; --token-buckets and --precompile choose them",
                "enforce_eager", SWITCH),
    **_advisory("jaxllm's steps are always compiled XLA programs; --token-buckets and --precompile choose them",
                "compilation_config optimization_level performance_mode max_cudagraph_capture_size"),
    **_advisory("jaxllm's steps are always compiled XLA programs; --token-buckets and --precompile choose them",
                "cudagraph_capture_sizes", VALUES),
    **_advisory(_CUDA, "attention_config kernel_config ir_op_priority moe_backend linear_backend "
                       "sparse_indexer_topk_backend gdn_prefill_backend kda_prefill_backend kda_decode_backend "
                       "mamba_backend mamba_ssu_algorithm mamba_cache_philox_rounds mamba_cache_dtype "
                       "mamba_ssm_cache_dtype mamba_block_size mamba_cache_mode replayssm_buffer_len "
                       "sleep_mode_backend offload_backend cpu_offload_gb offload_group_size offload_num_in_group "
                       "offload_prefetch_step mamba_config"),
    **_advisory(_CUDA, "enable_flashinfer_autotune monokernel disable_cascade_attn use_fp64_gumbel "
                       "enable_mamba_cache_stochastic_rounding enable_mamba_shared_prefix_checkpoint use_replayssm "
                       "sleep_mode_offload_cudagraph enable_cumem_allocator enable_nccl_comm_suspend "
                       "checkpoint_prepare_on_startup kv_sharing_fast_prefill swa_bounded_replay "
                       "enable_extensible_kv_cache allow_deprecated_quantization", SWITCH),
    **_advisory(_CUDA, "cpu_offload_params offload_params sleep_preserve_parameter_names", VALUES),
    **_advisory(_PARALLEL, "distributed_executor_backend pipeline_parallel_size master_addr master_port nnodes "
                           "node_rank distributed_timeout_seconds cpu_distributed_timeout_seconds device_ids "
                           "decode_context_parallel_size dcp_comm_backend dcp_kv_cache_interleave_size "
                           "cp_kv_cache_interleave_size prefill_context_parallel_size data_parallel_rank "
                           "data_parallel_start_rank data_parallel_size_local data_parallel_address "
                           "data_parallel_rpc_port data_parallel_backend all2all_backend ubatch_size "
                           "elastic_ep_max_dp_size dbo_decode_token_threshold dp_sync_interval "
                           "dbo_prefill_token_threshold eplb_config expert_placement_strategy "
                           "max_parallel_loading_workers fault_tolerance_config"),
    **_advisory(_PARALLEL, "numa_bind dcp_q_replicate data_parallel_hybrid_lb data_parallel_external_lb "
                           "data_parallel_multi_port_external_lb enable_hc_sp enable_expert_parallel "
                           "enable_batch_sharded_sampling enable_ep_weight_filter enable_dbo enable_shm_tensor_arena "
                           "enable_elastic_ep disable_nccl_for_dp_synchronization enable_eplb ray_workers_use_nsight "
                           "disable_custom_all_reduce enable_fault_tolerance", SWITCH),
    **_advisory(_PARALLEL, "numa_bind_nodes numa_bind_cpus", VALUES),
    **_advisory(_PARALLEL, "api_server_count data_parallel_supervisor_port dp_supervisor_probe_interval_s "
                           "dp_supervisor_probe_timeout_s dp_supervisor_probe_failure_threshold "
                           "headless_client_handshake_address", engine=False),
    **_advisory(_PARALLEL, "enable_scale_out", SWITCH, engine=False),
    **_advisory(_LOAD, "safetensors_load_strategy safetensors_prefetch_num_threads safetensors_prefetch_block_size "
                       "model_loader_extra_config pt_load_map_location model_weights"),
    **_advisory(_LOAD, "use_tqdm_on_load shuffle_safetensors_files", SWITCH),
    **_advisory(_LOAD, "ignore_patterns", VALUES),
    **_advisory(_NO_MM, "allowed_local_media_path limit_mm_per_prompt media_io_kwargs mm_processor_kwargs "
                        "mm_processor_cache_gb mm_processor_cache_type mm_hasher_algorithm "
                        "mm_shm_cache_max_object_size_mb mm_encoder_tp_mode mm_encoder_attn_backend "
                        "mm_encoder_attn_dtype mm_encoder_fp8_scale_path mm_encoder_fp8_scale_save_path "
                        "mm_encoder_fp8_scale_save_margin video_pruning_rate video_pruning_method mm_tensor_ipc "
                        "mm_processor_device mm_ipc_gpu_memory_gb default_mm_loras ec_manager_config"),
    **_advisory(_NO_MM, "language_model_only enable_mm_embeds mm_encoder_only interleave_mm_strings "
                        "skip_mm_profiling mm_device_do_normalize enable_tower_connector_lora "
                        "enable_mm_processor_stats disable_chunked_mm_input", SWITCH),
    **_advisory(_NO_MM, "allowed_media_domains", VALUES),
    **_advisory(_NO_MM, "trust_request_mm_kwargs", SWITCH, engine=False),
    **_advisory(_METRICS, "show_hidden_metrics_for_version otlp_traces_endpoint per_request_spec_decode_metrics "
                          "kv_cache_metrics_sample custom_histogram_buckets jit_monitor_mode logging_config "
                          "watchdog_config additional_config aux_output_config"),
    **_advisory(_METRICS, "kv_cache_metrics cudagraph_metrics enable_layerwise_nvtx_tracing enable_mfu_metrics "
                          "enable_logging_iteration_details jit_monitor_verbose enable_trace_replay", SWITCH),
    **_advisory("returning routed experts or sampling masks is not implemented",
                "enable_return_routed_experts return_sampling_mask", SWITCH, refuses=_truthy),
    **_advisory(_METRICS, "collect_detailed_traces", VALUES),
    **_advisory(_METRICS, "log_config_file"),
    **_advisory(_METRICS, "aggregate_engine_logging fail_on_environ_validation", SWITCH),
    **_advisory(_METRICS, "max_log_len", engine=False),
    **_advisory(_METRICS, "enable_server_load_tracking enable_log_outputs enable_log_deltas log_error_stack "
                          "enable_ssl_refresh", SWITCH, engine=False),
    **_advisory("a per-request metrics field in responses is not implemented", "enable_per_request_metrics", SWITCH,
                engine=False, refuses=_truthy),
    **_advisory("vLLM's API-server admission limits; jaxllm's is --max-waiting-requests (503 while that many "
                "wait for a batch seat)", "max_num_queued_reqs max_num_queued_tokens"),
    **_advisory(_SCHEDULING, "max_num_inflight_kv_loads watermark "
                             "prefill_schedule_interval cache_aware_admission_window cache_aware_admission_threshold "
                             "stream_interval prefix_caching_hash_algo prefix_cache_retention_interval "
                             "prefix_match_unit kv_offloading_backend renderer_num_workers"),
    **_advisory(_SCHEDULING, "long_prefill_token_threshold_adaptive scheduler_reserve_full_isl "
                             "disable_hybrid_kv_cache_manager", SWITCH),
    **_advisory("jaxllm's LoRA slots compute in the model's dtype", "lora_dtype max_lora_cls_labels"),
    **_advisory("jaxllm's LoRA slots compute in the model's dtype", "fully_sharded_loras specialize_active_lora "
                "enable_mixed_moe_lora_format enable_moe_shared_loras", SWITCH),
    "structured_outputs_config": Rule(ADVISORY, "jaxllm enforces structured outputs with llguidance; options "
                                                "other than the backend (disable_any_whitespace, ...) are not "
                                                "implemented server-wide", refuses=_json_keys_set("backend")),
    "tool_strict_level": Rule(ADVISORY, "tool calls are held to their schemas by a request's strict or "
                                        "tool_choice", engine=False, refuses=_outside("auto")),
    **_advisory("weights are updated through jaxllm's own calls (docs/features/rl.md)", "weight_transfer_config"),
    **_advisory("an experimental vLLM feature jaxllm does not have; it changes no output", "engram_config"),
    **_advisory("jaxllm serves no Cohere or Anthropic routes", "cohere_format anthropic_disabled_thinking_effort",
                engine=False),
    **_advisory("jaxllm serves no Cohere or Anthropic routes", "cohere_is_reasoning_model", SWITCH, engine=False),
    **_advisory("jaxllm's /v1 responses carry no system fingerprint", "fingerprint_mode fingerprint_value",
                engine=False),
    **_advisory("jaxllm's server sends no SSE keep-alive comments", "sse_keep_alive_interval", engine=False),
    **_advisory("uvicorn's default header limit applies", "h11_max_header_count", engine=False),
    **_advisory("every endpoint is logged alike (see --disable-uvicorn-access-log)",
                "disable_access_log_for_endpoints", engine=False),
    **_advisory("jaxllm's /docs pages load their assets from a CDN", "enable_offline_docs enable_flash_late_interaction",
                SWITCH, engine=False),
    **_advisory("jaxllm always reports usage.prompt_tokens_details.cached_tokens", "enable_prompt_tokens_details",
                SWITCH, engine=False),
    **_advisory("a request's own chat template is refused either way (give --chat-template)",
                "trust_request_chat_template", SWITCH, engine=False),
    **_advisory("a request's prompt_embeds is refused, naming the field (prompt embeddings are not implemented)",
                "enable_prompt_embeds", SWITCH),
}

# vLLM's EngineArgs fields with no flag: LLM keywords only.
KEYWORD_ONLY = ("mamba_config", "model_weights", "enable_mm_processor_stats")
# How LLMEngine and AsyncLLM treat the EngineArgs keywords that are jaxllm serve's flags (they run no server, and
# take each request's SamplingParams as given); served_model_name is a parameter of LLMEngine, the generation
# config ones of LLM.
_GENERATION = "LLM and jaxllm serve read it for their default SamplingParams; LLMEngine runs each request's as given"
LLM_RULES = {"generation_config": Rule(ADVISORY, _GENERATION),
             "override_generation_config": Rule(ADVISORY, _GENERATION),
             "reasoning_parser": Rule(ADVISORY, "LLM returns the text whole; jaxllm serve splits out reasoning"),
             "log_level": Rule(ADVISORY, "jaxllm's log level is JAXLLM_LOGGING_LEVEL's"),
             "shutdown_timeout": Rule(ADVISORY, "LLM runs no server to drain")}


def flag(name: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + name.replace("_", "-")


class Switch(argparse.BooleanOptionalAction):
    """vLLM's on/off flags: ``--x`` / ``--no-x``, and ``--enable-x`` / ``--disable-x`` as each other's negation."""

    _INVERSE = {"--enable-": "--disable-", "--disable-": "--enable-"}

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        inverse = [other + opt[len(prefix):] for opt in option_strings
                   for prefix, other in self._INVERSE.items() if opt.startswith(prefix)]
        self.negatives = {opt for opt in self.option_strings if opt not in option_strings} | set(inverse)
        self.option_strings = [*self.option_strings, *inverse]

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, option_string not in self.negatives)


def _dest(name: str) -> str:
    """Where the parsed value lands: ``--model`` beside the positional MODEL lands in ``model_option``."""
    return "model_option" if name == "model" else name


def _help(rule: Rule) -> str:
    """A table flag's ``--help`` line: what it does here, and which values are refused."""
    allowed = getattr(rule.refuses, "allowed", None)
    if rule.kind in (ALIAS, SERVER):
        text = f"honoured: {rule.reason}"
    elif allowed is not None:
        text = f"accepted as {allowed} (no effect); other values refused: {rule.reason}"
    elif rule.refuses is _truthy:
        text = f"refused when on: {rule.reason}"
    elif rule.refuses is not _never:
        text = f"refused when given: {rule.reason}"
    else:
        text = f"accepted, no effect: {rule.reason}"
    return f"vLLM's; {text}".replace("%", "%%")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add every flag of :data:`RULES` that ``parser`` lacks, each defaulting to None (not given), and vLLM's other
    spellings (:data:`OTHER_SPELLINGS`). :func:`apply_vllm_flags` then checks and applies them."""
    group = parser.add_argument_group("vLLM's flags (jaxllm/entrypoints/vllm_flags.py: what each does here)")
    taken = set(parser._option_string_actions)
    for name, rule in RULES.items():
        option = flag(name)
        if option in taken or name in KEYWORD_ONLY:
            continue
        if rule.form == SWITCH:
            group.add_argument(option, dest=_dest(name), action=Switch, default=None, help=_help(rule))
        elif rule.form == APPEND:
            group.add_argument(option, dest=_dest(name), action="append", default=None, help=_help(rule))
        else:
            nargs = "+" if rule.form == VALUES else ("?" if rule.const is not None else None)
            group.add_argument(option, dest=_dest(name), nargs=nargs, const=rule.const, default=None,
                               help=_help(rule))
    _add_spellings(parser)


# vLLM's other spellings of flags (its short forms, and --device-memory-utilization), by destination.
OTHER_SPELLINGS = {
    "api_server_count": "-asc", "quantization": "-q", "pipeline_parallel_size": "-pp", "nnodes": "-n",
    "node_rank": "-r", "tensor_parallel_size": "-tp", "decode_context_parallel_size": "-dcp",
    "prefill_context_parallel_size": "-pcp", "data_parallel_size": "-dp", "data_parallel_rank": "-dpn",
    "data_parallel_start_rank": "-dpr", "data_parallel_size_local": "-dpl", "data_parallel_address": "-dpa",
    "data_parallel_rpc_port": "-dpp", "data_parallel_backend": "-dpb", "data_parallel_hybrid_lb": "-dph",
    "data_parallel_external_lb": "-dpe", "data_parallel_multi_port_external_lb": "-dpm",
    "enable_expert_parallel": "-ep", "gpu_memory_utilization": "--device-memory-utilization",
    "speculative_config": "-sc", "diffusion_config": "-dc", "compilation_config": "-cc", "attention_config": "-ac",
}


def _add_spellings(parser: argparse.ArgumentParser) -> None:
    """Register :data:`OTHER_SPELLINGS` on the actions of their destinations (argparse has no public call to add
    an option string to an action, so this does what ``add_argument`` does for one)."""
    by_dest = {action.dest: action for action in parser._actions}
    for dest, spelling in OTHER_SPELLINGS.items():
        action = by_dest.get(dest)
        if action is not None and spelling not in parser._option_string_actions:
            action.option_strings.append(spelling)
            parser._option_string_actions[spelling] = action


def _refusal(name: str, value: Any, rule: Rule, spelled: Callable[[str], str]) -> Optional[str]:
    """The error for a refused value (None: accepted): the flag (and a value that is not a switch's), why, and the
    values accepted where only some are."""
    if not rule.refuses(value):
        return None
    shown = " ".join(map(str, value)) if isinstance(value, list) else repr(value)
    given = spelled(name) if rule.form == SWITCH and spelled(name).startswith("--") else f"{spelled(name)} {shown}"
    allowed = getattr(rule.refuses, "allowed", None)
    return f"{given} is not supported: {rule.reason}" + (f" (accepted: {allowed})" if allowed else "")


def _apply(settings: dict[str, Any], name: str, value: Any, rule: Rule, spelled: Callable[[str], str]) -> None:
    """Set an alias's target in ``settings`` (``EngineConfig`` keywords, or parsed flags). Raises ValueError: a
    value that does not convert, or one that contradicts the target's own value."""
    try:
        value = rule.convert(value)
    except (TypeError, ValueError):
        what = "a string" if rule.convert is str else "an int (or a size such as 8k)"
        raise ValueError(f"{spelled(name)} {value!r} must be {what}") from None
    target, current = rule.target, settings.get(rule.target)
    if rule.cap:
        if value < 1:
            raise ValueError(f"{spelled(name)} {value!r} must be >= 1")
        if current is None:  # an LLM keyword beside no target: the target's default
            from jaxllm.config import EngineConfig

            current = {f.name: f.default for f in dataclasses.fields(EngineConfig)}[target]
        settings[target] = min(current, value)
    elif rule.key is not None:
        try:
            config = json.loads(current) if isinstance(current, str) else dict(current or {})
        except ValueError:
            raise ValueError(f"{spelled(target)} {current!r} is not a JSON object") from None
        if config.get(rule.key, value) != value:
            raise ValueError(f"{spelled(name)} {value!r} contradicts {spelled(target)}'s {rule.key} "
                             f"{config[rule.key]!r}")
        settings[target] = {**config, rule.key: value}
    elif current is not None and current != value:
        where = "the positional MODEL" if target == "model" else spelled(target)
        raise ValueError(f"{spelled(name)} {value!r} contradicts {where} {current!r}")
    else:
        settings[target] = value


def apply_vllm_flags(args: argparse.Namespace) -> list[str]:
    """Check the vLLM flags :func:`add_vllm_flags` added and apply the aliases to ``args`` (``--model`` to
    ``args.model``). Returns the advisory flags given, each with why it has no effect (the caller logs them).
    Raises ValueError: a refused value or a contradiction, naming the flag."""
    settings = vars(args)
    advisory = []
    for name, rule in RULES.items():
        value = settings.get(_dest(name))
        if value is None:
            continue
        problem = _refusal(name, value, rule, flag)
        if problem is not None:
            raise ValueError(problem)
        if rule.kind == ALIAS:
            _apply(settings, name, value, rule, flag)
        elif rule.kind == ADVISORY:
            advisory.append(f"{flag(name)} ({rule.reason})")
    if settings.get("model") is None:  # a config file's model, unless the command line names one
        settings["model"] = settings.get("config_model")
    return advisory


def vllm_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``LLM`` / ``LLMEngine`` / ``AsyncLLM`` keywords as ``EngineConfig``'s: its fields as given, vLLM's
    ``EngineArgs`` keywords by :data:`RULES` (aliases applied; advisory ones dropped and logged; ``hf_token`` set
    as ``HF_TOKEN`` for Hub downloads).

    Raises:
      ValueError: a refused value or a contradiction, naming the keyword.
      TypeError: a keyword of ``vllm serve`` only (``response_role``), naming its flag; or an unknown keyword.
    """
    from jaxllm.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    out = {k: v for k, v in kwargs.items() if k in fields}
    advisory = []
    for name, value in kwargs.items():
        rule = LLM_RULES.get(name, RULES.get(name))
        if name in fields:
            continue
        if rule is None:
            raise TypeError(f"{name}= is neither an EngineConfig field nor a keyword of vLLM 0.34's LLM")
        if not rule.engine:
            raise TypeError(f"{name}= is vLLM's {flag(name)}, a flag of the server (jaxllm serve), not a keyword of "
                            "LLM or LLMEngine")
        if value is None:  # not given, as a flag left out (vLLM's EngineArgs defaults most of these to None)
            continue
        problem = _refusal(name, value, rule, lambda n: f"{n}=")
        if problem is not None:
            raise ValueError(problem)
        if rule.kind == ALIAS:
            _apply(out, name, value, rule, lambda n: f"{n}=")
        elif name == "hf_token":
            set_hf_token(value)
        elif rule.kind == ADVISORY:
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            advisory.append(f"{name}={shown} ({rule.reason})")
    if advisory:
        logger.info("vLLM keywords accepted without effect: " + "; ".join(advisory))
    return out


def set_hf_token(value: Any) -> None:
    """vLLM's ``hf_token``: a string is the token for Hub downloads (``HF_TOKEN``); True or None, the token the
    Hub's login saved (nothing set)."""
    if isinstance(value, str) and value:
        os.environ["HF_TOKEN"] = value


def _yaml_value(action: Optional[argparse.Action], option: str, value: Any) -> list[str]:
    """One YAML key's flags (``option`` set to ``value``) for ``action``, the parser's action of that option."""
    if isinstance(value, bool) and isinstance(action, Switch):
        on = value == (option not in action.negatives)  # the destination's value
        return [action.option_strings[0] if on else next(o for o in action.option_strings if o.startswith("--no-"))]
    if isinstance(value, bool) and action is not None and action.nargs == 0:
        return [option] if value else []
    if isinstance(value, list) and not value:
        return []
    if isinstance(value, list) and action is not None and action.nargs in ("+", "*"):
        return [option, *map(str, value)]
    if isinstance(value, (list, dict)):
        return [option, json.dumps(value)]
    return [option, str(value)]


def _yaml_flags(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """A vLLM ``--config`` YAML file's keys as command-line flags: ``max_num_seqs: 64`` -> ``--max-num-seqs 64``,
    ``enforce_eager: true`` -> ``--enforce-eager`` (false: its negation), a list -> its items (or its JSON for a
    one-value flag; an empty one: nothing), a mapping -> its JSON; ``model`` -> ``--config-model``, which a MODEL
    on the command line overrides. Raises ValueError: an unreadable file, or one that is not a YAML mapping."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: a YAML mapping of flag names to values is needed, not "
                         f"{type(data).__name__}")
    argv: list[str] = []
    for key, value in data.items():
        option = "--config-model" if key == "model" else flag(str(key).replace("-", "_"))
        argv += _yaml_value(parser._option_string_actions.get(option), option, value)
    return argv


def _dotted_value(text: str, plus: bool) -> Any:
    """The value of a dotted flag (``--compilation-config.mode 3``): a comma list (``plus``), JSON, a size
    (:func:`human_readable_int`), else the text, as vLLM reads it."""
    if plus:
        return text.split(",")
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return human_readable_int(text)
    except ValueError:
        return text


def _merge(into: dict, update: dict, flag_name: str) -> None:
    """Merge one dotted flag's ``update`` into ``into`` as vLLM does: nested objects merged, lists joined, a later
    value over an earlier one. Raises ValueError: a key set both to a value and to an object (named)."""
    for key, value in update.items():
        old = into.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            _merge(old, value, f"{flag_name}.{key}")
        elif isinstance(value, list) and isinstance(old, list):
            old += value
        elif isinstance(value, dict) != isinstance(old, dict) and old is not None:
            raise ValueError(f"{flag_name}.{key} is given both a value and keys of its own")
        else:
            into[key] = value


def _spelled_as_vllm(items: list[str]) -> list[str]:
    """vLLM's parser's respellings: ``--max_num_seqs`` -> ``--max-num-seqs`` (the name before any ``.`` or ``=``),
    ``-O3`` / ``-O 3`` -> ``--optimization-level 3``, and dotted keys (``--speculative-config.method ngram``,
    ``-cc.mode=3``, ``--x.list+ a,b``) gathered into one JSON object per flag, after the rest.
    Raises ValueError: a dotted flag without a value, or keys that contradict each other."""
    out: list[str] = []
    dotted: dict[str, dict] = {}
    i = 0
    while i < len(items):
        arg = items[i]
        i += 1
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            head, dot, tail = name.partition(".")
            arg = head.replace("_", "-") + dot + tail + eq + value
        if arg.startswith("-O") and len(arg) > 2 and not arg.startswith("--"):
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
            continue
        if arg == "-O" and i < len(items) and items[i] in ("0", "1", "2", "3"):
            arg = "--optimization-level"
        name = arg.partition("=")[0]
        if arg.startswith("-") and "." in name:
            if "=" not in arg and i >= len(items):
                raise ValueError(f"{name} needs a value")
            text = arg.partition("=")[2] if "=" in arg else items[i]
            i += 0 if "=" in arg else 1
            head, *keys = name.rstrip("+").split(".")
            update: Any = _dotted_value(text, name.endswith("+"))
            for key in reversed(keys):
                update = {key: update}
            _merge(dotted.setdefault(head, {}), update, head)
            continue
        out.append(arg)
    for head, value in dotted.items():
        out += [head, json.dumps(value)]
    return out


def normalize_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` as vLLM's parser reads it: ``--config FILE``'s flags (:func:`_yaml_flags`) put before the command
    line's, which win, then :func:`_spelled_as_vllm`'s respellings over both.
    Raises ValueError: an unreadable or malformed config file, a malformed dotted flag."""
    items = list(argv)
    config: list[str] = []
    out: list[str] = []
    i = 0
    while i < len(items):
        arg = items[i]
        if arg == "--config" and i + 1 < len(items):
            config += _yaml_flags(parser, items[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            config += _yaml_flags(parser, arg.partition("=")[2])
        else:
            out.append(arg)
        i += 1
    # A leading MODEL stays first: after the file's flags a flag of several values would take it.
    lead = 1 if out and not out[0].startswith("-") else 0
    return _spelled_as_vllm(out[:lead] + config + out[lead:])
