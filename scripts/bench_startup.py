"""Start-up and memory of the default model, as a new user meets them.

Each measurement runs in a fresh Python process, all sharing one temporary
jaxllm cache folder (``JAXLLM_CACHE``: JAX's persistent compilation cache and
the GGUF parse cache), which starts empty; the model file itself is linked
from the usual cache, so nothing is downloaded twice.

1. ``LLM()`` cold: empty caches. Seconds from the start of ``LLM()`` to the
   first streamed token of "The capital of France is", and until every step
   program is built (the rest build in the background while serving).
2. ``LLM()`` again: the caches now hold what run 1 built.
3. ``python -m jaxllm.generate`` end to end (process start to exit), twice:
   the second with a warm cache.
4. A 4,096-token prompt with ``max_model_len=8192``: it must complete; its
   time and the process's peak resident memory.

Every run prints the number of step programs and how many were compiled or
loaded from the persistent cache; the peak RSS of each ``LLM()`` process is
printed too (``resource.getrusage``, bytes).

    python scripts/bench_startup.py [--model PATH] [--skip-long-prompt]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Import this checkout's packages, not whatever an editable install points at (the parent reads the named models).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _bench_common as common  # noqa: E402

PROMPT = "The capital of France is"


def child_llm(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    from jaxllm import LLM, SamplingParams

    imported = time.perf_counter()
    kwargs = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    llm = LLM(model=args.model, **kwargs)
    constructed = time.perf_counter()
    prompt = PROMPT if not args.prompt_tokens else [1 + i % 1000 for i in range(args.prompt_tokens)]
    first = None
    text = ""
    for out in llm.generate_stream(prompt, SamplingParams(temperature=0, max_tokens=args.max_tokens)):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter()
        text = out.outputs[0].text
    done = time.perf_counter()
    llm.engine.wait_for_warmup()
    ready = time.perf_counter()
    stats = llm.engine.runner.compile_stats
    print(json.dumps(dict(
        import_s=imported - start, construct_s=constructed - imported, first_token_s=first - imported,
        generate_s=done - constructed, all_programs_s=ready - imported, programs=len(llm.engine.buckets),
        built=stats.num_compilations, cache_hits=stats.num_cache_hits, compile_s=stats.compile_seconds,
        cache_load_s=stats.cache_load_seconds, peak_rss_bytes=_peak_rss(), text=text,
    )))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _run_llm(env: dict, args: argparse.Namespace, **extra) -> dict:
    cmd = [sys.executable, __file__, "--child"]
    for key, value in {"model": args.model, **extra}.items():
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_cli(env: dict, args: argparse.Namespace) -> float:
    cmd = [sys.executable, "-m", "jaxllm.generate", "--prompt", PROMPT, "--max-tokens", "8", "--temperature", "0"]
    if args.model:
        cmd += ["--model", args.model]
    start = time.perf_counter()
    subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder, .gguf or a named model such as gemma3-270m "
                                                 "(default: the embedded SmolLM2)")
    p.add_argument("--skip-long-prompt", action="store_true", help="leave out the 4,096-token prompt run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompt-tokens", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--max-tokens", type=int, default=8, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child_llm(args)
        return
    from jaxllm.named_models import DEFAULT_MODEL_FILE, default_model_path
    from jaxllm.paths import cache_dir

    with tempfile.TemporaryDirectory(prefix="jaxllm-startup-") as cache:
        env = dict(os.environ, JAXLLM_CACHE=cache)
        if args.model is None:  # the default model, linked into the empty cache
            os.symlink(default_model_path(), Path(cache) / DEFAULT_MODEL_FILE)
        rows = [("LLM() cold (empty caches)", _run_llm(env, args)),
                ("LLM() cached", _run_llm(env, args))]
        cli = [_run_cli(env, args), _run_cli(env, args)]
        long = None if args.skip_long_prompt else _run_llm(env, args, max_model_len=8192, prompt_tokens=4096,
                                                           max_tokens=16)
    print(f"model: {args.model or DEFAULT_MODEL_FILE}; user cache untouched ({cache_dir()})")
    print(f"{'start':<28}{'import s':>9}{'LLM() s':>9}{'1st token s':>12}{'all built s':>12}{'programs':>10}"
          f"{'compiled':>10}{'cached':>8}{'peak RSS GB':>12}")
    for label, r in rows:
        print(f"{label:<28}{r['import_s']:>9.1f}{r['construct_s']:>9.1f}{r['first_token_s']:>12.1f}"
              f"{r['all_programs_s']:>12.1f}{r['programs']:>10}{r['built'] - r['cache_hits']:>10}"
              f"{r['cache_hits']:>8}{r['peak_rss_bytes'] / 1e9:>12.2f}")
    print(f"(1st token s and all built s count from the end of the imports; text: {rows[-1][1]['text']!r})")
    print(f"python -m jaxllm.generate end to end: {cli[0]:.1f} s (first call), {cli[1]:.1f} s (warm cache)")
    if long is not None:
        print(f"4,096-token prompt, max_model_len 8192: completed in {long['generate_s']:.1f} s "
              f"(first token after {long['first_token_s']:.1f} s from import), peak RSS "
              f"{long['peak_rss_bytes'] / 1e9:.2f} GB")
    print(common.host_line(common.host_info()))


if __name__ == "__main__":
    main()
