"""vLLM's profiling calls: ``profiler_config`` (``ProfilerConfig``), ``start_profile`` / ``stop_profile`` recording
a ``jax.profiler`` trace of the engine's steps (``jaxllm.core.profiler``).

The traced steps are counted in the Perfetto trace JAX writes (``create_perfetto_trace``): one ``jaxllm_step``
annotation per engine step, numbered from 1. The server's routes are tested in ``test_openai_server``.
"""

from __future__ import annotations

import gzip
import json
import types
from pathlib import Path

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import PROFILER_ADVISORY_KEYS, EngineConfig, ProfilerConfig, check_profile_request
from jaxllm.core.profiler import STEP_NAME, StepProfiler
from tests.conftest import log_messages
from tests.server_process import ENGINE

PERFETTO = {"create_perfetto_trace": True}


def traced_steps(folder: str) -> list[int]:
    """The step numbers annotated in the one Perfetto trace under ``folder``, in order."""
    traces = list(Path(folder).glob("plugins/profile/*/perfetto_trace.json.gz"))
    assert len(traces) == 1, traces
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    return sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == STEP_NAME and e.get("ph") == "X")


def test_profiler_config_takes_vllm_keys_json_and_dotted_torch_options(tmp_path):
    text = json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path), "delay_iterations": 2,
                       "torch_profiler_with_stack": False, "torch_profiler_record_shapes": True,
                       "ignore_frontend": True})
    config = EngineConfig(profiler_config=text).profiler_config
    assert config == ProfilerConfig(profiler="torch", torch_profiler_dir=str(tmp_path), delay_iterations=2)
    assert EngineConfig().observability.profiler_config is None
    assert ProfilerConfig.parse({"profiler": "jax", "torch_profiler_dir": "traces"}).torch_profiler_dir == str(
        Path("traces").absolute())
    assert set(PROFILER_ADVISORY_KEYS).isdisjoint(f.name for f in ProfilerConfig.__dataclass_fields__.values())


@pytest.mark.parametrize("value, named", [
    ({"profiler": "cuda", "torch_profiler_dir": "/t"}, "profiler='cuda'"),
    ({"profiler": "proton", "torch_profiler_dir": "/t"}, "profiler='proton'"),
    ({"profiler": "jax"}, "needs torch_profiler_dir"),
    ({"torch_profiler_dir": "/t"}, "needs a profiler"),
    ({"profiler": "jax", "torch_profiler_dir": "/t", "max_iterations": -1}, "max_iterations=-1"),
    ({"profiler": "jax", "torch_profiler_dir": "/t", "delay_iterations": True}, "delay_iterations=True"),
    ({"profiler": "jax", "torch_profiler_dir": "/t", "active_iterations": 0}, "active_iterations=0"),
    ({"profiler": "jax", "torch_profiler_dir": "/t", "profile_dir": "/u"}, "unknown field 'profile_dir'.*proton"),
    ("{profiler: jax}", "is not JSON"),
])
def test_profiler_config_refuses_what_it_cannot_record_naming_it(value, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        EngineConfig(profiler_config=value)


@pytest.mark.parametrize("prefix, ok", [
    ("run.1_a-B", True), ("a" * 128, True), ("7", True),
    ("", False), ("a" * 129, False), ("-run", False), (".run", False), ("a b", False), ("a/b", False),
    ("caf\u00e9", False), (7, False),
])
def test_profile_prefix_follows_vllms_rule(prefix, ok):
    if ok:
        assert check_profile_request(prefix, None, None, None) == {}
    else:
        with pytest.raises(ValueError, match="profile_prefix="):
            check_profile_request(prefix, None, None, None)


def test_profile_overrides_keep_jax_keywords_accept_torch_ones_and_name_the_rest():
    kwargs = {"create_perfetto_trace": True, "host_tracer_level": 3, "record_shapes": True, "with_stack": False}
    assert check_profile_request(None, 0, 5, kwargs) == {"create_perfetto_trace": True, "host_tracer_level": 3}
    for bad, named in [({"perfetto": True}, "key 'perfetto'"), ({"host_tracer_level": -1}, "host_tracer_level=-1"),
                       ({"create_perfetto_trace": 1}, "create_perfetto_trace=1")]:
        with pytest.raises(ValueError, match=named):
            check_profile_request(None, None, None, bad)
    for name in ("delay_iterations", "max_iterations"):
        with pytest.raises(ValueError, match=f"{name}=-1"):
            check_profile_request(None, *((-1, None) if name == "delay_iterations" else (None, -1)), None)


@pytest.mark.parametrize("delay, limit, steps", [(0, 0, 3), (0, 2, 5), (2, 0, 4), (2, 3, 10), (3, 1, 3)])
def test_a_session_traces_the_steps_after_its_delay_up_to_its_limit(tmp_path, delay, limit, steps):
    profiler = StepProfiler(ProfilerConfig(profiler="jax", torch_profiler_dir=str(tmp_path)), core_index=1)
    folder = profiler.start("s", delay, limit, PERFETTO)
    assert folder == str(tmp_path / "s_dp1")
    for _ in range(steps):
        with profiler.step():
            pass
    want = max(steps - delay, 0) if limit == 0 else min(limit, max(steps - delay, 0))
    stopped_by_itself = limit and steps - delay >= limit
    assert profiler.active is not stopped_by_itself
    assert profiler.stop() == (None if stopped_by_itself else folder)
    assert traced_steps(folder) == list(range(1, want + 1)) if want else not list(Path(folder).iterdir())


def test_vllms_schedule_skips_wait_and_warmup_steps_and_records_the_active_ones(tmp_path):
    config = ProfilerConfig(profiler="torch", torch_profiler_dir=str(tmp_path), wait_iterations=1,
                            warmup_iterations=2, active_iterations=2, delay_iterations=1)
    profiler = StepProfiler(config, core_index=0)
    folder = profiler.start(profiler_kwargs=PERFETTO)
    for _ in range(8):
        with profiler.step():
            pass
    assert not profiler.active and traced_steps(folder) == [1, 2]


def test_a_refused_start_leaves_the_active_sessions_options(tmp_path):
    profiler = StepProfiler(ProfilerConfig(profiler="jax", torch_profiler_dir=str(tmp_path)), core_index=0)
    folder = profiler.start("kept", 1, 2, PERFETTO)
    with pytest.raises(RuntimeError, match="already being recorded"):
        profiler.start("other", profiler_kwargs={})
    for _ in range(3):
        with profiler.step():
            pass
    assert not profiler.active and traced_steps(folder) == [1, 2]


def test_a_trace_folder_that_cannot_be_made_fails_the_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    profiler = StepProfiler(ProfilerConfig(profiler="jax", torch_profiler_dir=str(blocker)), core_index=0)
    with pytest.raises(RuntimeError, match=f"cannot make the trace folder {blocker}/dp0"):
        profiler.start()
    assert not profiler.active


def test_a_trace_that_cannot_be_written_is_logged_the_step_goes_on_and_the_next_session_starts(tmp_path, capfd,
                                                                                                 monkeypatch):
    import jax._src.profiler as jax_profiler

    def failing_write(log_dir):  # fails inside JAX's stop_trace, which then keeps its session set
        raise OSError("disk full")

    with monkeypatch.context() as patched:
        patched.setattr(jax_profiler, "_write_perfetto_trace_file", failing_write)
        profiler = StepProfiler(ProfilerConfig(profiler="jax", torch_profiler_dir=str(tmp_path)), core_index=0)
        profiler.start("failing", max_iterations=1, profiler_kwargs=PERFETTO)
        ran = []
        with profiler.step():
            ran.append(1)
    assert ran == [1] and not profiler.active
    assert any("could not be written" in m and "disk full" in m
               for m in log_messages(capfd.readouterr().err, "WARNING", "profiler.py"))
    folder = profiler.start("next", max_iterations=1, profiler_kwargs=PERFETTO)
    with profiler.step():
        pass
    assert traced_steps(folder) == [1]


def test_start_without_a_profiler_says_how_to_turn_it_on():
    for config in (None, ProfilerConfig()):
        with pytest.raises(RuntimeError, match="--profiler-config"):
            StepProfiler(config, 0).start()


def test_the_profile_routes_are_served_only_with_a_profiler():
    from jaxllm.entrypoints.openai.api_server import build_app

    routes = {"/start_profile", "/stop_profile"}
    for profiling in (False, True):
        paths = {r.path for r in build_app(types.SimpleNamespace(engine=None), profiling=profiling).routes}
        assert (routes <= paths) is profiling


@pytest.fixture(scope="module")
def llm(stories_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    return LLM(model=stories_dir, **ENGINE, profiler_config={"profiler": "jax", "torch_profiler_dir": str(folder)})


def test_llm_start_profile_traces_generate_steps_and_stop_profile_writes_them(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    want = llm.generate("Once upon a time", greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm.start_profile("gen", delay_iterations=1, max_iterations=4, profiler_kwargs=PERFETTO)
    got = llm.generate("Once upon a time", greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm.stop_profile()
    assert got == want
    folder = Path(llm.llm_engine.config.profiler_config.torch_profiler_dir) / "gen_dp0"
    assert traced_steps(str(folder)) == [1, 2, 3, 4]
    assert list(folder.glob("plugins/profile/*/*.xplane.pb"))


def test_a_second_start_is_refused_while_a_session_is_active_and_stop_is_idempotent(llm):
    llm.start_profile("twice")
    with pytest.raises(RuntimeError, match="already being recorded"):
        llm.start_profile("again")
    with pytest.raises(ValueError, match="profile_prefix='a b'"):
        llm.start_profile("a b")
    llm.stop_profile()
    llm.stop_profile()
    llm.start_profile("after", max_iterations=1)
    llm.stop_profile()
