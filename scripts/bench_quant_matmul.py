"""Ways to run a weight-only quantized matmul on this backend, timed in the engine's setting.

A model's MLP (gate, up, down at its sizes) runs for every layer inside a ``lax.scan`` over
stacked weights, as ``jaxllm.models.common.hidden_states`` runs it, for a few token counts.
Variants (``q``: int8 or float8_e4m3fn per output channel, ``s``: float32 [out]):

- ``float``: the unquantized weights in the compute dtype (bfloat16 as uint16 bits, as the CPU
  engine holds them);
- ``int8 scale output``: ``(x @ q.astype(dtype)) * s`` (what jaxllm runs);
- ``int8 scale weight``: ``x @ (q * s).astype(dtype)`` (dequantize, then the matmul);
- ``int8 mixed dot``: ``dot_general(x, q)`` with int8 ``q`` left to XLA, then ``* s``;
- ``int8 mul-reduce``: ``sum(x[:, :, None] * q[None], 1) * s``, one elementwise fusion
  reading int8 (no dot; for at most 48 tokens);
- ``int8 w8a8``: not weight-only: ``x`` quantized per row to int8 too, an int8 x int8 -> int32
  dot, then both scales (more error; shown for what the CPU's integer dot can do);
- ``fp8 scale output``: ``(x @ q.astype(dtype)) * s`` with float8_e4m3fn ``q`` (as uint8 bits on
  CPU, where XLA would otherwise convert a float8 loop operand every step).

Each variant is compiled once, then the variants are timed in turns (``--rounds``; the minimum
is printed), so that a machine shared with other work slows them alike.

    python scripts/bench_quant_matmul.py [--model PATH] [--tokens 16 48 512] [--dtype float32 bfloat16]
"""

from __future__ import annotations

import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _bench_common as common  # noqa: E402


def _variants(dtype):
    import jax
    import jax.numpy as jnp

    from kernels_pallas.storage import from_storage

    def w(p):
        return from_storage(p["q"])

    def scaled_output(x, p):
        return jnp.dot(x, w(p).astype(x.dtype), preferred_element_type=jnp.float32) * p["s"]

    def scaled_weight(x, p):
        return jnp.dot(x, (w(p).astype(jnp.float32) * p["s"]).astype(x.dtype), preferred_element_type=jnp.float32)

    def mixed(x, p):
        return jax.lax.dot_general(x, p["q"], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32) * p["s"]

    def mul_reduce(x, p):
        return jnp.sum(x.astype(jnp.float32)[:, :, None] * p["q"].astype(jnp.float32)[None], axis=1) * p["s"]

    def w8a8(x, p):
        sx = jnp.max(jnp.abs(x), axis=1, keepdims=True).astype(jnp.float32) / 127 + 1e-12
        xq = jnp.round(x / sx).astype(jnp.int8)
        dot = jax.lax.dot_general(xq, p["q"], (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return dot.astype(jnp.float32) * sx * p["s"]

    def plain(x, p):
        return jnp.dot(x, w(p), preferred_element_type=jnp.float32)

    return {"float": ("float", plain), "int8 scale output": ("int8", scaled_output),
            "int8 scale weight": ("int8", scaled_weight), "int8 mixed dot": ("int8", mixed),
            "int8 mul-reduce": ("int8", mul_reduce), "int8 w8a8": ("int8", w8a8),
            "fp8 scale output": ("fp8", scaled_output)}


def bench(cfg, dtype_name: str, tokens: list[int], rounds: int) -> None:
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from jaxllm.core.build import resolve_dtype
    from jaxllm.worker.quantization import quantize_weight
    from kernels_pallas.storage import to_storage

    dtype = resolve_dtype(dtype_name)
    rng = np.random.default_rng(0)
    e, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    shapes = {"gate": (layers, e, f), "up": (layers, e, f), "down": (layers, f, e)}
    dense = {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in shapes.items()}
    bits = {np.dtype(ml_dtypes.bfloat16): jnp.uint16, np.dtype(ml_dtypes.float8_e4m3fn): jnp.uint8}

    def stored(a):
        a = jnp.asarray(a)
        return to_storage(a, bits[np.dtype(a.dtype)]) if np.dtype(a.dtype) in bits else a

    weights = {"float": {k: {"q": stored(v.astype(dtype))} for k, v in dense.items()}}
    for kind in ("int8", "fp8"):
        weights[kind] = {}
        for k, v in dense.items():
            q, s = quantize_weight(v, kind)
            weights[kind][k] = {"q": stored(q), "s": jnp.asarray(s)}

    def run(mm, tree, x):
        def layer(x, i):
            p = jax.tree_util.tree_map(lambda a: a[i], tree)
            gate, up = mm(x, p["gate"]).astype(x.dtype), mm(x, p["up"]).astype(x.dtype)
            return (x + mm(jax.nn.silu(gate) * up, p["down"])).astype(x.dtype), None

        return jax.lax.scan(layer, x, jnp.arange(layers))[0]

    print(f"\n{dtype_name}: {layers} layers of MLP {e} -> {f} -> {e}; ms per pass, minimum of {rounds} rounds")
    variants = _variants(dtype)
    print(f"{'tokens':>7}" + "".join(f"{name:>20}" for name in variants))
    for t in tokens:
        x = jnp.asarray(rng.standard_normal((t, e)), dtype)
        fns = {}
        for name, (kind, mm) in variants.items():
            if name == "int8 mul-reduce" and t > 48:
                continue
            fns[name] = (jax.jit(functools.partial(run, mm)), weights[kind])
            jax.block_until_ready(fns[name][0](fns[name][1], x))
        best = {name: float("inf") for name in fns}
        for _ in range(rounds):
            for name, (fn, tree) in fns.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(tree, x))
                best[name] = min(best[name], time.perf_counter() - start)
        print(f"{t:>7}" + "".join(f"{best[n] * 1e3:>20.1f}" if n in best else f"{'-':>20}" for n in variants))


def main() -> None:
    common.run_matmul_bench(__doc__, bench, [16, 48, 512])


if __name__ == "__main__":
    main()
