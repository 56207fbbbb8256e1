"""Run bench_throughput.py's workloads on vLLM, in vLLM's own virtual environment (no jaxllm, no JAX here).

Usage (bench_throughput.py starts it): VLLM_PYTHON scripts/_vllm_worker.py SPEC.json RESULT.json

SPEC.json holds the engine settings (``model``: an HF folder, ``dtype``,
``max_num_seqs``, ``max_model_len``, ``max_num_batched_tokens``, ``seed``)
and ``runs``: a list of ``{"name", "warmup", "timed"}``, each workload a
``{"prompts": [[token id, ...], ...], "output_lens": [tokens, ...]}``. Every
request is greedy with ``ignore_eos``. RESULT.json gets ``vllm_version``,
``startup_s`` (building ``vllm.LLM``, seconds) and per run name
``elapsed_s`` (the timed ``generate``, seconds, after the untimed warm-up)
and ``token_ids`` (each request's output tokens, in request order).

vLLM runs its engine core in a spawned process, hence the ``__main__`` guard.
``VLLM_CPU_KVCACHE_SPACE`` defaults to 4 (GiB) here: vLLM's own default is
sized for servers. A folder without ``tokenizer.json`` (random weights) runs
with ``skip_tokenizer_init`` and no detokenization.
"""

from __future__ import annotations

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


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import vllm

    has_tokenizer = (Path(spec["model"]) / "tokenizer.json").is_file()
    start = time.perf_counter()
    llm = vllm.LLM(
        model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_num_batched_tokens"],
        seed=spec["seed"], skip_tokenizer_init=not has_tokenizer,
    )
    result = dict(vllm_version=vllm.__version__, startup_s=time.perf_counter() - start, runs={})
    for run in spec["runs"]:
        _generate(llm, run["warmup"], use_tqdm=False, detokenize=has_tokenizer)
        start = time.perf_counter()
        outs = _generate(llm, run["timed"], use_tqdm=True, detokenize=has_tokenizer)
        elapsed = time.perf_counter() - start
        result["runs"][run["name"]] = dict(elapsed_s=elapsed, token_ids=[list(o.outputs[0].token_ids) for o in outs])
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
