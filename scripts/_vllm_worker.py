"""Run bench_throughput.py's workloads on vLLM, in vLLM's own virtual environment (no jaxllm, no JAX here).

Usage (bench_throughput.py starts it): VLLM_PYTHON scripts/_vllm_worker.py SPEC.json RESULT.json

SPEC.json: engine settings (``model``, ``dtype``, ``max_num_seqs``, ``max_model_len``,
``max_num_batched_tokens``, ``seed``) and ``runs``, each ``{"name", "warmup", "timed"}`` with workloads
``{"prompts": [[ids]], "output_lens": [n]}``; greedy, ``ignore_eos``, prefix caching on.
RESULT.json: ``vllm_version``, ``startup_s``, ``affinity`` and per run ``elapsed_s`` and ``token_ids``.
``VLLM_CPU_KVCACHE_SPACE`` defaults to 4 (GiB); the CPU binding comes from the caller's environment.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path


def _generate(llm, workload: dict, use_tqdm: bool, detokenize: bool) -> list:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=detokenize)
              for n in workload["output_lens"]]
    prompts = [{"prompt_token_ids": p} for p in workload["prompts"]]
    return llm.generate(prompts, params, use_tqdm=use_tqdm)


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it, parents first (read from ``/proc/*/stat``)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name in parentheses may hold spaces; the parent pid is the second field after it.
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children[ppid].append(int(stat.parent.name))
    order, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        order.append(pid)
        todo += sorted(children[pid])
    return order


def process_affinity(root: int) -> list[dict]:
    """Where ``root`` and its descendants may run: one ``{"pid", "name", "cpus", "threads"}`` per process
    (``threads``: each thread ``Cpus_allowed_list`` -> how many threads have it).
    """
    rows = []
    for pid in _descendants(root):
        proc = Path(f"/proc/{pid}")
        try:
            name = (proc / "comm").read_text().strip()
            cpus = sorted(os.sched_getaffinity(pid))
            threads = collections.Counter()
            for status in (proc / "task").glob("*/status"):
                for line in status.read_text().splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        threads[line.split(":", 1)[1].strip()] += 1
        except (OSError, ProcessLookupError):
            continue
        rows.append(dict(pid=pid, name=name, cpus=cpus, threads=dict(sorted(threads.items()))))
    return rows


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import vllm

    has_tokenizer = (Path(spec["model"]) / "tokenizer.json").is_file()
    start = time.perf_counter()
    llm = vllm.LLM(
        model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_num_batched_tokens"],
        seed=spec["seed"], skip_tokenizer_init=not has_tokenizer, enable_prefix_caching=True,
    )
    result = dict(vllm_version=vllm.__version__, startup_s=time.perf_counter() - start,
                  affinity=process_affinity(os.getpid()), runs={})
    for run in spec["runs"]:
        print(f"vllm: run {run['name']}: {len(run['timed']['prompts'])} requests", file=sys.stderr, flush=True)
        _generate(llm, run["warmup"], use_tqdm=False, detokenize=has_tokenizer)
        start = time.perf_counter()
        outs = _generate(llm, run["timed"], use_tqdm=True, detokenize=has_tokenizer)
        elapsed = time.perf_counter() - start
        result["runs"][run["name"]] = dict(elapsed_s=elapsed, token_ids=[list(o.outputs[0].token_ids) for o in outs])
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
