"""Every benchmark script prints the machine's ``host:`` line once (CPU count, instruction sets, 1-minute load
average at the end; issue 28), since which dtype is fast and how fast depend on them: each script is run in its
quickest mode (on stories260K where it loads a model), except two that cannot run quickly, whose source is checked."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, STORIES
from tests.helpers import assert_one_host_line

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"

# Script -> the arguments of its quickest run.
QUICK_RUNS = {
    "bench_detokenize.py": ["--model", str(STORIES), "--repeats", "1"],
    "bench_cpu_attention.py": ["--model", str(STORIES), "--rows", "2", "--context", "20", "40", "--shared-prefix",
                               "16", "--dtype", "float32", "bfloat16", "--rounds", "1"],
    "bench_kernels.py": ["--smoke", "--iters", "1"],
    # One step program per engine (16-token steps; the prompts prefilled in chunks), three engines.
    "bench_kv_compression.py": ["--model", str(STORIES), "--requests", "2", "--max-tokens", "4",
                                "--budget-blocks", "24", "--max-num-batched-tokens", "16"],
    "bench_lora.py": ["--model", str(STORIES), "--num-requests", "4", "--input-len", "8", "--output-len", "4",
                      "--ranks", "8", "--mixes", "2", "--update-repeats", "1"],
    "bench_kv_pool.py": ["--num-blocks", "64", "--live", "0.5", "--repeats", "1", "--wide-chunk", "8"],
    "bench_quant_matmul.py": ["--model", str(STORIES), "--tokens", "4", "--dtype", "float32", "--rounds", "1"],
    "bench_matmul.py": ["--model", str(STORIES), "--tokens", "4", "--dtype", "float32", "--rounds", "1"],
    "bench_weights.py": ["--model", str(STORIES), "--repeats", "1"],
}
# The scheduler-only simulations, which must not import JAX (not even for the host line).
JAX_FREE_RUNS = {
    "bench_scheduler.py": ["--steps", "20", "--running", "4", "--budget", "64", "--runs", "1"],
    "bench_predicted.py": ["--requests", "30"],
}
# Run by other tests, which check the host line: tests/test_metrics.py (_run_script), test_host_tier_engine.py,
# test_bench_vs_vllm.py (its report), test_rl_rollouts.py, test_profile_trace.py.
CHECKED_ELSEWHERE = {"bench_throughput.py", "bench_serving.py", "bench_short_run.py", "bench_multiturn.py",
                     "bench_vs_vllm.py", "rl_rollouts.py", "profile_trace.py"}
# Too slow for the suite on 2 cores: profile_step.py compiles about 20 step programs (~45 s at its smallest),
# bench_startup.py builds every step program of two LLM()s in fresh processes (~75 s with --skip-long-prompt).
SOURCE_CHECKED = {"profile_step.py", "bench_startup.py"}
# Run by a test of its own below.
CHECKED_BELOW = {"bench_hf_anchor.py"}


def _run(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_every_benchmark_script_has_its_host_line_checked():
    scripts = {p.name for p in SCRIPTS.glob("bench_*.py")} | {"profile_step.py", "profile_trace.py", "rl_rollouts.py"}
    checked = [*QUICK_RUNS, *JAX_FREE_RUNS, *CHECKED_ELSEWHERE, *SOURCE_CHECKED, *CHECKED_BELOW]
    assert sorted(checked) == sorted(scripts)


@pytest.mark.parametrize("script", sorted(QUICK_RUNS))
def test_quick_run_prints_the_host_line_once(script):
    assert_one_host_line(_run([str(SCRIPTS / script), *QUICK_RUNS[script]]))


@pytest.mark.parametrize("script", sorted(JAX_FREE_RUNS))
def test_scheduler_simulation_prints_the_host_line_without_importing_jax(script):
    argv = [str(SCRIPTS / script), *JAX_FREE_RUNS[script]]
    code = (f"import runpy, sys; sys.argv = {argv!r}; sys.path.insert(0, {str(SCRIPTS)!r}); "
            f"runpy.run_path(sys.argv[0], run_name='__main__'); "
            "assert 'jax' not in sys.modules, 'imported jax'")
    assert_one_host_line(_run(["-c", code]))


@pytest.mark.parametrize("script", sorted(SOURCE_CHECKED))
def test_slow_script_prints_the_host_line_last(script):
    tree = ast.parse((SCRIPTS / script).read_text())
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    assert ast.unparse(main.body[-1]) == "print(common.host_line(common.host_info()))"
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "host_line"]
    assert len(calls) == 1


@pytest.mark.skipif(not __import__("kernels_pallas.ops", fromlist=["native_kernels"]).native_kernels(),
                    reason="no C++ kernel built here")
def test_bench_matmul_times_each_projection_shape_alone_in_gflops(capsys):
    # stories260K's projections are not all multiples of 16 (its quick run prints no native column), so the
    # per-projection table is run on a stack of its own: two names of one shape share a column.
    import jax.numpy as jnp

    sys.path.insert(0, str(SCRIPTS))
    import bench_matmul

    shapes = {"wq": (32, 48), "wk": (32, 16), "wv": (32, 16)}
    stack = {k: jnp.ones((2, *s), jnp.float32) for k, s in shapes.items()}
    bench_matmul.per_projection(stack, shapes, [1, 7], rounds=1, layers=2, dtype=jnp.float32)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "native, one projection alone over the 2 layers: GFLOP/s, best of 1 rounds"
    assert lines[1].split() == ["tokens", "wq", "32x48", "wk/wv", "32x16"]
    rows = [line.split() for line in lines[2:]]
    # Tiny shapes run at well under 0.1 GFLOP/s: the cells are numbers, one per shape.
    assert [r[0] for r in rows] == ["1", "7"] and all(len(r) == 3 and float(r[1]) >= 0 and float(r[2]) >= 0
                                                      for r in rows)


def test_bench_cpu_attention_builds_shared_prefix_tables_and_refuses_a_prefix_past_the_context_or_no_layers():
    import jax.numpy as jnp

    sys.path.insert(0, str(SCRIPTS))
    import bench_cpu_attention

    rng = np.random.default_rng(0)
    q, k, v, tables, row, pos, tokens = bench_cpu_attention.decode_batch(rng, 3, (33, 64), 4, 2, 8, jnp.bfloat16, 2)
    tables = np.asarray(tables)
    # Two shared blocks, then each row's own: every id once apart from the shared ones, all inside the cache.
    assert (tables[:, :2] == tables[0, :2]).all() and k.dtype == v.dtype == jnp.uint16 and k.shape[1:] == (16, 2, 8)
    assert sorted(tables[:, 2:].ravel().tolist() + tables[0, :2].tolist()) == list(range(k.shape[0]))
    assert tokens == int(pos.sum()) + 3 and 33 <= pos.min() + 1 and pos.max() + 1 <= tables.shape[1] * 16
    assert row.tolist() == [0, 1, 2] and q.shape == (3, 4, 8)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_cpu_attention.py"), "--context", "16", "32",
                           "--shared-prefix", "16"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "--shared-prefix 16: need 0 <= N < the shortest context 16" in proc.stderr
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_cpu_attention.py"), "--layers", "0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "--layers 0: need at least 1" in proc.stderr


def test_bench_cpu_attention_calls_the_layers_asked_for_and_by_default_enough_to_pass_its_dram_bytes():
    sys.path.insert(0, str(SCRIPTS))
    import bench_cpu_attention

    dram = bench_cpu_attention.DRAM_BYTES
    # 16 rows at contexts 600-1500 of SmolLM2 (37 MB a layer, K and V): 14 layers pass 512 MB; capped by the model.
    assert bench_cpu_attention.default_layers(37_748_736, 30) == 14
    assert bench_cpu_attention.default_layers(dram // 100, 30) == 30
    assert bench_cpu_attention.default_layers(dram, 30) == 1 and bench_cpu_attention.default_layers(dram + 1, 30) == 1
    assert bench_cpu_attention.default_layers(dram // 2 + 1, 30) == 2 and bench_cpu_attention.default_layers(0, 5) == 5
    out = _run([str(SCRIPTS / "bench_cpu_attention.py"), "--model", str(STORIES), "--rows", "2", "--context", "20",
                "40", "--dtype", "float32", "--layers", "3", "--rounds", "1"])
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("float32")]
    # dtype, rows, mean context, layers, us, GB/s, share of stream
    assert len(rows) == 1 and rows[0][:2] == ["float32", "2"] and rows[0][3] == "3" and float(rows[0][4]) > 0


def test_run_bandwidth_counts_each_step_reading_the_parameters_and_the_workload_reading_its_kv_once():
    sys.path.insert(0, str(SCRIPTS))
    import _bench_common as common

    # Prompt 3 then 2 outputs: the prefill reads 3 KV tokens, the second token's decode 4; prompt 1, 1 output: 1.
    workload = common.Workload([[5, 6, 7], [8]], [2, 1])
    assert common.workload_kv_tokens(workload) == 3 + 4 + 1
    row = common.run_bandwidth(workload, steps=3, elapsed_s=2.0, weight_bytes=100, kv_bytes_per_token=10,
                               bandwidth_gbps=1e-6)
    assert row["floor_bytes"] == 3 * 100 + 8 * 10 and row["floor_s"] == pytest.approx(0.38)
    assert row["bandwidth_fraction"] == pytest.approx(0.19) and row["ms_per_step"] == pytest.approx(2000 / 3)
    assert common.run_bandwidth(workload, 3, 2.0, 100, 10, None)["bandwidth_fraction"] is None
    assert common.device_bandwidth("NVIDIA H100 80GB HBM3") == 3350 and common.device_bandwidth("cpu") is None


def test_hf_anchor_runs_the_throughput_workload_on_transformers_continuous_batching(tmp_path, capsys):
    # gpu_check.sh --dry-run's anchor stage: its shrunken Qwen3 shape and sizes, float32 on the CPU; in this
    # process, where torch and transformers are imported once for the suite.
    pytest.importorskip("transformers")
    sys.path.insert(0, str(SCRIPTS))
    import _bench_common as common
    import bench_hf_anchor

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True, attention_bias=False, **shape)))
    jaxllm = dict(backend="jaxllm", output_tokens_per_s=977.5, total_tokens_per_s=2257.3, steps=18, ms_per_step=5.5,
                  floor_bytes=1.1e7, floor_s=2.2e-4, elapsed_s=0.099, bandwidth_fraction=0.0022)
    (tmp_path / "throughput.json").write_text(json.dumps(dict(results=[jaxllm])))
    sizes = ["--num-requests", "8", "--input-len", "8", "32", "--output-len", "4", "16", "--max-num-seqs", "8",
             "--max-num-batched-tokens", "64", "--max-model-len", "64"]
    payload = bench_hf_anchor.main(["--model", str(tmp_path), "--random-weights", *sizes, "--bandwidth", "50",
                                    "--jaxllm-json", str(tmp_path / "throughput.json"),
                                    "--output-json", str(tmp_path / "anchor.json"),
                                    "--results-json", str(tmp_path / "results.json")])
    out = capsys.readouterr().out
    assert_one_host_line(out)
    row = payload["results"][0]
    assert json.loads((tmp_path / "anchor.json").read_text())["results"] == [row, jaxllm]
    workload = common.make_workload(argparse.Namespace(seed=0, num_requests=8, input_len=[8, 32], output_len=[4, 16],
                                                       shared_prefix_len=0), 1000, token_seed=1)
    assert row["backend"] == "transformers-cb" and row["dtype"] == "float32" and row["device"] == "cpu"
    assert row["num_output_tokens"] == workload.num_output_tokens
    assert row["num_prompt_tokens"] == workload.num_prompt_tokens
    # One forward pass a step, at most one new token per request in each.
    assert max(workload.output_lens) <= row["steps"] <= workload.num_output_tokens + len(workload.prompts)
    e, d, f, layers = 64, 16, 128, 2
    params = 1000 * e + layers * (e * 4 * d + 2 * e * 2 * d + 4 * d * e + 3 * e * f + 2 * e + 2 * d) + e
    assert row["weight_bytes"] == 4 * params and row["kv_bytes_per_token"] == 2 * layers * 2 * d * 4
    kv_bytes = common.workload_kv_tokens(workload) * row["kv_bytes_per_token"]
    assert row["floor_bytes"] == row["steps"] * row["weight_bytes"] + kv_bytes
    assert row["floor_s"] == pytest.approx(row["floor_bytes"] / 50e9)
    assert 0 < row["bandwidth_fraction"] < 1
    assert row["bandwidth_fraction"] == pytest.approx(row["floor_s"] / row["elapsed_s"])
    assert row["output_tokens_per_s"] == pytest.approx(workload.num_output_tokens / row["elapsed_s"])
    assert row["ms_per_step"] == pytest.approx(1e3 * row["elapsed_s"] / row["steps"])
    table = {line.split()[0]: line.split() for line in out.splitlines()
             if line.startswith(("transformers-cb ", "jaxllm "))}
    assert table["jaxllm"][1:4] == ["977.5", "2257.3", "18"] and table["jaxllm"][-1] == "0.2%"
    assert table["transformers-cb"][3] == str(row["steps"]) and table["transformers-cb"][-1].endswith("%")
    assert "bar: engines of vLLM's class reach 50%-68% of the bandwidth limit" in out
    # The dated result file: both rows as rendered cells, the bar among the notes, rendered by render_results.
    import render_results

    result = json.loads((tmp_path / "results.json").read_text())
    assert result["machine"] == "cpu" and result["host"]["device"] == "cpu" and result["host"]["driver"] is None
    (rendered,) = result["tables"]
    assert [r[:4] for r in rendered["rows"]] == [table["transformers-cb"][:4], table["jaxllm"][:4]]
    assert rendered["columns"][-1] == "of bandwidth limit" and any("50%-68%" in n for n in rendered["notes"])
    page = render_results.render(result)
    assert "| transformers-cb |" in page and "| jaxllm | 977.5 | 2257.3 | 18 |" in page


def test_gpu_check_parses_and_prints_its_stages():
    # The GPU machine is lent for minutes at a time: a script that does not parse would waste a whole lease.
    script = ROOT / "scripts" / "gpu_check.sh"
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    shown = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert shown.returncode == 0
    for stage in ("kernel tests", "kernel bench", "parity", "throughput", "anchor", "profile"):
        assert f"\n  {stage} " in shown.stdout, stage


def test_profile_compile_sums_the_jax_compile_events_of_a_pytest_run():
    out = _run([str(SCRIPTS / "profile_compile.py"), "-q", "-p", "no:cacheprovider", "tests/test_kernels_pallas.py",
                "-k", "kv_cache_write"])
    assert "exit status 0" in out
    rows = {line.split()[2]: (float(line.split()[0]), int(line.split()[1])) for line in out.splitlines()
            if line.split()[2:3] and line.split()[2].startswith("/jax/")}
    seconds, count = rows["/jax/core/compile/backend_compile_duration"]
    # Three write tests, each compiling at least its kernel and the reference's scatter.
    assert count >= 3 and seconds > 0
    assert_one_host_line(out)
