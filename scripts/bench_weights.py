"""Weight updates and sleep / wake of a running engine (the JAX research API), on the default model.

Prints seconds (median of ``--repeats``) of: ``get_params()`` and its host copy; ``update_weights`` with a host
tree, a device tree and one leaf (bytes placed, device bytes before and after, the largest leaf as the bound
on extra memory); ``update_weights_from_path``; ``sleep``/``wake_up`` at levels 1 and 2 (bytes freed); and a
new ``LLM(model, params=tree)`` for comparison. Each line checks no compilation happened and the greedy
tokens of one prompt are unchanged.

    python scripts/bench_weights.py [--model PATH] [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _bench_common as common  # noqa: E402

PROMPT = "The capital of France is"
# One step program: the weights API does not depend on the bucket ladder, and start-up stays short.
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(64,), precompile=False,
              enable_sleep_mode=True)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(median seconds of ``repeats`` calls, the last call's value)."""
    seconds, value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), value


def device_bytes() -> tuple[int, str]:
    """Bytes held on device 0 and how they were counted."""
    import gc

    import jax

    gc.collect()  # arrays only cycles hold count until collected
    stats = jax.devices()[0].memory_stats()
    if stats:
        return int(stats["bytes_in_use"]), "memory_stats"
    # Arrays can share a buffer (device_put onto an equivalent sharding aliases it): count each buffer once.
    buffers = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            buffers[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return sum(buffers.values()), "live buffers"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def host_copy(llm: Any, repeats: int) -> dict:
    """Time ``get_params`` and its copy to host numpy; returns the copy (the engine's arrays are not kept)."""
    import jax
    import numpy as np

    from jaxllm.core.messages import flatten

    t, params = timed(llm.get_params, repeats)
    leaves = flatten(params)
    largest = max(a.nbytes for a in leaves.values())
    print(f"get_params: {t * 1e3:.2f} ms ({len(leaves)} leaves, the largest {mib(largest)})")
    # Copies, writable: on CPU jax.device_get gives read-only views of the device buffers, which device_put could
    # take back without a copy; a trainer's arrays are its own.
    t, host = timed(lambda: jax.tree_util.tree_map(np.array, jax.device_get(params)), repeats)
    print(f"get_params() to host numpy (copied): {t:.3f} s")
    print(f"an update holds at most one leaf more than the engine's weights meanwhile: {mib(largest)}")
    return host


def timed_update(llm: Any, tree: Any, settled: Callable[[Any], Any], repeats: int) -> str:
    """``update_weights(tree)``: seconds, bytes placed, device bytes before and after, as one line's text."""
    before, how = device_bytes()
    t, report = timed(lambda: settled(llm.update_weights(tree)), repeats)
    after, _ = device_bytes()
    return (f"{t:.3f} s, {mib(report['num_bytes'])} placed ({report['num_bytes'] / t / 2**30:.2f} GiB/s); device "
            f"bytes ({how}) {mib(before)} before, {mib(after)} after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder or GGUF (default: the default model)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax

    from jaxllm import LLM, SamplingParams
    from jaxllm.named_models import resolve_model

    model = resolve_model(args.model)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    llm = LLM(model, **ENGINE)
    runner = llm.engine.runner

    def tokens() -> list[int]:
        return llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids

    def settled(value: Any) -> Any:
        """``value`` once the engine's arrays are ready (transfers are asynchronous)."""
        jax.block_until_ready((runner.weights.params, runner.cache_engine.kv_cache))
        return value

    reference = tokens()
    compiled = runner.compile_stats.num_compilations
    print(f"model {model}; backend {jax.default_backend()}; {llm.engine.param_bytes['total'] / 2**20:.1f} MiB of "
          f"parameters; {compiled} programs built")

    host = host_copy(llm, args.repeats)
    for name, make in [("whole tree, host numpy", lambda: host),
                       ("whole tree, device arrays", lambda: settled(jax.device_put(host))),
                       ("one leaf (layers/wq), host numpy", lambda: {"layers": {"wq": host["layers"]["wq"]}})]:
        print(f"update_weights ({name}): {timed_update(llm, make(), settled, args.repeats)}; "
              f"programs built since start-up: {runner.compile_stats.num_compilations - compiled}")

    t, report = timed(lambda: settled(llm.update_weights_from_path(model)), 1)
    print(f"update_weights_from_path: {t:.3f} s ({report['num_leaves']} leaves, {mib(report['num_bytes'])})")

    for level in (1, 2):
        before, how = device_bytes()
        t_sleep, reports = timed(lambda: llm.sleep(level=level), 1)
        asleep, _ = device_bytes()
        restore = 0.0
        if level == 2:
            restore, _ = timed(lambda: settled(llm.update_weights(host)), 1)
        t_wake, _ = timed(lambda: settled(llm.wake_up()), 1)
        print(f"sleep(level={level}): {t_sleep:.3f} s, {mib(reports[0]['freed_bytes'])} of arrays freed; device "
              f"bytes ({how}) {mib(before)} -> {mib(asleep)} asleep; "
              + (f"update_weights (restore) {restore:.3f} s; " if level == 2 else "")
              + f"wake_up {t_wake:.3f} s; programs built since start-up: {runner.compile_stats.num_compilations - compiled}")

    print(f"greedy tokens after every update and wake-up identical to before: {tokens() == reference}")
    t, fresh = timed(lambda: LLM(model, params=host, **ENGINE), 1)
    print(f"instead: a new LLM(model, params=tree) starts in {t:.2f} s (before its first step compiles)")
    print(common.host_line(common.host_info()))


if __name__ == "__main__":
    main()
