"""Shared pieces of bench_throughput.py and bench_serving.py: flags, workloads, models, tables, JSON.

All times are seconds and all lengths tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

# Import this checkout's packages, not whatever an editable install points at.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _devices_asked(argv: Sequence[str]) -> int:
    """TP x DP from the command line, read before JAX starts (it fixes the simulated CPU device count)."""
    sizes = {"--tensor-parallel-size": 1, "--data-parallel-size": 1}
    for i, arg in enumerate(argv[:-1]):
        if arg in sizes and argv[i + 1].isdigit():
            sizes[arg] = int(argv[i + 1])
    return sizes["--tensor-parallel-size"] * sizes["--data-parallel-size"]


if _devices_asked(sys.argv) > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_devices_asked(sys.argv)}").strip()

if TYPE_CHECKING:
    from jaxllm.models.config import ModelConfig


@dataclasses.dataclass
class Workload:
    """Random-token requests: prompts (token ids) and the output length each one asks for."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def add_common_args(parser: argparse.ArgumentParser, *, num_requests: int, input_len: Sequence[int],
                    output_len: Sequence[int], max_num_seqs: int, max_model_len: Optional[int] = None) -> None:
    """Model, workload and engine flags both benchmarks take (defaults sized for 2 CPU cores)."""
    parser.add_argument("--model", default=None,
                        help="HF folder, .gguf or a named model such as gemma3-270m (default: the embedded "
                             "SmolLM2-135M-Instruct); with "
                             "--random-weights a folder (or config.json) holding only config.json")
    parser.add_argument("--random-weights", action="store_true",
                        help="random weights of --model's config.json shape (GPU machines cannot download)")
    parser.add_argument("--num-requests", type=int, default=num_requests)
    parser.add_argument("--input-len", type=int, nargs=2, default=list(input_len), metavar=("MIN", "MAX"),
                        help="prompt lengths are drawn uniformly from [MIN, MAX] tokens")
    parser.add_argument("--output-len", type=int, nargs=2, default=list(output_len), metavar=("MIN", "MAX"),
                        help="output lengths are drawn uniformly from [MIN, MAX] tokens (ignore_eos)")
    parser.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                        help="every prompt starts with the same N random tokens (a shared system prompt, read from "
                             "the prefix cache after the first request), then its own --input-len tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=max_num_seqs,
                        help="batch size; also the hf backend's padded batch size")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=max_model_len,
                        help=f"default: {max_model_len}" if max_model_len else
                        "default: the longest prompt plus the longest output")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from memory")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default=None, choices=["int8", "fp8"],
                        help="jaxllm's weight-only quantization of the dense projections (default: none)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8_e4m3"],
                        help="jaxllm's KV cache dtype (default auto: the compute dtype)")
    for name, what in (("token", "tokens per step (T)"), ("seq", "sequence rows per step (S)"),
                       ("width", "block-table width (W)")):
        parser.add_argument(f"--{name}-buckets", type=int, nargs="+", default=None, metavar="N",
                            help=f"jaxllm's bucket ladder for {what}; default derived from the limits")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve the engine's Prometheus metrics on this port while it runs")
    parser.add_argument("--output-json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule step N+1 while step N runs (jaxllm backends; default: the engine's, on "
                             "unless speculating)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="devices per model step; on CPU, simulated host devices (numbers not meaningful)")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas")


def validate_ranges(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject empty or non-positive length ranges with the flag named."""
    for flag in ("input_len", "output_len"):
        low, high = getattr(args, flag)
        if not 1 <= low <= high:
            parser.error(f"--{flag.replace('_', '-')} {low} {high}: need 1 <= MIN <= MAX")
    if args.num_requests < 1:
        parser.error(f"--num-requests {args.num_requests}: need at least 1")
    if args.shared_prefix_len < 0:
        parser.error(f"--shared-prefix-len {args.shared_prefix_len}: need at least 0")


def resolve_model(args: argparse.Namespace, workdir: Path) -> Path:
    """The model path: ``--model`` (a path or a named model), the default model, or random weights in ``workdir``."""
    if args.random_weights:
        if args.model is None:
            raise SystemExit("--random-weights needs --model: a folder (or config.json) with the shape to build")
        config = Path(args.model)
        config = config / "config.json" if config.is_dir() else config
        return write_random_weights(config, workdir / "random_model", seed=args.seed)
    from jaxllm.named_models import resolve_model

    return resolve_model(args.model)


def write_random_weights(config_file: Path, folder: Path, seed: int = 0) -> Path:
    """Write ``config.json`` and HF-named random float16 safetensors (N(0, 0.02), norms 1, biases 0) into ``folder``."""
    from safetensors.numpy import save_file

    from jaxllm.models.config import ModelConfig

    hf_config = json.loads(config_file.read_text())
    cfg = ModelConfig.from_hf_config(hf_config)
    rng = np.random.default_rng(seed)
    e, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_q_heads * d, cfg.num_kv_heads * d

    def normal(*shape: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)

    tensors = {"model.embed_tokens.weight": normal(cfg.vocab_size, e), "model.norm.weight": np.ones(e, np.float16)}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(cfg.vocab_size, e)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": np.ones(e, np.float16),
            "post_attention_layernorm.weight": np.ones(e, np.float16),
            "self_attn.q_proj.weight": normal(q, e), "self_attn.k_proj.weight": normal(kv, e),
            "self_attn.v_proj.weight": normal(kv, e), "self_attn.o_proj.weight": normal(e, q),
            "mlp.gate_proj.weight": normal(inter, e), "mlp.up_proj.weight": normal(inter, e),
            "mlp.down_proj.weight": normal(e, inter),
        }
        if cfg.qkv_bias:
            layer.update({"self_attn.q_proj.bias": np.zeros(q, np.float16),
                          "self_attn.k_proj.bias": np.zeros(kv, np.float16),
                          "self_attn.v_proj.bias": np.zeros(kv, np.float16)})
        if cfg.o_bias:
            layer["self_attn.o_proj.bias"] = np.zeros(e, np.float16)
        if cfg.mlp_bias:
            layer.update({"mlp.gate_proj.bias": np.zeros(inter, np.float16),
                          "mlp.up_proj.bias": np.zeros(inter, np.float16),
                          "mlp.down_proj.bias": np.zeros(e, np.float16)})
        if cfg.qk_norm:
            layer.update({"self_attn.q_norm.weight": np.ones(d, np.float16),
                          "self_attn.k_norm.weight": np.ones(d, np.float16)})
        tensors.update({p + k: v for k, v in layer.items()})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": "float16"}))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def dequantized_hf_folder(gguf_path: Path) -> Path:
    """An HF folder of ``gguf_path``'s weights dequantized to float32, for engines that read no GGUF (vLLM).

    Built once with transformers into ``cache_dir()/<gguf stem>-hf`` (atomically, by rename) and reused.

    Raises:
      SystemExit: torch or transformers is not installed.
    """
    from jaxllm.paths import cache_dir

    target = cache_dir() / f"{gguf_path.stem}-hf"
    if target.is_dir():
        return target
    try:
        import torch
        import transformers
    except ImportError as err:
        raise SystemExit(f"dequantizing {gguf_path.name} into an HF folder needs torch and transformers: {err}")
    print(f"building {target} from {gguf_path.name} with transformers (float32, once)", file=sys.stderr)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                              dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # transformers marks a GGUF-loaded model quantized and refuses to save it,
    # although its weights are plain float32 tensors by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def vocab_size(model: Path) -> int:
    """The model's vocabulary size, in token ids (read without loading the weights)."""
    if model.suffix == ".gguf":
        from gguf import GGUFReader

        return len(GGUFReader(str(model)).fields["tokenizer.ggml.tokens"].data)
    from jaxllm.loader.safetensors import read_hf_config

    return int(read_hf_config(model)["vocab_size"])


def make_workload(args: argparse.Namespace, vocab: int, *, token_seed: int) -> Workload:
    """``--num-requests`` prompts and output lengths, uniform in the flags' ranges.

    Lengths come from ``--seed`` alone, token ids from ``token_seed`` (a warm-up shares lengths, not tokens);
    ``--shared-prefix-len N`` starts every prompt with the same N tokens.
    """
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    input_lens = rng.integers(args.input_len[0], args.input_len[1] + 1, size=n)
    output_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, size=n)
    tokens = np.random.default_rng([args.seed, token_seed])
    # Ids from the first 10000 (nano-vllm's choice) keep clear of special tokens at the top of large vocabularies.
    high = min(vocab, 10000)
    prefix = tokens.integers(0, high, size=args.shared_prefix_len).tolist()
    prompts = [prefix + tokens.integers(0, high, size=int(m)).tolist() for m in input_lens]
    return Workload(prompts, [int(o) for o in output_lens])


def engine_kwargs(args: argparse.Namespace, batching: str, graceful_degradation: bool = True,
                  quantized: bool = True) -> dict[str, Any]:
    """``LLM``/``LLMEngine`` keyword arguments from the flags (``--quantization`` and
    ``--kv-cache-dtype`` unless ``quantized`` is False)."""
    max_model_len = args.max_model_len or (args.shared_prefix_len + args.input_len[1] + args.output_len[1])
    return dict(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
        dtype=args.dtype, seed=args.seed, batching=batching, metrics_port=args.metrics_port,
        async_scheduling=args.async_scheduling, tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size, token_buckets=args.token_buckets,
        seq_buckets=args.seq_buckets, width_buckets=args.width_buckets, graceful_degradation=graceful_degradation,
        **(dict(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype) if quantized else {}),
    )


def simulate_cpu_devices(args: argparse.Namespace) -> Optional[str]:
    """A warning line when TP x DP devices are simulated on the CPU, else None."""
    import jax

    needed = args.tensor_parallel_size * args.data_parallel_size
    if needed == 1 or jax.default_backend() != "cpu":
        return None
    return (f"note: {needed} devices are simulated on the CPU's cores; the numbers show that sharded steps run, "
            "not how fast they are")


def percentiles(values: Sequence[float], prefix: str) -> dict[str, Optional[float]]:
    """``{prefix_mean, prefix_p50, prefix_p90, prefix_p99}`` of ``values`` (None when empty)."""
    if len(values) == 0:
        return {f"{prefix}_{k}": None for k in ("mean", "p50", "p90", "p99")}
    arr = np.asarray(values, np.float64)
    return {
        f"{prefix}_mean": float(arr.mean()),
        f"{prefix}_p50": float(np.percentile(arr, 50)),
        f"{prefix}_p90": float(np.percentile(arr, 90)),
        f"{prefix}_p99": float(np.percentile(arr, 99)),
    }


def format_cell(value: Any) -> str:
    """A table cell: "-" for None, floats with 3 decimals (1 from 100 up), anything else as ``str``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned columns, cells by :func:`format_cell`."""
    cells = [[format_cell(v) for v in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def host_info() -> dict[str, Any]:
    """CPU count, instruction sets and 1-minute load average."""
    from kernels_pallas.cpu_features import describe_cpu

    return dict(cpu_count=os.cpu_count(), cpu_isa=describe_cpu(), load_avg_1m=os.getloadavg()[0])


def host_line(host: dict[str, Any]) -> str:
    """The ``host:`` line every benchmark prints."""
    return (f"host: {host['cpu_count']} CPUs ({host['cpu_isa']}), 1-minute load average {host['load_avg_1m']:.1f} "
            "at the end")


def matmul_flops_per_token(cfg: ModelConfig) -> int:
    """FLOPs of the dense projections one token runs through (2 per multiply-add, lm_head included, attention not)."""
    e, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    attention = e * cfg.num_q_heads * d * 2 + e * cfg.num_kv_heads * d * 2
    mlp = 3 * e * (cfg.moe_intermediate_size * cfg.num_experts_per_tok if cfg.num_experts else f)
    return 2 * (cfg.num_layers * (attention + mlp) + e * cfg.vocab_size)


def dot_bench_shape() -> tuple[int, int, int]:
    """``(rows, inner, cols)`` of the matmul ``measure_matmul_rates`` times: 256 x 1024 x 4096 on CPU, 8192 cubed on
    an accelerator (where a smaller call times the launch, not the dot).
    """
    import jax

    return (256, 1024, 4096) if jax.default_backend() == "cpu" else (8192, 8192, 8192)


def _rate(fn, args, flops: float, seconds: float) -> float:
    """GFLOP/s of ``fn(*args)`` (``flops`` per call), repeated for about ``seconds`` after one untimed call."""
    import time

    def call():
        out = fn(*args)
        if hasattr(out, "block_until_ready"):
            out.block_until_ready()

    call()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        call()
        count += 1
    return flops * count / (time.perf_counter() - start) / 1e9


def measure_matmul_rates(dtype: str, seconds: float = 2.0) -> dict[str, float]:
    """The machine's matmul rates now in GFLOP/s, each timed for about ``seconds`` on ``dot_bench_shape`` in
    ``dtype`` with float32 accumulation: ``"xla"`` (XLA's dot), and on CPU ``"jaxllm_kernel"`` (the C++
    projection kernel) and ``"numpy"`` (float32 only). An unknown dtype raises JAX's TypeError.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows, inner, cols = dot_bench_shape()
    flops = 2.0 * rows * inner * cols
    x = jnp.ones((rows, inner), dtype)
    w = jnp.ones((inner, cols), dtype)
    rates = {"xla": _rate(jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)), (x, w), flops,
                          seconds)}
    if jax.default_backend() != "cpu":
        return rates  # the host's own rates say nothing of an accelerator's steps
    from kernels_pallas import ops
    from kernels_pallas.matmul import cpu as matmul_cpu

    stacked = w[None]
    if ops.native_kernels() and matmul_cpu.matmul_supports(stacked):
        kernel = jax.jit(lambda a, b: matmul_cpu.stacked_matmul_cpu(a, b, jnp.int32(0)))
        rates["jaxllm_kernel"] = _rate(kernel, (x, stacked), flops, seconds)
    if jnp.dtype(dtype) == jnp.float32:
        a, b = np.ones((rows, inner), np.float32), np.ones((inner, cols), np.float32)
        rates["numpy"] = _rate(np.matmul, (a, b), flops, seconds)
    return rates


def rates_line(rates: dict[str, float]) -> str:
    """``measure_matmul_rates``' rates as one line, e.g. "xla 201.3, jaxllm_kernel 214.0, numpy 180.2 GFLOP/s"."""
    return ", ".join(f"{name} {gflops:.1f}" for name, gflops in rates.items()) + " GFLOP/s"


# HBM bandwidth by device name (a substring of ``jax.Device.device_kind`` or ``torch.cuda.get_device_name()``), GB/s,
# from NVIDIA's data sheets (H100 SXM 3.35 TB/s, H200 4.8 TB/s); the first match wins, so the longer names come first.
HBM_BANDWIDTH_GBPS: dict[str, float] = {"H200": 4800.0, "H100 PCIe": 2000.0, "H100 NVL": 3900.0, "H100": 3350.0}
# Fractions of the bandwidth limit that engines of vLLM's class reach on this kind of workload (issue 54: published
# Qwen3-0.6B runs at 256 sequences, vLLM and nano-vllm on A100/A800/A10G): the bar for the GPU check's rows.
VLLM_CLASS_BANDWIDTH_FRACTION = (0.50, 0.68)


def step_bytes(weight_bytes: int, kv_tokens: int, kv_bytes_per_token: float) -> float:
    """The fewest bytes a step moves through device memory: the parameters once and every row's KV read
    (``kv_tokens`` = the sum of its rows' ``seq_lens``)."""
    return weight_bytes + kv_tokens * kv_bytes_per_token


def floor_seconds(num_bytes: float, bandwidth_gbps: Optional[float]) -> Optional[float]:
    """``num_bytes`` over ``bandwidth_gbps`` (GB/s, 1e9 bytes), in seconds; None without a bandwidth."""
    if not bandwidth_gbps:
        return None
    return num_bytes / (bandwidth_gbps * 1e9)


def device_bandwidth(device_kind: str) -> Optional[float]:
    """HBM GB/s of a device name from :data:`HBM_BANDWIDTH_GBPS`, None when it has no entry."""
    for name, gbps in HBM_BANDWIDTH_GBPS.items():
        if name.lower() in device_kind.lower():
            return gbps
    return None


def workload_kv_tokens(workload: Workload) -> int:
    """KV tokens the attention of a whole run reads at the fewest, each prompt prefilled in one step and each later
    output token decoded one a step: ``sum(p + sum(p + k for k in 1..o-1))`` over requests (prompt ``p``, output
    ``o`` tokens), the sum over steps of ``seq_lens`` that :func:`step_bytes` takes."""
    return sum(len(p) * o + o * (o - 1) // 2 for p, o in zip(workload.prompts, workload.output_lens))


def run_bandwidth(workload: Workload, steps: int, elapsed_s: float, weight_bytes: int, kv_bytes_per_token: float,
                  bandwidth_gbps: Optional[float]) -> dict[str, Any]:
    """A whole run against the bandwidth limit: ``steps`` engine steps (each reads the ``weight_bytes`` parameters
    once) plus :func:`workload_kv_tokens` of ``kv_bytes_per_token`` (K and V, every layer), over the bandwidth.

    Returns ``steps``, ``ms_per_step`` (wall), ``weight_bytes``, ``kv_bytes_per_token``, ``floor_bytes``,
    ``bandwidth_gbps``, ``floor_s`` and ``bandwidth_fraction`` (floor / wall), the last two None without a bandwidth.
    """
    num_bytes = step_bytes(steps * weight_bytes, workload_kv_tokens(workload), kv_bytes_per_token)
    floor = floor_seconds(num_bytes, bandwidth_gbps)
    return dict(steps=steps, ms_per_step=1e3 * elapsed_s / steps if steps else None, weight_bytes=weight_bytes,
                kv_bytes_per_token=kv_bytes_per_token, floor_bytes=num_bytes, bandwidth_gbps=bandwidth_gbps,
                floor_s=floor, bandwidth_fraction=None if floor is None else floor / elapsed_s)


def bandwidth_bar() -> str:
    """The line that states :data:`VLLM_CLASS_BANDWIDTH_FRACTION` as the bar."""
    low, high = VLLM_CLASS_BANDWIDTH_FRACTION
    return (f"bar: engines of vLLM's class reach {low:.0%}-{high:.0%} of the bandwidth limit on this kind of workload "
            "(published Qwen3-0.6B runs at 256 sequences); each row's limit counts its own steps' weight reads, so "
            "tok/s, not the fraction, compares the rows")


def git_commit() -> Optional[str]:
    """This checkout's short commit id, None outside a git repository (a copy of the tree) or without git."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_json(path: Optional[str], payload: dict) -> None:
    """Write ``payload`` to ``path`` as indented JSON (nothing when ``path`` is None)."""
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))


def temporary_workdir() -> tempfile.TemporaryDirectory:
    """A scratch folder for random weights, removed on exit."""
    return tempfile.TemporaryDirectory(prefix="jaxllm-bench-")


def run_matmul_bench(doc: str, bench, default_tokens: Sequence[int]) -> None:
    """The matmul benchmarks' command line: parse ``--model``, ``--tokens``, ``--dtype``, ``--rounds``, call
    ``bench(cfg, dtype_name, tokens, rounds)`` per dtype, print the ``host:`` line (``doc``'s first paragraph is
    the description).
    """
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder, .gguf or a named model (default: the embedded "
                                                      "SmolLM2); only its sizes are used")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(default_tokens))
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    import jax

    from jaxllm.loader import read_model_config
    from jaxllm.named_models import resolve_model

    cfg = read_model_config(resolve_model(args.model))[0]
    print(f"backend {jax.default_backend()}, jax {jax.__version__}")
    for dtype in args.dtype:
        bench(cfg, dtype, args.tokens, args.rounds)
    print(host_line(host_info()))
