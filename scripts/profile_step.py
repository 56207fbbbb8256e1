"""Where a model step's time goes, per part, for both dtypes.

For a few fixed batches (a decode step of many rows, a lone decode row padded
to 16 and to 4 tokens, a 512-token prefill) it times, on the engine's own parameters and KV cache:

- ``step``: the decoder (embedding, every layer, final norm) and the lm_head
  of the sampled rows, as the engine runs it;
- ``no attention``: the same with the attention op replaced by the identity
  and the KV write by a no-op (so ``step - no attention`` is attention);
- ``lm_head``: the logits of the sampled rows alone, as the step computes them (every row);
- ``sampler``: one greedy ``sampler.sample`` over those logits, its tables
  donated as in the engine's step;
- ``jnp tiles``: with the ``xla`` attention (the CPU default), the full step
  again with attention on the ``jnp`` tiles instead of the C++ kernel
  (``kernels_pallas.ops.xla_attention``'s ``use_native=False``);
- ``xla dots``: the full step again with every projection on XLA's dots
  instead of the C++ matmul (the ops table's ``PROJECTION_MAX_ROWS`` set to 0
  on every CPU; past its AVX2 limit the step takes XLA's dots in every column); the step where
  neither kernel can be built is about both differences together.

Block tables hold each row's blocks and the null block after them, as the
scheduler's do. What the profiles showed, and what was changed after them: docs/design/profiling-history.md.

Each is compiled once, then timed ``--repeats`` times; the minimum is printed
(the machine may be shared). Optionally ``--trace DIR`` also writes a
``jax.profiler`` trace of the full steps (open with TensorBoard / Perfetto).

    python scripts/profile_step.py [--model PATH] [--dtype float32 bfloat16] [--trace DIR]
                                   [--quantization int8|fp8] [--kv-cache-dtype auto|int8|fp8_e4m3]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _bench_common as common  # noqa: E402


def _batch(rng, num_blocks, q_lens, contexts, tokens, rows, width, block_size):
    import jax.numpy as jnp

    from jaxllm.worker.step_batch import StepBatch

    n = len(q_lens)
    qsl = np.zeros(rows + 1, np.int32)
    qsl[1:n + 1] = np.cumsum(q_lens)
    qsl[n + 1:] = qsl[n]
    seq_lens = np.zeros(rows, np.int32)
    seq_lens[:n] = np.asarray(q_lens) + np.asarray(contexts)
    tables = np.zeros((rows, width), np.int32)
    for i in range(n):
        tables[i, :-(-seq_lens[i] // block_size)] = rng.integers(1, num_blocks, -(-seq_lens[i] // block_size))
    positions = np.zeros(tokens, np.int32)
    slots = np.zeros(tokens, np.int32)
    for i in range(n):
        pos = contexts[i] + np.arange(q_lens[i])
        positions[qsl[i]:qsl[i + 1]] = pos
        slots[qsl[i]:qsl[i + 1]] = tables[i, pos // block_size] * block_size + pos % block_size
    logits_indices = np.zeros(rows, np.int32)
    logits_indices[:n] = qsl[1:n + 1] - 1
    no_token = jnp.full(tokens, -1, jnp.int32)
    return StepBatch(input_ids=jnp.asarray(rng.integers(0, 1000, tokens), jnp.int32), positions=jnp.asarray(positions),
                     slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(tables), seq_lens=jnp.asarray(seq_lens),
                     query_start_loc=jnp.asarray(qsl), logits_indices=jnp.asarray(logits_indices),
                     prev_token_index=no_token, prompt_target_ids=no_token, num_spec_tokens=jnp.zeros(rows, jnp.int32),
                     num_seqs=jnp.int32(n))


def profile(model: str, dtype: str, repeats: int, trace: str | None, quantization: str | None = None,
            kv_cache_dtype: str = "auto") -> None:
    import jax
    import jax.numpy as jnp

    from jaxllm.frontend.llm_engine import LLMEngine
    from jaxllm import models
    from kernels_pallas import ops as kernel_ops
    from jaxllm.sample.sampler import SamplingArrays, sample

    engine = LLMEngine(model, dtype=dtype, precompile=False, max_model_len=512, max_num_seqs=64,
                       max_num_batched_tokens=512, compilation_cache=None, quantization=quantization,
                       kv_cache_dtype=kv_cache_dtype)
    cfg, runner = engine.model_config, engine.runner
    ops = runner.ops
    no_attention = ops._replace(ragged_paged_attention=lambda q, *a, **k: q,
                                kv_cache_write=lambda k_cache, v_cache, *a, **k: (k_cache, v_cache))
    rng = np.random.default_rng(0)
    width, block_size = engine.buckets.width_buckets[-1], engine.config.block_size
    make = functools.partial(_batch, rng, engine.num_blocks, width=width, block_size=block_size)
    cases = {
        "decode, 48 rows (T=48)": make([1] * 48, rng.integers(100, 400, 48).tolist(), 48, 48),
        "decode, 1 row (T=16)": make([1], [200], 16, 16),
        "decode, 1 row (T=4)": make([1], [200], 4, 4),
        "prefill 512 tokens, 3 rows": make([200, 200, 112], [0, 100, 0], 512, 64),
    }

    def model_step(params, kv, batch, ops):
        return models.forward(params, kv, batch, cfg=cfg, ops=ops)

    def timed(fn, *args, donate=False):
        out = fn(*args)
        times = []
        for _ in range(repeats):
            if donate:
                args = (args[0], out[1]) + args[2:]
            start = time.perf_counter()
            out = fn(*args)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - start)
        return min(times) * 1e3, out

    print(f"{model} {dtype}, weights {quantization or dtype}, KV {engine.kv_cache_dtype.name}, attention "
          f"{engine.config.attention_backend or 'default'}; ms, minimum of {repeats}")
    xla = engine.config.attention_backend in (None, "xla") and jax.default_backend() == "cpu"
    jnp_decode = ops._replace(ragged_paged_attention=functools.partial(ops.ragged_paged_attention,
                                                                       use_native=False))
    print(f"{'batch':<30}{'step':>9}{'no attention':>14}{'attention':>11}{'lm_head':>9}{'sampler':>9}"
          + (f"{'jnp tiles':>12}{'xla dots':>10}" if xla else ""))
    params, cache = runner.weights.params, runner.cache_engine
    for name, batch in cases.items():
        rows = batch.logits_indices.shape[0]
        step = jax.jit(functools.partial(model_step, ops=ops), donate_argnums=(1,))
        full, (logits, cache.kv_cache) = timed(step, params, cache.kv_cache, batch, donate=True)
        bare = jax.jit(functools.partial(model_step, ops=no_attention), donate_argnums=(1,))
        without, (_, cache.kv_cache) = timed(bare, params, cache.kv_cache, batch, donate=True)
        hidden = jnp.zeros((rows, cfg.hidden_size), params["embed"].dtype)
        head, _ = timed(jax.jit(functools.partial(models.compute_logits, cfg=cfg, native_kernels=True)),
                        params, hidden)
        arrays = jax.tree_util.tree_map(jnp.asarray, SamplingArrays.empty(rows))
        # The tables donated, as the engine's step donates them (else the timing includes a copy of the counts).
        draw = jax.jit(lambda logits, tables, arrays: sample(logits, arrays, tables), donate_argnums=(1,))
        sampler, (_, runner.sampler_tables) = timed(draw, logits, runner.sampler_tables, arrays, donate=True)
        extra = ""
        if xla:
            tiled = jax.jit(functools.partial(model_step, ops=jnp_decode), donate_argnums=(1,))
            old, (_, cache.kv_cache) = timed(tiled, params, cache.kv_cache, batch, donate=True)
            rows_limit = kernel_ops.PROJECTION_MAX_ROWS
            # Read when the step below is traced: the C++ matmul takes no step.
            kernel_ops.PROJECTION_MAX_ROWS = {kind: ((frozenset(), 0),) for kind in rows_limit}
            try:
                dots = jax.jit(functools.partial(model_step, ops=ops), donate_argnums=(1,))
                xla_dots, (_, cache.kv_cache) = timed(dots, params, cache.kv_cache, batch, donate=True)
            finally:
                kernel_ops.PROJECTION_MAX_ROWS = rows_limit
            extra = f"{old:>12.1f}{xla_dots:>10.1f}"
        print(f"{name:<30}{full:>9.1f}{without:>14.1f}{full - without:>11.1f}{head:>9.1f}{sampler:>9.1f}{extra}")
        if trace:
            with jax.profiler.trace(os.path.join(trace, f"{dtype}-{name.split(',')[0]}")):
                timed(step, params, cache.kv_cache, batch, donate=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder, .gguf or a named model such as gemma3-270m "
                                                      "(default: the embedded SmolLM2)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--trace", default=None, help="also write jax.profiler traces of the full steps here")
    parser.add_argument("--quantization", default=None, choices=["int8", "fp8"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8_e4m3"])
    args = parser.parse_args()
    from jaxllm.named_models import resolve_model

    model = str(resolve_model(args.model))
    for dtype in args.dtype:
        profile(model, dtype, args.repeats, args.trace, args.quantization, args.kv_cache_dtype)
    print(common.host_line(common.host_info()))


if __name__ == "__main__":
    main()
