"""An orbax checkpoint restores into tensor-parallel shardings with bit-identical weights."""

from __future__ import annotations

import jax
import numpy as np

from jaxllm import LLM
from jaxllm.loader import load_model
from scripts.convert_checkpoint import convert
from tests.multidevice.conftest import ENGINE, GREEDY, prompts


def test_orbax_checkpoint_restored_at_tp2_is_bit_identical_and_generates_the_same(kv4_dir, tmp_path):
    convert(kv4_dir, tmp_path / "orbax")
    restored = LLM(model=tmp_path / "orbax", tensor_parallel_size=2, **ENGINE)
    _, host, _ = load_model(kv4_dir, np.float32)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(host),
                                 jax.tree_util.tree_leaves(restored.engine.runner.weights.params)):
        assert got.sharding.mesh.shape["model"] == 2, path
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(path))
    original = LLM(model=kv4_dir, **ENGINE)
    batch = prompts(4, seed=2)
    assert ([o.outputs[0].token_ids for o in restored.generate(batch, GREEDY)]
            == [o.outputs[0].token_ids for o in original.generate(batch, GREEDY)])
