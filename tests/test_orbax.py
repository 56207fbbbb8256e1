"""orbax checkpoints: conversion from HF folders and GGUF, restore, and detection.
(The restore into tensor-parallel shardings runs in tests/multidevice/test_orbax_tp.py.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.loader import load_model
from jaxllm.loader.orbax import is_orbax_checkpoint, save_checkpoint
from kernels_pallas.storage import from_storage
from scripts.convert_checkpoint import convert

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_kv_blocks=32, precompile=False)


def _assert_same_params(restored, host):
    leaves = jax.tree_util.tree_leaves_with_path(host)
    assert len(leaves) == len(jax.tree_util.tree_leaves(restored))
    for (path, want), got in zip(leaves, jax.tree_util.tree_leaves(restored)):
        assert got.dtype == want.dtype, path
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(path))


def test_hf_folder_round_trip_is_bit_identical_with_the_same_text(stories_dir, tmp_path):
    convert(stories_dir, tmp_path / "ckpt")
    assert is_orbax_checkpoint(tmp_path / "ckpt") and not is_orbax_checkpoint(stories_dir)
    restored = LLM(model=tmp_path / "ckpt", **ENGINE)
    _assert_same_params(restored.get_params(), load_model(stories_dir, np.float32)[1])
    original = LLM(model=stories_dir, **ENGINE)
    assert restored.generate("Once upon a time", GREEDY)[0].outputs[0].text \
        == original.generate("Once upon a time", GREEDY)[0].outputs[0].text


def test_gguf_round_trip_is_bit_identical_and_serves_token_ids(tmp_path):
    from tests.test_gguf import write_tiny_gguf

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, "llama")
    convert(gguf_path, tmp_path / "ckpt")
    restored = LLM(model=tmp_path / "ckpt", **ENGINE)
    _assert_same_params(restored.get_params(), load_model(gguf_path, np.float32)[1])
    assert len(restored.generate([[1, 5, 9, 20]], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_bfloat16_conversion_restores_as_bfloat16(stories_dir, tmp_path):
    convert(stories_dir, tmp_path / "ckpt", dtype="bfloat16")
    restored = LLM(model=tmp_path / "ckpt", dtype="bfloat16", **ENGINE)
    params = restored.engine.runner.weights.params
    # On CPU the layer leaves are held as their uint16 bit patterns (models.loop_storage).
    assert {x.dtype.name for x in jax.tree_util.tree_leaves(jax.tree_util.tree_map(from_storage, params))} == {
        "bfloat16"}


def test_saving_into_a_non_empty_folder_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        save_checkpoint(tmp_path / "ckpt", {"embed": np.zeros((2, 2), np.float32)}, {})
