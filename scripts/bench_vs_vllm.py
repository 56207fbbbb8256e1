"""jaxllm against vLLM's CPU build on every shape users run, offline and serving: one command, one table.

Usage: python scripts/bench_vs_vllm.py [--vllm-python PATH] [--shapes mixed long shared-prefix short]
           [--dtypes float32 bfloat16] [--vllm-bindings default both] [--serving-dtypes float32 ...]
           [--serving-num-prompts N] [--serving-request-rate R|inf] [--model PATH] [--seed S] [--repeats N]
           [--json FILE]

Offline, per dtype and shape (:data:`SHAPES`): the same random-token requests (greedy, ``ignore_eos``, prefix
caching on) on jaxllm (one engine per shape) and on vLLM under each ``--vllm-bindings`` binding (one engine per
dtype and binding, with the shapes' largest limits), each timed run after an untimed warm-up on other tokens.
``--repeats N`` gives each engine's median run, the range and the ratio of the medians. Prints output tok/s
of jaxllm and each binding, jaxllm's ratio to the faster binding, greedy agreement, jaxllm's fraction of the
fastest matmul rate, a start-up table and vLLM's CPU binding.

Serving, per ``--serving-dtypes`` dtype: ``jaxllm serve`` and ``vllm serve`` on the same weights driven by
``vllm bench serve`` (random dataset around the ``mixed`` shape): output tok/s, TTFT and TPOT P50/P99 (ms).

The default GGUF is dequantized once into a float32 HF folder every engine reads. ``--json`` writes every
number; the ``host:`` line names the CPU's instruction sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import _bench_common as common
import bench_throughput as bt
from _vllm_worker import process_affinity

DTYPES = ("float32", "bfloat16")
WARMUP_REQUESTS, WARMUP_OUTPUT_LEN = 8, 8
# Requests vllm bench serve sends (and waits for) before it starts the clock.
SERVING_WARMUPS = 2
MAX_NUM_BATCHED_TOKENS = 512
SERVED_MODEL_NAME = "bench"
SERVER_STARTUP_S = 900
_CLI = Path(__file__).resolve().parent / "_vllm_cli.py"
_ROOT = _CLI.parents[1]


@dataclasses.dataclass(frozen=True)
class Shape:
    """One workload and the engine limits it runs under; lengths in tokens, drawn uniformly from [MIN, MAX]."""

    name: str
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    max_num_seqs: int
    max_model_len: int
    shared_prefix_len: int = 0

    def flags(self, dtype: str, seed: int) -> list[str]:
        """bench_throughput.py's flags for this shape in ``dtype``."""
        return ["--num-requests", str(self.num_requests), "--input-len", *map(str, self.input_len),
                "--output-len", *map(str, self.output_len), "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len), "--shared-prefix-len", str(self.shared_prefix_len),
                "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--dtype", dtype, "--seed", str(seed)]

    def describe(self) -> str:
        prefix = f"a shared {self.shared_prefix_len}-token prefix + " if self.shared_prefix_len else ""
        return (f"{self.name}: {self.num_requests} requests, prompts {prefix}{self.input_len[0]}-{self.input_len[1]}"
                f", outputs {self.output_len[0]}-{self.output_len[1]}, max_num_seqs {self.max_num_seqs}, "
                f"max_model_len {self.max_model_len}")


# Issue 28's shapes. The request counts of long and shared-prefix keep the whole run under ~40 minutes on 2 cores.
SHAPES = {s.name: s for s in (
    Shape("mixed", 48, (16, 256), (16, 192), max_num_seqs=64, max_model_len=512),
    Shape("long", 16, (600, 1500), (64, 256), max_num_seqs=64, max_model_len=2048),
    Shape("shared-prefix", 32, (16, 256), (16, 192), max_num_seqs=64, max_model_len=1024, shared_prefix_len=384),
    Shape("short", 192, (16, 64), (16, 64), max_num_seqs=192, max_model_len=128),
)}


def shape_args(shape: Shape, dtype: str, seed: int) -> argparse.Namespace:
    """The shape as bench_throughput.py's parsed flags (its defaults otherwise), checked by the same rules."""
    parser = argparse.ArgumentParser(prog=f"shape {shape.name}")
    common.add_common_args(parser, num_requests=shape.num_requests, input_len=shape.input_len,
                           output_len=shape.output_len, max_num_seqs=shape.max_num_seqs)
    args = parser.parse_args(shape.flags(dtype, seed))
    common.validate_ranges(parser, args)
    return args


def shape_workloads(shape: Shape, vocab: int, seed: int, repeat: int = 0) -> tuple[common.Workload, common.Workload]:
    """(timed, warm-up) of ``shape``: the warm-up has the first :data:`WARMUP_REQUESTS` lengths, other tokens and
    :data:`WARMUP_OUTPUT_LEN` outputs; each ``repeat`` has repeat 0's lengths and tokens of its own.
    """
    args = shape_args(shape, "float32", seed)
    timed = common.make_workload(args, vocab, token_seed=1 + 2 * repeat)
    other = common.make_workload(args, vocab, token_seed=2 + 2 * repeat)
    n = min(WARMUP_REQUESTS, shape.num_requests)
    return timed, common.Workload(other.prompts[:n], [WARMUP_OUTPUT_LEN] * n)


def vllm_engine_args(shapes: Sequence[Shape], dtype: str, seed: int) -> argparse.Namespace:
    """The one vLLM engine's flags for ``shapes``: the largest max_num_seqs and max_model_len among them."""
    widest = dataclasses.replace(shapes[0], max_num_seqs=max(s.max_num_seqs for s in shapes),
                                 max_model_len=max(s.max_model_len for s in shapes))
    return shape_args(widest, dtype, seed)


def progress(message: str) -> None:
    print(f"[bench_vs_vllm {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_offline(model: Path, dtype: str, shapes: Sequence[Shape], bindings: Sequence[str], vllm_python: str,
                seed: int, repeats: int = 1) -> list[dict]:
    """jaxllm and vLLM on every shape in ``dtype``, ``repeats`` timed runs each; rows of :func:`offline_row`."""
    from jaxllm.loader import read_model_config

    vocab = common.vocab_size(model)
    pairs = {s.name: [shape_workloads(s, vocab, seed, r) for r in range(repeats)] for s in shapes}
    jaxllm_runs = {}
    for shape in shapes:
        progress(f"jaxllm {dtype} {shape.describe()}")
        runs = bt.run_jaxllm(model, shape_args(shape, dtype, seed), pairs[shape.name], "jaxllm")
        jaxllm_runs[shape.name] = runs
        progress(f"jaxllm {dtype} {shape.name}: {_rates(runs)} output tok/s (start-up {runs[0]['startup_s']:.0f} s)")
    bt.add_dot_peak_fraction([r for runs in jaxllm_runs.values() for r in runs], read_model_config(model)[0], dtype)
    named = {f"{s.name}#{r}": pair for s in shapes for r, pair in enumerate(pairs[s.name])}
    vllm_runs: dict[str, dict[str, list[dict]]] = {s.name: {} for s in shapes}
    for binding in bindings:
        env = bt.vllm_binding_env(binding, vllm_python)
        engine = vllm_engine_args(shapes, dtype, seed)
        progress(f"vllm[{binding}] {dtype}: one engine (max_num_seqs {engine.max_num_seqs}, max_model_len "
                 f"{engine.max_model_len}) for {', '.join(s.name for s in shapes)}; env {env or 'none'}; "
                 "start-up takes minutes")
        result = bt.run_vllm_worker(vllm_python, bt.vllm_spec(model, engine, dtype, named), env)
        progress(bt.affinity_line(f"vllm[{binding}] {dtype}", result["affinity"]))
        rows = bt.vllm_rows(result, list(named.values()), list(named), binding, env)
        for i, shape in enumerate(shapes):
            runs = rows[i * repeats:(i + 1) * repeats]
            vllm_runs[shape.name][binding] = runs
            progress(f"vllm[{binding}] {dtype} {shape.name}: {_rates(runs)} output tok/s")
    return [offline_row(shape, dtype, jaxllm_runs[shape.name], vllm_runs[shape.name]) for shape in shapes]


def _rates(runs: Sequence[dict]) -> str:
    return ", ".join(f"{r['output_tokens_per_s']:.1f}" for r in runs)


def median_run(runs: Sequence[dict]) -> dict:
    """The run of median output tok/s among ``runs`` (the lower middle of an even count).

    Raises:
      ValueError: no runs.
    """
    if not runs:
        raise ValueError("median_run: no runs")
    return sorted(runs, key=lambda r: r["output_tokens_per_s"])[(len(runs) - 1) // 2]


def offline_row(shape: Shape, dtype: str, jaxllm_runs: Sequence[dict], vllm_runs: dict[str, Sequence[dict]]) -> dict:
    """One shape's numbers: each engine's median and per-run tok/s, start-up, the faster binding, jaxllm's ratio to
    it, greedy agreement on repeat 0, jaxllm's dot-peak fraction, compilations and cached prompt tokens.
    """
    jaxllm = median_run(jaxllm_runs)
    vllm = {b: median_run(runs) for b, runs in vllm_runs.items()}
    best = max(vllm, key=lambda b: vllm[b]["output_tokens_per_s"])
    same = sum(a == b for a, b in zip(jaxllm_runs[0]["token_ids"], vllm_runs[best][0]["token_ids"]))
    return dict(
        shape=shape.name, dtype=dtype, num_requests=jaxllm["num_requests"],
        num_prompt_tokens=jaxllm["num_prompt_tokens"], num_output_tokens=jaxllm["num_output_tokens"],
        jaxllm_output_tokens_per_s=jaxllm["output_tokens_per_s"], jaxllm_startup_s=jaxllm["startup_s"],
        jaxllm_runs_output_tokens_per_s=[r["output_tokens_per_s"] for r in jaxllm_runs],
        jaxllm_compilations=jaxllm["compilations"], dot_peak_fraction=jaxllm["dot_peak_fraction"],
        dot_rates=jaxllm["dot_rates"],
        jaxllm_cached_prompt_tokens=jaxllm["num_cached_prompt_tokens"],
        vllm={b: dict(output_tokens_per_s=r["output_tokens_per_s"], startup_s=r["startup_s"],
                      runs_output_tokens_per_s=[run["output_tokens_per_s"] for run in vllm_runs[b]],
                      env=r["vllm_env"], affinity=r["vllm_affinity"], version=r["version"])
              for b, r in vllm.items()},
        best_binding=best, ratio_to_best=jaxllm["output_tokens_per_s"] / vllm[best]["output_tokens_per_s"],
        same_tokens_as_best=same,
    )


def _tok_s(median: float, runs: Optional[Sequence[float]]):
    """A tok/s cell: the median, and with more than one run the lowest and highest."""
    if runs is None or len(runs) < 2:
        return median
    return f"{median:.1f} ({min(runs):.0f}-{max(runs):.0f})"


def offline_table(rows: Sequence[dict], bindings: Sequence[str]) -> str:
    """The side-by-side table: one line per (shape, dtype); tok/s medians (with more than one run their range)."""
    header = ["shape", "dtype", "requests", "jaxllm tok/s", *(f"vllm[{b}] tok/s" for b in bindings),
              "jaxllm / best vllm", "same tokens as best", "jaxllm of dot peak"]
    table = [[r["shape"], r["dtype"], r["num_requests"],
              _tok_s(r["jaxllm_output_tokens_per_s"], r.get("jaxllm_runs_output_tokens_per_s")),
              *(_tok_s(r["vllm"][b]["output_tokens_per_s"], r["vllm"][b].get("runs_output_tokens_per_s"))
                for b in bindings),
              f"{r['ratio_to_best']:.2f}x vs {r['best_binding']}", f"{r['same_tokens_as_best']}/{r['num_requests']}",
              f"{100 * r['dot_peak_fraction']:.1f}%"] for r in rows]
    return common.format_table(header, table)


def startup_table(rows: Sequence[dict], bindings: Sequence[str]) -> str:
    """Start-up seconds: jaxllm per (shape, dtype), vLLM per (dtype, binding), its one engine serving every shape."""
    header = ["dtype", "shape", "jaxllm start-up s", *(f"vllm[{b}] start-up s" for b in bindings)]
    return common.format_table(header, [[r["dtype"], r["shape"], r["jaxllm_startup_s"],
                                         *(r["vllm"][b]["startup_s"] for b in bindings)] for r in rows])


# ---- serving ------------------------------------------------------------------------------------------------------

SERVING_METRICS = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")
# What else of vllm bench serve's result goes into the JSON (its per-request lists do not).
SERVING_EXTRA = ("duration", "total_input_tokens", "request_throughput", "p50_itl_ms", "p99_itl_ms", "p50_e2el_ms",
                 "p99_e2el_ms", "max_concurrency")


def random_dataset_flags(shape: Shape) -> list[str]:
    """``vllm bench serve`` random-dataset flags over ``shape``'s ranges (a centre and a range ratio each)."""
    def centre_ratio(low: int, high: int) -> tuple[int, float]:
        centre = (low + high) / 2
        return round(centre), (high - low) / (low + high)

    input_centre, input_ratio = centre_ratio(*shape.input_len)
    output_centre, output_ratio = centre_ratio(*shape.output_len)
    return ["--dataset-name", "random", "--random-input-len", str(input_centre), "--random-output-len",
            str(output_centre), "--random-range-ratio", json.dumps({"input": round(input_ratio, 4),
                                                                    "output": round(output_ratio, 4)}),
            "--random-prefix-len", str(shape.shared_prefix_len)]


def server_argv(kind: str, model: Path, shape: Shape, dtype: str, port: int, seed: int, vllm_python: str) -> list[str]:
    """The command line of ``jaxllm serve`` (``kind`` "jaxllm") or ``vllm serve`` (``kind`` "vllm") on 127.0.0.1."""
    engine = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_MODEL_NAME, "--dtype", dtype,
              "--max-num-seqs", str(shape.max_num_seqs), "--max-model-len", str(shape.max_model_len),
              "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--seed", str(seed)]
    if kind == "jaxllm":
        return [sys.executable, "-m", "jaxllm.entrypoints.cli", "serve", str(model), *engine]
    return [vllm_python, str(_CLI), "serve", str(model), *engine, "--enable-prefix-caching"]


def client_argv(vllm_python: str, url: str, model: Path, shape: Shape, num_prompts: int, rate: float, seed: int,
                result_dir: Path) -> list[str]:
    """``vllm bench serve`` against ``url``: greedy, ``ignore_eos``, P50/P99 latencies, ``result_dir/result.json``."""
    return [vllm_python, str(_CLI), "bench", "serve", "--backend", "openai", "--base-url", url,
            "--model", SERVED_MODEL_NAME, "--tokenizer", str(model), *random_dataset_flags(shape),
            "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--num-warmups", str(min(SERVING_WARMUPS, num_prompts)),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
            "--result-dir", str(result_dir), "--result-filename", "result.json", "--disable-tqdm"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Wait until ``url``/health answers 200. Raises RuntimeError when the server exits first or takes over
    :data:`SERVER_STARTUP_S`."""
    import httpx

    deadline = time.monotonic() + SERVER_STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{proc.args[:4]} did not answer /health in {SERVER_STARTUP_S} s")


def serve_and_measure(kind: str, binding: Optional[str], model: Path, shape: Shape, dtype: str,
                      args: argparse.Namespace, workdir: Path) -> dict:
    """Start one server, wait for /health, run ``vllm bench serve`` against it, stop its process group.

    Returns the row: ``server``, ``dtype``, ``startup_s``, ``client_flags``, :data:`SERVING_METRICS` and
    :data:`SERVING_EXTRA` (vLLM's names and units), ``completed``/``failed``, and vLLM's ``env`` and ``affinity``.

    Raises:
      RuntimeError: the server did not come up, or the client failed (the logs' tails).
    """
    label = "jaxllm" if kind == "jaxllm" else f"vllm[{binding}]"
    env = bt.vllm_binding_env(binding, args.vllm_python) if kind == "vllm" else {}
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"{label}-{dtype}.log"
    progress(f"serving: starting {label} {dtype} on port {port} (log {log})")
    start = time.perf_counter()
    with open(log, "w") as out:
        # From the repository root, so jaxllm serve runs this checkout's packages (as the offline runs do);
        # vLLM's KV cache is 4 GiB, as offline (its default reserves 92% of the memory, more than is free).
        proc = subprocess.Popen(server_argv(kind, model, shape, dtype, port, args.seed, args.vllm_python),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=_ROOT,
                                env={"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ, "VLLM_TARGET_DEVICE": "cpu", **env})
    try:
        _wait_ready(proc, url, log)
        startup = time.perf_counter() - start
        affinity = process_affinity(proc.pid) if kind == "vllm" else None
        if affinity:
            progress(bt.affinity_line(f"{label} serve {dtype}", affinity))
        result_dir = workdir / f"{label}-{dtype}-result"
        result_dir.mkdir()
        progress(f"serving: vllm bench serve against {label} {dtype} ({args.serving_num_prompts} prompts)")
        client = subprocess.run(client_argv(args.vllm_python, url, model, shape, args.serving_num_prompts,
                                            args.serving_request_rate, args.seed, result_dir),
                                capture_output=True, text=True)
        if client.returncode != 0:
            raise RuntimeError(f"vllm bench serve against {label} exited with {client.returncode}: "
                               f"{(client.stdout + client.stderr)[-3000:]}")
        result = json.loads((result_dir / "result.json").read_text())
    finally:
        bt.stop_process_group(proc)
    flags = client_argv(args.vllm_python, "URL", model, shape, args.serving_num_prompts, args.serving_request_rate,
                        args.seed, Path("DIR"))
    row = dict(server=label, dtype=dtype, startup_s=startup, num_prompts=args.serving_num_prompts,
               client_flags=flags[flags.index("--dataset-name"):flags.index("--save-result")],
               completed=result["completed"], failed=result.get("failed", 0),
               total_output_tokens=result["total_output_tokens"], env=env, affinity=affinity)
    row.update({k: result[k] for k in SERVING_METRICS})
    row.update({k: result.get(k) for k in SERVING_EXTRA})
    progress(f"serving: {label} {dtype}: {row['output_throughput']:.1f} output tok/s")
    return row


def serving_table(rows: Sequence[dict]) -> str:
    """Serving rows side by side, and each server's output tok/s over the best vLLM of its dtype."""
    best = {}
    for r in rows:
        if r["server"] != "jaxllm":
            best[r["dtype"]] = max(best.get(r["dtype"], 0.0), r["output_throughput"])
    header = ["server", "dtype", "completed", "output tok/s", "TTFT P50 ms", "TTFT P99 ms", "TPOT P50 ms",
              "TPOT P99 ms", "start-up s", "vs best vllm"]
    table = [[r["server"], r["dtype"], f"{r['completed']}/{r['num_prompts']}", r["output_throughput"],
              r["p50_ttft_ms"], r["p99_ttft_ms"], r["p50_tpot_ms"], r["p99_tpot_ms"], r["startup_s"],
              f"{r['output_throughput'] / best[r['dtype']]:.2f}x" if r["dtype"] in best else None] for r in rows]
    return common.format_table(header, table)


# ---- the command --------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """The flags, checked: unknown shapes, dtypes and bindings are refused naming the value and the choices."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default="/root/vllm-cpu/bin/python",
                        help="python of vLLM's CPU build's virtual environment (default: %(default)s)")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE",
                        help=f"offline shapes, of {', '.join(SHAPES)}; none given: serving only (default: all)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES, metavar="DTYPE",
                        help="offline dtypes, of float32 and bfloat16 (default: both)")
    parser.add_argument("--vllm-bindings", nargs="+", default=["default", "both"], metavar="BINDING",
                        help="vLLM CPU bindings to compare, as bench_throughput.py's --vllm-binding (default: "
                             "default both)")
    parser.add_argument("--serving-dtypes", nargs="*", default=["float32"], choices=DTYPES, metavar="DTYPE",
                        help="dtypes of the serving comparison; none given: no serving (default: float32)")
    parser.add_argument("--serving-num-prompts", type=int, default=48, help="requests per server (default 48)")
    parser.add_argument("--serving-request-rate", type=float, default=math.inf,
                        help="requests/s of vllm bench serve (default inf: all at once)")
    parser.add_argument("--model", default=None, help="a GGUF or HF folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs of each shape on each engine, each on its own tokens; the table gives "
                             "the median run and the range (default 1)")
    parser.add_argument("--json", default=None, help="also write every number to this JSON file")
    args = parser.parse_args(argv)
    if not Path(args.vllm_python).is_file():
        parser.error(f"--vllm-python {args.vllm_python}: no such file (vLLM's CPU build's venv python)")
    for binding in args.vllm_bindings:
        try:
            bt.vllm_binding_env(binding, args.vllm_python)
        except ValueError as err:
            parser.error(f"--vllm-bindings: {err}")
    if len(set(args.vllm_bindings)) != len(args.vllm_bindings):
        parser.error(f"--vllm-bindings {' '.join(args.vllm_bindings)}: a binding is named twice")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: need at least 1")
    if args.serving_num_prompts < 1:
        parser.error(f"--serving-num-prompts {args.serving_num_prompts}: need at least 1")
    if not args.serving_request_rate > 0:
        parser.error(f"--serving-request-rate {args.serving_request_rate}: need > 0 (inf: all at once)")
    if not args.shapes and not args.serving_dtypes:
        parser.error("--shapes and --serving-dtypes both empty: nothing to run")
    args.shapes = list(dict.fromkeys(args.shapes))
    args.dtypes = list(dict.fromkeys(args.dtypes))
    return args


def command_line(argv: Optional[Sequence[str]]) -> str:
    """This run's command, to quote beside its numbers."""
    return " ".join(["python", "scripts/bench_vs_vllm.py", *(sys.argv[1:] if argv is None else argv)])


def _exit_on_sigterm(signum: int, frame) -> None:
    # As an exception, so the finally blocks stop the vLLM and server process groups this run started.
    raise SystemExit(128 + signum)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from jaxllm.named_models import resolve_model

    model = resolve_model(args.model)
    if model.suffix == ".gguf":
        model = common.dequantized_hf_folder(model)
    shapes = [SHAPES[name] for name in args.shapes]
    started = time.perf_counter()
    offline = []
    for dtype in args.dtypes if shapes else ():
        offline += run_offline(model, dtype, shapes, args.vllm_bindings, args.vllm_python, args.seed, args.repeats)
    serving = []
    with common.temporary_workdir() as workdir:
        for dtype in args.serving_dtypes:
            serving.append(serve_and_measure("jaxllm", None, model, SHAPES["mixed"], dtype, args, Path(workdir)))
            for binding in args.vllm_bindings:
                serving.append(serve_and_measure("vllm", binding, model, SHAPES["mixed"], dtype, args,
                                                 Path(workdir)))
    host = common.host_info()
    payload = dict(command=command_line(argv), model=str(model), host=host,
                   shapes={s.name: dataclasses.asdict(s) for s in shapes}, bindings=args.vllm_bindings,
                   offline=offline, serving=serving, wall_s=time.perf_counter() - started)
    print(report(payload))
    common.write_json(args.json, payload)
    return payload


def _shape_from_json(fields: dict) -> Shape:
    return Shape(**{**fields, "input_len": tuple(fields["input_len"]), "output_len": tuple(fields["output_len"])})


def report(payload: dict) -> str:
    """The printed report of a run's ``payload`` (:func:`main`'s JSON): command, model, host, shapes, the tables."""
    bindings = payload["bindings"]
    lines = [f"command: {payload['command']}", f"model: {payload['model']} (every engine reads it)",
             common.host_line(payload["host"]),
             "shapes (greedy, ignore_eos, prefix caching on; random token ids):",
             *(f"  {_shape_from_json(s).describe()}" for s in payload["shapes"].values())]
    if payload["offline"]:
        lines += ["", "offline: output tok/s of the timed generate (after an untimed warm-up; of several repeats the "
                  "median and the range); vLLM: one engine per "
                  "dtype and binding for every shape", offline_table(payload["offline"], bindings),
                  "", "start-up (seconds, engine built and compiled):", startup_table(payload["offline"], bindings)]
        rates = {r["dtype"]: r["dot_rates"] for r in payload["offline"]}
        lines += [f"{dtype} matmul rates measured in this run: {common.rates_line(r)}; 'jaxllm of dot peak' is "
                  "against the fastest" for dtype, r in rates.items()]
        seen = set()
        for r in payload["offline"]:
            for b, v in r["vllm"].items():
                if (r["dtype"], b) not in seen:
                    seen.add((r["dtype"], b))
                    lines.append(bt.affinity_line(f"vllm[{b}] {r['dtype']} (env {v['env'] or 'none'})",
                                                  v["affinity"]))
        compiled = [f"{r['shape']} {r['dtype']}: {r['jaxllm_compilations']}" for r in payload["offline"]
                    if r["jaxllm_compilations"]]
        if compiled:
            lines.append("warning: jaxllm compiled during timed runs: " + ", ".join(compiled))
    if payload["serving"]:
        first = payload["serving"][0]
        lines += ["", f"serving: jaxllm serve and vllm serve with the limits of {SHAPES['mixed'].describe()}; client "
                  f"vllm bench serve {' '.join(first['client_flags'])}", serving_table(payload["serving"])]
        lines += [bt.affinity_line(f"{r['server']} serve {r['dtype']}", r["affinity"])
                  for r in payload["serving"] if r["affinity"]]
    lines.append(f"wall time {payload['wall_s'] / 60:.1f} min")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
