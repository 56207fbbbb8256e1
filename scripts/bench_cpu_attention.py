"""Decode attention alone on the CPU: the C++ kernel's KV bytes per second against the host's memory stream rate.

Times ``kernels_pallas.attention.cpu.ragged_paged_attention_cpu`` on the model's head shape for ``--rows`` decode
rows with contexts uniform in ``--context``, once per layer over ``--layers`` caches (default: enough to pass
512 MB, so K and V come from memory). Prints per layer the fastest of ``--rounds`` rounds, the KV bytes over
that time, and its share of the stream rate (numpy sums, one thread per CPU) measured in the same run.
``--shared-prefix N`` shares every row's first N tokens (the share can then pass 100%).

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
    """GB/s that ``threads`` numpy sums read at once over shares of one STREAM_BYTES float32 array (best of three)."""
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
    """The fewest caches of ``layer_bytes`` each that pass DRAM_BYTES together, within ``[1, num_layers]``."""
    return max(1, min(num_layers, -(-DRAM_BYTES // max(1, layer_bytes))))


def decode_batch(rng: np.random.Generator, rows: int, context: tuple[int, int], q_heads: int, kv_heads: int,
                 head_dim: int, dtype, shared_blocks: int = 0):
    """A decode step of ``rows`` sequences (contexts uniform in ``context``) as the kernel takes it.

    Returns q float32 [rows, q_heads, head_dim]; k_cache, v_cache [N, BLOCK_SIZE, kv_heads, head_dim] in
    ``dtype`` (bfloat16 as uint16 bits); tables int32 [rows, W]; token_row, token_pos int32 [rows]; the total
    context tokens. Blocks are randomly placed; the first ``shared_blocks`` of every row are shared.
    """
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
    from kernels_pallas import ops
    from kernels_pallas.attention import cpu

    cfg = read_model_config(resolve_model(args.model))[0]
    print(f"backend {jax.default_backend()}, jax {jax.__version__}")
    if not ops.native_kernels():
        print(f"native attention: not run ({ops.native_unavailable_reason()})")
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
