"""Runs tests/multidevice in child ``python -m pytest`` processes on 8 CPU host devices, for the test files of the
main run that stand for them (tests/test_sharding.py, tests/test_sharding_tp.py).

``--xla_force_host_platform_device_count`` is read once, when JAX starts, so these tests cannot run in the main
process. The modules are split into parts, one child run (one start of Python, JAX and torch, one set of tiny
models) per part and one main-run test file per part, so that ``pytest-xdist --dist loadfile`` gives the parts to
different workers instead of one long unit to one worker. ``PARTS`` names the modules of every part but the last;
the last part runs every other module, so a new module runs without being listed.

In the main run, each test function of a module is one test case there, which passes when every one of its cases
here did (all parametrizations, in the child's JUnit report).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Every part but the last, by module file name: each part takes a similar share of the child runs' time.
PARTS = (("test_tensor_parallel.py",),)


def part_modules(index: int) -> list[Path]:
    """The module files of part ``index`` (0 to ``len(PARTS)``); the last part holds every module no part names."""
    if index < len(PARTS):
        return [HERE / name for name in PARTS[index]]
    named = {name for part in PARTS for name in part}
    return sorted(p for p in HERE.glob("test_*.py") if p.name not in named)


def listed_tests(modules: list[Path]) -> list[tuple[str, str]]:
    """(module stem, test function name) for each top-level ``test_*`` function of ``modules``, read from the
    source (the main process must not import them: they need 8 devices)."""
    return [(module.stem, node.name) for module in modules for node in ast.parse(module.read_text()).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def run(modules: list[Path], folder: Path) -> tuple[subprocess.CompletedProcess, list[tuple[str, str, str, str]]]:
    """``modules`` in one ``python -m pytest`` on 8 CPU devices: (the finished process, each case of its JUnit
    report as (module stem, name, outcome, message)). Outcome is "passed", "failure", "error" or "skipped"; a
    module that failed to collect is one "error" case named by the module."""
    report = folder / "junit.xml"
    env = {**os.environ, "JAXLLM_MULTIDEVICE": "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--continue-on-collection-errors", f"--junitxml={report}", *map(str, modules)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    cases = []
    for case in ET.parse(report).iter("testcase") if report.is_file() else ():
        bad = [child for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = bad[0].tag if bad else "passed"
        message = (bad[0].get("message") or "") + "\n" + (bad[0].text or "") if bad else ""
        # A test's class name is its module's dotted path; a module that failed to collect is named by its name.
        module = (case.get("classname") or case.get("name", "")).rsplit(".", 1)[-1]
        cases.append((module, case.get("name", ""), outcome, message))
    return proc, cases


def check(result, functions: list[tuple[str, str]], module: str, function: str) -> None:
    """Fails unless the child run ran ``module``'s ``function`` and every case of it passed or skipped. A module's
    collection error fails each of its functions; a failing case that is no listed function's (a crash, a test
    class), or a failed run that no case explains, fails every function of the run."""
    proc, cases = result
    output = proc.stdout[-6000:] + proc.stderr[-3000:]

    def owner(case):
        return next(((m, f) for m, f in functions if case[0] == m and case[1].split("[")[0] == f), None)

    mine = [c for c in cases if owner(c) == (module, function)]
    failed = [c for c in cases if c[2] in ("failure", "error")
              and (owner(c) == (module, function) or owner(c) is None)]
    assert mine and not failed, "\n".join(f"{m}::{name}: {outcome}\n{message[-3000:]}"
                                          for m, name, outcome, message in failed) + "\n" + output
    unclaimed = [c[:2] for c in cases if owner(c) is None]
    assert not unclaimed, f"cases of no top-level test function: {unclaimed}"
    assert proc.returncode == 0 or any(c[2] in ("failure", "error") for c in cases), \
        f"exit status {proc.returncode}\n{output}"


def part_tests(index: int) -> tuple[Any, Any]:
    """The fixture and test a main-run file binds as ``multidevice_run`` and
    ``test_multidevice_test_passes_on_8_cpu_devices`` to run part ``index`` (:func:`part_modules`): one case per
    listed test function of the part, all from one child run."""
    import pytest

    modules = part_modules(index)
    listed = listed_tests(modules)

    @pytest.fixture(scope="module")
    def multidevice_run(tmp_path_factory):
        return run(modules, tmp_path_factory.mktemp("multidevice"))

    @pytest.mark.parametrize("module, function", listed, ids=lambda x: x)
    def test_multidevice_test_passes_on_8_cpu_devices(module, function, multidevice_run):
        check(multidevice_run, listed, module, function)

    return multidevice_run, test_multidevice_test_passes_on_8_cpu_devices
