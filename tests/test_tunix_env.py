"""tests/test_tunix.py in an environment of its own, made here when tunix cannot be imported in this one.

tunix's pins (the ``[tunix]`` extra: ``google-tunix==0.1.7`` wants safetensors < 0.8, so transformers 5.12,
tokenizers 0.22.2, huggingface-hub 1.x) sit below what the main test environment runs, so they cannot share it.
This module makes a ``--system-site-packages`` virtual environment in the test session's cache folder
(``$JAXLLM_TEST_CACHE``, kept between runs), has pip install the ``[tunix]`` extra's requirements into it (only
what this environment lacks or pins otherwise), and runs tests/test_tunix.py there in one ``python -m pytest``
with this checkout's jaxllm first on the path. The test passes when every test there passed (none skipped) and
shows that run's output when one did not. It skips only when pip cannot reach the package index; where tunix is
importable here, tests/test_tunix.py runs in this session and this module skips.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tomllib
import venv
import xml.etree.ElementTree as ET
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INNER = ROOT / "tests" / "test_tunix.py"
# pip's messages when it cannot reach the index (urllib3's errors, and the resolver finding no release at all).
OFFLINE = ("NewConnectionError", "NameResolutionError", "ConnectTimeoutError", "Network is unreachable",
           "Temporary failure in name resolution", "(from versions: none)")

pytestmark = pytest.mark.skipif(find_spec("tunix") is not None,
                                reason="tunix is importable here: tests/test_tunix.py runs in this session")


def tunix_requirements() -> list[str]:
    """The ``[tunix]`` extra's requirements, as pyproject.toml lists them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"]["tunix"]


def tunix_env() -> Path:
    """The python of a venv with the ``[tunix]`` extra installed over this environment's packages, made once per
    requirements list and interpreter in ``$JAXLLM_TEST_CACHE`` (locked while made; a marker file says it is
    complete). Skips the test when pip cannot reach the index; fails with pip's output on any other error."""
    requirements = tunix_requirements()
    key = hashlib.sha256(json.dumps([requirements, sys.executable, sys.version]).encode()).hexdigest()[:12]
    folder = Path(os.environ["JAXLLM_TEST_CACHE"]) / f"venv-tunix-{key}"
    python, done = folder / "bin" / "python", folder / "installed.json"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"venv-tunix-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_file():
            return python
        # No pip inside (ensurepip takes seconds): this environment's pip installs into it (pip --python).
        venv.EnvBuilder(system_site_packages=True, clear=True, with_pip=False).create(folder)
        proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-compile",
                               "--retries", "2", "--timeout", "60", *requirements],
                              capture_output=True, text=True, timeout=1200)
        output = proc.stdout[-4000:] + proc.stderr[-4000:]
        if proc.returncode != 0 and any(marker in output for marker in OFFLINE):
            pytest.skip(f"the package index cannot be reached to install {requirements}: {proc.stderr[-800:]}")
        assert proc.returncode == 0, f"pip install {requirements} failed:\n{output}"
        done.write_text(json.dumps({"requirements": requirements, "python": sys.executable}))
    return python


def test_tunix_suite_passes_in_an_environment_with_tunix_pins(tmp_path):
    python = tunix_env()
    report = tmp_path / "junit.xml"
    # This checkout's jaxllm and tests first on the path (not an installed jaxllm); JAXLLM_TEST_CACHE carries the
    # session's compilation cache over. Only tests/test_tunix.py runs there, so this module does not recurse.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    check = f"import jaxllm, sys; assert jaxllm.__file__.startswith({str(ROOT / 'jaxllm')!r}), jaxllm.__file__"
    proc = subprocess.run([str(python), "-c", f"{check}; import pytest; sys.exit(pytest.main(sys.argv[1:]))",
                           "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(INNER)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    output = proc.stdout[-8000:] + proc.stderr[-4000:]
    assert report.is_file(), f"no report (exit status {proc.returncode}):\n{output}"
    cases = [(case.get("name"), [child.tag for child in case if child.tag in ("failure", "error", "skipped")])
             for case in ET.parse(report).iter("testcase")]
    not_passed = [(name, outcome) for name, outcome in cases if outcome]
    assert proc.returncode == 0 and cases and not not_passed, f"exit status {proc.returncode}, {not_passed}\n{output}"
