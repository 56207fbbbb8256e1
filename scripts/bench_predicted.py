"""Predicted output lengths (``scheduling_policy="predicted"``, ``reserve_predicted_output``) against fcfs, sjf and an
oracle, on a workload whose output length follows its template.

Usage: python scripts/bench_predicted.py [--requests N] [--rate R] [--seed S] [--aging B] [--no-graceful-degradation]
                                         [--shuffle-lengths]

A simulation (no model): the real ``Scheduler`` with a fake model on a simulated clock (a step of T tokens
takes ``STEP_BASE_S + STEP_PER_TOKEN_S * T`` s). Poisson arrivals at R/s (default 35, an overload); three
templates with outputs around 16, 128 or 512 tokens; a cache of 1024 blocks, so the batch preempts.
``--shuffle-lengths`` is the control (lengths shuffled across requests).

Policies on the same arrivals: fcfs, sjf (by prompt length), predicted and oracle (each of the last two also
with ``reserve_predicted_output``). Columns: mean and P99 end-to-end latency and TTFT (simulated s),
throughput, preemptions, the predictor's mean absolute error (tokens), the mean latency's place between fcfs
(0%) and the oracle (100%), and host CPU seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

# Import this checkout's scheduler/, not whatever an editable install points at.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _bench_common as common  # noqa: E402
from scheduler import PredictedPolicy, Request, SamplingParams, Scheduler, SchedulerConfig  # noqa: E402

STEP_BASE_S = 4e-3
STEP_PER_TOKEN_S = 40e-6
EOS = 0
MAX_TOKENS = 1024
TEMPLATE_OUTPUT_TOKENS = (16, 128, 512)
CONFIG = dict(num_blocks=1025, block_size=16, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048)


def make_workload(num_requests: int, rate: float, seed: int, shuffle: bool) -> list[tuple[float, list[int], int]]:
    """``(arrival s, prompt ids, true output length)`` per request, by arrival (``shuffle``: lengths permuted)."""
    rng = np.random.default_rng(seed)
    header = rng.integers(1, 32000, 16).tolist()
    systems = [header + rng.integers(1, 32000, 40).tolist() for _ in TEMPLATE_OUTPUT_TOKENS]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    templates = rng.integers(0, len(TEMPLATE_OUTPUT_TOKENS), num_requests)
    workload = []
    for arrival, t in zip(arrivals.tolist(), templates.tolist()):
        user = rng.integers(1, 32000, int(rng.integers(16, 257))).tolist()
        length = int(np.clip(round(TEMPLATE_OUTPUT_TOKENS[t] * rng.lognormal(0.0, 0.3)), 1, MAX_TOKENS - 1))
        workload.append((arrival, systems[t] + user, length))
    if shuffle:
        lengths = rng.permutation([length for _, _, length in workload]).tolist()
        workload = [(arrival, prompt, length) for (arrival, prompt, _), length in zip(workload, lengths)]
    return workload


def simulate(workload, policy, reserve: bool, oracle: bool, degradation: bool) -> dict[str, float]:
    """Run ``workload`` through a fresh ``Scheduler``; returns the table's numbers for one policy."""
    clock = [0.0]
    config = SchedulerConfig(**CONFIG, scheduling_policy=policy, reserve_predicted_output=reserve,
                             graceful_degradation=degradation)
    sched = Scheduler(config, clock=lambda: clock[0])
    cpu_start = time.process_time()
    true_len, arrival, ttft, e2e = {}, {}, {}, {}
    nxt = 0
    while nxt < len(workload) or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests():
            clock[0] = max(clock[0], workload[nxt][0])
        while nxt < len(workload) and workload[nxt][0] <= clock[0]:
            nxt = _add(sched, workload, nxt, oracle, true_len, arrival)
        out = sched.schedule()
        tokens = [EOS if r.num_output_tokens + 1 >= true_len[r.request_id] else 1 for r in out.requests]
        clock[0] += STEP_BASE_S + STEP_PER_TOKEN_S * out.total_num_scheduled_tokens
        for req in sched.update_from_output(out, tokens):
            rid = req.request_id
            ttft.setdefault(rid, clock[0] - arrival[rid])
            if req.is_finished:
                e2e[rid] = clock[0] - arrival[rid]
    summary = _summary(sched, ttft, e2e, clock[0] - workload[0][0], sum(true_len.values()))
    summary["host_s"] = time.process_time() - cpu_start
    return summary


def _add(sched: Scheduler, workload, i: int, oracle: bool, true_len: dict, arrival: dict) -> int:
    """Add request ``i`` (for the oracle, with its true length as its prediction); returns ``i + 1``."""
    at, prompt, length = workload[i]
    rid = f"r{i}"
    req = Request(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS), eos_token_id=EOS, arrival_time=at)
    sched.add_request(req)
    if oracle:
        req.predicted_output_tokens = length
    true_len[rid], arrival[rid] = length, at
    return i + 1


def _summary(sched: Scheduler, ttft: dict, e2e: dict, seconds: float, output_tokens: int) -> dict[str, float]:
    e, t, stats = np.array(list(e2e.values())), np.array(list(ttft.values())), sched.stats
    return dict(
        e2e_mean=e.mean(), e2e_p99=np.percentile(e, 99), ttft_mean=t.mean(), ttft_p99=np.percentile(t, 99),
        req_s=len(e) / seconds, tok_s=output_tokens / seconds, preemptions=stats.num_preemptions,
        mae=stats.prediction_abs_error_tokens / max(stats.num_predicted_finished, 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=35.0, help="Poisson arrivals per simulated second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aging", type=float, default=4.0, help="PredictedPolicy aging_per_arrival (steps)")
    parser.add_argument("--no-graceful-degradation", action="store_true")
    parser.add_argument("--shuffle-lengths", action="store_true", help="lengths independent of the template")
    args = parser.parse_args()
    workload = make_workload(args.requests, args.rate, args.seed, args.shuffle_lengths)
    budget = CONFIG["max_num_batched_tokens"]
    predicted = lambda: PredictedPolicy(args.aging, budget)  # noqa: E731 -- a fresh policy per run
    runs = [
        ("fcfs", "fcfs", False, False), ("sjf", "sjf", False, False), ("predicted", predicted(), False, False),
        ("predicted+reserve", predicted(), True, False), ("oracle", predicted(), False, True),
        ("oracle+reserve", predicted(), True, True),
    ]
    print(f"simulated: {args.requests} requests, Poisson {args.rate}/s, seed {args.seed}, aging_per_arrival "
          f"{args.aging}; step = {STEP_BASE_S * 1e3:g} ms + {STEP_PER_TOKEN_S * 1e6:g} us/token; {CONFIG}, "
          f"graceful_degradation={not args.no_graceful_degradation}, shuffled lengths: {args.shuffle_lengths}")
    print(f"{'policy':18s} {'e2e mean':>9s} {'e2e p99':>8s} {'ttft mean':>9s} {'ttft p99':>8s} {'req/s':>6s} "
          f"{'tok/s':>6s} {'preempt':>7s} {'pred MAE':>8s} {'fcfs->oracle':>12s} {'host s':>6s}")
    degradation = not args.no_graceful_degradation
    results = {name: simulate(workload, policy, reserve, oracle, degradation) for name, policy, reserve, oracle in runs}
    span = results["fcfs"]["e2e_mean"] - results["oracle"]["e2e_mean"]
    for name, r in results.items():
        gain = (results["fcfs"]["e2e_mean"] - r["e2e_mean"]) / span if span else float("nan")
        print(f"{name:18s} {r['e2e_mean']:9.2f} {r['e2e_p99']:8.2f} {r['ttft_mean']:9.2f} {r['ttft_p99']:8.2f} "
              f"{r['req_s']:6.2f} {r['tok_s']:6.0f} {r['preemptions']:7d} {r['mae']:8.1f} {gain:11.0%} {r['host_s']:6.2f}")
    print(common.host_line(common.host_info()))


if __name__ == "__main__":
    main()
