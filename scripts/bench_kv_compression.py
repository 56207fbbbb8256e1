"""KV compression before preemption (``kv_cache_compression``): with vs without, at one fixed KV budget.

Usage: python scripts/bench_kv_compression.py [--model PATH] [--requests N] [--budget-blocks B] [--fraction F ...]
                                              [--max-tokens N] [--max-num-batched-tokens T]

N greedy requests (default 16, ``max_tokens`` 96, ``ignore_eos``) arrive at once into a budget of B blocks
(default 48) with ``max_num_seqs=N``, so without compression the batch preempts; compression gives fraction
``F`` of the same bytes to the compressed pool. Columns:

* ``device blk`` / ``compr blk``: the two pools' blocks (null ones included);
* ``capacity``: the most leading requests served without preemption (the real ``Scheduler``, no model);
* ``peak``: requests running at once before the first preemption;
* ``preempt``, ``compressed``: preemptions, and blocks compressed; ``tok/s``: output tokens per wall second;
* ``agree %``: output tokens of compressed requests equal to the uncompressed run's;
* ``ppl`` and ``top1 %``: teacher-forced over ``CALIBRATION_TEXT`` with every earlier block read compressed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _bench_common as common  # noqa: E402

BLOCK_SIZE = 16
SENTENCES = (
    "The old lighthouse keeper climbed the stairs every evening, and tonight the wind was stronger than usual, so",
    "To make bread at home you need flour, water, salt and yeast. First, mix the flour and the salt in a large bowl,",
    "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France",
    "Dear team, thank you all for your hard work this quarter. Before the holidays I would like to share",
    "In the middle of the forest there was a small pond where the frogs sang every night. One evening a fox",
    "A good way to learn a new language is to read simple stories and to listen to people speaking it. For example,",
    "The train left the station at seven in the morning. Anna sat by the window with a cup of coffee and watched",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into",
    "When the museum opened its new wing, hundreds of visitors came to see the paintings that had been hidden",
    "The recipe for my grandmother's apple cake has never been written down. She always said that the secret was",
    "Engineers who design bridges have to think about wind, weight, temperature and the ground under the pillars,",
    "On the first day of school the children were nervous, but the teacher smiled and asked each of them to",
    "The city council met on Thursday to discuss the new park. Some members wanted a playground, others a garden,",
    "Mountain weather changes quickly. Hikers should carry a map, warm clothes, water and a little food, because",
    "The market was full of colours: red tomatoes, yellow lemons, green peppers and purple onions, and the sellers",
    "Every computer program starts as an idea. A programmer writes the idea down as instructions that the machine",
)


def prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` prompts: each sentence, then another one after it for variety in length (40-70 tokens)."""
    out = []
    for i in range(n):
        text = SENTENCES[i % len(SENTENCES)]
        if i % 3 == 0:
            text = SENTENCES[(i + 5) % len(SENTENCES)] + " " + text
        out.append(tokenizer.encode(text))
    return out


def capacity(workload, *, num_blocks: int, num_compressed: int, max_tokens: int, max_num_batched_tokens: int) -> int:
    """The largest k such that the workload's first k requests run to the end without a preemption."""
    from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

    best = 0
    for k in range(1, len(workload) + 1):
        max_len = max(len(p) for p in workload) + max_tokens
        sched = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=k,
                                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
                                          num_pool_blocks=num_compressed))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(workload[:k]):
            sched.add_request(Request(f"r{i}", prompt, params))
        while sched.has_unfinished_requests() and not sched.num_preemptions:
            out = sched.schedule()
            sched.update_from_output(out, [1] * out.num_seqs)
        if sched.num_preemptions:
            break
        best = k
    return best


def serve(model, workload, *, budget_blocks: int, max_tokens: int, max_num_batched_tokens: int, compression=None,
          fraction=0.5):
    """One engine over the workload. Returns its row: sizes, counts, throughput, tokens and compressed ids.
    Its step programs, all built before the timed run: one for steps of up to 16 tokens and one for
    ``max_num_batched_tokens`` (the same one at 16 or fewer)."""
    from jaxllm import SamplingParams
    from jaxllm.frontend.llm_engine import LLMEngine

    n = len(workload)
    max_len = max(len(p) for p in workload) + max_tokens
    engine = LLMEngine(model, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=budget_blocks, max_num_seqs=n,
                       max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len, precompile=True,
                       async_scheduling=False, token_buckets=sorted({min(16, max_num_batched_tokens),
                                                                     max_num_batched_tokens}),
                       seq_buckets=[n], kv_cache_compression=compression,
                       kv_cache_compression_fraction=fraction)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(workload):
        engine.add_request(f"r{i}", prompt, params)
    sched, kv = engine.scheduler, engine.scheduler.kv_cache_manager
    tokens, compressed, peak, steps = {}, set(), 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if sched.num_preemptions == 0:
            peak = max(peak, len(sched.running))
        compressed |= {rid for rid, ids in kv.req_to_block_ids.items() if any(b >= engine.num_blocks for b in ids)}
    seconds = time.perf_counter() - start
    stats = sched.stats
    pool = engine.runner.cache_engine.scaled_pool
    num_compressed = 0 if pool is None else pool.k.shape[1]
    return dict(name=compression or "off", fraction=fraction if compression else 0.0, device=engine.num_blocks,
                compressed_blocks=num_compressed, peak=peak, preemptions=stats.num_preemptions,
                capacity=capacity(workload, num_blocks=engine.num_blocks, num_compressed=num_compressed,
                                  max_tokens=max_tokens, max_num_batched_tokens=max_num_batched_tokens),
                num_compressed=stats.num_blocks_pooled, tok_s=sum(map(len, tokens.values())) / seconds,
                tokens=tokens, compressed=compressed, steps=steps)


def teacher_forced(path, compression):
    """(perplexity, argmax per position) of CALIBRATION_TEXT in BLOCK_SIZE-token chunks, earlier blocks read from
    a compressed pool of ``compression`` (None: uncompressed).
    """
    import jax
    import jax.numpy as jnp

    from jaxllm.loader import load_model
    from jaxllm.models import compute_logits, hidden_states
    from jaxllm.tokenizer import load_tokenizer
    from jaxllm.worker.kv_cache import CALIBRATION_TEXT, KV_QUANT_DTYPES, allocate_kv_cache
    from jaxllm.worker.sharding import ModelSharding, make_mesh
    from jaxllm.worker.step_batch import StepBatch
    from kernels_pallas.ops import get_attention_ops
    from kernels_pallas.storage import BITS_STORAGE, ScaledKV, quantize_blocks

    cfg, params, _ = load_model(path, np.float32)
    ids = np.asarray(load_tokenizer(path).encode(CALIBRATION_TEXT), np.int32)
    chunks = len(ids) // BLOCK_SIZE
    ids = ids[: chunks * BLOCK_SIZE]
    sharding = ModelSharding(cfg, make_mesh(1))
    ops = sharding.attention_ops(get_attention_ops("xla"))
    num_blocks = chunks + 1
    kv = allocate_kv_cache(num_blocks, BLOCK_SIZE, jnp.float32, sharding)
    pool = None
    if compression is not None:
        storage = KV_QUANT_DTYPES[compression]
        storage = BITS_STORAGE.get(storage, storage)
        k, v = allocate_kv_cache(num_blocks, BLOCK_SIZE, storage, sharding)
        ones = jnp.ones((cfg.num_layers, num_blocks, cfg.num_kv_heads), jnp.float32)
        pool = ScaledKV(k, v, ones, ones)

    @jax.jit
    def chunk(params, kv, pool, batch):
        hidden, kv = hidden_states(params, kv, batch, cfg=cfg, ops=ops, scaled_pool=pool)
        return compute_logits(params, hidden, cfg=cfg), kv

    @jax.jit
    def compress(kv, pool, block):
        (k, ks), (v, vs) = (quantize_blocks(c[:, block], p.dtype) for c, p in zip(kv, pool[:2]))
        return ScaledKV(pool.k.at[:, block].set(k), pool.v.at[:, block].set(v),
                            pool.k_scale.at[:, block].set(ks), pool.v_scale.at[:, block].set(vs))

    logits = []
    none = np.full(BLOCK_SIZE, -1, np.int32)
    for c in range(chunks):
        # Block j of the text lives in device block j + 1, and once compressed in slot j + 1 (id num_blocks + j + 1).
        table = np.zeros(chunks, np.int32)
        table[: c + 1] = np.arange(1, c + 2)
        if pool is not None:
            table[:c] += num_blocks
        positions = np.arange(c * BLOCK_SIZE, (c + 1) * BLOCK_SIZE, dtype=np.int32)
        batch = StepBatch(input_ids=ids[positions], positions=positions, slot_mapping=positions + BLOCK_SIZE,
                          block_tables=table[None], seq_lens=np.asarray([(c + 1) * BLOCK_SIZE], np.int32),
                          query_start_loc=np.asarray([0, BLOCK_SIZE], np.int32),
                          logits_indices=np.asarray([BLOCK_SIZE - 1], np.int32), prev_token_index=none,
                          prompt_target_ids=none, num_spec_tokens=np.zeros(1, np.int32), num_seqs=np.int32(1))
        out, kv = chunk(params, kv, pool, batch)
        logits.append(np.asarray(out))
        if pool is not None:
            pool = compress(kv, pool, np.int32(c + 1))
    logits = np.concatenate(logits)
    logp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    nll = -np.asarray(logp[np.arange(len(ids) - 1), ids[1:]])
    return float(np.exp(nll.mean())), logits.argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--budget-blocks", type=int, default=48, help="KV budget, in blocks of 16 float32 tokens")
    parser.add_argument("--fraction", type=float, nargs="+", default=[0.5],
                        help="kv_cache_compression_fraction values to run")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256,
                        help="tokens per step (longer prompts are prefilled in chunks)")
    args = parser.parse_args()

    from jaxllm.named_models import resolve_model
    from jaxllm.tokenizer import load_tokenizer

    model = resolve_model(args.model)
    workload = prompts(load_tokenizer(model), args.requests)
    sizes = dict(budget_blocks=args.budget_blocks, max_tokens=args.max_tokens,
                 max_num_batched_tokens=args.max_num_batched_tokens)
    runs = [serve(model, workload, **sizes)]
    for kind in ("int8", "fp8"):
        for fraction in args.fraction:
            runs.append(serve(model, workload, **sizes, compression=kind, fraction=fraction))
    base_ppl, base_top1 = teacher_forced(model, None)
    quality = {kind: teacher_forced(model, kind) for kind in ("int8", "fp8")}

    base = runs[0]["tokens"]
    print(f"\n{args.requests} requests, {sum(map(len, workload))} prompt tokens, max_tokens {args.max_tokens}; "
          f"KV budget {args.budget_blocks} blocks of {BLOCK_SIZE} float32 tokens")
    header = (f"{'compression':<12}{'fraction':>9}{'device blk':>11}{'compr blk':>10}{'capacity':>9}{'peak':>6}"
              f"{'preempt':>8}{'compressed':>11}{'tok/s':>8}{'agree %':>9}{'ppl':>8}{'top1 %':>8}")
    print(header)
    print("-" * len(header))
    for run in runs:
        held = sorted(run["compressed"])
        same = sum(int(a == b) for rid in held for a, b in zip(run["tokens"][rid], base[rid]))
        total = sum(len(base[rid]) for rid in held)
        agree = f"{100 * same / total:.1f}" if total else "-"
        ppl, top1 = (base_ppl, base_top1) if run["name"] == "off" else quality[run["name"]]
        print(f"{run['name']:<12}{run['fraction']:>9.2f}{run['device']:>11}{run['compressed_blocks']:>10}"
              f"{run['capacity']:>9}{run['peak']:>6}{run['preemptions']:>8}{run['num_compressed']:>11}"
              f"{run['tok_s']:>8.1f}{agree:>9}"
              f"{ppl:>8.3f}{100 * np.mean(top1 == base_top1):>8.1f}")
    print(common.host_line(common.host_info()))


if __name__ == "__main__":
    main()
