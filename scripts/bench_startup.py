"""Start-up cost: bucket count, cold and cached warm-up, time to first token.

Runs the engine twice in fresh processes sharing one persistent compilation
cache folder (first empty, then filled) and prints, for each start: seconds to
load weights, seconds to compile every bucket, and the first request's time
to first token (TTFT) right after start-up.

    python scripts/bench_startup.py [--model PATH] [--max-model-len 1024] ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time


def child(args: argparse.Namespace) -> None:
    from jaxllm import SamplingParams
    from jaxllm.engine import LLMEngine

    from jaxllm.default_model import resolve_model

    model = str(resolve_model(args.model))
    start = time.perf_counter()
    engine = LLMEngine(model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, compilation_cache=args.cache)
    startup = time.perf_counter() - start
    t0 = time.perf_counter()
    engine.add_request("first", "The capital of France is", SamplingParams(temperature=0, max_tokens=4))
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.delta_token_ids:
                ttft = time.perf_counter() - t0
    print(json.dumps(dict(buckets=len(engine.buckets), startup_s=startup,
                          warmup_s=engine.runner.compile_seconds, ttft_s=ttft)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder, .gguf or a named model such as gemma3-270m "
                                                 "(default: the embedded SmolLM2)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for label in ("cold (empty cache)", "warm (filled cache)"):
            cmd = [sys.executable, __file__, "--child", "--cache", cache,
                   "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
            if args.model:
                cmd += ["--model", args.model]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append((label, json.loads(proc.stdout.strip().splitlines()[-1])))
    print(f"buckets (step programs): {rows[0][1]['buckets']}")
    print(f"{'start':<22}{'start-up s':>12}{'warm-up s':>12}{'TTFT s':>10}")
    for label, r in rows:
        print(f"{label:<22}{r['startup_s']:>12.1f}{r['warmup_s']:>12.1f}{r['ttft_s']:>10.3f}")


if __name__ == "__main__":
    main()
