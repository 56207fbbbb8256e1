"""The GPU command-buffer flags, set in one place (jaxllm/worker/xla_flags.py)."""

from __future__ import annotations

import os

import pytest

from jaxllm.worker.xla_flags import apply_gpu_xla_flags, gpu_xla_flags, with_gpu_xla_flags


def test_modes_give_their_flags_and_replace_earlier_ones():
    assert gpu_xla_flags("default") == []
    assert gpu_xla_flags("off") == ["--xla_gpu_enable_command_buffer="]
    assert gpu_xla_flags("all") == ["--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                                    "CONDITIONAL,WHILE", "--xla_gpu_graph_min_graph_size=1"]
    earlier = "--xla_force_host_platform_device_count=2 --xla_gpu_enable_command_buffer=FUSION"
    assert with_gpu_xla_flags(earlier, "off") == ("--xla_force_host_platform_device_count=2 "
                                                  "--xla_gpu_enable_command_buffer=")
    assert with_gpu_xla_flags(earlier, "default") == "--xla_force_host_platform_device_count=2"
    with pytest.raises(ValueError, match="JAXLLM_XLA_COMMAND_BUFFER='sometimes'"):
        gpu_xla_flags("sometimes")


def test_apply_reads_the_environment(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    monkeypatch.setenv("JAXLLM_XLA_COMMAND_BUFFER", "off")
    assert apply_gpu_xla_flags() == "--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer="
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer="
