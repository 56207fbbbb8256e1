"""Decode attention alone on the CPU: the C++ kernel's KV bytes per second against the host's memory stream rate.

A decode step reads every running sequence's K and V once per layer, so on a CPU its attention is bounded by how
fast the host streams memory. For a few batches (``--rows`` sequences of one new token each, contexts drawn
uniformly in ``--context MIN MAX``) this times ``kernels_pallas.attention.cpu``'s kernel on the model's
head shape (``--model``'s query heads, KV heads and head dim), its blocks anywhere in a cache of the rows' blocks
(block size 16). A round calls it once per layer, each layer's cache its own (``--layers``; by default as many as
make the caches together pass 512 MB, at most the model's layers), so that the K and V come from memory as in a step
(for a batch of a few short rows, whose 30 layers may not fill much more than an L3, less surely) rather than from
the CPU's last-level cache as one layer's alone would (on a 32 MiB L3 a 16-row batch at contexts 600-1500, 25 MB a
layer, measured about twice as fast alone as among 30 layers). It prints the fastest of ``--rounds`` rounds divided
by its layers, the KV bytes a layer attends over (every row's K and V) divided by that time, and what share that is
of the stream rate measured in the same run: numpy ``sum`` over a 400 MB float32 array in one share per CPU this
process may run on, all at once (the best of three). Every dtype gets the same batch of a row count (its lengths and
tables). With ``--shared-prefix N`` every row's first N tokens (whole blocks) are the same blocks, as prefix caching
leaves a shared system prompt: those bytes come from the CPU's caches after the first row, so the share can pass
100%. ``scripts/profile_step.py`` has the whole step; this is its part that the memory's rate bounds (or, with a
shared prefix, the kernel's own arithmetic).

    python scripts/bench_cpu_attention.py [--model PATH] [--rows 1 32 192] [--context 400 830]
                                          [--shared-prefix 0] [--dtype float32 bfloat16] [--rounds 50]
                                          [--layers N]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _bench_common as common  # noqa: E402

BLOCK_SIZE = 16
STREAM_BYTES = 400_000_000
DRAM_BYTES = 512_000_000  # the layers' caches together, by default: about 15 times a 32 MiB L3


def stream_gbps(threads: int) -> float:
    """GB/s (10^9 bytes per second) that ``threads`` numpy sums read at once, each over its own share of one
    float32 array of STREAM_BYTES (the best of three rounds): the read half of McCalpin's STREAM idea, with the
    threads the kernel would have. Raises nothing (MemoryError where the host cannot hold the array)."""
    parts = np.array_split(np.ones(STREAM_BYTES // 4, np.float32), threads)
    best = float("inf")
    for _ in range(3):
        workers = [threading.Thread(target=np.sum, args=(part,)) for part in parts]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return STREAM_BYTES / best / 1e9


def default_layers(layer_bytes: int, num_layers: int) -> int:
    """Caches a round calls by default: the fewest of ``layer_bytes`` each (one layer's K and V, bytes) that pass
    DRAM_BYTES together, at most ``num_layers`` (the model's) and at least 1. Raises nothing."""
    return max(1, min(num_layers, -(-DRAM_BYTES // max(1, layer_bytes))))


def decode_batch(rng: np.random.Generator, rows: int, context: tuple[int, int], q_heads: int, kv_heads: int,
                 head_dim: int, dtype, shared_blocks: int = 0):
    """A decode step of ``rows`` sequences, context lengths uniform in ``context`` (tokens, both ends included),
    as ``cpu.ragged_paged_attention_cpu`` takes it: q float32 [rows, q_heads, head_dim]; k_cache and v_cache
    [N, BLOCK_SIZE, kv_heads, head_dim] in ``dtype``, a bfloat16 cache as its uint16 bits, as the engine holds it
    on the CPU (a bfloat16 operand is copied by XLA on every call); tables int32 [rows, W]; token_row int32 [rows]
    (0..rows-1); token_pos int32 [rows] (each length minus one); then the total context tokens (int). Each row's
    blocks are a random permutation's share of a cache holding exactly the batch's blocks, the first
    ``shared_blocks`` of every row the same ones (a prefix-cache hit; the caller keeps it below the shortest
    context's blocks). The layout is ``attention.cpu.ragged_paged_attention_cpu``'s (the engine's paged
    cache). Raises nothing."""
    import jax
    import jax.numpy as jnp

    lens = rng.integers(context[0], context[1] + 1, size=rows)
    width = int(-(-lens.max() // BLOCK_SIZE))
    num_blocks = shared_blocks + rows * (width - shared_blocks)
    k, v = (jnp.asarray(rng.standard_normal((num_blocks, BLOCK_SIZE, kv_heads, head_dim)), dtype) for _ in range(2))
    if dtype == jnp.bfloat16:
        k, v = (jax.lax.bitcast_convert_type(c, jnp.uint16) for c in (k, v))
    ids = rng.permutation(num_blocks)
    own = ids[shared_blocks:].reshape(rows, width - shared_blocks)
    tables = jnp.asarray(np.concatenate([np.broadcast_to(ids[:shared_blocks], (rows, shared_blocks)), own], 1),
                         jnp.int32)
    q = jnp.asarray(rng.standard_normal((rows, q_heads, head_dim)), jnp.float32)
    token_row = jnp.arange(rows, dtype=jnp.int32)
    token_pos = jnp.asarray(lens - 1, jnp.int32)
    return q, k, v, tables, token_row, token_pos, int(lens.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder, .gguf or a named model (default: the embedded "
                                                      "SmolLM2); only its head shape is used")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 192])
    parser.add_argument("--context", type=int, nargs=2, default=[400, 830], metavar=("MIN", "MAX"))
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                        help="tokens at the start of every row in the same blocks (rounded down to whole blocks)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--layers", type=int, default=None,
                        help="caches called in turn per round (default: enough to pass 512 MB together, at most "
                             "the model's layers)")
    args = parser.parse_args()
    if not 1 <= args.context[0] <= args.context[1]:
        parser.error(f"--context {args.context[0]} {args.context[1]}: need 1 <= MIN <= MAX")
    if not 0 <= args.shared_prefix < args.context[0]:
        parser.error(f"--shared-prefix {args.shared_prefix}: need 0 <= N < the shortest context {args.context[0]}")
    if min(args.rows) < 1 or args.rounds < 1:
        parser.error(f"--rows {args.rows} and --rounds {args.rounds}: need at least 1")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers}: need at least 1")
    import jax
    import jax.numpy as jnp

    from jaxllm.loader import read_model_config
    from jaxllm.named_models import resolve_model
    from kernels_pallas import cpu_build
    from kernels_pallas.attention import cpu

    cfg = read_model_config(resolve_model(args.model))[0]
    print(f"backend {jax.default_backend()}, jax {jax.__version__}")
    if not cpu_build.available():
        print(f"native attention: not run ({cpu_build.unavailable_reason()})")
        print(common.host_line(common.host_info()))
        return
    threads = len(os.sched_getaffinity(0))
    stream = stream_gbps(threads)
    print(f"memory stream rate: {stream:.1f} GB/s ({threads} numpy sums at once over shares of "
          f"{STREAM_BYTES / 1e6:.0f} MB)")
    heads = (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim)
    shared = args.shared_prefix // BLOCK_SIZE
    print(f"layers of {heads[0]} query heads, {heads[1]} KV heads of {heads[2]}, block size {BLOCK_SIZE}, "
          f"contexts {args.context[0]}-{args.context[1]}, shared prefix {shared * BLOCK_SIZE}; minimum of "
          f"{args.rounds} rounds, per layer")
    print(f"{'dtype':>9}{'rows':>6}{'context':>9}{'layers':>7}{'us':>10}{'KV GB/s':>10}{'of stream':>10}")
    scale = 1.0 / float(np.sqrt(cfg.head_dim))
    call = jax.jit(lambda q, k, v, t, r, p: cpu.ragged_paged_attention_cpu(q, k, v, t, r, p, scale=scale))
    for dtype_name in args.dtype:
        dtype = jnp.dtype(dtype_name)
        for rows in args.rows:
            rng = np.random.default_rng(rows)
            q, k, v, *rest, tokens = decode_batch(rng, rows, tuple(args.context), *heads, dtype, shared)
            layers = args.layers or default_layers(k.nbytes + v.nbytes, cfg.num_layers)
            # The same batch over each layer's own cache, as a step's layers read it.
            caches = [(k, v)] + [tuple(jax.random.permutation(jax.random.key(i), c) for c in (k, v))
                                 for i in range(1, layers)]
            for k, v in caches:
                jax.block_until_ready(call(q, k, v, *rest))
            best = float("inf")
            for _ in range(args.rounds):
                start = time.perf_counter()
                for k, v in caches:
                    jax.block_until_ready(call(q, k, v, *rest))
                best = min(best, (time.perf_counter() - start) / layers)
            kv_bytes = 2 * tokens * heads[1] * heads[2] * dtype.itemsize
            gbps = kv_bytes / best / 1e9
            print(f"{dtype_name:>9}{rows:>6}{tokens / rows:>9.0f}{layers:>7}{best * 1e6:>10.0f}{gbps:>10.1f}"
                  f"{gbps / stream:>10.0%}")
            del caches, k, v  # before the next batch's are made
    print(common.host_line(common.host_info()))


if __name__ == "__main__":
    main()
