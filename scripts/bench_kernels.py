"""Time jaxllm's paged-attention kernels on a GPU and report achieved HBM bandwidth.

Decode at batch {1, 32, 256} x context {512, 4096, 32768} for
  * triton:   kernels_pallas.attention.pallas_decode.paged_attention (flash-decoding over block tables),
  * mosaic:   kernels_pallas.attention.mosaic_decode.paged_attention (the same plan on Mosaic GPU, Hopper only),
  * jax:      jax.experimental.pallas.ops.gpu.paged_attention, K/V re-laid into
              its head-major page layout outside the timing,
  * ref:      kernels_pallas.attention.reference.paged_attention_reference under XLA,
and one mixed prefill + decode batch for ours (ragged_paged_attention: pallas_ragged through
Triton, mosaic_ragged through Mosaic GPU) and the reference (JAX's kernel is decode-only).

GB/s counts the bytes a perfect kernel must move: every sequence's K and V
once, plus q and the output. Usage:

  python scripts/bench_kernels.py [--peak-gbps 4800] [--block-size 16] [--smoke]

Exits with status 2 when JAX has no GPU, unless ``--smoke``: tiny shapes, every
kernel in the Pallas interpreter, on any backend; it proves the script runs
(scripts/gpu_check.sh --dry-run), its times mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _bench_common as common  # noqa: E402
# noqa: E402: after the path fix so the checkout's package is used.
from kernels_pallas.attention import mosaic_decode, mosaic_ragged, pallas_decode, pallas_ragged, reference  # noqa: E402

DTYPE = jnp.bfloat16
BATCHES = (1, 32, 256)
CONTEXTS = (512, 4096, 32768)
# (new tokens, context) per sequence of the mixed batch: prefill chunks over a
# cached prefix, whole prompts, and decode rows.
MIXED = [(256, 1024)] * 4 + [(512, 512)] + [(1, 1024)] * 64
SMOKE_BATCHES, SMOKE_CONTEXTS, SMOKE_MIXED = (2,), (64,), [(16, 48), (1, 40), (1, 64)]


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="device HBM peak, GB/s (H200: 4800)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10, help="timed calls per measurement")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in the Pallas interpreter on any backend (a dry run; times mean nothing)")
    return parser.parse_args()


def _time_ms(fn, *args, iters: int) -> float:
    """Best of 3 averages of ``iters`` back-to-back calls, after a compiling call."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e3


def _device_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def _paged_inputs(key, seq_ctx: list[int], args):
    """A full cache holding the given contexts in shuffled blocks, and its block tables."""
    bs, hkv, d = args.block_size, args.num_kv_heads, args.head_dim
    width = max(-(-c // bs) for c in seq_ctx)
    num_blocks = len(seq_ctx) * width + 1
    k_key, v_key, perm_key = jax.random.split(key, 3)
    k_cache = jax.random.normal(k_key, (num_blocks, bs, hkv, d), DTYPE)
    v_cache = jax.random.normal(v_key, (num_blocks, bs, hkv, d), DTYPE)
    # Shuffled, as a cache that has served many requests would be; block 0 stays the null block.
    tables = (jax.random.permutation(perm_key, num_blocks - 1) + 1).reshape(len(seq_ctx), width).astype(jnp.int32)
    seq_lens = jnp.asarray(seq_ctx, jnp.int32)
    return k_cache, v_cache, tables, seq_lens


# The most a bf16 kernel's output may differ from the Triton kernel's before its timing is not printed.
AGREEMENT = 2e-2


def _agrees_with_triton(name: str, shape: str, fn, triton, fn_args) -> bool:
    """Whether ``fn`` gives the Triton kernel's output on ``fn_args`` within :data:`AGREEMENT` (printed when not, or
    when either fails); a kernel that computes something else has no speed to report."""
    try:
        diff = float(jnp.max(jnp.abs(fn(*fn_args).astype(jnp.float32) - triton(*fn_args).astype(jnp.float32))))
    except Exception as err:  # a kernel that fails must not stop the others
        print(f"{name:<6} {shape:<28} FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
        return False
    if not diff <= AGREEMENT:
        print(f"{name:<6} {shape:<28} WRONG: max |difference| from triton {diff:.3g} > {AGREEMENT}")
    return diff <= AGREEMENT


def _mosaic_unsupported(module, q, k_cache, tables, args) -> str | None:
    """Why a Mosaic kernel (``module``) cannot run these inputs here (None when it can)."""
    why_not = module.unsupported_reason(q.dtype, k_cache.dtype, args.head_dim, args.block_size,
                                        args.num_q_heads // args.num_kv_heads, table_width=tables.shape[1])
    device = jax.devices()[0]
    if why_not is None and not args.smoke and not str(getattr(device, "compute_capability", "")).startswith("9"):
        why_not = f"{device.device_kind} is not a Hopper GPU"
    return why_not


def _report(name: str, shape: str, ms: float, nbytes: int, peak_gbps: float) -> None:
    gbps = nbytes / ms / 1e6
    print(f"{name:<6} {shape:<28} {ms:9.3f} ms {gbps:9.1f} GB/s {100 * gbps / peak_gbps:6.1f}% of peak", flush=True)


def _run(name: str, shape: str, needed_bytes: int, fn, *fn_args, nbytes: int, args) -> None:
    """Time one implementation, printing a skip or the error instead of stopping."""
    limit = _device_bytes()
    if limit is not None and needed_bytes > 0.9 * limit:
        print(f"{name:<6} {shape:<28} skipped: needs ~{needed_bytes / 2**30:.0f} GiB of {limit / 2**30:.0f} GiB")
        return
    try:
        _report(name, shape, _time_ms(fn, *fn_args, iters=args.iters), nbytes, args.peak_gbps)
    except Exception as err:  # one failed benchmark must not stop the others
        print(f"{name:<6} {shape:<28} FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}")


def _bench_decode(key, batch: int, ctx: int, args) -> None:
    hq, hkv, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    item = jnp.dtype(DTYPE).itemsize
    shape = f"decode batch={batch} ctx={ctx}"
    cache_bytes = 2 * batch * ctx * hkv * d * item
    # Twice the cache: random generation needs temporaries of the cache's size.
    if (limit := _device_bytes()) is not None and 2 * cache_bytes > 0.9 * limit:
        print(f"all    {shape:<28} skipped: building the cache needs ~{2 * cache_bytes / 2**30:.0f} GiB")
        return
    cache_key, q_key = jax.random.split(key)
    k_cache, v_cache, tables, seq_lens = _paged_inputs(cache_key, [ctx] * batch, args)
    q = jax.random.normal(q_key, (batch, hq, d), DTYPE)
    nbytes = cache_bytes + 2 * q.size * item
    scale = d ** -0.5

    triton = jax.jit(functools.partial(pallas_decode.paged_attention, scale=scale, interpret=args.smoke))
    _run("triton", shape, cache_bytes, triton, q, k_cache, v_cache, tables, seq_lens, nbytes=nbytes, args=args)
    if why_not := _mosaic_unsupported(mosaic_decode, q, k_cache, tables, args):
        print(f"mosaic {shape:<28} n/a: {why_not}")
    else:
        mosaic = jax.jit(functools.partial(mosaic_decode.paged_attention, scale=scale, interpret=args.smoke))
        if _agrees_with_triton("mosaic", shape, mosaic, triton, (q, k_cache, v_cache, tables, seq_lens)):
            _run("mosaic", shape, cache_bytes, mosaic, q, k_cache, v_cache, tables, seq_lens, nbytes=nbytes,
                 args=args)

    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

        k_pages = jax.block_until_ready(k_cache.transpose(2, 0, 1, 3))
        v_pages = jax.block_until_ready(v_cache.transpose(2, 0, 1, 3))
        pages = tables.shape[1]
        k_splits = max(s for s in (16, 8, 4, 2, 1) if pages % s == 0)
        theirs = jax.jit(functools.partial(jax_paged.paged_attention, k_splits=k_splits, interpret=args.smoke))
        # JAX's kernel has no scale argument: fold it into q, as its callers do.
        _run("jax", shape, 2 * cache_bytes, theirs, q * scale,
             k_pages, v_pages, tables, seq_lens, nbytes=nbytes, args=args)
        del k_pages, v_pages
    except Exception as err:  # an API change in JAX's kernel must not stop the rest
        print(f"jax    {shape:<28} FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}")

    # The reference gathers every sequence's context and upcasts it to float32.
    ref_bytes = cache_bytes * (1 + 1 + 4 // item) + batch * hq * ctx * 4 * 3
    ref = jax.jit(functools.partial(reference.paged_attention_reference, scale=scale))
    _run("ref", shape, ref_bytes, ref, q, k_cache, v_cache, tables, seq_lens, nbytes=nbytes, args=args)


def _bench_mixed(key, mixed: list[tuple[int, int]], args) -> None:
    hq, hkv, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    item = jnp.dtype(DTYPE).itemsize
    q_lens = [n for n, _ in mixed]
    contexts = [c for _, c in mixed]
    cache_key, q_key = jax.random.split(key)
    k_cache, v_cache, tables, seq_lens = _paged_inputs(cache_key, contexts, args)
    num_tokens = sum(q_lens)
    q = jax.random.normal(q_key, (num_tokens, hq, d), DTYPE)
    query_start_loc = jnp.cumsum(jnp.asarray([0] + q_lens, jnp.int32)).astype(jnp.int32)
    num_seqs = jnp.int32(len(mixed))
    cache_bytes = 2 * sum(contexts) * hkv * d * item
    nbytes = cache_bytes + 2 * q.size * item
    shape = f"mixed T={num_tokens} S={len(mixed)}"
    batch = (q, k_cache, v_cache, tables, seq_lens, query_start_loc, num_seqs)
    scale = d ** -0.5

    triton = jax.jit(functools.partial(pallas_ragged.ragged_paged_attention, scale=scale, interpret=args.smoke))
    _run("triton", shape, cache_bytes, triton, *batch, nbytes=nbytes, args=args)
    if why_not := _mosaic_unsupported(mosaic_ragged, q, k_cache, tables, args):
        print(f"mosaic {shape:<28} n/a: {why_not}")
    else:
        mosaic = jax.jit(functools.partial(mosaic_ragged.ragged_paged_attention, scale=scale, interpret=args.smoke))
        if _agrees_with_triton("mosaic", shape, mosaic, triton, batch):
            _run("mosaic", shape, cache_bytes, mosaic, *batch, nbytes=nbytes, args=args)
    print(f"jax    {shape:<28} n/a: JAX's paged_attention is decode-only")
    ref_bytes = 2 * num_tokens * tables.shape[1] * args.block_size * hkv * d * (item + 4)
    ref = jax.jit(functools.partial(reference.ragged_paged_attention_reference, scale=scale))
    _run("ref", shape, ref_bytes, ref, *batch, nbytes=nbytes, args=args)


def main() -> int:
    args = _parse_args()
    if jax.default_backend() != "gpu" and not args.smoke:
        print(f"bench_kernels.py needs a GPU; JAX's default backend is {jax.default_backend()!r}.", file=sys.stderr)
        return 2
    batches, contexts, mixed = (SMOKE_BATCHES, SMOKE_CONTEXTS, SMOKE_MIXED) if args.smoke else (
        BATCHES, CONTEXTS, MIXED)
    if args.smoke:
        print("smoke run: tiny shapes in the Pallas interpreter; the times below mean nothing")
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, {jnp.dtype(DTYPE).name}, "
          f"q_heads={args.num_q_heads} kv_heads={args.num_kv_heads} head_dim={args.head_dim} "
          f"block_size={args.block_size}, peak {args.peak_gbps:.0f} GB/s")
    key = jax.random.key(0)
    for batch in batches:
        for ctx in contexts:
            _bench_decode(key, batch, ctx, args)
            gc.collect()  # drop the previous combination's caches before allocating the next
    _bench_mixed(key, mixed, args)
    print(common.host_line(common.host_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
