"""The cost of LoRA adapters on the default model: output tokens per second, and adapter updates.

Output tok/s of one offline batch (``--num-requests`` random prompts of ``--input-len`` tokens, ``--output-len``
greedy tokens each, ``ignore_eos``) with: the base model alone (LoRA off); then, per ``--ranks`` rank, an engine of
``max_loras`` slots of that rank running the base model's requests, one adapter on every request, and ``n`` adapters
mixed round-robin across the requests (``--mixes``, one engine with ``max_loras = n`` each). Adapters are random PEFT
folders (``adapter_config.json``, ``adapter_model.safetensors``) targeting q, k, v, o, gate, up and down, written
to a temporary folder. Each engine runs the batch once untimed (it compiles its buckets) then ``--repeats`` times;
the median counts. Then the seconds of ``update_lora`` with a whole adapter against ``update_weights`` with every
weight (medians of ``--update-repeats``, settled on the device). ``--result-file MACHINE`` writes the dated result
file ``docs/benchmarks/results/<date>-MACHINE-lora.json`` and renders its Markdown page.

    python scripts/bench_lora.py [--num-requests 32] [--input-len 64] [--output-len 64] [--ranks 8 64]
                                 [--mixes 4 16] [--result-file MACHINE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _bench_common as common  # noqa: E402
import render_results  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COLUMNS = ["LoRA rank", "max_loras", "requests run under", "output tok/s", "vs base"]
PROFILE_COLUMNS = ["LoRA rank", "max_loras", "tokens", "projections ms", "with LoRA slots ms", "ratio"]


def write_adapter(folder: Path, rank: int, shapes: dict[str, tuple[int, int]], num_layers: int, seed: int) -> None:
    """A random PEFT LoRA folder of ``rank`` over every projection in ``TARGETS`` (``shapes``: HF module name ->
    the projection's ``(in, out)``), laid out as PEFT's ``save_pretrained`` writes it."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if module[0] in "qkvo" else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) / fan_in ** 0.5).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (0.01 * rng.standard_normal((fan_out, rank))).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "lora_dropout": 0.0, "bias": "none", "use_rslora": False}))


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``repeats`` calls."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def projection_ms(layers: dict[str, Any], num_slots: int, num_tokens: int, repeats: int = 5) -> float:
    """Milliseconds of every layer's seven projections (``jaxllm.models.common.project``, as a step reads its layer
    leaves) over ``num_tokens`` rows, each row in slot ``row % num_slots`` when ``layers`` hold LoRA slots (minimum
    of ``repeats`` after one compiling call)."""
    import jax
    import jax.numpy as jnp

    from jaxllm.models.common import LORA_A, LORA_B, LORA_ROWS, LoRARows, project
    from kernels_pallas.ops import with_stacked_weights
    from kernels_pallas.storage import from_storage

    keys = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    hidden, inter = layers["wq"].shape[1], layers["w_down"].shape[1]
    slots = max(num_slots, 1)
    rows = LoRARows(jnp.arange(num_tokens, dtype=jnp.int32) % slots, jnp.arange(slots, dtype=jnp.int32),
                    jnp.int32(min(slots, num_tokens)))

    @jax.jit
    def run(layers, x, h):
        def step(carry, index):
            # As a step reads them: the projections' layer sliced, the adapter slots stacked (read in place).
            adapters = {k: a for k, a in layers.items() if k.endswith((LORA_A, LORA_B))}
            dense = {k: a for k, a in layers.items() if k not in adapters}
            layer = with_stacked_weights(jax.tree_util.tree_map(lambda a: from_storage(a[index]), dense), layers,
                                         index, jnp.int32(num_tokens))
            if num_slots:
                layer.update(adapters)
                layer[LORA_ROWS] = rows._replace(layer=index)
            total = sum(project(layer, key, h if key == "w_down" else x).sum() for key in keys)
            return carry + total, None
        return jax.lax.scan(step, jnp.float32(0), jnp.arange(layers["wq"].shape[0]))[0]

    x = jnp.ones((num_tokens, hidden), jnp.float32)
    h = jnp.ones((num_tokens, inter), jnp.float32)
    run(layers, x, h).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(layers, x, h).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the default model)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--mixes", type=int, nargs="+", default=[4, 16],
                        help="adapter counts mixed across the requests (besides 1 on every request)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per case (median)")
    parser.add_argument("--update-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="also time every layer's projections with and without the engine's LoRA slots, for a "
                             "decode step (--num-requests rows) and a 512-token step")
    parser.add_argument("--result-file", metavar="MACHINE", default=None,
                        help="write docs/benchmarks/results/<date>-MACHINE-lora.json and its Markdown page")
    args = parser.parse_args()

    import jax

    from jaxllm import LLM, LoRARequest, SamplingParams
    from jaxllm.models import family
    from jaxllm.named_models import resolve_model

    model = str(resolve_model(args.model))
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine = dict(dtype="float32", max_num_seqs=args.num_requests, max_num_batched_tokens=512,
                  max_model_len=args.input_len + args.output_len, precompile=False,
                  enable_prefix_caching=False)
    shape = (f"{args.num_requests} requests of {args.input_len} random prompt tokens and {args.output_len} greedy "
             f"output tokens (ignore_eos), max_num_seqs={args.num_requests}, max_num_batched_tokens=512, float32, "
             "no prefix caching")
    rows, prompts = [], None
    work = tempfile.TemporaryDirectory(prefix="jaxllm-bench-lora-")

    def throughput(llm: LLM, loras: list) -> float:
        """Output tok/s of the batch (after one untimed run that builds the programs)."""
        def run() -> None:
            outs = llm.generate(prompts, params, lora_request=loras,
                                use_tqdm=False)
            assert sum(len(o.outputs[0].token_ids) for o in outs) == args.num_requests * args.output_len
        run()
        compiled = llm.engine.runner.compile_stats.num_compilations
        seconds = timed(run, args.repeats)
        assert llm.engine.runner.compile_stats.num_compilations == compiled, "a timed run compiled"
        return args.num_requests * args.output_len / seconds

    llm = LLM(model, **engine)
    vocab = llm.engine.runner.cfg.vocab_size
    prompts = [rng.integers(100, vocab - 100, args.input_len).tolist() for _ in range(args.num_requests)]
    base = throughput(llm, [None] * args.num_requests)
    rows.append(["-", "-", "base model (LoRA off)", f"{base:.1f}", "1.00"])
    print(common.format_table(COLUMNS, rows[-1:]), flush=True)
    full = jax.tree_util.tree_map(np.array, jax.device_get(llm.get_params()))
    runner = llm.engine.runner

    def settled(value: Any) -> Any:
        jax.block_until_ready((runner.weights.params, runner.cache_engine.kv_cache))
        return value

    update_weights = timed(lambda: settled(llm.update_weights(full)), args.update_repeats)
    num_layers = runner.weights.params["layers"]["wq"].shape[0]
    fam = family(runner.cfg)
    del llm, full, runner

    updates, profile = [], []
    for rank in args.ranks:
        for count in [1, *args.mixes]:
            llm = LLM(model, enable_lora=True, max_loras=count, max_lora_rank=rank, **engine)
            lora = llm.engine.core.lora
            shapes = {name.rsplit(".", 2)[-2]: lora.slots.shapes[key]
                      for name, (key, _) in fam.hf_layer_names.items() if key in lora.slots.shapes}
            requests = []
            for i in range(count):
                folder = Path(work.name) / f"r{rank}-n{count}-{i}"
                write_adapter(folder, rank, shapes, num_layers, seed=1000 * rank + i)
                requests.append(LoRARequest(f"adapter{i}", i + 1, str(folder)))
            cases = [("every request on the base model", [None] * args.num_requests)] if count in (1, max(
                args.mixes)) else []
            label = "one adapter on every request" if count == 1 else f"{count} adapters mixed"
            cases.append((label, [requests[i % count] for i in range(args.num_requests)]))
            for what, loras in cases:
                tok_s = throughput(llm, loras)
                rows.append([str(rank), str(count), what, f"{tok_s:.1f}", f"{tok_s / base:.2f}"])
                print(common.format_table(COLUMNS, rows[-1:]), flush=True)
            if count == 1:
                slots = llm.engine.runner.lora
                tree = lora.weights(1).tree()
                seconds = timed(lambda: jax.block_until_ready(
                    (llm.update_lora(1, tree), slots.leaves)), args.update_repeats)
                updates.append([str(rank), f"{1e3 * seconds:.1f}", f"{1e3 * update_weights:.1f}",
                                f"{update_weights / seconds:.0f}x",
                                f"{sum(v.nbytes for v in tree.values()) / 2**20:.1f}"])
            if args.profile:
                layers = llm.engine.runner.weights.params["layers"]
                with_slots = {**layers, **llm.engine.runner.lora.leaves}
                for tokens in (args.num_requests, 512):
                    base_ms, lora_ms = projection_ms(layers, 0, tokens), projection_ms(with_slots, count, tokens)
                    profile.append([str(rank), str(count), str(tokens), f"{base_ms:.2f}", f"{lora_ms:.2f}",
                                    f"{lora_ms / base_ms:.2f}"])
                    print(common.format_table(PROFILE_COLUMNS, profile[-1:]), flush=True)
            del llm, lora
    work.cleanup()

    host = common.host_info()
    host["load_avg_1m"] = round(host["load_avg_1m"], 1)
    update_columns = ["LoRA rank", "update_lora ms", "update_weights ms", "update_weights / update_lora",
                      "adapter MiB"]
    print(common.format_table(COLUMNS, rows))
    print(common.format_table(update_columns, updates))
    if profile:
        print(common.format_table(PROFILE_COLUMNS, profile))
    print(f"shape: {shape}")
    print(common.host_line(host))
    if args.result_file:
        date = datetime.date.today().isoformat()
        command = "python scripts/bench_lora.py" + (" --profile" if args.profile else "") + " --result-file " \
            + args.result_file
        result = {
            "date": date, "machine": args.result_file, "host": host,
            "title": "LoRA adapters on SmolLM2-135M-Instruct (float32)",
            "description": f"Offline batches of {shape}. Adapters are random PEFT folders targeting q, k, v, o, "
                           "gate, up and down; an engine has max_loras slots of the given rank, and a step "
                           "computes x A B for the slots its rows use (one fixed shape whatever the mix).",
            "tables": [{"title": "Output tokens per second", "command": command, "columns": COLUMNS, "rows": rows},
                       {"title": "Updating one adapter against every weight (median, settled on the device)",
                        "command": command, "columns": update_columns, "rows": updates}]}
        if profile:
            result["tables"].append({
                "title": "Where the time goes: every layer's seven projections of one step, with and without the "
                         "LoRA slots (minimum of 5)", "command": command,
                "columns": PROFILE_COLUMNS, "rows": profile})
        path = render_results.RESULTS / f"{date}-{args.result_file}-lora.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        path.with_suffix(".md").write_text(render_results.render(result))
        print("wrote", path)


if __name__ == "__main__":
    main()
