"""Host time of one scheduler step: schedule() + build_batch() + update_from_output().

Usage: python scripts/bench_scheduler.py [--steps N] [--running R] [--budget T]

Scenarios (both with R requests in the batch and a T-token budget):
  decode: every request decoding (one token each), as in steady-state serving.
  mixed:  requests finish after a few tokens and fresh 300-token prompts
          replace them, so chunked prefill shares each step with decodes.
Prints median and p99 microseconds per step. The model is replaced by a
precomputed array of token ids, so only host work is timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

# Import this checkout's scheduler/, not whatever an editable install points at.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scheduler import BucketTable, Request, SamplingParams, Scheduler, SchedulerConfig, build_batch  # noqa: E402


def make_scheduler(running: int, budget: int) -> tuple[Scheduler, BucketTable]:
    config = SchedulerConfig(
        num_blocks=running * 40,
        block_size=16,
        max_num_seqs=running,
        max_num_batched_tokens=budget,
        max_model_len=4096,
    )
    buckets = BucketTable.from_limits(budget, running, config.max_model_len, config.block_size)
    return Scheduler(config), buckets


def bench(sched: Scheduler, buckets: BucketTable, steps: int, refill) -> np.ndarray:
    rng = np.random.default_rng(0)
    samples = rng.integers(1, 32000, size=(64, sched.config.max_num_seqs), dtype=np.int32)
    times = np.empty(steps)
    for i in range(steps):
        refill(i)
        t0 = time.perf_counter()
        out = sched.schedule()
        build_batch(out, buckets)
        sched.update_from_output(out, samples[i % 64])
        times[i] = time.perf_counter() - t0
    return times * 1e6


def decode_scenario(running: int, budget: int, steps: int) -> np.ndarray:
    sched, buckets = make_scheduler(running, budget)
    rng = np.random.default_rng(1)
    for i in range(running):
        prompt = rng.integers(1, 32000, size=int(rng.integers(64, 512))).tolist()
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=steps + 1000, ignore_eos=True)))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.waiting:
        out = sched.schedule()
        sched.update_from_output(out, np.ones(len(out.scheduled), dtype=np.int32))
    return bench(sched, buckets, steps, refill=lambda i: None)


def mixed_scenario(running: int, budget: int, steps: int) -> np.ndarray:
    sched, buckets = make_scheduler(running, budget)
    rng = np.random.default_rng(2)
    counter = iter(range(10**9))

    def refill(_):
        while sched.num_unfinished_requests < running + 8:
            prompt = rng.integers(1, 32000, size=300).tolist()
            max_tokens = int(rng.integers(8, 64))
            sched.add_request(Request(f"m{next(counter)}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))

    bench(sched, buckets, 200, refill)  # reach a steady mix first
    return bench(sched, buckets, steps, refill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--budget", type=int, default=2048)
    args = parser.parse_args()
    for name, fn in (("decode", decode_scenario), ("mixed", mixed_scenario)):
        us = fn(args.running, args.budget, args.steps)
        print(
            f"{name:6s} running={args.running} budget={args.budget} steps={args.steps}: "
            f"median {np.median(us):7.1f} us  p99 {np.percentile(us, 99):7.1f} us per schedule+build_batch+update"
        )


if __name__ == "__main__":
    main()
