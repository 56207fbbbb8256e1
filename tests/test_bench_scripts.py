"""Every benchmark script prints the machine's ``host:`` line once (CPU count, instruction sets, 1-minute load
average at the end; issue 28), since which dtype is fast and how fast depend on them: each script is run in its
quickest mode (on stories260K where it loads a model), except two that cannot run quickly, whose source is checked."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import STORIES
from tests.helpers import assert_one_host_line

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"

# Script -> the arguments of its quickest run.
QUICK_RUNS = {
    "bench_kernels.py": ["--smoke"],
    "bench_kv_compression.py": ["--model", str(STORIES), "--requests", "2", "--max-tokens", "4",
                                "--budget-blocks", "24"],
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
# test_bench_vs_vllm.py (its report), test_rl_rollouts.py.
CHECKED_ELSEWHERE = {"bench_throughput.py", "bench_serving.py", "bench_short_run.py", "bench_multiturn.py",
                     "bench_vs_vllm.py", "rl_rollouts.py"}
# Too slow for the suite on 2 cores: profile_step.py compiles about 20 step programs (~45 s at its smallest),
# bench_startup.py builds every step program of two LLM()s in fresh processes (~75 s with --skip-long-prompt).
SOURCE_CHECKED = {"profile_step.py", "bench_startup.py"}


def _run(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_every_benchmark_script_has_its_host_line_checked():
    scripts = {p.name for p in SCRIPTS.glob("bench_*.py")} | {"profile_step.py", "rl_rollouts.py"}
    checked = [*QUICK_RUNS, *JAX_FREE_RUNS, *CHECKED_ELSEWHERE, *SOURCE_CHECKED]
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
