"""A user's short script, timed from outside: ``LLM()``, one prompt of 32 greedy tokens, then exit.

For each checkout of ``--checkouts`` (default: this one) and cache state (``cold``, ``warm``), ``--repeats``
times interleaved, a child process runs::

    llm = LLM(model)                                   # start-up
    llm.generate_stream([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))

One row per run: start-up s, time to first token s, tok/s over the stream, decode tok/s after the first token,
and exit s (from the child's last line to its exit: a background warm-up must not hold it).

    python scripts/bench_short_run.py [--checkouts DIR ...] [--model M] [--max-tokens 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _bench_common as common  # noqa: E402

# The child: the user's script, then one JSON line with its own timings and the wall clock of its last line.
CHILD = """
import json, sys, time
t0 = time.perf_counter()
from jaxllm import LLM, SamplingParams
llm = LLM(**({"model": sys.argv[1]} if sys.argv[1] else {}))
ready = time.perf_counter()
first, n = None, 0
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[2]), ignore_eos=True)
for out in llm.generate_stream(["Tell me a story about a cat."], params):
    if first is None and out.outputs[0].token_ids:
        first = time.perf_counter()
    n = len(out.outputs[0].token_ids)
end = time.perf_counter()
print(json.dumps(dict(start_up_s=ready - t0, ttft_s=first - ready, tokens=n, tok_s=n / (end - ready),
                      decode_tok_s=(n - 1) / (end - first) if n > 1 else 0.0, last_line=time.time())), flush=True)
"""


def run_once(checkout: Path, model: str, max_tokens: int, cold: bool) -> dict:
    """One child run; its JSON fields plus ``exit_s`` (seconds from its last line to its exit)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    with tempfile.TemporaryDirectory() as cache:
        if cold:
            # A jaxllm cache with everything of the usual one (the fetched models) but its compilation cache.
            home = Path(os.environ.get("JAXLLM_CACHE", Path.home() / ".cache" / "jaxllm"))
            for entry in home.glob("*"):
                if entry.name != "xla":
                    os.symlink(entry, Path(cache) / entry.name)
            env["JAXLLM_CACHE"] = cache
        proc = subprocess.run([sys.executable, "-c", CHILD, model, str(max_tokens)], env=env, capture_output=True,
                              text=True, cwd=cache)
        ended = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"the short script under {checkout} exited with status {proc.returncode}:\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "exit_s": ended - result.pop("last_line")}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkouts", nargs="+", type=Path,
                        default=[Path(__file__).resolve().parent.parent], help="repository folders to compare")
    parser.add_argument("--model", default="", help="what LLM() is given (default: nothing, the default model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or args.repeats < 1:
        parser.error(f"--max-tokens {args.max_tokens} and --repeats {args.repeats} must be >= 1")
    for checkout in args.checkouts:
        if not (checkout / "jaxllm" / "__init__.py").is_file():
            parser.error(f"--checkouts {checkout}: no jaxllm package there")
    rows = []
    for rep in range(args.repeats):
        for checkout in args.checkouts:
            for mode in args.modes:
                row = run_once(checkout.resolve(), args.model, args.max_tokens, mode == "cold")
                rows.append(dict(checkout=str(checkout), mode=mode, repeat=rep + 1, **row))
    print(f"{'checkout':<28} {'mode':<5} {'start-up s':>10} {'TTFT s':>7} {'tok/s':>6} {'decode tok/s':>12} "
          f"{'exit s':>7}")
    for r in rows:
        print(f"{Path(r['checkout']).name[:28]:<28} {r['mode']:<5} {r['start_up_s']:>10.2f} {r['ttft_s']:>7.2f} "
              f"{r['tok_s']:>6.1f} {r['decode_tok_s']:>12.1f} {r['exit_s']:>7.2f}")
    host = common.host_info()
    print(common.host_line(host))
    common.write_json(args.output_json, dict(config={k: str(v) for k, v in vars(args).items()}, host=host,
                                             results=rows))
    return rows


if __name__ == "__main__":
    main()
