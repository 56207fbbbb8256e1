"""Shared fixtures: the stories260K model from ../shared, the SmolLM2 GGUF, tiny HF models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# tests/multidevice needs 8 host devices, a flag JAX reads once at start-up:
# tests/test_sharding.py runs it in subprocesses with that flag set.
collect_ignore = [] if os.environ.get("JAXLLM_MULTIDEVICE") else ["multidevice"]

_ROOT = Path(__file__).resolve().parents[1]
# The project's shared/ folder sits beside the main checkout; a copy inside the
# checkout (what travels to a GPU machine, see scripts/gpu_check.sh) comes first.
SHARED = next((p for p in (_ROOT / "shared", _ROOT.parent / "shared") if (p / "models").is_dir()),
              _ROOT.parent / "shared")
STORIES = SHARED / "models" / "stories260K"
STORIES_SENTENCE = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball."
)


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"{STORIES} is absent (it ships in the project's shared/ folder)")
    return STORIES


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from jaxllm.default_model import default_model_path

    try:
        return default_model_path()
    except RuntimeError as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    from tests.hf_models import make_tiny_hf_model

    folder = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_hf_model("llama", folder, seed=3)
    return folder
