"""The CLI, run as a user runs it (a subprocess)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import STORIES_SENTENCE


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "jaxllm.generate", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_stories260k_prints_the_reference_sentence(stories_dir):
    proc = _cli("--model", str(stories_dir), "--prompt", "Once upon a time", "--max-tokens", "40",
                "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == STORIES_SENTENCE


def test_cli_default_model_names_paris(smollm2_gguf):
    proc = _cli("--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is")
    assert "Paris" in proc.stdout


def test_cli_missing_model_exits_with_a_clear_error(tmp_path):
    proc = _cli("--model", str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr


def test_cli_bad_max_tokens_exits_with_a_clear_error(stories_dir):
    proc = _cli("--model", str(stories_dir), "--max-tokens", "0")
    assert proc.returncode == 2
    assert "max_tokens=0" in proc.stderr
