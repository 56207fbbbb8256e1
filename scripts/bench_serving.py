"""Online serving latency under Poisson arrivals, through the engine API in process or a running server over HTTP
(vLLM's benchmark_serving).

Usage: python scripts/bench_serving.py [--request-rate R|inf] [--burstiness B] [--batching continuous|static]
           [--compare | --compare-degradation] [--no-graceful-degradation] [--model PATH] [--num-requests N]
           [--input-len MIN MAX] [--output-len MIN MAX] [--max-num-seqs B] [--num-kv-blocks N]
           [--output-json FILE] [--metrics-port PORT] [--random-weights]
       python scripts/bench_serving.py --base-url http://HOST:PORT [--model PATH] [--request-rate R|inf] ...

Requests arrive at ``--request-rate``/s with gamma gaps of shape ``--burstiness`` (1 = Poisson) and are fed
to ``LLMEngine.add_request`` while one loop steps the engine (greedy, ``ignore_eos``, random tokens, after
an untimed warm-up). The default rate is 70% of the capacity the warm-up measured.

Prints TTFT, TPOT, ITL, end-to-end latency and queue time (mean, p50, p90, p99, seconds), step times,
request and output-token throughput, peak running requests, preemptions and live KV slot fraction.
``--compare`` (continuous vs static batching) and ``--compare-degradation`` (graceful degradation on vs
off) print the first's improvement in % (positive: better). ``--base-url`` measures a running OpenAI-
compatible server with streamed ``/v1/completions`` (``--model`` must name the served model; the server's
queue and KV figures print as "-").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Optional

import numpy as np

import _bench_common as common
from _bench_common import Workload


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Arrival seconds of ``n`` requests: gaps gamma(burstiness, 1 / (rate * burstiness)), the first at 0."""
    if np.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng([seed, 3])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def serve(engine, workload: Workload, offsets: np.ndarray, prefix: str) -> tuple[dict[str, dict], list[float]]:
    """Feed the requests at their arrival times while stepping ``engine``; returns per-request timings
    (``arrival``, ``token_times``, ``first_scheduled``, ``finished``: monotonic seconds) and each step's seconds.
    """
    from jaxllm import SamplingParams

    start = time.monotonic()
    arrivals = start + offsets
    records: dict[str, dict] = {}
    step_seconds: list[float] = []
    i, n = 0, len(workload.prompts)
    while i < n or engine.has_unfinished_requests():
        now = time.monotonic()
        while i < n and arrivals[i] <= now:
            rid = f"{prefix}{i}"
            params = SamplingParams(temperature=0, max_tokens=workload.output_lens[i], ignore_eos=True)
            engine.add_request(rid, workload.prompts[i], params, arrival_time=float(arrivals[i]))
            records[rid] = dict(arrival=float(arrivals[i]), token_times=[], first_scheduled=None, finished=None)
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(arrivals[i] - now, 0.0))
            continue
        stepped = time.monotonic()
        outputs = engine.step()
        now = time.monotonic()
        step_seconds.append(now - stepped)
        for out in outputs:
            rec = records[out.request_id]
            rec["token_times"].extend([now] * len(out.delta_token_ids))
            if out.finished:
                rec["finished"] = now
                rec["first_scheduled"] = out.metrics["first_scheduled_time"]
    return records, step_seconds


def summarize(records: dict[str, dict], run: dict, batching: str, graceful_degradation: Optional[bool] = None,
              step_seconds: Optional[list[float]] = None) -> dict:
    """Latency percentiles and throughputs from :func:`serve`'s records (seconds, tokens)."""
    ttft, tpot, itl, e2e, queue = [], [], [], [], []
    for rid, rec in records.items():
        times = rec["token_times"]
        if not times:
            raise RuntimeError(f"request {rid} produced no token (refused as too long for the KV cache?)")
        ttft.append(times[0] - rec["arrival"])
        e2e.append(rec["finished"] - rec["arrival"])
        if rec["first_scheduled"] is not None:
            queue.append(rec["first_scheduled"] - rec["arrival"])
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(np.diff(times).tolist())
    start = min(r["arrival"] for r in records.values())
    duration = max(r["finished"] for r in records.values()) - start
    output_tokens = sum(len(r["token_times"]) for r in records.values())
    return dict(
        batching=batching, graceful_degradation=graceful_degradation, num_requests=len(records), duration_s=duration,
        request_throughput=len(records) / duration, output_throughput=output_tokens / duration,
        num_output_tokens=output_tokens,
        **common.percentiles(ttft, "ttft_s"), **common.percentiles(tpot, "tpot_s"),
        **common.percentiles(itl, "itl_s"), **common.percentiles(e2e, "e2e_s"),
        **common.percentiles(queue, "queue_s"), **common.percentiles(step_seconds or [], "step_s"),
        max_concurrency=run["max_num_running"], num_preemptions=run["num_preemptions"],
        kv_live_slot_fraction=run["kv_live_slot_fraction"], mean_kv_cache_usage=run["mean_kv_cache_usage"],
        peak_kv_cache_usage=run["peak_kv_cache_usage"], compilations=run["compilations"],
    )


RATE_FRACTION = 0.7  # of the measured capacity, when --request-rate is not given


async def _stream_one(client, model_name: str, prompt: list[int], max_tokens: int, arrival: float) -> dict:
    """Send one streaming completion at ``arrival`` (monotonic seconds); its timings as :func:`serve` records them."""
    await asyncio.sleep(max(arrival - time.monotonic(), 0.0))
    record = dict(arrival=arrival, token_times=[], first_scheduled=None, finished=None)
    body = dict(model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the server answered {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                record["token_times"].append(time.monotonic())
    record["finished"] = time.monotonic()
    return record


def serve_http(base_url: str, model_name: str, workload: Workload, offsets: np.ndarray) -> dict[str, dict]:
    """:func:`serve` against a server: every request streamed from ``/v1/completions`` at its arrival time."""
    import httpx

    async def run_all() -> list[dict]:
        limits = httpx.Limits(max_connections=len(workload.prompts) + 1, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
            start = time.monotonic()
            return await asyncio.gather(*(
                _stream_one(client, model_name, prompt, n, start + offset)
                for prompt, n, offset in zip(workload.prompts, workload.output_lens, offsets)))

    return {f"http-{i}": record for i, record in enumerate(asyncio.run(run_all()))}


def _scrape(base_url: str) -> dict[str, float]:
    """The unlabelled series of the server's ``/metrics``."""
    import httpx

    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name and not name.startswith("#") and "{" not in name:
            values[name] = float(value)
    return values


def run_http(base_url: str, args: argparse.Namespace, workload: Workload, warmup: Workload,
             rate: Optional[float]) -> tuple[dict, float, float]:
    """:func:`run` against a running server: its warm-up measures capacity, then the workload at ``rate``."""
    import httpx

    model_name = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    start = time.perf_counter()
    serve_http(base_url, model_name, warmup, np.zeros(len(warmup.prompts)))
    capacity = len(warmup.prompts) / (time.perf_counter() - start)
    rate = RATE_FRACTION * capacity if rate is None else rate
    before = _scrape(base_url)
    records = serve_http(base_url, model_name, workload, arrival_offsets(len(workload.prompts), rate,
                                                                          args.burstiness, args.seed))
    after = _scrape(base_url)

    def delta(name: str) -> Optional[int]:
        return int(after[name] - before[name]) if name in after and name in before else None

    run_stats = dict(max_num_running=None, num_preemptions=delta("jaxllm:num_preemptions_total"),
                     kv_live_slot_fraction=None, mean_kv_cache_usage=None, peak_kv_cache_usage=None,
                     compilations=delta("jaxllm:compilations_total"))
    return summarize(records, run_stats, f"server {base_url}"), rate, capacity


def run(model: Path, args: argparse.Namespace, workload: Workload, warmup: Workload, batching: str,
        rate: Optional[float], graceful_degradation: bool = True) -> tuple[dict, float, float]:
    """Warm up, then serve the workload under ``batching`` at ``rate`` requests/s (None: ``RATE_FRACTION`` of the
    warm-up's capacity); returns the summary, the rate and that capacity.
    """
    from jaxllm import LLM, SamplingParams

    llm = LLM(model=model, **common.engine_kwargs(args, batching, graceful_degradation))
    llm.engine.wait_for_warmup()  # every program built before the clock starts
    try:
        start = time.perf_counter()
        llm.generate(warmup.prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                      for n in warmup.output_lens], use_tqdm=False)
        capacity = len(warmup.prompts) / (time.perf_counter() - start)
        rate = RATE_FRACTION * capacity if rate is None else rate
        llm.engine.metrics.begin_run()
        offsets = arrival_offsets(len(workload.prompts), rate, args.burstiness, args.seed)
        records, step_seconds = serve(llm.engine, workload, offsets, prefix=f"{batching}-")
        summary = summarize(records, llm.engine.metrics.run_summary(), batching, graceful_degradation, step_seconds)
        return summary, rate, capacity
    finally:
        llm.engine.metrics.close()


_REPORT = [  # (label, key, higher is better)
    ("request throughput (req/s)", "request_throughput", True),
    ("output throughput (tok/s)", "output_throughput", True),
    ("mean TTFT (s)", "ttft_s_mean", False),
    ("P99 TTFT (s)", "ttft_s_p99", False),
    ("mean TPOT (s)", "tpot_s_mean", False),
    ("P99 TPOT (s)", "tpot_s_p99", False),
    ("P99 ITL (s)", "itl_s_p99", False),
    ("mean E2E latency (s)", "e2e_s_mean", False),
    ("P99 E2E latency (s)", "e2e_s_p99", False),
    ("mean queue time (s)", "queue_s_mean", False),
    ("P99 queue time (s)", "queue_s_p99", False),
    ("P50 engine step (s)", "step_s_p50", False),
    ("P99 engine step (s)", "step_s_p99", False),
    ("memory efficiency (live KV slots)", "kv_live_slot_fraction", True),
    ("mean KV cache usage", "mean_kv_cache_usage", None),
    ("max concurrency (running reqs)", "max_concurrency", None),
    ("preemptions", "num_preemptions", None),
    ("compilations during run", "compilations", None),
]


def improvement(first: float, second: float, higher_is_better: bool) -> str:
    """The first run over the second in %, positive when the first is better (higher or lower as the metric wants)."""
    if second in (None, 0) or first is None:
        return "-"
    change = (first - second) / second if higher_is_better else (second - first) / second
    return f"{100 * change:+.1f}%"


def label(result: dict) -> str:
    """A run's name in the tables: its batching, and its graceful degradation when that was compared."""
    degradation = result.get("graceful_degradation")
    return result["batching"] + ("" if degradation is None else f", degradation {'on' if degradation else 'off'}")


def print_tables(results: list[dict], show_degradation: bool = False) -> None:
    names = [label(r) if show_degradation else r["batching"] for r in results]
    for r, name in zip(results, names):
        print(f"\n{name} batching: {r['num_requests']} requests in {r['duration_s']:.1f} s")
        rows = [[m, r[f"{m}_mean"], r[f"{m}_p50"], r[f"{m}_p90"], r[f"{m}_p99"]]
                for m in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s", "step_s")]
        print(common.format_table(["seconds", "mean", "p50", "p90", "p99"], rows))
        live = r["kv_live_slot_fraction"]
        print(f"request throughput {r['request_throughput']:.3f} req/s, output {r['output_throughput']:.1f} tok/s, "
              f"max concurrency {r['max_concurrency'] if r['max_concurrency'] is not None else '-'}, "
              f"preemptions {r['num_preemptions']}, live KV fraction {'-' if live is None else f'{live:.3f}'}, "
              f"compilations {r['compilations']}")
    if len(results) == 2:
        first, second = results
        rows = [[metric, {True: "higher", False: "lower", None: "-"}[better], first[key], second[key],
                 improvement(first[key], second[key], better) if better is not None else "-"]
                for metric, key, better in _REPORT]
        print()
        print(common.format_table(["metric", "better", *names, "improvement"], rows))
        print(f"improvement: {names[0]} over {names[1]}; positive = {names[0]} better in the metric's better "
              f"direction (a lower latency or a higher throughput), negative = {names[1]} better")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, num_requests=24, input_len=(16, 64), output_len=(16, 128), max_num_seqs=8)
    parser.add_argument("--request-rate", type=float, default=None,
                        help=f"requests per second; inf = all at once; default {100 * RATE_FRACTION:.0f}%% of the "
                             "capacity measured by the warm-up run")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    parser.add_argument("--batching", choices=["continuous", "static"], default="continuous")
    parser.add_argument("--compare", action="store_true", help="run continuous and static at the same arrivals")
    parser.add_argument("--graceful-degradation", action=argparse.BooleanOptionalAction, default=True,
                        help="EngineConfig.graceful_degradation (default on)")
    parser.add_argument("--compare-degradation", action="store_true",
                        help="run continuous batching with graceful degradation on, then off, at the same arrivals")
    parser.add_argument("--base-url", default=None,
                        help="measure the server running at this URL (http://HOST:PORT) instead of an engine in "
                             "this process; --model names the served model")
    args = parser.parse_args(argv)
    if args.base_url and (args.compare or args.compare_degradation):
        parser.error("--compare and --compare-degradation run engines in process; they do not apply to --base-url")
    if args.compare and args.compare_degradation:
        parser.error("--compare and --compare-degradation: choose one")
    common.validate_ranges(parser, args)
    device_note = common.simulate_cpu_devices(args)
    if (args.request_rate is not None and args.request_rate <= 0) or args.burstiness <= 0:
        parser.error("--request-rate and --burstiness must be > 0")
    modes = [(args.batching, args.graceful_degradation)]
    if args.compare:
        modes = [("continuous", args.graceful_degradation), ("static", args.graceful_degradation)]
    if args.compare_degradation:
        modes = [("continuous", True), ("continuous", False)]
    if args.base_url:
        modes = [("server", None)]
    with common.temporary_workdir() as workdir:
        model = common.resolve_model(args, Path(workdir))
        vocab = common.vocab_size(model)
        workload = common.make_workload(args, vocab, token_seed=1)
        warmup = common.make_workload(args, vocab, token_seed=2)
        results, rate, measured = [], args.request_rate, None
        rate_note = f"request rate {rate} req/s (--request-rate)"
        for mode, degradation in modes:
            if args.base_url:
                result, used, capacity = run_http(args.base_url.rstrip("/"), args, workload, warmup, rate)
            else:
                result, used, capacity = run(model, args, workload, warmup, mode, rate, degradation)
            result["measured_capacity"] = capacity
            if rate is None:
                rate, measured = used, capacity
                rate_note = (f"request rate {rate:.3f} req/s = {RATE_FRACTION:.0%} of the capacity {capacity:.3f} "
                             f"req/s that {mode} batching's warm-up measured ({args.num_requests} requests queued at "
                             f"once, same lengths); --request-rate sets it")
            results.append(result)
    print(rate_note)
    print(f"{args.num_requests} requests at {rate:.3f} req/s (burstiness {args.burstiness}), "
          f"input {args.input_len[0]}-{args.input_len[1]}, output {args.output_len[0]}-{args.output_len[1]}, "
          f"max_num_seqs {args.max_num_seqs}")
    host = common.host_info()
    print(common.host_line(host))
    capacities = ", ".join(f"{r['measured_capacity']:.3f}" for r in results)
    print(f"capacity measured by each warm-up (req/s, all its requests queued at once): {capacities}")
    print_tables(results, show_degradation=args.compare_degradation)
    if device_note:
        print(device_note)
    # JSON has no infinity; "inf" is what the flag takes.
    payload = dict(config={**vars(args), "request_rate": str(rate) if np.isinf(rate) else rate},
                   request_rate_note=rate_note, measured_capacity=measured, host=host, results=results)
    common.write_json(args.output_json, payload)
    return payload


if __name__ == "__main__":
    main()
