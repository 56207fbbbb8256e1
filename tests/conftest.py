"""Shared fixtures: the default SmolLM2 GGUF and the stories260K HF folder, skipped when absent."""

from pathlib import Path

import pytest

from jaxllm.default_model import default_model_path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (fetched into the cache on first use)."""
    try:
        return default_model_path()
    except RuntimeError as exc:
        pytest.skip(f"default model unavailable: {exc}")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The stories260K Hugging Face folder in the shared models directory."""
    path = Path(__file__).resolve().parents[1].parent / "shared/models/stories260K"
    if not path.is_dir():
        pytest.skip(f"stories260K not found at {path}")
    return path
