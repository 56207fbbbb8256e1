"""Host time of one scheduler step: schedule() + build_batch() + update_from_output().

Usage: python scripts/bench_scheduler.py [--steps N] [--running R] [--budget T] [--runs K]

Scenarios with R requests running and a T-token budget, the model replaced by precomputed token ids:
  decode: every request decoding one token, nothing preempted.
  mixed:  requests finish after 32-128 tokens and fresh 300-token prompts take their seats.
Each runs K times on a fresh scheduler; the table shows the median over runs of each run's median and p99
(microseconds per step) per phase and in all, each phase's share, "total_cpu" (thread CPU time) and
"scheduled" (reading ``SchedulerOutput.scheduled``, not in the total). The ``host:`` lines give the load.
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
from scheduler import BucketTable, Request, SamplingParams, Scheduler, SchedulerConfig, build_batch  # noqa: E402

BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
PHASES = ("schedule", "build_batch", "update", "total", "total_cpu", "scheduled")


def make_scheduler(running: int, budget: int, num_blocks: int) -> tuple[Scheduler, BucketTable]:
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=running,
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
    )
    buckets = BucketTable.from_limits(budget, running, config.max_model_len, config.block_size)
    return Scheduler(config), buckets


def bench(sched: Scheduler, buckets: BucketTable, steps: int, refill) -> dict[str, np.ndarray]:
    """Time ``steps`` steps; returns microseconds per step for each phase, and rows and tokens per step."""
    rng = np.random.default_rng(0)
    samples = rng.integers(1, 32000, size=(64, sched.config.max_num_seqs), dtype=np.int32)
    times = np.empty((steps, 5))
    rows = np.empty(steps)
    tokens = np.empty(steps)
    clock, cpu_clock = time.perf_counter, time.thread_time
    for i in range(steps):
        refill()
        c0 = cpu_clock()
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        build_batch(out, buckets)
        t2 = clock()
        sched.update_from_output(out, samples[i % 64])
        t3 = clock()
        c3 = cpu_clock()
        out.scheduled  # noqa: B018 -- what reading the row objects costs
        times[i] = (t1 - t0, t2 - t1, t3 - t2, clock() - t3, c3 - c0)
        rows[i] = out.num_seqs
        tokens[i] = out.total_num_scheduled_tokens
    us = times * 1e6
    result = dict(zip(("schedule", "build_batch", "update", "scheduled", "total_cpu"), us.T))
    result["total"] = us[:, :3].sum(axis=1)
    result["num_seqs"] = rows
    result["num_tokens"] = tokens
    return result


def decode_scenario(running: int, budget: int, steps: int) -> dict[str, np.ndarray]:
    warmup = 50
    max_prompt = 512
    blocks_each = -(-(max_prompt + warmup + steps + 1) // BLOCK_SIZE) + 1
    sched, buckets = make_scheduler(running, budget, running * blocks_each + 1)
    rng = np.random.default_rng(1)
    for i in range(running):
        prompt = rng.integers(1, 32000, size=int(rng.integers(64, max_prompt))).tolist()
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=steps + 1000, ignore_eos=True)))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.waiting:
        out = sched.schedule()
        sched.update_from_output(out, np.ones(out.num_seqs, dtype=np.int32))
    bench(sched, buckets, warmup, refill=lambda: None)
    result = bench(sched, buckets, steps, refill=lambda: None)
    assert sched.num_preemptions == 0 and len(sched.running) == running
    return result


def mixed_scenario(running: int, budget: int, steps: int) -> dict[str, np.ndarray]:
    prompt_len, max_output = 300, 128
    sched, buckets = make_scheduler(running, budget, running * -(-(prompt_len + max_output) // BLOCK_SIZE) + 1)
    rng = np.random.default_rng(2)
    counter = iter(range(10**9))

    def refill():
        while sched.num_unfinished_requests < running + 8:
            prompt = rng.integers(1, 32000, size=prompt_len).tolist()
            params = SamplingParams(max_tokens=int(rng.integers(32, max_output)), ignore_eos=True)
            sched.add_request(Request(f"m{next(counter)}", prompt, params))

    bench(sched, buckets, 300, refill)  # reach a steady mix first
    return bench(sched, buckets, steps, refill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3, help="fresh runs per scenario; medians over runs are shown")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    print(
        f"scheduler step host time: {args.running} running requests, budget {args.budget} tokens, "
        f"block_size {BLOCK_SIZE}, {args.steps} steps x {args.runs} runs"
    )
    header = " ".join(f"{p:>13s}" for p in PHASES)
    print(f"{'':8s} {'rows':>5s} {'tokens':>6s}  {header}   (median / p99 us per step)")
    for name, fn in (("decode", decode_scenario), ("mixed", mixed_scenario)):
        runs = [fn(args.running, args.budget, args.steps) for _ in range(args.runs)]
        med = {p: float(np.median([np.median(r[p]) for r in runs])) for p in PHASES}
        p99 = {p: float(np.median([np.percentile(r[p], 99) for r in runs])) for p in PHASES}
        rows = np.median([np.median(r["num_seqs"]) for r in runs])
        tokens = np.median([np.median(r["num_tokens"]) for r in runs])
        cells = " ".join(f"{med[p]:6.0f}/{p99[p]:6.0f}" for p in PHASES)
        print(f"{name:8s} {rows:5.0f} {tokens:6.0f}  {cells}")
        shares = ", ".join(f"{p} {med[p] / med['total']:.0%}" for p in ("schedule", "build_batch", "update"))
        print(f"{'':8s} share of the median total: {shares}")
    print(common.host_line(common.host_info()))
    print(f"1-minute load average at the start: {load_start:.1f}")


if __name__ == "__main__":
    main()
