"""Multi-turn chat against a device KV pool too small for the live histories: the prefix cache's host tier
(``--kv-offloading-size``) off and on, side by side.

Usage: python scripts/bench_multiturn.py [--model PATH] [--conversations 16] [--turns 8] [--system-len 64]
           [--user-len 16] [--output-len 16] [--max-num-seqs 4] [--num-kv-blocks N] [--kv-offloading-size GIB]
           [--output-json FILE]

Each conversation resends its whole history plus ``--user-len`` new tokens as soon as its previous answer
is complete (closed loop), asking for ``--output-len`` greedy tokens. The device pool defaults to a quarter
of the final histories' blocks (at least every seat's longest), the tier to room for all.

Prints per configuration: TTFT P50/P99 (s), output tokens/s, prefill tokens computed, hits by tier,
preemptions, blocks offloaded/loaded, the loop's seconds on tier copies, and whether every answer
equals the tier-off run's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import _bench_common as common

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "tests" / "fixtures" / "stories260K"


def conversations(args: argparse.Namespace, vocab: int, seed: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and each conversation's user turns (random token ids in [3, vocab))."""
    rng = np.random.default_rng(seed)
    system = [1] + rng.integers(3, vocab, args.system_len - 1).tolist()
    users = [[rng.integers(3, vocab, args.user_len).tolist() for _ in range(args.turns)]
             for _ in range(args.conversations)]
    return system, users


def chat(engine, system: list[int], users: list[list[list[int]]], output_len: int, prefix: str) -> dict:
    """Run every conversation to its last turn; returns each turn's TTFT (seconds) and answers, and the wall time."""
    from jaxllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    histories = [list(system) for _ in users]
    turn = [0] * len(users)
    answers: dict[str, list[int]] = {}
    submitted: dict[str, float] = {}
    ttft: list[float] = []

    def submit(c: int) -> None:
        histories[c] += users[c][turn[c]]
        rid = f"{prefix}{c}-{turn[c]}"
        submitted[rid], answers[rid] = time.monotonic(), []
        engine.add_request(rid, list(histories[c]), params, arrival_time=submitted[rid])

    start = time.monotonic()
    for c in range(len(users)):
        submit(c)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            if out.delta_token_ids and not answers[out.request_id]:
                ttft.append(now - submitted[out.request_id])
            answers[out.request_id] += out.delta_token_ids
            if out.finished:
                if not answers[out.request_id]:
                    raise RuntimeError(f"request {out.request_id} produced no token (too long for the KV pool?)")
                c = int(out.request_id[len(prefix):].split("-")[0])
                histories[c] += answers[out.request_id]
                turn[c] += 1
                if turn[c] < len(users[c]):
                    submit(c)
    return dict(ttft=ttft, answers=answers, seconds=time.monotonic() - start)


def tier_copies(tier) -> tuple[int, int]:
    """The host tier's blocks offloaded and loaded so far; zeros without a tier."""
    return (0, 0) if tier is None else (tier.num_offloaded, tier.num_loaded)


def run(args: argparse.Namespace, offloading_gib: float) -> dict:
    """One configuration: warm up, chat, and read the core's counters."""
    from jaxllm import LLM

    llm = LLM(model=str(args.model), max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              dtype="float32", kv_offloading_size=offloading_gib, precompile=True)
    engine = llm.engine
    engine.wait_for_warmup()
    try:
        vocab = common.vocab_size(args.model)
        system, users = conversations(args, vocab, seed=1)
        chat(engine, system, users[:1], args.output_len, prefix="warmup-")
        tier = engine.core.scheduler.block_pool.host_tier
        before, copies_before = engine.metrics.core_stats[0], tier_copies(tier)
        written_before = engine.core.offload_write_seconds
        system, users = conversations(args, vocab, seed=0)
        result = chat(engine, system, users, args.output_len, prefix="c")
        after = engine.metrics.core_stats[0]
        offloaded, loaded = (a - b for a, b in zip(tier_copies(tier), copies_before))
        written = engine.core.offload_write_seconds - written_before
    finally:
        engine.metrics.close()
    delta = {f: getattr(after, f) - getattr(before, f) for f in (
        "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hits_host", "num_preemptions",
        "kv_offload_seconds_to_host", "kv_offload_seconds_to_device")}
    output_tokens = sum(len(a) for a in result["answers"].values())
    return dict(
        kv_offloading_size=offloading_gib, host_tier_blocks=after.num_offload_blocks,
        ttft_p50_s=float(np.percentile(result["ttft"], 50)), ttft_p99_s=float(np.percentile(result["ttft"], 99)),
        output_throughput=output_tokens / result["seconds"], duration_s=result["seconds"],
        prefill_tokens_computed=delta["prefix_cache_queries"] - delta["prefix_cache_hits"],
        device_hit_tokens=delta["prefix_cache_hits"] - delta["prefix_cache_hits_host"],
        host_hit_tokens=delta["prefix_cache_hits_host"], preemptions=delta["num_preemptions"],
        offloaded_blocks=offloaded, loaded_blocks=loaded,
        offload_seconds_before_dispatch=delta["kv_offload_seconds_to_host"] - written,
        offload_seconds_after_dispatch=written,
        offload_seconds_to_device=delta["kv_offload_seconds_to_device"],
        answers=result["answers"],
    )


_ROWS = [  # (label, key)
    ("TTFT P50 (s)", "ttft_p50_s"),
    ("TTFT P99 (s)", "ttft_p99_s"),
    ("output throughput (tok/s)", "output_throughput"),
    ("prefill tokens computed", "prefill_tokens_computed"),
    ("device-tier hit tokens", "device_hit_tokens"),
    ("host-tier hit tokens", "host_hit_tokens"),
    ("preemptions", "preemptions"),
    ("blocks offloaded", "offloaded_blocks"),
    ("blocks loaded", "loaded_blocks"),
    ("loop s on offloads before dispatch", "offload_seconds_before_dispatch"),
    ("loop s on offloads after dispatch", "offload_seconds_after_dispatch"),
    ("loop s on loads (before dispatch)", "offload_seconds_to_device"),
    ("host-tier blocks", "host_tier_blocks"),
    ("wall time (s)", "duration_s"),
]


def print_table(results: list[dict], names: list[str]) -> None:
    rows = [[label] + [r[key] for r in results] for label, key in _ROWS]
    same = ["yes" if r["answers"] == results[0]["answers"] else "NO" for r in results]
    rows.append(["answers equal the tier-off run's"] + same)
    print(common.format_table(["metric", *names], rows))
    off, on = results[0], results[1]
    ratio = off["prefill_tokens_computed"] / max(on["prefill_tokens_computed"], 1)
    print(f"prefill tokens computed: {ratio:.2f}x fewer with the tier; TTFT P99 "
          f"{off['ttft_p99_s']:.4f} s -> {on['ttft_p99_s']:.4f} s")


def final_history_blocks(args: argparse.Namespace) -> int:
    """Blocks the final histories of every conversation take together (block size 16)."""
    tokens = args.system_len + args.turns * (args.user_len + args.output_len)
    return args.conversations * -(-tokens // 16)


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=STORIES)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=64)
    p.add_argument("--user-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: a quarter of the final histories' blocks")
    p.add_argument("--kv-offloading-size", type=float, default=0.01, help="GiB of the tier in the 'on' run")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    args.max_model_len = args.system_len + args.turns * (args.user_len + args.output_len)
    if args.num_kv_blocks is None:
        # A quarter of the histories, but room for every seat's longest history (and the null block).
        args.num_kv_blocks = max(final_history_blocks(args) // 4,
                                 args.max_num_seqs * final_history_blocks(args) // args.conversations) + 1
    for name in ("conversations", "turns", "system_len", "user_len", "output_len", "max_num_seqs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.kv_offloading_size <= 0:
        p.error(f"--kv-offloading-size={args.kv_offloading_size} must be > 0 (the 'on' run's tier)")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    print(f"{args.conversations} conversations x {args.turns} turns, histories up to {args.max_model_len} tokens; "
          f"device pool {args.num_kv_blocks} blocks (final histories: {final_history_blocks(args)}), "
          f"max_num_seqs {args.max_num_seqs}")
    results = [run(args, 0.0), run(args, args.kv_offloading_size)]
    names = ["tier off", f"tier on ({args.kv_offloading_size} GiB)"]
    print_table(results, names)
    host = common.host_info()
    print(common.host_line(host))
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "host": host,
               "results": [{k: v for k, v in r.items() if k != "answers"} for r in results],
               "answers_equal": all(r["answers"] == results[0]["answers"] for r in results)}
    common.write_json(args.output_json, payload)
    return payload


if __name__ == "__main__":
    main()
