"""Sharding: partition-rule checks in this process (1 device), and in subprocesses a part of the 8-device suite
(tests/multidevice, see tests/multidevice/runner.py) and a 2-process multi-host run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxllm.config import EngineConfig
from jaxllm.models.config import ModelConfig
from jaxllm.worker.sharding import PARAM_AXES, check_tensor_parallel, make_mesh
from jaxllm.loader.params import expected_layer_keys
from tests.multidevice import runner

ROOT = Path(__file__).resolve().parents[1]


def _config(q_heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=16,
    ))


@pytest.mark.parametrize("q, kv, tp", [(8, 4, 3), (8, 4, 16), (12, 6, 4)])
def test_tensor_parallel_that_does_not_split_the_heads_is_rejected(q, kv, tp):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp}"):
        check_tensor_parallel(_config(q, kv), tp)


@pytest.mark.parametrize("q, kv, tp", [(8, 4, 2), (8, 4, 4), (8, 2, 4), (8, 1, 8), (8, 8, 1)])
def test_tensor_parallel_splitting_or_replicating_kv_heads_is_accepted(q, kv, tp):
    check_tensor_parallel(_config(q, kv), tp)


@pytest.mark.parametrize("field", ["tensor_parallel_size", "data_parallel_size"])
def test_parallel_sizes_below_one_are_rejected(field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: 0})


def test_mesh_larger_than_the_devices_is_rejected_with_both_numbers():
    with pytest.raises(ValueError, match="needs 1024 devices"):
        make_mesh(tensor_parallel_size=512, data_parallel_size=2)


@pytest.mark.parametrize("architecture, extra", [
    ("Qwen2ForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    ("Qwen3ForCausalLM", {}),
    ("Gemma3ForCausalLM", {}),
    ("Qwen3MoeForCausalLM", dict(num_experts=4)),
])
def test_every_parameter_key_has_logical_axes(architecture, extra):
    cfg = ModelConfig.from_hf_config(dict(
        architectures=[architecture], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, **extra,
    ))
    keys = expected_layer_keys(cfg) | {"embed", "lm_head", "final_norm"}
    assert keys <= PARAM_AXES.keys()


# The last part of tests/multidevice (tests/multidevice/runner.py; tests/test_sharding_tp.py runs the first).
multidevice_run, test_multidevice_test_passes_on_8_cpu_devices = runner.part_tests(len(runner.PARTS))


_DISTRIBUTED_CHILD = textwrap.dedent("""
    import sys
    import jax
    sys.path.insert(0, {root!r})
    from jaxllm.worker.sharding import initialize_distributed, make_mesh
    process_id = int(sys.argv[1])
    initialize_distributed("127.0.0.1:{port}", num_processes=2, process_id=process_id)
    mesh = make_mesh(tensor_parallel_size=2, data_parallel_size=2)
    owners = sorted({{d.process_index for d in mesh.devices.flat}})
    rows = [sorted({{d.process_index for d in row}}) for row in mesh.devices]
    print("MESH", mesh.devices.size, owners, rows, len(jax.local_devices()), flush=True)
    jax.distributed.shutdown()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_distributed_initialize_gives_a_mesh_spanning_two_processes(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_DISTRIBUTED_CHILD.format(root=str(ROOT), port=_free_port()))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
    procs = [subprocess.Popen([sys.executable, str(script), str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        results = [p.communicate(timeout=180) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.skip("jax.distributed on the CPU backend did not come up within 180 s on loopback")
    for proc, (out, err) in zip(procs, results):
        if proc.returncode != 0 and "MESH" not in out:
            pytest.skip(f"this JAX's CPU backend does not run jax.distributed on loopback: {err[-800:]}")
        # 4 global devices, 2 per process; each data row (one replica) is one process's pair.
        assert "MESH 4 [0, 1] [[0], [1]] 2" in out, out + err
