"""The first part of the 8-device suite, run in a subprocess: tensor parallelism (tests/multidevice/runner.py;
tests/test_sharding.py runs the rest)."""

from __future__ import annotations

import pytest

from tests.multidevice import runner

PART = runner.part_modules(0)
LISTED = runner.listed_tests(PART)


@pytest.fixture(scope="module")
def multidevice_run(tmp_path_factory):
    return runner.run(PART, tmp_path_factory.mktemp("multidevice"))


@pytest.mark.parametrize("module, function", LISTED, ids=lambda x: x)
def test_multidevice_test_passes_on_8_cpu_devices(module, function, multidevice_run):
    runner.check(multidevice_run, LISTED, module, function)
