"""scripts/bench_vs_vllm.py and bench_throughput.py's vLLM binding and shared prefix: the shapes' exact lengths, the
binding environments, the tables from canned results, the flags refused, and one offline run on a stand-in vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kernels_pallas import ops
from tests.test_metrics import FAKE_VLLM

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import _bench_common as common  # noqa: E402
import bench_throughput as bt  # noqa: E402
import bench_vs_vllm as vs  # noqa: E402
from _vllm_worker import process_affinity  # noqa: E402

VOCAB = 32000


def _lengths(shape: vs.Shape, seed: int = 0) -> tuple[list[int], list[int]]:
    """The prompt and output lengths make_workload draws for ``shape``: uniform from the ranges, ``seed``'s rng."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(shape.input_len[0], shape.input_len[1] + 1, size=shape.num_requests)
    outputs = rng.integers(shape.output_len[0], shape.output_len[1] + 1, size=shape.num_requests)
    return inputs.tolist(), outputs.tolist()


def test_shapes_are_the_issues_workloads_and_limits():
    got = {name: (s.num_requests, s.input_len, s.output_len, s.max_num_seqs, s.max_model_len, s.shared_prefix_len)
           for name, s in vs.SHAPES.items()}
    assert got == {
        "mixed": (48, (16, 256), (16, 192), 64, 512, 0),
        "long": (16, (600, 1500), (64, 256), 64, 2048, 0),
        "shared-prefix": (32, (16, 256), (16, 192), 64, 1024, 384),
        "short": (192, (16, 64), (16, 64), 192, 128, 0),
    }


@pytest.mark.parametrize("name", list(vs.SHAPES))
def test_shape_workload_has_the_drawn_lengths_plus_the_shared_prefix(name):
    shape = vs.SHAPES[name]
    timed, warmup = vs.shape_workloads(shape, VOCAB, seed=3)
    inputs, outputs = _lengths(shape, seed=3)
    assert [len(p) for p in timed.prompts] == [shape.shared_prefix_len + n for n in inputs]
    assert timed.output_lens == outputs
    assert max(len(p) for p in timed.prompts) + max(outputs) <= shape.max_model_len
    n = min(vs.WARMUP_REQUESTS, shape.num_requests)
    assert [len(p) for p in warmup.prompts] == [shape.shared_prefix_len + m for m in inputs[:n]]
    assert warmup.output_lens == [vs.WARMUP_OUTPUT_LEN] * n
    # The warm-up's tokens are its own: the timed run finds none of its blocks in the prefix cache.
    assert all(w[:16] != t[:16] for w, t in zip(warmup.prompts, timed.prompts))


def test_shared_prefix_is_the_same_384_tokens_in_every_prompt_and_new_per_workload():
    timed, warmup = vs.shape_workloads(vs.SHAPES["shared-prefix"], VOCAB, seed=0)
    prefixes = {tuple(p[:384]) for p in timed.prompts}
    assert len(prefixes) == 1
    # What follows the prefix is each request's own.
    assert len({tuple(p[384:400]) for p in timed.prompts}) == len(timed.prompts)
    assert {tuple(p[:384]) for p in warmup.prompts} != prefixes and len({tuple(p[:384]) for p in warmup.prompts}) == 1


def test_shared_prefix_len_zero_leaves_the_workload_as_before():
    args = vs.shape_args(vs.SHAPES["mixed"], "float32", seed=0)
    tokens = np.random.default_rng([0, 1])
    inputs, _ = _lengths(vs.SHAPES["mixed"])
    assert common.make_workload(args, VOCAB, token_seed=1).prompts == [
        tokens.integers(0, 10000, size=n).tolist() for n in inputs]


def test_default_max_model_len_counts_the_shared_prefix():
    args = vs.shape_args(vs.SHAPES["shared-prefix"], "float32", seed=0)
    args.max_model_len = None
    assert common.engine_kwargs(args, "continuous")["max_model_len"] == 384 + 256 + 192


def test_vllm_engine_takes_the_largest_limits_of_the_shapes():
    args = vs.vllm_engine_args([vs.SHAPES["mixed"], vs.SHAPES["short"], vs.SHAPES["long"]], "bfloat16", seed=5)
    assert (args.max_num_seqs, args.max_model_len, args.dtype, args.seed) == (192, 2048, "bfloat16", 5)


# ---- the binding -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cpus, text", [([0, 1], "0-1"), ([0, 1, 2, 5], "0-2,5"), ([3], "3"), ([0, 2, 4], "0,2,4")])
def test_cpu_lists_are_spelled_as_vllm_reads_them(cpus, text):
    assert bt._cpu_list(cpus) == text
    assert bt._parse_cpu_list(text) == cpus


@pytest.mark.parametrize("binding, env", [
    ("default", {}),
    ("both", {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
    ("nobind", {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}),
    ("VLLM_CPU_OMP_THREADS_BIND=0-1;VLLM_CPU_NUM_OF_RESERVED_CPU=1",
     {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}),
    ("VLLM_CPU_OMP_THREADS_BIND=1", {"VLLM_CPU_OMP_THREADS_BIND": "1"}),
])
def test_binding_environment(binding, env):
    assert bt.vllm_binding_env(binding, "/venv/bin/python", cpus=[0, 1]) == env


def test_both_binding_spans_every_cpu_given():
    assert bt.vllm_binding_env("both", "/venv/bin/python", cpus=[0, 1, 2, 3])["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"


def test_iomp_binding_preloads_the_venvs_intel_openmp(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "bin" / "python").touch()
    (tmp_path / "lib" / "libiomp5.so").touch()
    env = bt.vllm_binding_env("both-iomp", str(tmp_path / "bin" / "python"), cpus=[0, 1])
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                   "LD_PRELOAD": str((tmp_path / "lib" / "libiomp5.so").resolve())}
    (tmp_path / "lib" / "libiomp5.so").unlink()
    with pytest.raises(ValueError, match="LD_PRELOAD=.*libiomp5.so.*no such file"):
        bt.vllm_binding_env("both-iomp", str(tmp_path / "bin" / "python"), cpus=[0, 1])


@pytest.mark.parametrize("binding, message", [
    ("fast", r"'fast' is neither a binding \(default, both, both-iomp, nobind\) nor KEY=VALUE"),
    ("OMP_NUM_THREADS=2", r"'OMP_NUM_THREADS=2' is neither.*KEY one of VLLM_CPU_OMP_THREADS_BIND"),
    ("VLLM_CPU_OMP_THREADS_BIND=0-3", r"'0-3' names CPUs outside this machine's 0-1"),
    ("VLLM_CPU_OMP_THREADS_BIND=0-1|0-1", r"'0-1\|0-1' is not one CPU list"),
    ("VLLM_CPU_OMP_THREADS_BIND=all", r"'all' is not one CPU list"),
    ("VLLM_CPU_NUM_OF_RESERVED_CPU=2", r"'2': need an integer in \[0, 2\)"),
    ("VLLM_CPU_NUM_OF_RESERVED_CPU=-1", r"'-1': need an integer in \[0, 2\)"),
    ("LD_PRELOAD=/no/such/lib.so", r"'/no/such/lib.so': no such file"),
])
def test_bad_binding_is_refused_naming_the_value_and_the_limit(binding, message):
    with pytest.raises(ValueError, match=message):
        bt.vllm_binding_env(binding, "/venv/bin/python", cpus=[0, 1])


def test_affinity_is_read_for_the_process_and_its_children():
    child = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
            time.sleep(0.01)
        rows = process_affinity(os.getpid())
    finally:
        child.kill()
        child.wait()
    by_pid = {r["pid"]: r for r in rows}
    assert rows[0]["pid"] == os.getpid() and rows[0]["cpus"] == sorted(os.sched_getaffinity(0))
    # The child inherits this process's affinity; sleep runs one thread.
    assert by_pid[child.pid]["name"] == "sleep"
    assert by_pid[child.pid]["threads"] == {bt._cpu_list(os.sched_getaffinity(0)): 1}
    line = bt.affinity_line("vllm[x]", [dict(pid=7, name="VLLM::Worker", cpus=[0], threads={"0": 47, "0-1": 2})])
    assert line == "vllm[x] CPU affinity: VLLM::Worker (pid 7) CPUs 0, threads 47 on 0, 2 on 0-1"


def _ended(pid: int) -> bool:
    """The process is gone, or a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_stopping_a_process_group_ends_the_children_that_outlive_their_parent(tmp_path):
    pids = tmp_path / "pids"
    # The leader's child would outlive it, as vLLM's engine core outlived its killed parent here.
    leader = subprocess.Popen(["bash", "-c", f"sleep 60 & echo $! > {pids}; wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    while not (pids.exists() and pids.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.01)
    child = int(pids.read_text())
    bt.stop_process_group(leader)
    assert leader.returncode == -15
    deadline = time.monotonic() + 10
    while not _ended(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _ended(child)
    bt.stop_process_group(leader)  # nothing left: no error


# ---- tables from canned results --------------------------------------------------------------------------------


def _jaxllm_row(tok_s: float, tokens: list) -> dict:
    return dict(num_requests=4, num_prompt_tokens=400, num_output_tokens=200, output_tokens_per_s=tok_s,
                startup_s=11.0, compilations=0, dot_peak_fraction=0.125,
                dot_rates={"xla": 180.0, "jaxllm_kernel": 212.5}, num_cached_prompt_tokens=0, token_ids=tokens)


def _vllm_row(tok_s: float, tokens: list, binding: str) -> dict:
    return dict(output_tokens_per_s=tok_s, startup_s=120.0, token_ids=tokens, vllm_env={"B": binding},
                vllm_affinity=[dict(pid=1, name="VLLM::Worker", cpus=[0], threads={"0": 3})], version="vllm 0.32.0")


CANNED = [
    vs.offline_row(vs.SHAPES["mixed"], "float32", [_jaxllm_row(100.0, [[1], [2], [3], [4]])],
                   {"default": [_vllm_row(60.0, [[1], [2], [3], [4]], "default")],
                    "both": [_vllm_row(80.0, [[1], [2], [3], [5]], "both")]}),
    vs.offline_row(vs.SHAPES["long"], "bfloat16", [_jaxllm_row(20.0, [[1], [2], [3], [4]])],
                   {"default": [_vllm_row(40.0, [[1], [9], [3], [4]], "default")],
                    "both": [_vllm_row(25.0, [[1], [2], [3], [4]], "both")]}),
]
# Three repeats each: the medians are 100 (jaxllm) and 90 (both, over default's 85), the agreement of repeat 0.
REPEATED = vs.offline_row(
    vs.SHAPES["short"], "float32",
    [_jaxllm_row(100.0, [[1], [2], [3], [4]]), _jaxllm_row(130.0, [[7]] * 4), _jaxllm_row(91.0, [[7]] * 4)],
    {"default": [_vllm_row(85.0, [[1], [2], [3], [4]], "default"), _vllm_row(60.0, [[7]] * 4, "default"),
                 _vllm_row(99.0, [[7]] * 4, "default")],
     "both": [_vllm_row(70.0, [[1], [2], [0], [0]], "both"), _vllm_row(90.0, [[8]] * 4, "both"),
              _vllm_row(120.0, [[8]] * 4, "both")]})


def test_offline_row_compares_with_the_faster_binding():
    mixed, long = CANNED
    assert (mixed["best_binding"], mixed["ratio_to_best"], mixed["same_tokens_as_best"]) == ("both", 1.25, 3)
    assert (long["best_binding"], long["ratio_to_best"], long["same_tokens_as_best"]) == ("default", 0.5, 3)


def test_repeated_runs_compare_the_median_runs_and_agree_on_the_first():
    assert vs.median_run([dict(output_tokens_per_s=v) for v in (3.0, 1.0, 2.0, 4.0)]) == dict(output_tokens_per_s=2.0)
    with pytest.raises(ValueError, match="no runs"):
        vs.median_run([])
    row = REPEATED
    assert (row["jaxllm_output_tokens_per_s"], row["best_binding"], row["vllm"]["both"]["output_tokens_per_s"],
            row["vllm"]["default"]["output_tokens_per_s"]) == (100.0, "both", 90.0, 85.0)
    assert row["ratio_to_best"] == pytest.approx(100.0 / 90.0) and row["same_tokens_as_best"] == 2
    assert row["jaxllm_runs_output_tokens_per_s"] == [100.0, 130.0, 91.0]
    assert row["vllm"]["both"]["runs_output_tokens_per_s"] == [70.0, 90.0, 120.0]
    line = vs.offline_table([row], ["default", "both"]).splitlines()[2].split()
    assert line == ["short", "float32", "4", "100.0", "(91-130)", "85.0", "(60-99)", "90.0", "(70-120)", "1.11x",
                    "vs", "both", "2/4", "12.5%"]


def test_repeats_have_the_lengths_of_the_first_and_tokens_of_their_own():
    shape = vs.SHAPES["shared-prefix"]
    first, second = (vs.shape_workloads(shape, VOCAB, seed=0, repeat=r) for r in (0, 1))
    assert first[0].prompts == vs.shape_workloads(shape, VOCAB, seed=0)[0].prompts
    assert [len(p) for p in first[0].prompts] == [len(p) for p in second[0].prompts]
    assert first[0].output_lens == second[0].output_lens and first[1].output_lens == second[1].output_lens
    # Nothing shared: not the 384-token prefix of the timed prompts, nor the warm-ups' tokens.
    assert first[0].prompts[0][:384] != second[0].prompts[0][:384]
    assert all(a[:16] != b[:16] for a, b in zip(first[1].prompts + first[0].prompts, second[1].prompts))


def test_offline_table_prints_every_binding_the_ratio_and_agreement():
    lines = vs.offline_table(CANNED, ["default", "both"]).splitlines()
    assert [c.strip() for c in lines[0].split("  ") if c.strip()] == [
        "shape", "dtype", "requests", "jaxllm tok/s", "vllm[default] tok/s", "vllm[both] tok/s",
        "jaxllm / best vllm", "same tokens as best", "jaxllm of dot peak"]
    assert lines[2].split() == ["mixed", "float32", "4", "100.0", "60.000", "80.000", "1.25x", "vs", "both", "3/4",
                                "12.5%"]
    assert lines[3].split() == ["long", "bfloat16", "4", "20.000", "40.000", "25.000", "0.50x", "vs", "default",
                                "3/4", "12.5%"]


def test_startup_table_gives_jaxllm_per_shape_and_vllm_per_binding():
    lines = vs.startup_table(CANNED, ["default", "both"]).splitlines()
    assert lines[2].split() == ["float32", "mixed", "11.000", "120.0", "120.0"]


def test_serving_table_compares_each_server_with_the_best_vllm_of_its_dtype():
    def row(server, tok_s):
        return dict(server=server, dtype="float32", completed=48, num_prompts=48, output_throughput=tok_s,
                    p50_ttft_ms=100.0, p99_ttft_ms=900.0, p50_tpot_ms=20.0, p99_tpot_ms=30.0, startup_s=15.0)

    lines = vs.serving_table([row("jaxllm", 90.0), row("vllm[default]", 60.0), row("vllm[both]", 75.0)]).splitlines()
    assert lines[2].split() == ["jaxllm", "float32", "48/48", "90.000", "100.0", "900.0", "20.000", "30.000",
                                "15.000", "1.20x"]
    assert lines[3].split()[-1] == "0.80x" and lines[4].split()[-1] == "1.00x"


def test_report_quotes_the_command_the_host_and_each_binding_affinity():
    payload = dict(command="python scripts/bench_vs_vllm.py --shapes mixed", model="/m", bindings=["default", "both"],
                   host=dict(cpu_count=2, cpu_isa="AVX2, AVX-512", load_avg_1m=0.5),
                   shapes={s: vars(vs.SHAPES[s]) for s in ("mixed", "long")}, offline=CANNED, serving=[], wall_s=600)
    text = vs.report(payload)
    assert text.splitlines()[0] == "command: python scripts/bench_vs_vllm.py --shapes mixed"
    assert "host: 2 CPUs (AVX2, AVX-512), 1-minute load average 0.5 at the end" in text
    assert "  mixed: 48 requests, prompts 16-256, outputs 16-192, max_num_seqs 64, max_model_len 512" in text
    assert ("vllm[both] float32 (env {'B': 'both'}) CPU affinity: VLLM::Worker (pid 1) CPUs 0, threads 3 on 0"
            in text)
    assert ("float32 matmul rates measured in this run: xla 180.0, jaxllm_kernel 212.5 GFLOP/s; 'jaxllm of dot "
            "peak' is against the fastest") in text
    assert text.endswith("wall time 10.0 min")


def test_report_quotes_the_serving_clients_workload_flags():
    row = dict(server="jaxllm", dtype="float32", completed=48, num_prompts=48, output_throughput=90.0,
               p50_ttft_ms=100.0, p99_ttft_ms=900.0, p50_tpot_ms=20.0, p99_tpot_ms=30.0, startup_s=15.0, affinity=None,
               client_flags=["--dataset-name", "random", "--num-prompts", "48"])
    payload = dict(command="c", model="/m", bindings=["default"], host=dict(cpu_count=2, cpu_isa="AVX2",
                   load_avg_1m=0.5), shapes={}, offline=[], serving=[row], wall_s=60)
    assert ("serving: jaxllm serve and vllm serve with the limits of mixed: 48 requests, prompts 16-256, outputs "
            "16-192, max_num_seqs 64, max_model_len 512; client vllm bench serve --dataset-name random --num-prompts "
            "48") in vs.report(payload)


def test_random_dataset_flags_span_the_shapes_lengths():
    flags = vs.random_dataset_flags(vs.SHAPES["mixed"])
    assert flags == ["--dataset-name", "random", "--random-input-len", "136", "--random-output-len", "104",
                     "--random-range-ratio", json.dumps({"input": 0.8824, "output": 0.8462}),
                     "--random-prefix-len", "0"]
    assert (136 * (1 - 0.8824), 136 * (1 + 0.8824)) == pytest.approx((16, 256), abs=0.02)
    assert (104 * (1 - 0.8462), 104 * (1 + 0.8462)) == pytest.approx((16, 192), abs=0.02)


# ---- flags ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--shapes", "huge"], "argument --shapes: invalid choice: 'huge'"),
    (["--dtypes", "float16"], "argument --dtypes: invalid choice: 'float16'"),
    (["--vllm-python", "/no/such/python"], "--vllm-python /no/such/python: no such file"),
    (["--vllm-bindings", "default", "fast"], "--vllm-bindings: vLLM binding 'fast': 'fast' is neither"),
    (["--vllm-bindings", "both", "both"], "--vllm-bindings both both: a binding is named twice"),
    (["--serving-num-prompts", "0"], "--serving-num-prompts 0: need at least 1"),
    (["--repeats", "0"], "--repeats 0: need at least 1"),
    (["--serving-request-rate", "0"], "--serving-request-rate 0.0: need > 0"),
    (["--shapes", "--serving-dtypes"], "--shapes and --serving-dtypes both empty: nothing to run"),
])
def test_bad_flags_are_refused_naming_the_value(flags, message, capsys):
    with pytest.raises(SystemExit):
        vs.parse_args(["--vllm-python", sys.executable, *flags])
    assert message in capsys.readouterr().err


def test_flags_default_to_every_shape_both_dtypes_and_two_bindings():
    args = vs.parse_args(["--vllm-python", sys.executable, "--serving-dtypes"])
    assert (args.shapes, args.dtypes, args.vllm_bindings, args.serving_dtypes) == (
        ["mixed", "long", "shared-prefix", "short"], ["float32", "bfloat16"], ["default", "both"], [])


def test_bench_throughput_refuses_a_bad_binding(capsys):
    with pytest.raises(SystemExit):
        bt.main(["--backend", "vllm", "--vllm-python", sys.executable, "--vllm-binding", "VLLM_CPU_OMP_THREADS_BIND=9"])
    assert "--vllm-binding: vLLM binding 'VLLM_CPU_OMP_THREADS_BIND=9'" in capsys.readouterr().err


def test_bench_throughput_refuses_a_negative_shared_prefix(capsys):
    with pytest.raises(SystemExit):
        bt.main(["--shared-prefix-len", "-1"])
    assert "--shared-prefix-len -1: need at least 0" in capsys.readouterr().err


# ---- one offline run on a stand-in vLLM --------------------------------------------------------------------------


def test_offline_run_gives_one_row_per_shape_with_every_binding(stories_dir, tmp_path, monkeypatch):
    fake = tmp_path / "fake_vllm"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(fake))
    monkeypatch.setenv("FAKE_VLLM_ARGS", str(tmp_path / "vllm_args.json"))
    tiny = [vs.Shape("tiny", 3, (4, 12), (2, 6), max_num_seqs=2, max_model_len=64),
            # One request at a time: the second finds the first's full block of the prefix (16 tokens) cached.
            vs.Shape("tiny-prefix", 2, (4, 8), (2, 4), max_num_seqs=1, max_model_len=96, shared_prefix_len=20)]
    flags = tiny[0].flags("float32", 0)
    assert flags[flags.index("--max-num-batched-tokens") + 1] == str(vs.MAX_NUM_BATCHED_TOKENS) == "512"
    # The engine builds every step program before its timed run (13 token buckets up to 512, twice: ~4 minutes on
    # 2 cores); a 32-token budget (5 buckets, the tiny prompts chunked) runs the same path in a fraction of that.
    monkeypatch.setattr(vs, "MAX_NUM_BATCHED_TOKENS", 32)
    rows = vs.run_offline(stories_dir, "float32", tiny, ["default", "both"], sys.executable, seed=0, repeats=2)
    assert [r["shape"] for r in rows] == ["tiny", "tiny-prefix"]
    for row in rows:  # two timed runs of each shape on each engine
        assert len(row["jaxllm_runs_output_tokens_per_s"]) == 2
        assert all(len(v["runs_output_tokens_per_s"]) == 2 for v in row["vllm"].values())
    for row, shape in zip(rows, tiny):
        assert row["num_requests"] == shape.num_requests and set(row["vllm"]) == {"default", "both"}
        assert row["num_output_tokens"] == sum(_lengths(shape)[1])
        assert row["jaxllm_compilations"] == 0  # every program was built before the timed run
        assert row["ratio_to_best"] == pytest.approx(
            row["jaxllm_output_tokens_per_s"] / row["vllm"][row["best_binding"]]["output_tokens_per_s"])
        assert 0 <= row["same_tokens_as_best"] <= shape.num_requests
        assert row["vllm"]["both"]["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert [r["jaxllm_cached_prompt_tokens"] for r in rows] == [0, 16]
    # float32 on the CPU host: XLA's dot, the engine's kernel and numpy's BLAS, the fraction against the fastest.
    kernel = {"jaxllm_kernel"} if ops.native_kernels() else set()
    assert all(set(r["dot_rates"]) == {"xla", "numpy"} | kernel for r in rows)
    # The last vLLM engine (binding both) ran every shape with the largest limits.
    engine = json.loads((tmp_path / "vllm_args.json").read_text())
    assert (engine["max_num_seqs"], engine["max_model_len"]) == (2, 96)
    assert engine["binding_env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_both_servers_get_the_same_engine_flags():
    shape = vs.SHAPES["mixed"]
    jaxllm = vs.server_argv("jaxllm", Path("/m"), shape, "bfloat16", 8001, 3, "/venv/bin/python")
    vllm = vs.server_argv("vllm", Path("/m"), shape, "bfloat16", 8002, 3, "/venv/bin/python")
    engine = ["--served-model-name", "bench", "--dtype", "bfloat16", "--max-num-seqs", "64", "--max-model-len", "512",
              "--max-num-batched-tokens", "512", "--seed", "3"]
    assert jaxllm == [sys.executable, "-m", "jaxllm.entrypoints.cli", "serve", "/m", "--host", "127.0.0.1", "--port",
                      "8001", *engine]
    assert vllm == ["/venv/bin/python", str(SCRIPTS / "_vllm_cli.py"), "serve", "/m", "--host", "127.0.0.1", "--port",
                    "8002", *engine, "--enable-prefix-caching"]


def test_client_is_vllms_bench_serve_greedy_with_ignore_eos_and_p50_p99(tmp_path):
    argv = vs.client_argv("/venv/bin/python", "http://127.0.0.1:8001", Path("/m"), vs.SHAPES["mixed"], 32,
                          float("inf"), 0, tmp_path)
    assert argv[:4] == ["/venv/bin/python", str(SCRIPTS / "_vllm_cli.py"), "bench", "serve"]
    flags = " ".join(argv[4:])
    for part in ("--base-url http://127.0.0.1:8001", "--model bench --tokenizer /m", "--num-prompts 32",
                 "--request-rate inf", "--ignore-eos", "--temperature 0", "--num-warmups 2",
                 "--percentile-metrics ttft,tpot,itl,e2el", "--metric-percentiles 50,99",
                 f"--result-dir {tmp_path} --result-filename result.json"):
        assert part in flags


def test_bfloat16_matmul_rates_are_xlas_and_the_kernels_without_numpy():
    rates = common.measure_matmul_rates("bfloat16", seconds=0.01)
    assert set(rates) == {"xla"} | ({"jaxllm_kernel"} if ops.native_kernels() else set())
    assert min(rates.values()) > 0


@pytest.mark.parametrize("backend, shape", [("cpu", (256, 1024, 4096)), ("gpu", (8192, 8192, 8192))])
def test_dot_rate_is_timed_on_a_projection_shape_on_cpu_and_a_large_dot_on_an_accelerator(monkeypatch, backend,
                                                                                          shape):
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert common.dot_bench_shape() == shape
