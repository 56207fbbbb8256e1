"""tunix's GRPOLearner on jaxllm (jaxllm.rl.tunix), in an environment of its own.

tunix 0.1.7's pins take transformers, tokenizers, safetensors and huggingface-hub below the main test environment's,
so this test builds a virtual environment over the main one (``--system-site-packages``, cached under
``~/.cache/jaxllm/venv-tunix-<hash of the pins>``: about 40 s the first time) with ``pip install -e ".[tunix]"``,
and runs ``scripts/tunix_grpo.py --check`` there: per step, the engine's weights equal the trainer's after the sync
and its logprobs are within 1e-5 of tunix's recomputation relative to max(1, |logprob|) (asserted in the script);
here, the reward rises and nothing compiles after the first step.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# slow: builds a virtual environment (once) and runs four GRPO steps, minutes on 2 CPU cores.
pytestmark = [pytest.mark.tunix, pytest.mark.slow]


def _tunix_python() -> Path:
    pins = [line for line in (ROOT / "pyproject.toml").read_text().splitlines() if line.startswith("tunix = ")]
    key = hashlib.sha256((sys.version + "".join(pins)).encode()).hexdigest()[:12]
    venv = Path.home() / ".cache" / "jaxllm" / f"venv-tunix-{key}"
    python = venv / "bin" / "python"
    if not (venv / "ready").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(venv)], check=True)
        # The venv's pip is the system's; an older one misreads some installed metadata.
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", f"{ROOT}[tunix]"], check=True)
        (venv / "ready").touch()
    return python


def test_grpo_on_jaxllm_learns_syncs_exactly_and_compiles_nothing_after_the_first_step(tmp_path):
    python = _tunix_python()
    records = tmp_path / "steps.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([str(python), str(ROOT / "scripts" / "tunix_grpo.py"), "--steps", "4", "--engines", "jaxllm",
                    "--check", "--no-write", "--json", str(records)], check=True, env=env, cwd=ROOT, timeout=900)
    steps = json.loads(records.read_text())["jaxllm"]
    assert len(steps) == 4
    assert all(s["logprob_max_diff"] <= 1e-5 for s in steps)
    assert all(s["rollout_compilations"] == 0 for s in steps[1:])
    assert all(s["sync_compilations"] == 0 for s in steps[2:])
    assert steps[-1]["reward"] > steps[0]["reward"]
