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
  (``use_native=False``);
- ``xla dots``: the full step again with every projection on XLA's dots
  instead of the C++ matmul (``jaxllm.models.common.NATIVE_MATMUL_MAX_ROWS``
  set to 0, which ``native_matmul_max_rows()`` then returns on every CPU; past
  its AVX2 limit the step takes XLA's dots in every column); the step where
  neither kernel can be built is about both differences together.

Block tables hold each row's blocks and the null block after them, as the
scheduler's do. What the profile showed on SmolLM2-135M, float32, 2 cores
with AVX-512 (``jax.profiler`` traces, 2026-12-01): in a 48-row decode step
(contexts 100-400) attention took two thirds of the step (about 90 of 132 ms),
and 74 ms of that was two loop fusions that gather the keys and values and
copy them into the head-major layouts the dots want -- for the keys a
transpose of ``head_dim`` against the context, element by element. The
dense layers ran at XLA's measured dot rate (a 512-token prefill's matmuls
at about 400 GFLOP/s), so the decode gap to vLLM's CPU build is attention.
Cross-head dots (``kernels_pallas.xla._cross_head_dots``) and 4-block decode
chunks removed the transposed copy: 132 -> 105-112 ms for that step, 204 ->
183 ms for 64 rows at contexts 400-500, prefill unchanged. The same traces
show each layer's weights copied out of the stacked parameters by a
dynamic-slice (about 15 ms of the decode step); unrolling the layer loop
instead made the step slower (122 -> 218 ms), so the scan stays. The
``XLA_FLAGS`` of jaxlib 0.10.2's CPU backend that name oneDNN or XNNPACK
(``xla_cpu_use_onednn``, ``xla_cpu_experimental_onednn_fusion_type``,
``xla_cpu_use_xnnpack``, ``xla_cpu_experimental_ynn_fusion_type``) left the
optimized HLO unchanged (its dots are YNNPACK fusions either way).

The gathered copies are what XLA's CPU dots need (they cannot read through
a gather), so the next change left XLA for decode rows: a C++ kernel
(``kernels_pallas/paged_attention_cpu.cc``, an XLA FFI call) reads each
row's blocks in place, one pass over the cached bytes instead of three
(traced: ``ffi_call`` is then the step's only attention op besides the KV
write). Measured with this script's ``jnp tiles`` column, same process
(2026-12-01, AVX-512 EPYC, 2 cores): the 48-row decode step 117-129 -> 95-98
ms float32 with the kernel's first, scalar-reduction form.

Then (2026-12-01, same machine): the kernel's ``exp`` had called ``roundf``
per lane, which kept its loops scalar (``perf annotate``: ``__roundf`` was
12% of a prefill's attention); rounding by adding and subtracting 1.5 * 2^23
vectorizes. Prefill runs got a GEMM-shaped path (a unit's (token, head) pairs
as vector lanes, transposed queries, register tiles of keys by lanes), so
prefill rows left the tiles too: 30 layers of a 512-token prefill after a
1000-token context 863 -> 223 ms (about 200 GFLOP/s). Vectors now follow the
target (16 floats with AVX-512, 8 with AVX2): 16-float generic vectors under
``-march=haswell`` spilled every operation to the stack, making the kernel
slower than the tiles on an AVX2-only CPU (a 48-row decode's attention 153
vs 99 ms; now 54 ms). The dense layers: XLA's dynamic-slice of each layer's
weights out of the stacked parameters is a copy per layer per step, so a
30-layer scan of SmolLM2's projections at 4 rows took 27-36 ms against 18 ms
for the same dots on separate per-layer arrays; a C++ matmul that reads the
stacked weight in place took 8-12 ms at 1-4 rows and 35 ms at 48 (52 in
XLA). This script's columns then read, float32, load 5-8 (another job at
``nice 19``): a 48-row decode step 80.9 ms, 115.5 with the tiles, 104.3 with
XLA's dots; a 512-token prefill 313.7, 406.5 and 324.0 ms.

Then (2026-12-02, same kind of machine, quiet): the ``sampler`` column of a
greedy 48-row step was 8.6 ms of which XLA's ``argmax`` (a reduction over
(value, index) pairs it does not vectorize) took 5.5 ms and the ``lax.cond``
branches that passed the [rows, vocab] logits through (the bitmask, the
processors) a copy each: a two-pass argmax and conds that return tokens took
the sampler to 0.9 ms (192 rows: 33 -> 2.7 ms). The lm_head went to a C++ NT
matmul that computes only a step's real rows (``jnp`` zeros elsewhere):
a full 48-row head 10.3 -> 9.7-11 ms (the embedding streams from memory
either way), a 512-token prefill step's 64-row head (3 real rows) 11.5 -> 3-4
ms (one pass over the embedding), and the projections skip a bucket's padding
tokens the same way. The step columns above call the head on every row.

Then (a later session, same machine): the decode attention read scattered
blocks at 11-14 GB/s against 22-28 GB/s for a plain read of the same blocks
through the same tables, and ran no faster with every block already in the
L3. ``perf annotate``: the multiply-adds of the scores (one key at a time) and
of the values' sum waited on each other's latency, and the 384 prefetches of
the next block issued at once stalled the loads behind them. Keys innermost,
even and odd tokens in separate accumulators, and the prefetches spread over
the query heads: this script's 48-row decode step 95.6 / 91.0 -> 76.9 / 73.3 ms,
its attention column 47.6 / 44.2 -> 29.8 / 24.6 (two runs each, interleaved).

Then (2026-12-02, an Intel Xeon with AVX-512, AVX-512-BF16 and AMX, 2 cores,
about 13 GB/s of memory reads per core): in a perf profile of the
shared-prefix shape (float32) the C++ matmul's tiles were 52% of the samples
and attention 12%. A 30-layer scan of one projection shape alone showed the
fused gate and up (N = 3072) at 77 GFLOP/s against 137 at N = 3136: rows of a
panel 12 KiB apart fall in the same few cache sets. More than one tile of rows
now takes the panel in chunks of 128 rows of K copied into a contiguous
buffer (kept in L1 while the tiles reread it), and each chunk's tiles prefetch
the next chunk's rows (or the next panel's, taken one ahead from the shared
counter). SmolLM2's projections, 30 layers, float32 (``scripts/bench_matmul.py``'s
shapes), before -> after (two runs
each, interleaved): 16 rows 55-62 -> 45-46 ms, 48 rows 82-89 -> 73-74, 128
rows 145-151 -> 121-129, 512 rows 490-497 -> 422-465 (XLA's dots: 53-59, 82-93,
139-153 and 496-500). This script's 48-row decode step: 131-144 -> 128-138 ms.
The same kernel now takes bfloat16 weights (``vdpbf16ps`` on pairs of rows of
K): on this machine XLA's bfloat16 dots run on AMX and beat it from 4 rows,
so the engine uses it for the 4-token bucket only: this script's 1-row decode
step in that bucket 36.1 / 38.4 -> 26.1 / 26.4 ms (48 rows through it: 78 ->
112 ms, so they keep XLA's dots).

Then (2026-12-03, an Intel Xeon with AVX-512 and AMX, 2 cores, quiet): this
script's columns, three runs: the 48-row decode step 107-110 ms (attention
30-35, lm_head 14-15), the 512-token prefill 476-546 ms against 468-501 with
XLA's dots. In perf profiles of the short and shared-prefix shapes of
``bench_vs_vllm.py`` the C++ matmul was 55-66% of the samples and decode
attention 6-15%; ``scripts/bench_matmul.py --dtype float32`` ran SmolLM2's
projections over 30 layers at 192 rows in 158-167 ms (four runs), 244-258
GFLOP/s, 73-77% of the 333 that two cores with two AVX-512 FMA units each
reach at the 2.6 GHz the machine reports. Two things were tried and dropped,
each measured interleaved with the code as it was: splitting the panels left
over when their count is odd (N = 576: 9 panels on 2 threads) by rows
(``bench_matmul.py``, two runs each: 192 rows 158.5 / 167.2 ms before against
173.0 / 158.1 after, 256 rows 192.4 / 200.9 against 197.1 / 218.4, 512 rows
412.4 / 405.6 against 399.4 / 378.3: no consistent difference), and glibc's
malloc tunables (one arena with ``mmap_max=0``, or ``hugetlb=1``), which cut
the short shape's page faults from 2.4 million to 0.6 and 0.3 million but left
its output tok/s within the noise (384-405 before, 387 and 391 after). The
``sampler`` column had timed a copy of the counts table as well, its tables
not donated (2.3-3.6 ms here at any row count, the earlier figures above
included); donated, 0.3-1.3 ms.

A later session on the same kind of machine (2026-12-03, ``bench_vs_vllm.py
--shapes short shared-prefix --dtypes float32 --vllm-bindings both``: short
345.1 against vLLM's 365.4 tok/s, shared-prefix 150.9 against 156.9) tried
three more and dropped them, each measured interleaved with the code as it was
(``bench_throughput.py``'s short and shared-prefix shapes, jaxllm alone, two
runs each): one kernel call for the projections of one input (q, k and v;
gate and up), their panels shared out together so that k's and v's 3 panels
no longer leave a thread idle -- ``bench_matmul.py`` 32 rows 55.0 -> 51.8 ms,
48 rows 66.2 -> 65.5, 192 rows 169.9 -> 167.0, 512 rows 422.4 -> 440.7; short
343.5 / 352.6 -> 346.7 / 346.6 tok/s, shared-prefix 153.1 / 149.8 -> 157.0 /
148.4; the lm_head on XLA's dot when at least 3/4 of its bucket's rows are
sequences (a ``lax.cond`` on the row count): one run each, short 354.0 -> 349.0,
shared-prefix 155.4 -> 153.8, and start-up 9 -> 26 s for the second branch of
every head; and the decode attention's prefetch of the next block into L2
instead of L1, one or two blocks ahead: this script's 48-row attention 37.3 ms
before, 33.9 and 36.4 after, within its spread.

Then (2026-12-04, an AMD EPYC Zen 4 with AVX-512, 2 cores) the same change
measured apart from the noise and was kept, with its twin in the matmul: on
that core the chunk or block being reread fills L1, and lines prefetched into
L1 evicted it. This script's 48-row decode step 118.8 / 119.0 -> 109.3 /
110.9 ms (attention 40.1 / 38.2 -> 32.0 / 32.9; interleaved runs), and
``bench_matmul.py --dtype float32``: 8 rows 32-36 -> 21-22 ms, 16 rows 41-46
-> 27-30, 32 rows 54-56 -> 45-47, 64 rows and up alike.

Then (2026-12-05, the same kind of Zen 4 machine) the split of the panels left over on an odd count, dropped on
the Xeon above, measured clear of the noise per projection and was kept (``matmul_cpu.cc``: ``set_units``): the
last panels % threads panels go in pieces, runs of row tiles or, for a decode step, of columns. One projection
alone (this session's form of ``bench_matmul.py``'s per-projection table), two runs each interleaved: N = 576 at
512 rows 178-194 -> 214-215 GFLOP/s, K = 1536 192-193 -> 210-213; ``bench_throughput.py``'s short shape, jaxllm
alone, three runs each interleaved: 280 / 322 / 295 -> 306 / 327 / 320 tok/s, shared-prefix 166 / 168 / 170 -> 172
/ 171 / 172. Taking units one at a time and prefetching a guess at the next (which would have balanced N = 192's 3
panels too) cost shared-prefix 171 -> 161 in the engine, so each thread still reserves its next unit.
Then (2026-12-05, same machine) ``perf record`` of the short shape's timed run alone (perf started from inside the
process when the timed ``generate`` began): the C++ kernels 86% of the samples (matmul tiles 80%, the lm_head's
inlined into ``drain``; attention 7%), the kernel 5%, XLA's fusions 3%, Python under 1%; 1.9 of the 2 CPUs busy.
Two costs showed: the tiled attention's copy of the queries divided an index by the group size for every element
(one layer of a 512-token prefill of 63-token prompts, the kernel alone: 729-734 -> 474-487 us), and the timed run
took 0.76 million page faults and 2.0 s of system time (``perf record -e page-faults``: 54% of them where the
lm_head writes the logits, 37.7 MB at 192 rows, fresh pages on every step). glibc's mallopt before JAX's CPU
client starts (``jaxllm/worker/host_malloc.py``: one arena, no mmap or trim below 1 GiB) took them to 14 thousand
and 0.5 s; set after the client had started, nothing changed (768 thousand: its threads keep their arenas). The
short shape, three runs each interleaved with the code before: 317.5 / 329.2 / 316.0 -> 329.5 / 329.1 / 333.4
tok/s; shared-prefix, two runs each: 155.7 / 159.1 -> 177.0 / 166.4. A contiguous buffer for the lm_head's
output panel (its rows are 196 KB apart in the logits) measured within the noise and was dropped.
Then (2026-12-05, same machine) decode attention with its cache from memory: ``bench_cpu_attention.py`` had timed
one layer, whose 25 MB of K and V (16 rows at contexts 600-1500) stay in the 32 MiB L3 between calls; over 30
layers' caches the kernel read 17.5 GB/s (one thread: 9.9) against the host's 31-42 (one thread: 22.7); its time did
not move with the prefetch distance (1, 2 or 4 blocks ahead) while dropping the prefetches cost 1.4x: the prefetches
came in bursts of a slice's share (64 lines of K and 64 of V), which filled the core's miss buffers so that the
block's own loads waited behind them. Spread over the block's loops a few lines a step (``Prefetch``): 44.8 / 45.0
-> 34.0 / 33.4 ms for the 30 layers (about 23 GB/s), 48 rows at 16-448 31.0 -> 23.5, 192 rows at 16-128 41.3 ->
35.1, AVX2's build 42.4 -> 34.7; long 69.3 / 65.7 / 70.8 -> 74.5 / 71.1 / 76.3 tok/s and mixed 270.3 / 270.9 ->
298.3 / 286.1 (jaxllm alone, interleaved). The same spreading in the prefill tiles (a few tokens' lines per tile
call) measured level (a 512-token chunk at position 1200: 7.9 -> 7.9-8.0 ms a layer): they are bound by their
arithmetic, about 70 GFLOP/s a core against the matmul's 105 (``perf``: the value tiles 46% of it, the score tiles
34%, the softmax between them 20%). Each row's first block came unprefetched: a decode unit that reserves the next
unit as it starts and prefetches that one's first block during its last took 192 rows at 16-128 34.6 / 34.7 -> 29.9
/ 30.0 ms over the 30 layers (48 rows at 16-448 23.4 / 23.7 -> 22.2 / 21.0), level end to end.

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
    from jaxllm.models import common as model_common
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
            rows_limit = model_common.NATIVE_MATMUL_MAX_ROWS
            model_common.NATIVE_MATMUL_MAX_ROWS = 0  # read when the step below is traced
            try:
                dots = jax.jit(functools.partial(model_step, ops=ops), donate_argnums=(1,))
                xla_dots, (_, cache.kv_cache) = timed(dots, params, cache.kv_cache, batch, donate=True)
            finally:
                model_common.NATIVE_MATMUL_MAX_ROWS = rows_limit
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
