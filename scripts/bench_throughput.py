"""Offline throughput, in the style of nano-vllm's bench.py.

Usage: python scripts/bench_throughput.py [--backend jaxllm|static|hf] [--compare] [--model PATH]
           [--num-requests N] [--input-len MIN MAX] [--output-len MIN MAX] [--max-num-seqs B]
           [--output-json FILE] [--metrics-port PORT] [--random-weights]

N requests with random token ids, prompt and output lengths drawn uniformly
from the ranges (fixed seed, ``ignore_eos``, greedy), after one untimed
warm-up run of the same lengths with other tokens (so every shape the timed
run needs is compiled, and nothing of it is in the prefix cache).

Backends:
  jaxllm  continuous batching (the engine as it is).
  static  jaxllm with ``batching="static"``: a batch of up to B requests
          is admitted only when the previous one has finished entirely.
  hf      Hugging Face ``generate`` on the same weights, padded batches of B
          in request order, left padding, greedy, ``max_new_tokens`` = the
          longest output asked for in the batch; only each request's own
          output tokens count as useful.

Reports requests/s, output tokens/s, total (prompt + output) tokens/s, the
peak KV cache held (token slots; and as a fraction of jaxllm's cache) and the
fraction of allocated KV slots holding live tokens. ``--compare`` runs all
three and prints ratios to hf. Defaults fit a 2-core CPU and the default
model; on a GPU, e.g. ``--num-requests 256 --input-len 100 1024 --output-len
100 1024 --max-num-seqs 256 --max-num-batched-tokens 8192 --model
qwen3_0.6b_config_folder --random-weights``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import _bench_common as common
from _bench_common import Workload

BACKENDS = ("hf", "static", "jaxllm")
_BATCHING = {"jaxllm": "continuous", "static": "static"}


def run_jaxllm(model: Path, args: argparse.Namespace, workload: Workload, warmup: Workload, backend: str) -> dict:
    """Time ``LLM.generate`` on the workload after an untimed warm-up; returns the result row."""
    from jaxllm import LLM, SamplingParams

    llm = LLM(model=model, **common.engine_kwargs(args, _BATCHING[backend]))
    try:
        def params(lens):
            return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]

        llm.generate(warmup.prompts, params(warmup.output_lens), use_tqdm=False)
        metrics = llm.engine.metrics
        metrics.begin_run()
        start = time.perf_counter()
        outs = llm.generate(workload.prompts, params(workload.output_lens))
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        if produced != workload.num_output_tokens:
            raise RuntimeError(f"{backend}: produced {produced} output tokens, asked for {workload.num_output_tokens}")
        run = metrics.run_summary()
        total_slots = (llm.engine.num_blocks - 1) * args.block_size
    finally:
        llm.engine.metrics.close()
    return dict(
        **_rates(backend, workload, elapsed),
        peak_kv_cache_usage=run["peak_kv_cache_usage"],
        peak_kv_slots=int(round(run["peak_kv_cache_usage"] * total_slots)),
        kv_live_slot_fraction=run["kv_live_slot_fraction"],
        max_num_running=run["max_num_running"],
        num_preemptions=run["num_preemptions"],
        compilations=run["compilations"],
    )


def run_hf(model: Path, args: argparse.Namespace, workload: Workload, warmup: Workload) -> dict:
    """Time HF ``generate`` in padded batches of ``--max-num-seqs``; returns the result row.

    KV slots are counted as HF's dynamic cache holds them: every row of a
    batch spans the longest prompt plus the tokens generated so far.
    """
    import torch
    import transformers

    torch.manual_seed(args.seed)
    dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    if model.suffix == ".gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, dtype=dtype)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    hf.eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    batch = args.max_num_seqs
    # Eager torch compiles nothing, so a few tokens of one batch warm it up.
    _hf_batch(hf, warmup.prompts[:batch], [min(n, 4) for n in warmup.output_lens[:batch]], pad)
    start = time.perf_counter()
    live = allocated = peak = 0
    for i in range(0, len(workload.prompts), batch):
        sl = slice(i, i + batch)
        b_live, b_allocated, b_peak = _hf_batch(hf, workload.prompts[sl], workload.output_lens[sl], pad)
        live, allocated, peak = live + b_live, allocated + b_allocated, max(peak, b_peak)
    elapsed = time.perf_counter() - start
    return dict(
        **_rates("hf", workload, elapsed),
        peak_kv_cache_usage=None,
        peak_kv_slots=peak,
        kv_live_slot_fraction=live / allocated,
        max_num_running=min(batch, len(workload.prompts)),
        num_preemptions=0,
        compilations=None,
    )


def _hf_batch(hf, prompts: list[list[int]], output_lens: list[int], pad: int) -> tuple[int, int, int]:
    """Generate one left-padded greedy batch; returns (live, allocated, peak) KV token slots summed over steps."""
    import torch

    longest = max(len(p) for p in prompts)
    new = max(output_lens)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    with torch.no_grad():
        # min_new_tokens: a row reaching eos must not end the batch early, as ignore_eos does for jaxllm.
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=pad)
    if out.shape[1] != longest + new:
        raise RuntimeError(f"hf generated {out.shape[1] - longest} tokens, asked for {new}")
    live = allocated = 0
    for step in range(1, new + 1):
        allocated += len(prompts) * (longest + step)
        live += sum(len(p) + min(step, n) for p, n in zip(prompts, output_lens))
    return live, allocated, len(prompts) * (longest + new)


def _rates(backend: str, workload: Workload, elapsed: float) -> dict:
    n = len(workload.prompts)
    return dict(
        backend=backend, num_requests=n, elapsed_s=elapsed,
        num_prompt_tokens=workload.num_prompt_tokens, num_output_tokens=workload.num_output_tokens,
        requests_per_s=n / elapsed,
        output_tokens_per_s=workload.num_output_tokens / elapsed,
        total_tokens_per_s=(workload.num_prompt_tokens + workload.num_output_tokens) / elapsed,
    )


def print_table(results: list[dict]) -> None:
    base = next((r for r in results if r["backend"] == "hf"), None)
    header = ["backend", "time s", "req/s", "output tok/s", "total tok/s", "peak KV slots", "peak KV usage",
              "live KV fraction", "compiles", "output tok/s vs hf"]
    rows = [[r["backend"], r["elapsed_s"], r["requests_per_s"], r["output_tokens_per_s"], r["total_tokens_per_s"],
             r["peak_kv_slots"], r["peak_kv_cache_usage"], r["kv_live_slot_fraction"], r["compilations"],
             f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x" if base else None]
            for r in results]
    print(common.format_table(header, rows))
    by = {r["backend"]: r for r in results}
    if "jaxllm" in by and "static" in by:
        print(f"continuous / static output tok/s: "
              f"{by['jaxllm']['output_tokens_per_s'] / by['static']['output_tokens_per_s']:.2f}x")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, num_requests=24, input_len=(16, 64), output_len=(16, 128), max_num_seqs=8)
    parser.add_argument("--backend", choices=BACKENDS, default="jaxllm")
    parser.add_argument("--compare", action="store_true", help="run hf, static and jaxllm; print ratios to hf")
    args = parser.parse_args(argv)
    common.validate_ranges(parser, args)
    device_note = common.simulate_cpu_devices(args)
    backends = BACKENDS if args.compare else (args.backend,)
    with common.temporary_workdir() as workdir:
        model = common.resolve_model(args, Path(workdir))
        vocab = common.vocab_size(model)
        workload = common.make_workload(args, vocab, token_seed=1)
        warmup = common.make_workload(args, vocab, token_seed=2)
        results = []
        for backend in backends:
            if backend == "hf":
                results.append(run_hf(model, args, workload, warmup))
            else:
                results.append(run_jaxllm(model, args, workload, warmup, backend))
    print(f"model {model.name if not args.random_weights else args.model + ' (random weights)'}, "
          f"{args.num_requests} requests, input {args.input_len[0]}-{args.input_len[1]}, "
          f"output {args.output_len[0]}-{args.output_len[1]}, batch {args.max_num_seqs}")
    host = common.host_info()
    print(f"host: {host['cpu_count']} CPUs, 1-minute load average {host['load_avg_1m']:.1f} at the end")
    print_table(results)
    if device_note:
        print(device_note)
    payload = dict(config=vars(args), host=host, results=results)
    common.write_json(args.output_json, payload)
    return payload


if __name__ == "__main__":
    main()
