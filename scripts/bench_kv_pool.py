"""Time the elastic KV pool: a compaction of a full pool and a resize, on an engine over stories260K (or --model).

The pool is filled with live blocks (every non-null block taken, then a fraction freed at random, the rest held as
pins), so a compaction moves every live block above the live count into a hole below it. For each pool size and
live fraction the table gives the moves, the host plan (``Scheduler.compact_kv_cache``: renumbering and the block
tables), the device copies with the warm ``BLOCK_CHUNK`` copy program (what ``LLM.kv_cache_compact`` runs) and,
for comparison, with a copy program of ``--wide-chunk`` blocks built for this script, then the whole
``EngineCore.kv_cache_compact`` call. A second table times ``kv_cache_resize`` (shrinks compact first) and counts
the programs it rebuilds.

Usage: python scripts/bench_kv_pool.py [--model DIR] [--num-blocks 4096 16384] [--block-size 16]
                                       [--live 0.5 0.9] [--wide-chunk 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _bench_common as common  # noqa: E402
from jaxllm import LLM  # noqa: E402  (after the path fix so the checkout's package is used)
from jaxllm.worker import kv_cache  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def fill(core, live: float, rng: np.random.Generator) -> None:
    """Take every free block, then free a random ``1 - live`` of them: the rest stay held as pins."""
    sched = core.scheduler
    sched.kv_cache_manager.release_pinned_prefixes()
    pool = sched.block_pool
    blocks = pool.get_new_blocks(pool.num_free_blocks)
    keep = rng.random(len(blocks)) < live
    pool.free_blocks([b for b, k in zip(blocks, keep) if not k])
    sched.kv_cache_manager.pinned_blocks = [b for b, k in zip(blocks, keep) if k]


def time_copies(runner, moves, chunk: int) -> float:
    """Seconds to do ``moves`` on the device in chunks of ``chunk`` blocks (the program built beforehand)."""
    saved = kv_cache.BLOCK_CHUNK
    kv_cache.BLOCK_CHUNK = chunk
    runner.cache_engine._ops.pop("copy", None)
    try:
        runner.cache_engine.copy_blocks(moves[:1])  # build the program outside the timing
        jax.block_until_ready(runner.cache_engine.kv_cache)
        start = time.perf_counter()
        runner.cache_engine.copy_blocks(moves)
        jax.block_until_ready(runner.cache_engine.kv_cache)
        return time.perf_counter() - start
    finally:
        kv_cache.BLOCK_CHUNK = saved
        runner.cache_engine._ops.pop("copy", None)
        runner.cache_engine.copy_blocks(moves[:1])


def compaction_rows(llm, num_blocks: int, live: float, wide: int, repeats: int):
    core = llm.engine.core
    rng = np.random.default_rng(0)
    best = None
    for _ in range(repeats):
        fill(core, live, rng)
        start = time.perf_counter()
        moves = core.scheduler.compact_kv_cache()
        plan = time.perf_counter() - start
        fill(core, live, rng)
        moves = core.scheduler.compact_kv_cache()
        narrow = time_copies(core.runner, moves, kv_cache.BLOCK_CHUNK)
        wide_s = time_copies(core.runner, moves, wide)
        fill(core, live, rng)
        whole = core.kv_cache_compact()
        row = (len(moves), plan, narrow, wide_s, whole["seconds"], whole["num_moved_blocks"])
        best = row if best is None or row[4] < best[4] else best
    core.scheduler.kv_cache_manager.release_pinned_prefixes()
    return best


def resize_rows(llm, num_blocks: int):
    core = llm.engine.core
    rows = []
    for target in (num_blocks // 2, num_blocks):
        fill(core, 0.25, np.random.default_rng(1))
        report = core.kv_cache_resize(target)
        rows.append((num_blocks if target == num_blocks // 2 else num_blocks // 2, target, report["num_moved_blocks"],
                     report["num_compilations"], report["seconds"]))
        core.scheduler.kv_cache_manager.release_pinned_prefixes()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "stories260K"))
    parser.add_argument("--num-blocks", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--live", type=float, nargs="+", default=[0.5, 0.9])
    parser.add_argument("--wide-chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"backend {jax.default_backend()}, model {Path(args.model).name}, block_size {args.block_size}, "
          f"copy chunk {kv_cache.BLOCK_CHUNK} (warm) vs {args.wide_chunk}; best of {args.repeats}")
    print(f"{'blocks':>7} {'MiB':>7} {'live':>5} {'moved':>6} {'plan ms':>8} {'copy ms':>8} "
          f"{'wide ms':>8} {'compact ms':>10}")
    resizes = []
    for num_blocks in args.num_blocks:
        llm = LLM(args.model, num_kv_blocks=num_blocks, block_size=args.block_size, max_model_len=256,
                  max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(16,), precompile=True)
        mib = sum(c.nbytes for c in llm.engine.core.runner.cache_engine.kv_cache) / 2**20
        for live in args.live:
            moved, plan, narrow, wide, whole, _ = compaction_rows(llm, num_blocks, live, args.wide_chunk, args.repeats)
            print(f"{num_blocks:>7} {mib:>7.1f} {live:>5.2f} {moved:>6} {plan * 1e3:>8.1f} {narrow * 1e3:>8.1f} "
                  f"{wide * 1e3:>8.1f} {whole * 1e3:>10.1f}")
        resizes += resize_rows(llm, num_blocks)
    print(f"\n{'from':>7} {'to':>7} {'moved':>6} {'programs':>8} {'resize s':>8}")
    for old, new, moved, programs, seconds in resizes:
        print(f"{old:>7} {new:>7} {moved:>6} {programs:>8} {seconds:>8.2f}")
    print(common.host_line(common.host_info()))


if __name__ == "__main__":
    main()
