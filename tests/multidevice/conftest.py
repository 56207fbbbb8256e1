"""Fixtures for tests run with 8 CPU host devices (run by tests/multidevice/runner.py, for tests/test_sharding*.py)."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from jaxllm import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Two token buckets, a decode-sized and a prefill-sized one: each engine here (one per model, degree and backend)
# compiles its step programs on first use, and the default ladder's seven (4 to 64 tokens) made most of these
# modules' time. The tests compare tokens across degrees under the same buckets; the default ladder is built and
# served by the single-device tests (tests/test_warmup.py, tests/test_compilation.py).
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=8, num_kv_blocks=96, precompile=False,
              token_buckets=(8, 64))


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    if jax.device_count() < 8:
        pytest.fail("tests/multidevice needs XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                    "(run it through tests/test_sharding.py and tests/test_sharding_tp.py)")


def _tiny(tmp_path_factory, name: str, **overrides) -> Path:
    pytest.importorskip("torch")
    from tests.hf_models import make_tiny_hf_model

    folder = tmp_path_factory.mktemp(name)
    make_tiny_hf_model("llama", folder, seed=5, num_attention_heads=8, **overrides)
    return folder


@pytest.fixture(scope="session")
def kv4_dir(tmp_path_factory) -> Path:
    """Tiny Llama: 8 q heads, 4 KV heads, untied lm_head."""
    return _tiny(tmp_path_factory, "kv4", num_key_value_heads=4)


@pytest.fixture(scope="session")
def kv2_dir(tmp_path_factory) -> Path:
    """Tiny Llama: 8 q heads, 2 KV heads, tied embeddings."""
    return _tiny(tmp_path_factory, "kv2", num_key_value_heads=2, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory) -> Path:
    """Tiny Qwen3-MoE: 8 experts, top 3, 8 q heads, 4 KV heads."""
    pytest.importorskip("torch")
    from tests.hf_models import make_tiny_hf_model

    folder = tmp_path_factory.mktemp("moe")
    make_tiny_hf_model("qwen3_moe", folder, seed=5, num_attention_heads=8, num_key_value_heads=4)
    return folder


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=int(k)).tolist() for k in rng.integers(2, 30, size=n)]
