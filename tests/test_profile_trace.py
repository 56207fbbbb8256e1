"""scripts/profile_trace.py (issue 54 item 1, gpu_check.sh's profile stage): real engine steps of stories260K traced
with jax.profiler on this CPU, and the trace reduced to its table: the steps' descriptors, wall and device time,
the bandwidth floor of their bytes, the host's parts, the device ops by name."""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import STORIES
from tests.helpers import assert_one_host_line

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import profile_trace as pt  # noqa: E402

ROWS, CONTEXT, STEPS = 4, 24, 2
BANDWIDTH = 50.0  # GB/s, a stated nominal: a CPU has no HBM_BANDWIDTH_GBPS entry


def test_the_floor_of_the_issues_decode_step_is_its_bytes_over_each_devices_bandwidth():
    # Qwen3-0.6B in bfloat16: 596M parameters; K and V of 28 layers x 8 heads x 128 (114,688 bytes a token).
    weights = 2 * (151936 * 1024 + 28 * (1024 * 6144 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128) + 1024)
    kv_per_token = 28 * 2 * 8 * 128 * 2
    num_bytes = pt.step_bytes(weights, 256 * 450, kv_per_token)
    assert num_bytes == pytest.approx(14.40e9, rel=1e-3) and 256 * 450 * kv_per_token / num_bytes == pytest.approx(
        0.92, abs=0.005)
    assert pt.device_bandwidth("NVIDIA H200") == 4800 and pt.device_bandwidth("NVIDIA H100 80GB HBM3") == 3350
    assert pt.device_bandwidth("NVIDIA H100 PCIe") == 2000 and pt.device_bandwidth("cpu") is None
    # That step cannot take less than 3.0 ms on an H200 or 4.3 ms on an H100.
    assert pt.floor_seconds(num_bytes, pt.device_bandwidth("NVIDIA H200")) == pytest.approx(3.0e-3, rel=1e-3)
    assert pt.floor_seconds(num_bytes, pt.device_bandwidth("NVIDIA H100 80GB HBM3")) == pytest.approx(4.3e-3,
                                                                                                      rel=1e-3)
    assert pt.floor_seconds(num_bytes, None) is None


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """stories260K's decode and mixed phases traced on this CPU, and their reduction."""
    from jaxllm import LLMEngine

    out = tmp_path_factory.mktemp("profile")
    engine = LLMEngine(STORIES, max_num_seqs=ROWS, max_num_batched_tokens=32, max_model_len=64,
                       token_buckets=(8, 32), seq_buckets=(ROWS,))
    try:
        engine.wait_for_warmup()
        rng = np.random.default_rng(0)
        mixed = pt.common.Workload([rng.integers(3, 500, n).tolist() for n in (30, 20, 25, 28, 22, 26)],
                                   [12] * 6)
        meta = pt.profile_engine(engine, out, phases=["decode", "mixed"], mixed=mixed, decode_rows=ROWS,
                                 decode_context=CONTEXT, steps=STEPS, skip_steps=0, bandwidth_gbps=BANDWIDTH)
        cfg, weight_bytes = engine.model_config, engine.param_bytes["total"]
        assert not engine.has_unfinished_requests()
    finally:
        engine.shutdown()
    text, results = pt.reduce_run(out, meta, top=5)
    return dict(out=out, meta=meta, text=text, results=results, cfg=cfg, weight_bytes=weight_bytes)


def test_decode_steps_are_read_from_the_engines_descriptors_and_timed_against_their_floor(profiled):
    meta, cfg = profiled["meta"], profiled["cfg"]
    # float32 K and V of every layer; the parameters as the engine holds them.
    assert meta["kv_bytes_per_token"] == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert meta["weight_bytes"] == profiled["weight_bytes"] and meta["bandwidth_gbps"] == BANDWIDTH
    steps = profiled["results"]["decode"]["steps"]
    assert len(steps) == STEPS
    for prev, s in zip(steps, steps[1:]):
        # One new token a row a step: the KV read grows by the row count.
        assert s["step"] == prev["step"] + 1 and s["kv_tokens"] == prev["kv_tokens"] + ROWS
    assert sum(s["device_busy_ms"] for s in steps) > 0
    for s in steps:
        assert s["kind"] == "decode" and s["rows"] == s["tokens"] == ROWS and s["program"][:2] == [8, ROWS]
        assert CONTEXT - 6 <= s["mean_context"] <= CONTEXT + 6 and s["max_context"] <= 64
        assert s["bytes"] == meta["weight_bytes"] + s["kv_tokens"] * meta["kv_bytes_per_token"]
        assert s["floor_ms"] == pytest.approx(s["bytes"] / (BANDWIDTH * 1e9) * 1e3)
        assert s["wall_ms"] > 0 and s["wall_over_floor"] == pytest.approx(s["wall_ms"] / s["floor_ms"])
        # A window runs from one step's start to the next's; under async scheduling the next starts while this
        # step's program runs, so a loaded host can push a step's device work wholly into the next window.
        assert 0 <= s["device_busy_ms"] <= s["wall_ms"] and s["device_idle_ms"] == pytest.approx(
            s["wall_ms"] - s["device_busy_ms"])
        assert 0 <= s["max_gap_ms"] <= s["device_idle_ms"] + 1e-9
        # Each step puts its batch on the device, launches the step program and reads the last one's samples.
        assert s["host_ms"]["launch"] > 0 and s["host_ms"]["apply"] > 0 and s["host_ms"]["schedule"] > 0
        # The front end's part: every step reports the decoding rows' tokens to it.
        assert s["host_ms"]["process_core_outputs"] > 0
        assert s["waits"] >= 1 and s["puts"] >= 1 and s["cuda_syncs"] == 0 and s["h2d"] == s["d2h"] == 0


def test_mixed_steps_hold_prefill_chunks_and_ops_are_named_with_their_time(profiled):
    results, text = profiled["results"], profiled["text"]
    mixed = results["mixed"]["steps"]
    assert mixed and mixed[0]["kind"] == "mixed" and all(s["tokens"] > s["rows"] for s in mixed if s["kind"] != "decode")
    for phase in ("decode", "mixed"):
        ops = results[phase]["ops"]
        assert 1 <= len(ops) <= 5 and results[phase]["num_ops"] >= len(ops)
        assert all(o["name"] and o["ms_per_step"] > 0 and o["count_per_step"] > 0 for o in ops)
        assert [o["ms_per_step"] for o in ops] == sorted((o["ms_per_step"] for o in ops), reverse=True)
        assert sum(o["share"] for o in ops) <= 1 + 1e-9
        assert ops[0]["name"] in text
    lines = text.splitlines()
    assert lines[0].startswith("profile: cpu (cpu)") and "bandwidth 50 GB/s (--bandwidth)" in lines[0]
    means = [line for line in lines if line.startswith("mean: wall ")]
    assert len(means) == 2 and all("of the bandwidth limit" in line for line in means)
    assert "--- decode: 2 steps" in lines and any(line.startswith("host ms per step by engine part: schedule ")
                                                   for line in lines)


def test_the_traces_are_packed_under_the_limit_and_reduce_again_from_the_folder(profiled, capsys):
    out = profiled["out"]
    # Room for every trace file: their size follows what the process has loaded (more inside a full test run), so
    # the drop order is tested on files of known sizes below.
    limit = sum(p.stat().st_size for p in (out / "trace").rglob("*") if p.is_file()) / 2**20 + 1
    archive = pt.pack_traces(out, limit_mib=limit)
    assert archive.stat().st_size <= limit * 2**20
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert sum(n.endswith(".xplane.pb") for n in names) == 2 and any(n.endswith("perfetto_trace.json.gz")
                                                                     for n in names)
    (out / "profile.json").write_text(pt.json.dumps(profiled["meta"], default=str))
    text = pt.main(["--reduce", str(out), "--top", "5"])
    assert text == profiled["text"] and (out / "profile.txt").read_text() == text + "\n"
    assert_one_host_line(capsys.readouterr().out)


@pytest.mark.parametrize("limit_mib, kept", [
    (4.0, ["a.trace.json.gz", "a.xplane.pb", "b.xplane.pb", "perfetto_trace.json.gz"]),
    (2.5, ["a.trace.json.gz", "a.xplane.pb", "b.xplane.pb"]),  # Perfetto's JSON goes first
    (1.8, ["a.xplane.pb", "b.xplane.pb"]),                      # then the trace JSON
    (0.5, []),                                                   # then the XSpaces
])
def test_packing_drops_perfetto_then_trace_json_then_xspace_until_under_the_limit(tmp_path, limit_mib, kept):
    # Random bytes do not compress: each file weighs its size in the archive. 1 MiB of Perfetto JSON, 0.5 MiB of
    # trace JSON, two XSpaces of 0.75 MiB.
    rng = np.random.default_rng(0)
    sizes = {"perfetto_trace.json.gz": 2**20, "a.trace.json.gz": 2**19, "a.xplane.pb": 3 * 2**18,
             "b.xplane.pb": 3 * 2**18}
    phase = tmp_path / "trace" / "decode"
    phase.mkdir(parents=True)
    for name, size in sizes.items():
        (phase / name).write_bytes(rng.integers(0, 256, size, np.uint8).tobytes())
    archive = pt.pack_traces(tmp_path, limit_mib=limit_mib)
    assert archive.stat().st_size <= limit_mib * 2**20
    with tarfile.open(archive) as tar:
        names = sorted(Path(n).name for n in tar.getnames() if n != "trace/LEFT_OUT.txt")
        left = tar.extractfile("trace/LEFT_OUT.txt").read().decode() if kept != sorted(sizes) else ""
    assert names == kept
    assert all((name in left) == (name not in kept) for name in sizes), left
