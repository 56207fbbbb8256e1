"""The ops table (``kernels_pallas.ops``): the models reach the kernels only through it (the C++ build driver's
one importer: tests/test_layout.py), and it picks each op's backend by platform, devices, CPU flags and rows."""

from __future__ import annotations

import ast
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ops
from kernels_pallas.lm_head.cpu import matmul_nt_cpu
from kernels_pallas.lm_head.reference import matmul_nt_reference
from kernels_pallas.matmul.cpu import stacked_matmul_cpu
from kernels_pallas.matmul.reference import stacked_matmul_reference
from scripts.code_stats import SOURCE_PACKAGES, _modules

ROOT = Path(__file__).resolve().parents[1]
AVX2 = frozenset({"avx2"})
AVX512 = AVX2 | {"avx512f"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AMX = AVX512_BF16 | {"amx_bf16"}


def _imported(tree: ast.Module) -> set[str]:
    """Every module an ``import`` or ``from ... import`` of the tree names, with ``from``'s names as submodules."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_models_import_nothing_of_the_kernels_but_the_ops_table():
    found = {module: sorted(name for name in _imported(tree) if name.split(".")[0] == "kernels_pallas"
                            and not name.startswith("kernels_pallas.ops"))
             for module, (_, tree) in _modules(ROOT, "jaxllm").items() if module.startswith("jaxllm.models")}
    assert {module: names for module, names in found.items() if names} == {}
    assert any("kernels_pallas.ops" in _imported(tree) for module, (_, tree) in _modules(ROOT, "jaxllm").items()
               if module.startswith("jaxllm.models"))


def test_only_the_kernels_read_proc_cpuinfo():
    readers = {module for package in (*SOURCE_PACKAGES, "scripts") for module, (path, _) in
               _modules(ROOT, package).items() if "/proc/cpuinfo" in (ROOT / path).read_text()}
    assert readers == {"kernels_pallas.cpu_features"}


@pytest.mark.parametrize(("op", "platform", "expected"), [
    ("attention", "gpu", "pallas"), ("attention", "cpu", "xla"), ("attention", "tpu", "xla"),
    ("cache_write", "gpu", "pallas"), ("cache_write", "cpu", "reference"),
])
def test_attention_and_the_kv_write_follow_the_platform(op, platform, expected):
    assert ops.select(op, platform=platform, features=AMX) == expected


@pytest.mark.parametrize(("features", "dtype", "rows", "expected"), [
    (AVX512, jnp.float32, 1, "cpu"), (AVX512, jnp.float32, 512, "cpu"), (AVX512, jnp.float32, 513, "xla"),
    (AVX2, jnp.float32, 192, "cpu"), (AVX2, jnp.float32, 193, "xla"), (frozenset(), jnp.float32, 192, "cpu"),
    (AMX, jnp.bfloat16, 4, "cpu"), (AMX, jnp.bfloat16, 5, "xla"), (AMX, jnp.uint16, 4, "cpu"),
    (AVX512_BF16, jnp.bfloat16, 128, "cpu"), (AVX512_BF16, jnp.uint16, 129, "xla"),
    (AVX512, jnp.bfloat16, 1, "xla"), (AMX, jnp.int8, 1, "xla"),
])
def test_the_projection_takes_the_cpp_matmul_up_to_the_rows_of_its_instruction_sets(features, dtype, rows,
                                                                                     expected):
    assert ops.select("matmul", platform="cpu", features=features, rows=rows, dtype=dtype) == expected
    # Never on an accelerator or across devices (the custom call is not partitioned).
    assert ops.select("matmul", platform="gpu", features=features, rows=rows, dtype=dtype) == "xla"
    assert ops.select("matmul", platform="cpu", features=features, rows=rows, dtype=dtype, devices=2) == "xla"


@pytest.mark.parametrize(("rows", "dtype", "packed", "expected"), [
    (4, jnp.float32, False, "cpu"), (3, jnp.float32, False, "xla"), (1, jnp.float32, True, "cpu"),
    (64, jnp.bfloat16, False, "xla"), (64, jnp.bfloat16, True, "xla"),
])
def test_the_lm_head_takes_the_cpp_kernel_from_four_float32_rows_or_one_packed(rows, dtype, packed, expected):
    assert ops.select("lm_head", platform="cpu", features=AVX2, rows=rows, dtype=dtype, packed=packed) == expected
    assert ops.select("lm_head", platform="gpu", rows=rows, dtype=dtype, packed=packed) == "xla"


def test_the_table_refuses_an_op_it_does_not_have():
    with pytest.raises(ValueError, match="unknown op 'softmax'"):
        ops.select("softmax", platform="cpu")


@pytest.mark.skipif(not ops.native_kernels(), reason="the C++ kernels are not built here")
def test_the_cpp_matmuls_match_their_references():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((7, 48)), jnp.float32)
    stack = jnp.asarray(rng.standard_normal((3, 48, 32)), jnp.float32)
    np.testing.assert_allclose(np.asarray(stacked_matmul_cpu(x, stack, 2, jnp.int32(5))),
                               np.asarray(stacked_matmul_reference(x, stack, 2, jnp.int32(5))), atol=1e-4, rtol=0)
    w = jnp.asarray(rng.standard_normal((40, 48)), jnp.float32)
    np.testing.assert_allclose(np.asarray(matmul_nt_cpu(x, w, jnp.int32(6))),
                               np.asarray(matmul_nt_reference(x, w, jnp.int32(6))), atol=1e-4, rtol=0)
