"""Loading HF folders: sharded safetensors, bfloat16, and the errors that name what is wrong."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from jaxllm.loader import load_model
from jaxllm.loader.safetensors import INDEX_FILE

torch = pytest.importorskip("torch")


def test_sharded_checkpoint_loads_the_same_parameters(tmp_path):
    from tests.hf_models import make_tiny_hf_model

    model = make_tiny_hf_model("qwen2", tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    _, single, _ = load_model(tmp_path / "single")
    _, sharded, _ = load_model(tmp_path / "sharded")
    for a, b in zip(_leaves(single), _leaves(sharded)):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_parameters_are_bfloat16(tmp_path):
    from tests.hf_models import make_tiny_hf_model

    make_tiny_hf_model("llama", tmp_path)
    _, params, _ = load_model(tmp_path, ml_dtypes.bfloat16)
    assert {leaf.dtype for leaf in _leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    from tests.hf_models import make_tiny_hf_model

    make_tiny_hf_model("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_unknown_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        load_model(tmp_path)


def _leaves(params):
    import jax

    return jax.tree_util.tree_leaves(params)


@pytest.mark.parametrize("kind", ["text-file", "folder-without-config", "missing"])
def test_issue11_model_path_that_is_not_a_model_is_named(tmp_path, kind):
    from jaxllm import LLM
    from jaxllm.loader import read_model_config

    (tmp_path / "notes.gguf").write_text("not a model")
    path, message = {"text-file": (tmp_path / "notes.gguf", "is a file but not a GGUF model"),
                     "folder-without-config": (tmp_path, "has no config.json"),
                     "missing": (tmp_path / "missing", "does not exist")}[kind]
    for load in (read_model_config, load_model, LLM):
        with pytest.raises(ValueError, match=message):
            load(path)
