"""The anchor: transformers' continuous batching (paged attention) on bench_throughput.py's workload and weights.

vLLM cannot run on the lent GPU machines; PyTorch and transformers can. This runs the model through transformers'
``ContinuousBatchingManager`` (the engine under ``model.generate_batch``: a FIFO scheduler over a paged KV cache,
``paged|sdpa`` attention by default, CUDA graphs and async batching as transformers decides them) on the requests
``bench_throughput.py`` times: the same lengths and token ids from ``--seed`` (its timed run's ``token_seed`` 1,
its warm-up's 2), greedy, ``ignore_eos`` (an EOS id of -1), each request with its own output length. With
``--random-weights`` the weights are the ones ``bench_throughput.py`` serves: ``_bench_common.write_random_weights``
with the same seed.

Prints and writes (``--output-json``) one row: start-up seconds, output and total tok/s, engine steps (transformers'
``current_batch`` count of forward passes), wall ms per step, and the fraction of the bandwidth limit computed by
``_bench_common.run_bandwidth`` as for jaxllm's rows in ``bench_throughput.py``: steps x parameter bytes plus the
workload's KV reads, over the HBM bandwidth of the GPU (``_bench_common.HBM_BANDWIDTH_GBPS``) or ``--bandwidth``.
``--jaxllm-json`` (``bench_throughput.py --output-json`` of the same flags) puts jaxllm's row beside it, with the
fractions vLLM-class engines reach as the bar. Dtype ``auto`` is jaxllm's: bfloat16 on a GPU, float32 on a CPU.
``--results-json`` writes that table as a dated result file (``scripts/render_results.py``'s format: device, driver,
JAX and torch versions, commit, command), to be copied into ``docs/benchmarks/results/``.

    python scripts/bench_hf_anchor.py --model FOLDER_WITH_CONFIG_JSON --random-weights [bench_throughput flags]
           [--attn-implementation paged|sdpa] [--bandwidth GB/s] [--jaxllm-json FILE] [--output-json FILE]
           [--results-json FILE]

Imports torch and transformers (test-only references of this project, never imported by jaxllm itself) and starts
no JAX backend, so that no XLA client holds GPU memory beside torch.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402
from _bench_common import Workload  # noqa: E402

# Output tokens per request of the untimed warm-up (the warm-up workload's prompts all prefilled, a few decode steps).
WARMUP_TOKENS = 8


def build_model(model: Path, dtype_name: str, attn_implementation: str, device: str) -> Any:
    """transformers' model of ``model`` (an HF folder) in ``dtype_name`` ("auto": bfloat16 on CUDA, float32 on CPU,
    as jaxllm resolves it) on ``device``, in eval mode."""
    import torch
    import transformers

    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.startswith("cuda") else "float32"
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype_name),
                                                           attn_implementation=attn_implementation)
    return hf.to(device).eval()


def cb_config(args: argparse.Namespace) -> Any:
    """transformers' ``ContinuousBatchingConfig`` of the flags: ``--max-num-batched-tokens`` tokens and
    ``--max-num-seqs`` requests a step, and KV blocks for ``--max-num-seqs`` requests of ``--max-model-len`` tokens
    (sized, not inferred from free memory, so that the run is the same on any device; ``--num-kv-blocks`` means as many
    KV tokens as that many of jaxllm's ``--block-size`` blocks)."""
    from transformers import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(max_batch_tokens=args.max_num_batched_tokens,
                                      max_requests_per_batch=args.max_num_seqs, seed=args.seed)
    # Tokens a block holds per layer: ``page_size`` in later transformers, ``block_size`` in 5.17.
    block_tokens = getattr(config, "page_size", None) or config.block_size
    max_model_len = common.engine_kwargs(args, "continuous")["max_model_len"]
    # --num-kv-blocks counts jaxllm's blocks of --block-size tokens: the same KV tokens in transformers' blocks.
    kv_tokens = args.num_kv_blocks * args.block_size if args.num_kv_blocks else args.max_num_seqs * max_model_len
    config.num_blocks = math.ceil(kv_tokens / block_tokens)
    return config


def run_requests(manager: Any, workload: Workload, output_lens: list[int]) -> list[list[int]]:
    """Add every request of ``workload`` (output lengths ``output_lens``, EOS off) to the started ``manager`` and
    wait for all; each request's generated token ids, in order.

    Raises:
      RuntimeError: a request failed, or the manager's loop stopped before every request finished.
    """
    ids = [manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
           for i, (prompt, n) in enumerate(zip(workload.prompts, output_lens))]
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"transformers' generation loop stopped with {len(ids) - len(done)} requests left")
            continue
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        if result.is_finished():
            done[result.request_id] = list(result.generated_tokens)
    return [done[i] for i in ids]


def run_anchor(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """Time transformers' continuous batching on the throughput workload; the result row (see the module's doc)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    hf = build_model(model, args.dtype, args.attn_implementation, device)
    vocab = hf.config.vocab_size
    timed = common.make_workload(args, vocab, token_seed=1)
    warmup = common.make_workload(args, vocab, token_seed=2)
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(timed.output_lens), eos_token_id=-1)
    manager = hf.init_continuous_batching(generation_config=generation, continuous_batching_config=cb_config(args))
    try:
        manager.warmup()
        manager.start()
        run_requests(manager, warmup, [min(n, WARMUP_TOKENS) for n in warmup.output_lens])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        startup = time.perf_counter() - start
        steps_before = manager.current_batch
        start = time.perf_counter()
        token_ids = run_requests(manager, timed, timed.output_lens)
        elapsed = time.perf_counter() - start
        steps = manager.current_batch - steps_before
        resolved = manager.continuous_batching_config
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    if [len(t) for t in token_ids] != timed.output_lens:
        raise RuntimeError(f"transformers produced {sum(map(len, token_ids))} output tokens, "
                           f"asked for {timed.num_output_tokens}")
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    bandwidth = args.bandwidth or common.device_bandwidth(device_name)
    cfg = hf.config.get_text_config()
    dtype = next(hf.parameters()).dtype
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype.itemsize
    # parameters() yields a tied embedding once: the bytes a step reads.
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    return dict(
        backend="transformers-cb", device=device_name, dtype=str(dtype).removeprefix("torch."),
        attn_implementation=args.attn_implementation,
        version=f"transformers {transformers.__version__}, torch {torch.__version__}",
        # transformers' resolved choices: CUDA graphs as [varlen path, decode path], async double-buffering.
        cuda_graph=list(resolved.use_cuda_graph), async_batching=resolved.use_async_batching,
        num_requests=len(timed.prompts), num_prompt_tokens=timed.num_prompt_tokens,
        num_output_tokens=timed.num_output_tokens, startup_s=startup, elapsed_s=elapsed,
        output_tokens_per_s=timed.num_output_tokens / elapsed,
        total_tokens_per_s=(timed.num_prompt_tokens + timed.num_output_tokens) / elapsed,
        **common.run_bandwidth(timed, steps, elapsed, weight_bytes, kv_per_token, bandwidth),
    )


# The side-by-side table's columns, and each one's cell of a row.
COLUMNS = ["engine", "output tok/s", "total tok/s", "steps", "ms/step", "GB moved", "floor s", "time s",
           "of bandwidth limit"]


def table_rows(rows: list[dict]) -> list[list[Any]]:
    """Each row's cells under :data:`COLUMNS` (tok/s, steps, ms per step, floor and fraction of the limit)."""
    return [[r["backend"], r["output_tokens_per_s"], r["total_tokens_per_s"], r["steps"], r["ms_per_step"],
             r["floor_bytes"] / 1e9, r["floor_s"], r["elapsed_s"],
             None if r["bandwidth_fraction"] is None else f"{r['bandwidth_fraction']:.1%}"] for r in rows]


def nvidia_driver() -> Optional[str]:
    """The NVIDIA driver's version from ``nvidia-smi``, None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def result_file(rows: list[dict], notes: list[str], command: str) -> dict[str, Any]:
    """The run as a dated result file of ``scripts/render_results.py`` (one table: ``rows`` under
    :data:`COLUMNS`, ``notes`` under it), its machine named after the device (``gpu-nvidia-h100-80gb-hbm3``)."""
    anchor = rows[0]
    jaxllm = next((r for r in rows[1:] if r["backend"] == "jaxllm"), None)
    device = anchor["device"]
    machine = "cpu" if device == "cpu" else "gpu-" + re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    cells = [[common.format_cell(v) for v in row] for row in table_rows(rows)]
    return dict(
        date=time.strftime("%Y-%m-%d", time.gmtime()), machine=machine,
        title=f"jaxllm beside transformers' continuous batching on one {device}",
        host=dict(device=device, driver=nvidia_driver(), jax=None if jaxllm is None else jaxllm.get("version"),
                  anchor=anchor["version"], commit=common.git_commit(), python=platform.python_version()),
        description=("`scripts/gpu_check.sh`'s throughput and anchor stages: the same requests, weights and dtype on "
                     "jaxllm and on transformers' continuous batching, each against the bandwidth limit."),
        tables=[dict(title="Throughput against the bandwidth limit", command=command, columns=COLUMNS, rows=cells,
                     notes=notes)],
    )


def jaxllm_row(path: Optional[str]) -> Optional[dict]:
    """The jaxllm row of ``bench_throughput.py``'s JSON at ``path`` (None without a path, or without that row)."""
    if not path:
        return None
    import json

    results = json.loads(Path(path).read_text())["results"]
    return next((r for r in results if r["backend"] == "jaxllm" and r.get("steps")), None)


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, num_requests=48, input_len=(16, 256), output_len=(16, 192), max_num_seqs=64,
                           max_model_len=512)
    parser.add_argument("--attn-implementation", default="paged|sdpa",
                        help="transformers' attention: paged|sdpa, paged|eager, paged|flash_attention_2 (installed)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when torch sees one, else cpu)")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="memory bandwidth in GB/s for the floor (default: by GPU name, HBM_BANDWIDTH_GBPS)")
    parser.add_argument("--jaxllm-json", default=None,
                        help="bench_throughput.py's --output-json of the same flags: its jaxllm row is printed beside")
    parser.add_argument("--results-json", default=None,
                        help="also write the table as a dated result file (scripts/render_results.py's format)")
    args = parser.parse_args(argv)
    common.validate_ranges(parser, args)
    with common.temporary_workdir() as workdir:
        model = common.resolve_model(args, Path(workdir))
        row = run_anchor(args, model)
    rows = [row]
    other = jaxllm_row(args.jaxllm_json)
    if other is not None:
        rows.append(other)
    bandwidth = f"{row['bandwidth_gbps']:.0f} GB/s" if row["bandwidth_gbps"] else "n/a (--bandwidth GB/s sets one)"
    notes = [
        f"transformers continuous batching ({row['attn_implementation']}, CUDA graphs [varlen, decode] "
        f"{row['cuda_graph']}, async batching {row['async_batching']}), {row['version']}, on {row['device']}, "
        f"{row['dtype']}; {args.num_requests} requests, input {args.input_len[0]}-{args.input_len[1]}, output "
        f"{args.output_len[0]}-{args.output_len[1]} (greedy, ignore_eos), max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}",
        f"bandwidth limit: (steps x {row['weight_bytes'] / 1e9:.3f} GB of parameters + the workload's KV reads x "
        f"{row['kv_bytes_per_token']:.0f} B/token) / {bandwidth}; ms/step = wall time / engine steps",
        common.bandwidth_bar(),
    ]
    print("\n".join(notes[:2]))
    print(common.format_table(COLUMNS, table_rows(rows)))
    print(notes[2])
    print(common.host_line(common.host_info()))
    payload = dict(config=vars(args), results=rows)
    common.write_json(args.output_json, payload)
    command = "python scripts/bench_hf_anchor.py " + " ".join(sys.argv[1:] if argv is None else argv)
    common.write_json(args.results_json, result_file(rows, notes, command))
    return payload


if __name__ == "__main__":
    main()
