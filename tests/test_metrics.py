"""Engine metrics on scripted workloads (stories260K), static batching, the progress bar, the bench scripts' JSON."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm import LLM, SamplingParams
from kernels_pallas import ops
from kernels_pallas.cpu_features import cpu_instruction_sets, describe_cpu
from kernels_pallas.ops import HEAD_PANELS
from tests.conftest import log_messages
from tests.helpers import assert_one_host_line

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
GREEDY = dict(temperature=0, ignore_eos=True)


def _llm(stories_dir, **kwargs) -> LLM:
    config = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, precompile=False)
    return LLM(model=stories_dir, **{**config, **kwargs})


def _value(llm: LLM, name: str, **labels: str) -> float:
    return llm.engine.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def llm(stories_dir) -> LLM:
    return _llm(stories_dir)


def _prompt(n: int, start: int = 3) -> list[int]:
    return [start + (i * 7) % 400 for i in range(n)]


def test_prompt_and_generation_token_counters_equal_exact_sums(llm):
    prompts = [_prompt(5), _prompt(12, 9), _prompt(20, 30)]
    max_tokens = [3, 7, 11]
    before = _value(llm, "jaxllm:prompt_tokens_total"), _value(llm, "jaxllm:generation_tokens_total")
    llm.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in max_tokens], use_tqdm=False)
    assert _value(llm, "jaxllm:prompt_tokens_total") - before[0] == 5 + 12 + 20
    assert _value(llm, "jaxllm:generation_tokens_total") - before[1] == 3 + 7 + 11


def test_latency_histograms_count_each_request_and_each_later_token(llm):
    names = ["time_to_first_token", "e2e_request_latency", "request_queue_time", "inter_token_latency"]
    before = {n: _value(llm, f"jaxllm:{n}_seconds_count") for n in names}
    max_tokens = [4, 6, 9, 1, 2]
    llm.generate([_prompt(6, s) for s in range(5)], [SamplingParams(max_tokens=n, **GREEDY) for n in max_tokens],
                 use_tqdm=False)
    delta = {n: _value(llm, f"jaxllm:{n}_seconds_count") - before[n] for n in names}
    assert delta["time_to_first_token"] == 5
    assert delta["e2e_request_latency"] == 5
    assert delta["request_queue_time"] == 5
    assert delta["inter_token_latency"] == sum(n - 1 for n in max_tokens)


def test_iteration_tokens_histogram_sums_every_computed_token(llm):
    before = _value(llm, "jaxllm:iteration_tokens_total_sum")
    llm.generate([_prompt(10)], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    # 10 prompt tokens, then one token fed back per decode step after the first sample.
    assert _value(llm, "jaxllm:iteration_tokens_total_sum") - before == 10 + 4


def test_repeated_prompt_raises_prefix_cache_hits_by_the_cached_tokens(llm):
    prompt = _prompt(40, 77)
    params = SamplingParams(max_tokens=2, **GREEDY)
    llm.generate([prompt], params, use_tqdm=False)
    queries, hits = _value(llm, "jaxllm:prefix_cache_queries_total"), _value(llm, "jaxllm:prefix_cache_hits_total")
    llm.generate([prompt], params, use_tqdm=False)
    # Two full 16-token blocks of the 40-token prompt were cached by the first run.
    assert _value(llm, "jaxllm:prefix_cache_hits_total") - hits == 32
    assert _value(llm, "jaxllm:prefix_cache_queries_total") - queries == 40


def test_forced_preemption_raises_num_preemptions_by_one(stories_dir):
    # 3 usable blocks of 16: two 16-token prompts fit, but both cannot grow past 16 tokens.
    llm = _llm(stories_dir, num_kv_blocks=4)
    llm.generate([_prompt(16), _prompt(16, 50)], SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions == 1
    assert _value(llm, "jaxllm:num_preemptions_total") == 1


def test_gauges_follow_running_requests_and_kv_blocks(stories_dir):
    llm = _llm(stories_dir, num_kv_blocks=17, max_num_batched_tokens=128)
    engine = llm.engine
    for i in range(6):
        engine.add_request(f"g{i}", _prompt(17, i), SamplingParams(max_tokens=8, **GREEDY))
    engine.step()
    assert _value(llm, "jaxllm:num_requests_running") == 4
    assert _value(llm, "jaxllm:num_requests_waiting") == 2
    # 4 requests x 2 blocks of the 16 usable.
    assert _value(llm, "jaxllm:kv_cache_usage_perc") == pytest.approx(8 / 16)
    # 17 computed tokens in 32 allocated slots per request.
    assert _value(llm, "jaxllm:kv_cache_fragmentation_ratio") == pytest.approx(15 / 32)
    while engine.has_unfinished_requests():
        engine.step()
    assert _value(llm, "jaxllm:num_requests_running") == 0
    assert _value(llm, "jaxllm:kv_cache_usage_perc") == 0
    assert _value(llm, "jaxllm:kv_cache_fragmentation_ratio") == 0


def test_scheduler_step_histogram_counts_every_step(llm):
    before = _value(llm, "jaxllm:scheduler_step_seconds_count")
    engine = llm.engine
    engine.add_request("s0", _prompt(4), SamplingParams(max_tokens=3, **GREEDY))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert _value(llm, "jaxllm:scheduler_step_seconds_count") - before == steps


def test_compilations_count_new_shapes_only(stories_dir):
    llm = _llm(stories_dir)
    params = SamplingParams(max_tokens=3, **GREEDY)
    llm.generate([_prompt(5)], params, use_tqdm=False)
    first = _value(llm, "jaxllm:compilations_total")
    assert first >= 1
    llm.generate([_prompt(5, 100)], params, use_tqdm=False)
    assert _value(llm, "jaxllm:compilations_total") == first


def test_each_engine_has_its_own_registry(stories_dir, llm):
    other = _llm(stories_dir)
    before = _value(llm, "jaxllm:generation_tokens_total")
    other.generate([_prompt(4)], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert _value(other, "jaxllm:generation_tokens_total") == 5
    assert _value(llm, "jaxllm:generation_tokens_total") == before


def test_static_batching_admits_a_batch_only_after_the_previous_one_finished(stories_dir):
    llm = _llm(stories_dir, max_num_seqs=2, batching="static")
    engine = llm.engine
    lengths = {"a": 2, "b": 8, "c": 3, "d": 3}
    for rid, n in lengths.items():
        engine.add_request(rid, _prompt(6, ord(rid)), SamplingParams(max_tokens=n, **GREEDY))
    finished: list[str] = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
        running = {r.request_id for r in engine.scheduler.running}
        if running & {"c", "d"}:
            assert {"a", "b"} <= set(finished)
        elif "a" in finished and "b" not in finished:
            # a's seat stays empty: c and d are held while b runs on.
            assert running == {"b"} and engine.scheduler.stats.num_waiting == 2
    assert finished == ["a", "b", "c", "d"]


def test_static_batching_gives_the_same_greedy_tokens_as_continuous(stories_dir, llm):
    static = _llm(stories_dir, max_num_seqs=2, batching="static")
    prompts = [_prompt(7, s) for s in range(5)]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (2, 9, 4, 6, 3)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in static.generate(prompts, params, use_tqdm=False)] == want


def test_static_batching_abort_drops_a_held_request(stories_dir):
    llm = _llm(stories_dir, max_num_seqs=1, batching="static")
    engine = llm.engine
    engine.add_request("first", _prompt(4), SamplingParams(max_tokens=2, **GREEDY))
    engine.add_request("held", _prompt(4, 9), SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    assert engine.scheduler.stats.num_waiting == 1
    engine.abort_request("held")
    assert engine.scheduler.stats.num_waiting == 0
    while engine.has_unfinished_requests():
        engine.step()


def test_unknown_batching_mode_is_rejected(stories_dir):
    with pytest.raises(ValueError, match="batching"):
        _llm(stories_dir, batching="dynamic")


def test_disable_log_stats_moves_no_series_keeps_the_cores_stats_and_the_tokens(stories_dir, llm):
    """vLLM's disable_log_stats: the same greedy tokens, no Prometheus series moves (counters and histograms stay
    at 0), while the cores' latest stats, which admission's waiting limit reads, are still kept."""
    quiet = _llm(stories_dir, disable_log_stats=True)
    prompts = [_prompt(6, s) for s in range(3)]
    params = SamplingParams(max_tokens=5, **GREEDY)
    got = [o.outputs[0].token_ids for o in quiet.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for name in ("jaxllm:generation_tokens_total", "jaxllm:prompt_tokens_total",
                 "jaxllm:inter_token_latency_seconds_count", "jaxllm:time_to_first_token_seconds_count",
                 "jaxllm:e2e_request_latency_seconds_count", "jaxllm:num_kv_blocks"):
        assert _value(quiet, name) == 0.0, name
    stats = quiet.engine.metrics.core_stats[0]
    assert stats.num_running == 0 and stats.num_blocks == _value(llm, "jaxllm:num_kv_blocks") > 0


@pytest.mark.parametrize("other", [dict(log_stats=True), dict(metrics_port=9999)], ids=["log_stats", "metrics_port"])
def test_disable_log_stats_refuses_a_stats_log_or_a_metrics_port(stories_dir, other):
    (name, value), = other.items()
    with pytest.raises(ValueError, match=rf"disable_log_stats=True .*{name}={value}"):
        _llm(stories_dir, disable_log_stats=True, **other)


def test_log_stats_logs_a_summary_line(stories_dir, capfd):
    llm = _llm(stories_dir, log_stats=True)
    llm.engine.metrics.log_interval = 0.0
    capfd.readouterr()
    llm.generate([_prompt(4)], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    lines = log_messages(capfd.readouterr().err, "INFO", "metrics.py")
    assert lines and "generation throughput" in lines[-1] and "KV cache usage" in lines[-1]


def test_metrics_port_serves_the_registry(stories_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    llm = _llm(stories_dir, metrics_port=port)
    try:
        llm.generate([_prompt(4)], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        llm.engine.metrics.close()
    assert "jaxllm:generation_tokens_total 3.0" in body


def test_generate_shows_a_progress_bar_unless_use_tqdm_is_false(llm, capsys):
    params = SamplingParams(max_tokens=2, **GREEDY)
    llm.generate([_prompt(4)], params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    llm.generate([_prompt(4)], params)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "tok/s" in err


TINY = ["--num-requests", "3", "--input-len", "4", "12", "--output-len", "2", "6", "--max-num-seqs", "2",
        "--max-model-len", "64", "--max-num-batched-tokens", "32"]
THROUGHPUT_FIELDS = {
    "backend", "num_requests", "startup_s", "elapsed_s", "num_prompt_tokens", "num_output_tokens", "requests_per_s",
    "output_tokens_per_s", "total_tokens_per_s", "peak_kv_cache_usage", "peak_kv_slots", "kv_live_slot_fraction",
    "max_num_running", "num_preemptions", "compilations", "same_tokens_as_jaxllm", "steps", "schedule_s_per_step",
    "schedule_fraction_of_wall", "version",
    # Memory: jaxllm's parameter and KV cache MiB and KV blocks (None on the other backends' rows).
    "param_mib", "kv_blocks", "kv_mib",
    # The matmul rates measured in the run, the fastest, and the fraction of it the row's tokens needed.
    "dot_gflops", "dot_rates", "dot_peak_fraction",
}
# Rows of jaxllm's own runs (static and continuous batching) also say whether they were constrained.
JAXLLM_RUN_FIELDS = {"structured", "compare", "bitmask_s_per_step", "num_cached_prompt_tokens", "page_faults",
                     "system_s", "host_thread_s_per_step",
                     # Against the bandwidth limit (_bench_common.run_bandwidth).
                     "ms_per_step", "weight_bytes", "kv_bytes_per_token", "floor_bytes", "bandwidth_gbps", "floor_s",
                     "bandwidth_fraction"}
# vLLM's rows also say which CPU binding ran and where it put vLLM's processes.
VLLM_RUN_FIELDS = {"vllm_binding", "vllm_env", "vllm_affinity"}
# A stand-in for vLLM's package, run by bench_throughput.py's vllm backend through
# scripts/_vllm_worker.py: it records the engine arguments and answers each
# request with its own prompt tokens, repeated to the asked length.
FAKE_VLLM = """
import json, os, types
__version__ = "fake"
class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos, detokenize):
        self.max_tokens = max_tokens
class LLM:
    def __init__(self, **kwargs):
        binding = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_") and k != "VLLM_CPU_KVCACHE_SPACE"}
        with open(os.environ["FAKE_VLLM_ARGS"], "w") as f:
            json.dump(dict(kwargs, binding_env=binding), f)
    def generate(self, prompts, params, use_tqdm):
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
            token_ids=(p["prompt_token_ids"] * s.max_tokens)[:s.max_tokens])]) for p, s in zip(prompts, params)]
"""
SERVING_FIELDS = {
    "batching", "graceful_degradation", "measured_capacity", "num_requests", "duration_s", "request_throughput",
    "output_throughput", "num_output_tokens",
    "max_concurrency", "num_preemptions", "kv_live_slot_fraction", "mean_kv_cache_usage", "peak_kv_cache_usage",
    "compilations",
} | {f"{m}_{s}" for m in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s", "step_s")
      for s in ("mean", "p50", "p90", "p99")}


def _run_script(name: str, args: list[str], tmp_path: Path, env: dict | None = None) -> dict:
    """The script's JSON, once its printed ``host:`` line is checked to be its JSON's ``host`` (this machine's)."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args, "--output-json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert assert_one_host_line(proc.stdout) == _bench_common().host_line(result["host"])
    return result


def _bench_common():
    """scripts/_bench_common.py, imported with scripts/ on the path."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import _bench_common

    return _bench_common


# stories260K: 5 layers of q, k, v, o (64 x 64, 64 x 32, 64 x 32, 64 x 64) and a 64 x 172 SwiGLU, the tied
# 64 x 512 head; 2 FLOPs a multiply-add.
STORIES_MATMUL_FLOPS = 2 * (5 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 172) + 64 * 512)


def test_matmul_flops_per_token_counts_every_projection_and_the_head(stories_dir):
    from jaxllm.loader import read_model_config

    assert _bench_common().matmul_flops_per_token(read_model_config(stories_dir)[0]) == STORIES_MATMUL_FLOPS


@pytest.mark.parametrize("flags, names", [
    ("fpu sse avx2 fma", ["AVX2"]),
    ("avx2 avx512f avx512bw avx512_bf16", ["AVX2", "AVX-512", "AVX-512-BF16"]),
    ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile", ["AVX2", "AVX-512", "AVX-512-BF16", "AMX-BF16"]),
    ("sse4_2", []),
])
def test_cpu_instruction_sets_are_read_from_the_first_cpus_flags(tmp_path, flags, names):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: avx2 avx512f\n")
    assert cpu_instruction_sets(info) == names
    assert describe_cpu(info) == (", ".join(names) or "no AVX2")
    assert cpu_instruction_sets(tmp_path / "missing") == []


@pytest.mark.parametrize("dtype, said", [
    ("auto", "float32 (dtype='auto', float32 on CPU: bfloat16 is no faster there)"),
    ("float32", "float32 (dtype='float32')"),
])
def test_start_up_log_says_the_dtype_auto_chose_on_cpu_and_the_cpus_instruction_sets(stories_dir, capfd, dtype,
                                                                                     said):
    from jaxllm.frontend.llm_engine import LLMEngine

    engine = LLMEngine(stories_dir, dtype=dtype, num_kv_blocks=8, max_model_len=64, precompile=False,
                       compilation_cache=None)
    assert engine.runner.cache_engine.kv_cache[0].dtype.name == "float32"
    total = engine.param_bytes["total"] / 2**20
    # stories260K ties its float32 embedding: with the native kernels the engine holds it packed for the lm_head too.
    panels = engine.runner.weights.params.get(HEAD_PANELS)
    assert (panels is not None) == ops.native_kernels()
    packed = "" if panels is None else f" ({panels.nbytes / 2**20:.1f} MiB of them the tied embedding packed again " \
                                       "for the CPU lm_head)"
    assert f"parameters: {total:.1f} MiB{packed}, {said}; CPU: {describe_cpu()}\n" in capfd.readouterr().err


def test_bench_throughput_json_has_every_field_for_each_backend(stories_dir, tmp_path):
    pytest.importorskip("transformers")
    fake = tmp_path / "fake_vllm"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    env = {**os.environ, "PYTHONPATH": str(fake), "FAKE_VLLM_ARGS": str(tmp_path / "vllm_args.json")}
    result = _run_script("bench_throughput.py", ["--model", str(stories_dir), "--compare", *TINY,
                                                 "--vllm-python", sys.executable, "--vllm-binding", "both"],
                         tmp_path, env)
    assert [r["backend"] for r in result["results"]] == ["hf", "static", "jaxllm", "vllm[both]"]
    for row in result["results"]:
        own = {"static": JAXLLM_RUN_FIELDS, "jaxllm": JAXLLM_RUN_FIELDS, "vllm[both]": VLLM_RUN_FIELDS}.get(
            row["backend"], set())
        assert set(row) == THROUGHPUT_FIELDS | own
        assert row["num_requests"] == 3 and row["output_tokens_per_s"] > 0
    assert result["config"]["num_requests"] == 3
    assert result["host"]["cpu_isa"] == describe_cpu()
    gflops, rates = result["results"][0]["dot_gflops"], result["results"][0]["dot_rates"]
    # XLA's dot, the engine's own kernel (where this CPU host built it) and numpy's, float32: the fastest is the limit.
    assert set(rates) == {"xla", "numpy"} | ({"jaxllm_kernel"} if ops.native_kernels() else set())
    assert gflops == max(rates.values()) > 0
    assert all(r["dot_gflops"] == gflops and r["dot_rates"] == rates for r in result["results"])
    for row in result["results"]:
        # Random prompts shorter than a block: no prompt token comes from the prefix cache.
        assert row.get("num_cached_prompt_tokens", 0) == 0
        assert row["dot_peak_fraction"] == pytest.approx(
            row["total_tokens_per_s"] * STORIES_MATMUL_FLOPS / (gflops * 1e9))
    static, jaxllm, vllm = result["results"][1:]
    # Greedy float32 outputs do not depend on the batching.
    assert static["same_tokens_as_jaxllm"] == 3 and jaxllm["same_tokens_as_jaxllm"] is None
    assert vllm["version"] == "vllm fake" and 0 <= vllm["same_tokens_as_jaxllm"] <= 3
    assert 0 < jaxllm["schedule_fraction_of_wall"] < 1 and jaxllm["steps"] > 0
    for row in (static, jaxllm):
        assert isinstance(row["page_faults"], int) and row["page_faults"] >= 0
        assert 0 <= row["system_s"] <= row["elapsed_s"] * len(os.sched_getaffinity(0))
    cpus = sorted(os.sched_getaffinity(0))
    both = {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0]),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert json.loads((tmp_path / "vllm_args.json").read_text()) == dict(
        model=str(stories_dir), dtype="float32", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32,
        seed=0, skip_tokenizer_init=False, enable_prefix_caching=True, binding_env=both)
    assert vllm["vllm_binding"] == "both" and vllm["vllm_env"] == both
    # The worker read where its own process may run (the fake engine spawns none).
    assert vllm["vllm_affinity"][0]["cpus"] == cpus


@pytest.fixture(scope="module")
def serving_compare(stories_dir, tmp_path_factory):
    """bench_serving.py --compare with no --request-rate: one start of the script (imports, engines, compilations)
    for the two tests below."""
    return _run_script("bench_serving.py", ["--model", str(stories_dir), "--compare", *TINY],
                       tmp_path_factory.mktemp("serving"))


def test_bench_serving_json_has_every_field_for_both_batching_modes(serving_compare):
    result = serving_compare
    assert [r["batching"] for r in result["results"]] == ["continuous", "static"]
    for row in result["results"]:
        assert set(row) == SERVING_FIELDS
        assert row["num_requests"] == 3 and row["ttft_s_p99"] > 0


def test_bench_serving_defaults_to_a_rate_below_the_capacity_its_warm_up_measured(serving_compare):
    result = serving_compare
    rate, capacity = result["config"]["request_rate"], result["measured_capacity"]
    assert capacity > 0 and rate == pytest.approx(0.7 * capacity)
    assert "70% of the capacity" in result["request_rate_note"]


def test_bench_throughput_runs_random_weights_from_a_config_json_alone(tmp_path):
    folder = tmp_path / "qwen3_shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256,
        tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, hidden_act="silu",
    )))
    result = _run_script("bench_throughput.py", ["--model", str(folder), "--random-weights", *TINY,
                                                 "--bandwidth", "50"], tmp_path)
    (row,) = result["results"]
    assert row["backend"] == "jaxllm" and set(row) == THROUGHPUT_FIELDS | JAXLLM_RUN_FIELDS
    assert row["output_tokens_per_s"] > 0
    # One thread's CPU time per step: some, and no more than the step's wall time.
    assert 0 < row["host_thread_s_per_step"] <= row["elapsed_s"] / row["steps"]
    # Float32 K and V of 2 layers, 2 heads of 16; the floor at the stated 50 GB/s over the run's wall time.
    assert row["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4 and row["weight_bytes"] == round(row["param_mib"] * 2**20)
    assert row["floor_bytes"] > row["steps"] * row["weight_bytes"] and row["bandwidth_gbps"] == 50
    assert row["bandwidth_fraction"] == pytest.approx(row["floor_bytes"] / 50e9 / row["elapsed_s"])
    assert list(folder.iterdir()) == [folder / "config.json"]


def test_generation_tokens_count_every_completion_of_n(llm):
    before = _value(llm, "jaxllm:generation_tokens_total")
    llm.generate([_prompt(6)], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=5, ignore_eos=True),
                 use_tqdm=False)
    assert _value(llm, "jaxllm:generation_tokens_total") - before == 15


# ---- the monitoring board ----------------------------------------------------------------------------------------


def test_step_duration_counts_every_engine_step_and_covers_its_schedule(llm):
    names = ("jaxllm:step_duration_seconds", "jaxllm:scheduler_step_seconds")
    before = {n: (_value(llm, f"{n}_count"), _value(llm, f"{n}_sum")) for n in names}
    engine = llm.engine
    engine.add_request("d0", _prompt(9, 301), SamplingParams(max_tokens=4, **GREEDY))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    (step_count, step_sum), (sched_count, sched_sum) = [
        (_value(llm, f"{n}_count") - c, _value(llm, f"{n}_sum") - s) for n, (c, s) in before.items()]
    assert step_count == sched_count == steps
    assert step_sum > sched_sum > 0


def test_batch_utilization_queue_depth_and_prompt_mix_follow_a_scripted_batch(llm):
    engine = llm.engine
    lengths = [10, 12, 20, 6, 9]  # 4 seats: the first four run (48 of 64 budget tokens), the fifth waits
    for i, n in enumerate(lengths):
        engine.add_request(f"u{i}", _prompt(n, 211 + 13 * i), SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    running = lengths[:4]
    mean = sum(running) / 4
    cv = (sum((n - mean) ** 2 for n in running) / 4) ** 0.5 / mean
    assert _value(llm, "jaxllm:batch_utilization", resource="tokens") == 48 / 64
    assert _value(llm, "jaxllm:batch_utilization", resource="seqs") == 1.0
    assert _value(llm, "jaxllm:scheduler_queue_depth", kind="new") == 1
    assert _value(llm, "jaxllm:scheduler_queue_depth", kind="preempted") == 0
    assert _value(llm, "jaxllm:batch_prompt_len_cv") == pytest.approx(cv)
    while engine.has_unfinished_requests():
        engine.step()
    assert _value(llm, "jaxllm:batch_utilization", resource="seqs") == 0
    assert _value(llm, "jaxllm:scheduler_queue_depth", kind="new") == 0
    assert _value(llm, "jaxllm:batch_prompt_len_cv") == 0


def test_request_success_counts_finished_requests_by_reason(llm):
    def count(reason: str) -> float:
        return _value(llm, "jaxllm:request_success_total", finished_reason=reason)

    before = {r: count(r) for r in ("stop", "length", "abort")}
    prompt = _prompt(7, 333)
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    stopped = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0,
                                                    stop_token_ids=list(first.outputs[0].token_ids)), use_tqdm=False)
    assert stopped[0].outputs[0].finish_reason == "stop"
    llm.engine.add_request("aborted", prompt, SamplingParams(max_tokens=5))
    llm.engine.abort_request("aborted")
    assert {r: count(r) - before[r] for r in before} == {"stop": 1, "length": 1, "abort": 1}


def test_queue_time_quantiles_interpolate_within_the_histogram_buckets():
    from jaxllm.frontend.metrics import EngineMetrics

    metrics = EngineMetrics()
    name = "jaxllm:request_queue_time_seconds"
    assert metrics.quantile(name, 0.99) != metrics.quantile(name, 0.99)  # NaN before any observation
    for seconds in [0.003] * 9 + [0.6]:
        metrics.request_queue_time.observe(seconds)
    # Rank 5 of 10 falls in (0.001, 0.005], which holds 9; rank 9.9 in (0.5, 0.75], which holds the tenth.
    assert metrics.quantile(name, 0.5) == pytest.approx(0.001 + 0.004 * 5 / 9)
    assert metrics.quantile(name, 0.99) == pytest.approx(0.5 + 0.25 * 0.9)
    with pytest.raises(ValueError, match="q=1.5"):
        metrics.quantile(name, 1.5)
    with pytest.raises(ValueError, match="no histogram"):
        metrics.quantile("jaxllm:num_requests_running", 0.5)


def test_board_and_alert_rules_use_only_series_the_engine_exports(llm):
    import re

    import prometheus_client

    yaml = pytest.importorskip("yaml")
    exported = {line.split("{")[0].split(" ")[0] for line in
                prometheus_client.generate_latest(llm.engine.metrics.registry).decode().splitlines()
                if line.startswith("jaxllm:")}
    board = json.loads((ROOT / "docs" / "operations" / "grafana.json").read_text())
    rules = yaml.safe_load((ROOT / "docs" / "operations" / "alert_rules.yml").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    alerts = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    used = {name for expr in exprs + list(alerts.values()) for name in re.findall(r"jaxllm:[a-z0-9_]+", expr)}
    assert used and used <= exported, used - exported
    for series in ("step_duration_seconds_bucket", "batch_utilization", "request_success_total",
                   "request_queue_time_seconds_bucket", "scheduler_queue_depth", "batch_prompt_len_cv",
                   "kv_cache_fragmentation_ratio", "effective_max_num_seqs"):
        assert any(f"jaxllm:{series}" in e for e in exprs), series
    thresholds = {"step_duration_seconds": "> 0.05", "kv_cache_fragmentation_ratio": "> 0.2",
                  "batch_utilization": "< 0.7", "request_queue_time_seconds": "> 1"}
    for series, bound in thresholds.items():
        assert any(series in expr and bound in expr for expr in alerts.values()), (series, bound)


def test_vllm_namespace_names_vllms_series_as_vllm_does_with_the_model_name_label(stories_dir):
    from jaxllm.frontend.metrics import VLLM_SERIES

    llm = _llm(stories_dir, metrics_namespace="vllm", max_num_batched_tokens=16)
    model = {"model_name": str(stories_dir)}
    llm.generate([_prompt(40), _prompt(40)], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert _value(llm, "vllm:prompt_tokens_total", **model) == 80
    assert _value(llm, "vllm:generation_tokens_total", **model) == 6
    assert _value(llm, "vllm:request_success_total", finished_reason="length", **model) == 2
    assert _value(llm, "vllm:e2e_request_latency_seconds_count", **model) == 2
    # The second prompt, identical and scheduled after the first's blocks were cached, hits its 2 full blocks.
    assert _value(llm, "vllm:prefix_cache_queries_total", **model) == 80
    assert _value(llm, "vllm:prefix_cache_hits_total", **model) == 32
    assert _value(llm, "vllm:num_requests_running", **model) == 0
    assert _value(llm, "jaxllm:num_kv_blocks", **model) > 0  # jaxllm's own series keep their names
    names = {m.name for m in llm.engine.metrics.registry.collect()}
    assert {n.split(":")[1] for n in names if n.startswith("vllm:")} == VLLM_SERIES
    assert not any(n.startswith("jaxllm:") and n.split(":")[1] in VLLM_SERIES for n in names)


# Every series vLLM's stock Grafana board queries, as its PromQL names them: vllm-project/vllm
# examples/observability/prometheus_grafana/grafana.json (commit 4b5c627), plus the time-per-output-token
# panel of vLLM 0.32's copy (issue 55 counts its 16 series).
VLLM_DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum", "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_sum", "vllm:request_time_per_output_token_seconds_count",
)


@pytest.fixture(scope="module")
def vllm_scrape(stories_dir):
    """An engine under metrics_namespace="vllm" after one request (40 prompt tokens, 5 generated), and the text a
    scrape of its /metrics port returned."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    llm = _llm(stories_dir, metrics_namespace="vllm", metrics_port=port)
    try:
        llm.generate([_prompt(40, 17)], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        llm.engine.metrics.close()
    return llm, body


def test_every_series_vllms_grafana_dashboard_queries_is_scraped_under_the_vllm_namespace(vllm_scrape,
                                                                                         stories_dir):
    _, body = vllm_scrape
    labelled = {line.split("{")[0] for line in body.splitlines()
                if not line.startswith("#") and f'model_name="{stories_dir}"' in line}
    assert [s for s in VLLM_DASHBOARD_SERIES if s not in labelled] == []


def test_vllms_per_request_histograms_observe_a_known_request_with_vllms_buckets(vllm_scrape, stories_dir):
    llm, _ = vllm_scrape
    model = {"model_name": str(stories_dir)}

    def value(name, **labels):
        return _value(llm, name, **model, **labels)

    for name, total, below, within in [("request_prompt_tokens", 40, "20.0", "50.0"),
                                       ("request_generation_tokens", 5, "2.0", "5.0"),
                                       ("request_max_num_generation_tokens", 5, "2.0", "5.0")]:
        assert (value(f"vllm:{name}_count"), value(f"vllm:{name}_sum")) == (1, total), name
        assert (value(f"vllm:{name}_bucket", le=below), value(f"vllm:{name}_bucket", le=within)) == (0, 1), name
    # vLLM's 1-2-5 buckets up to max_model_len=128.
    bounds = [s.labels["le"] for m in llm.engine.metrics.registry.collect() if m.name == "vllm:request_prompt_tokens"
              for s in m.samples if s.name.endswith("_bucket")]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]
    prefill, decode = value("vllm:request_prefill_time_seconds_sum"), value("vllm:request_decode_time_seconds_sum")
    e2e, queue = value("vllm:e2e_request_latency_seconds_sum"), value("vllm:request_queue_time_seconds_sum")
    assert prefill > 0 and decode > 0 and queue + prefill + decode == pytest.approx(e2e, abs=1e-6)
    assert value("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(decode / 4)
    assert value("vllm:request_decode_time_seconds_bucket", le="7680.0") == 1
    assert value("vllm:request_time_per_output_token_seconds_bucket", le="80.0") == 1


def test_request_token_histograms_count_a_request_of_n_once_with_its_longest_completion(llm):
    def delta(name):
        return _value(llm, f"jaxllm:{name}_sum") - before[name], _value(llm, f"jaxllm:{name}_count") - counts[name]

    names = ("request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens")
    before = {n: _value(llm, f"jaxllm:{n}_sum") for n in names}
    counts = {n: _value(llm, f"jaxllm:{n}_count") for n in names}
    prompt = _prompt(6, 91)
    # Three sampled completions that stop at different lengths (seeded), and a greedy request of 5 tokens.
    outs = llm.generate([prompt, prompt], [
        SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=0, stop_token_ids=[410, 289, 433]),
        SamplingParams(max_tokens=5, **GREEDY)], use_tqdm=False)
    lengths = [len(c.token_ids) for c in outs[0].outputs]
    assert len(set(lengths)) > 1
    assert [delta(n) for n in names] == [(12, 2), (sum(lengths) + 5, 2), (max(lengths) + 5, 2)]


def test_an_unknown_metrics_namespace_is_refused_naming_it():
    from jaxllm.config import EngineConfig

    with pytest.raises(ValueError, match="metrics_namespace='prometheus' must be one of"):
        EngineConfig(metrics_namespace="prometheus")


def test_bench_short_run_times_a_short_script_cold_and_warm_and_its_exit(stories_dir, tmp_path):
    result = _run_script("bench_short_run.py", ["--model", str(stories_dir), "--max-tokens", "6", "--repeats", "1"],
                         tmp_path)
    rows = result["results"]
    assert [(r["mode"], r["repeat"], r["tokens"]) for r in rows] == [("cold", 1, 6), ("warm", 1, 6)]
    for r in rows:
        assert 0 < r["ttft_s"] < r["start_up_s"] + 60 and r["tok_s"] > 0 and 0 <= r["exit_s"] < 30
    assert result["host"]["cpu_isa"] == describe_cpu()


@settings(max_examples=100)
@given(values=st.lists(st.one_of(st.sampled_from([0.0, 0.001, 0.02, 2560.0, 1e9, -1.0, float("nan")]),
                                 st.floats(-10.0, 1e4)), max_size=60),
       split=st.integers(0, 40), vllm=st.booleans())
def test_a_batch_histogram_exposes_what_prometheus_clients_histogram_exposes_for_the_same_values(values, split, vllm):
    """Any values (bounds exactly, below the first, past the last, NaN), observed in any two batches: the same
    exposition text as ``prometheus_client.Histogram`` observing them one by one, but for the creation time."""
    import prometheus_client as prom

    from jaxllm.frontend.metrics import _LATENCY_BUCKETS, BatchHistogram

    labels = (("model_name", "m"),) if vllm else ()
    ours, theirs = prom.CollectorRegistry(), prom.CollectorRegistry()
    batch = BatchHistogram("x:itl_seconds", "doc", _LATENCY_BUCKETS, ours, labels=labels)
    reference = prom.Histogram("x:itl_seconds", "doc", [k for k, _ in labels], buckets=_LATENCY_BUCKETS,
                               registry=theirs)
    reference = reference.labels(*[v for _, v in labels]) if labels else reference
    batch.observe_many(values[:split])
    batch.observe_many(values[split:])
    for value in values:
        reference.observe(value)

    def text(registry):
        return [line for line in prom.generate_latest(registry).decode().splitlines() if "_created" not in line]

    assert text(ours) == text(theirs)
    assert ours.get_sample_value("x:itl_seconds_created", dict(labels)) is not None
    # Described like a Histogram: a second series of its name is refused, and a name filter finds it.
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        prom.Histogram("x:itl_seconds", "doc", registry=ours)
    restricted = ours.restricted_registry(["x:itl_seconds_count"])
    assert [s.value for m in restricted.collect() for s in m.samples] == [sum(v == v for v in values)]  # NaN in no bucket
