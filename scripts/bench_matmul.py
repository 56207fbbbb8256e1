"""The dense layers' matmuls alone: the C++ kernel against XLA's dots, in the engine's layer scan.

Every projection of the model runs per layer inside a ``lax.scan`` over stacked weights, for a few token
counts: ``native`` (``kernels_pallas.matmul.cpu.stacked_matmul_cpu``, weights read in place) and ``xla``
(``x @ w[layer]``). Prints ms per pass over all layers (minimum of ``--rounds``, taken in turns), then the
native kernel per projection shape in GFLOP/s, and in float32 the tied lm_head three ways (XLA,
``lm_head.cpu.matmul_nt_cpu``, and over ``lm_head.cpu.pack_nt_panels``' packed panels).

    python scripts/bench_matmul.py [--model PATH] [--tokens 1 4 16 48 128 512] [--dtype float32 bfloat16]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _bench_common as common  # noqa: E402


def in_turns(fns: dict, args: tuple, rounds: int) -> dict[str, float]:
    """Each of ``fns`` compiled, then ``rounds`` rounds of all of them in turns: the minimum seconds of each by name."""
    import jax

    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench(cfg, dtype_name: str, tokens: list[int], rounds: int) -> None:
    import jax
    import jax.numpy as jnp

    from jaxllm.core.build import resolve_dtype
    from kernels_pallas import ops
    from kernels_pallas.matmul import cpu as native
    from kernels_pallas.storage import from_storage, to_storage

    dtype = jnp.dtype(resolve_dtype(dtype_name))
    rng = np.random.default_rng(0)
    e, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"wq": (e, q), "wk": (e, kv), "wv": (e, kv), "wo": (q, e), "w_gate": (e, f), "w_up": (e, f),
              "w_down": (f, e)}
    storage = jnp.uint16 if dtype == jnp.bfloat16 else dtype
    stack = {k: to_storage(jnp.asarray(rng.standard_normal((layers, *s)) * 0.05, dtype), storage)
             for k, s in shapes.items()}

    def run(use_native, x, m):
        def layer(x, i):
            total = jnp.zeros_like(x)
            for key, (k_dim, _) in shapes.items():
                xin = jnp.resize(x, (x.shape[0], k_dim))
                if use_native:
                    y = native.stacked_matmul_cpu(xin, stack[key], i, m)
                else:
                    y = jnp.dot(xin, from_storage(stack[key][i]), preferred_element_type=jnp.float32)
                total = total + jnp.resize(y, x.shape).astype(x.dtype)
            return (x + total * 1e-3).astype(x.dtype), None

        return jax.lax.scan(layer, x, jnp.arange(layers))[0]

    print(f"\n{dtype_name}: {layers} layers of {', '.join(f'{k} {a}x{b}' for k, (a, b) in shapes.items())}; "
          f"ms per pass, minimum of {rounds} rounds")
    # A shape the kernel does not take (native.matmul_supports: N a multiple of 16, an even K for bfloat16) or no
    # kernel built: XLA's column only.
    sides = (("native", True), ("xla", False))
    if not (ops.native_kernels() and all(native.matmul_supports(w) for w in stack.values())):
        print(f"native: not run ({ops.native_unavailable_reason() or 'a shape the kernel does not take'})")
        sides = sides[1:]
    print(f"{'tokens':>7}{'native':>12}{'xla':>12}")
    for t in tokens:
        x = jnp.asarray(rng.standard_normal((t, e)), dtype)
        fns = {name: jax.jit(lambda x, m, n=use: run(n, x, m)) for name, use in sides}
        best = in_turns(fns, (x, jnp.int32(t)), rounds)
        print(f"{t:>7}" + "".join(f"{best[n] * 1e3:>12.1f}" if n in best else f"{'-':>12}" for n in ("native", "xla")))
    if sides[0][0] == "native":
        per_projection(stack, shapes, tokens, rounds, layers, dtype)
        if dtype == jnp.float32:
            tied_head(cfg, tokens, rounds)


def tied_head(cfg, tokens: list[int], rounds: int) -> None:
    """The tied lm_head ``x @ embed.T`` three ways, ms (minimum of ``rounds``); ``-`` where a kernel cannot."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas import ops
    from kernels_pallas.lm_head import cpu as native

    v, e = cfg.vocab_size, cfg.hidden_size
    embed = jnp.asarray(np.random.default_rng(1).standard_normal((v, e)) * 0.05, jnp.float32)
    fns = {"xla": jax.jit(lambda x, m: jax.lax.dot_general(x, embed, (((1,), (1,)), ((), ())))),
           "transposed": jax.jit(lambda x, m: native.matmul_nt_cpu(x, embed, m))}
    if native.nt_panels_shape(embed, ops.lm_head_panel_columns()) is not None:
        panels = jax.block_until_ready(ops.pack_lm_head_panels(embed))
        fns["packed"] = jax.jit(lambda x, m: native.matmul_nt_cpu(x, embed, m, panels))
    print(f"\nthe tied lm_head, [{v}, {e}] float32: ms, minimum of {rounds} rounds")
    print(f"{'tokens':>7}" + "".join(f"{name:>12}" for name in ("xla", "transposed", "packed")))
    for t in tokens:
        x = jnp.asarray(np.random.default_rng(t).standard_normal((t, e)), jnp.float32)
        best = in_turns(fns, (x, jnp.int32(t)), rounds)
        print(f"{t:>7}" + "".join(f"{best[n] * 1e3:>12.2f}" if n in best else f"{'-':>12}"
                                  for n in ("xla", "transposed", "packed")))


def per_projection(stack, shapes, tokens: list[int], rounds: int, layers: int, dtype) -> None:
    """The native kernel on each projection shape alone over the layers: GFLOP/s from the minimum of ``rounds``."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.matmul import cpu as native

    names: dict[tuple[int, int], list[str]] = {}
    for key, shape in shapes.items():
        names.setdefault(shape, []).append(key)
    print(f"native, one projection alone over the {layers} layers: GFLOP/s, best of {rounds} rounds")
    labels = {shape: "/".join(keys) + f" {shape[0]}x{shape[1]}" for shape, keys in names.items()}
    print(f"{'tokens':>7}" + "".join(f"{label:>22}" for label in labels.values()))
    rng = np.random.default_rng(1)
    for t in tokens:
        cells = []
        for (k_dim, n), keys in names.items():
            w = stack[keys[0]]
            x = jnp.asarray(rng.standard_normal((t, k_dim)), dtype)
            fn = jax.jit(lambda x, m, w=w: jax.lax.scan(
                lambda acc, i: (acc + native.stacked_matmul_cpu(x, w, i, m)[0, 0], None), 0.0,
                jnp.arange(layers))[0])
            jax.block_until_ready(fn(x, jnp.int32(t)))
            best = float("inf")
            for _ in range(rounds):
                start = time.perf_counter()
                jax.block_until_ready(fn(x, jnp.int32(t)))
                best = min(best, time.perf_counter() - start)
            cells.append(2 * t * k_dim * n * layers / best / 1e9)
        print(f"{t:>7}" + "".join(f"{c:>22.1f}" for c in cells))


def main() -> None:
    common.run_matmul_bench(__doc__, bench, [1, 4, 16, 48, 128, 512])


if __name__ == "__main__":
    main()
