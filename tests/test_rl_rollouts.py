"""scripts/rl_rollouts.py, the research example: rollouts by the engine, gradients by jax.grad on the same pytree,
weights back by update_weights; the reward rises and nothing compiles after the first iteration."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.helpers import assert_one_host_line

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "rl_rollouts.py"


def _script():
    spec = importlib.util.spec_from_file_location("rl_rollouts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPT.parent))  # where a run of the script finds _bench_common
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_group_advantages_are_centred_per_prompt_and_padding_is_masked():
    rl = _script()
    adv = rl.advantages(np.asarray([1, 3, 0, 0], np.float32), n=2)
    np.testing.assert_allclose(adv, [-1, 1, 0, 0], atol=1e-5)
    ids, mask = rl.pack([[7, 8, 9]], [[4, 5], [6]], n=2, length=6)
    assert ids.tolist() == [[7, 8, 9, 4, 5, 0], [7, 8, 9, 6, 0, 0]]
    # Position t's logits score token t + 1: the completion tokens only.
    assert mask.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0]]


def test_three_iterations_raise_the_reward_and_compile_nothing_after_the_first():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--iterations", "3"], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    reward = [float(r[1]) for r in rows]
    assert reward[2] > reward[0], proc.stdout
    assert [int(r[4]) for r in rows[1:]] == [0, 0] and [int(r[5]) for r in rows] == [0, 0, 0], proc.stdout
    assert_one_host_line(proc.stdout)
