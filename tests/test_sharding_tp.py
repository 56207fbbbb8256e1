"""The first part of the 8-device suite, run in a subprocess: tensor parallelism (tests/multidevice/runner.py;
tests/test_sharding.py runs the rest)."""

from __future__ import annotations

from tests.multidevice import runner

multidevice_run, test_multidevice_test_passes_on_8_cpu_devices = runner.part_tests(0)
