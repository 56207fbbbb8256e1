"""The test suite is self-contained: its model ships in the repository, and what jaxllm writes
during tests goes to the session's own cache, never to the user's ``~/.cache/jaxllm``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax

from jaxllm import LLM
from jaxllm.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
USER_DEFAULT_CACHE = Path.home() / ".cache" / "jaxllm"
# A path that leaves the repository: the shared folder beside it, relative or absolute.
OUTSIDE = re.compile(r"\.\./shared|/work/shared|parents\[\d\]\.parent")


def test_issue11_tests_are_self_contained(stories_dir):
    assert stories_dir.resolve().is_relative_to(ROOT)
    assert {"config.json", "model.safetensors", "tokenizer.json", "LICENSE"} <= {p.name for p in stories_dir.iterdir()}
    files = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("scripts/*.py")]
    offenders = [str(f.relative_to(ROOT)) for f in files if f != Path(__file__) and OUTSIDE.search(f.read_text())]
    assert offenders == []


def test_issue11_test_session_cache_is_not_the_users(stories_dir):
    session = cache_dir().resolve()
    user = USER_DEFAULT_CACHE.resolve()
    assert session != user and not session.is_relative_to(user)
    # An engine puts JAX's persistent compilation cache in it.
    LLM(model=stories_dir, precompile=False, max_num_seqs=4, max_model_len=64)
    assert Path(jax.config.jax_compilation_cache_dir).resolve() == session / "xla"
    # Subprocesses (CLI, multidevice tests) inherit it.
    child = subprocess.run([sys.executable, "-c", "from jaxllm.paths import cache_dir; print(cache_dir())"],
                           capture_output=True, text=True, check=True)
    assert Path(child.stdout.strip()).resolve() == session


def test_every_test_process_sees_the_users_cache_for_linking_the_named_models():
    # Under xdist the workers inherit the session's $JAXLLM_CACHE; the user's cache must still be the user's, or
    # every fresh clone fetches the named models again instead of linking the user's copies.
    from tests.conftest import USER_CACHE

    assert USER_CACHE.resolve() != cache_dir().resolve()
    assert not USER_CACHE.resolve().is_relative_to(cache_dir().resolve())
