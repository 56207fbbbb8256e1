"""Loading HF folders: sharded safetensors, bfloat16, and the errors that name what is wrong."""

from __future__ import annotations

import json
import re

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


# ---- issue 25 item 8: a config.json without architectures -------------------------------------------

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "mixtral", "qwen3_moe"]


def _without_architectures(folder, how: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    if how == "absent":
        del config["architectures"]
    else:
        config["architectures"] = None if how == "null" else []
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family", FAMILIES)
def test_issue25_item8_every_family_without_architectures_loads_by_its_model_type(tmp_path, family):
    # The class: each supported family as transformers saves it (its own model_type), with architectures null,
    # absent or empty, loads as the same model it is with them.
    from tests.hf_models import make_tiny_hf_model

    make_tiny_hf_model(family, tmp_path / "named")
    want_cfg, want, _ = load_model(tmp_path / "named")
    for how in ("null", "absent", "empty"):
        folder = tmp_path / how
        folder.mkdir()
        for f in (tmp_path / "named").iterdir():
            (folder / f.name).symlink_to(f)
        (folder / "config.json").unlink()
        (folder / "config.json").write_text((tmp_path / "named" / "config.json").read_text())
        _without_architectures(folder, how)
        cfg, params, _ = load_model(folder)
        assert cfg == want_cfg, how
        for a, b in zip(_leaves(params), _leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


GGUF_FAMILIES = [("llama", {}), ("qwen2", {}), ("qwen3", dict(head_dim=128)), ("gemma3", {}), ("phi3", {}),
                 ("qwen3moe", dict(experts=4, head_dim=128, ffn=768))]


@pytest.mark.parametrize("arch, kwargs", GGUF_FAMILIES, ids=[a for a, _ in GGUF_FAMILIES])
def test_issue25_item8_a_config_transformers_saved_from_a_gguf_is_the_gguf_s_model(tmp_path, arch, kwargs):
    # A model transformers 5 loaded from a GGUF has no architectures: its config.json says "architectures": null
    # in full (use_diff=False), and leaves the key out as a diff (save_pretrained's default).
    transformers = pytest.importorskip("transformers")
    from jaxllm.loader.gguf import load_gguf
    from jaxllm.models.config import ModelConfig
    from tests.test_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, **kwargs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    hf.config.to_json_file(tmp_path / "full.json", use_diff=False)
    hf.config.save_pretrained(tmp_path / "diff")
    ours = ModelConfig.from_hf_config(load_gguf(path)[0])
    fields = ("architecture", "model_type", "num_layers", "hidden_size", "num_q_heads", "num_kv_heads", "head_dim",
              "vocab_size", "num_experts")
    for saved in (tmp_path / "full.json", tmp_path / "diff" / "config.json"):
        config = json.loads(saved.read_text())
        assert config.get("architectures", "absent") in (None, "absent") and "model_type" in config
        theirs = ModelConfig.from_hf_config(config)
        assert {f: getattr(theirs, f) for f in fields} == {f: getattr(ours, f) for f in fields}, saved


def test_issue25_item8_stories260k_with_architectures_null_runs_as_llama(stories_dir, tmp_path):
    # The report: "architectures": null and "model_type": "llama" was refused as "unsupported architecture 'llama'".
    from jaxllm import LLM, SamplingParams
    from tests.conftest import STORIES_SENTENCE

    for f in stories_dir.iterdir():
        (tmp_path / f.name).symlink_to(f.resolve())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text((stories_dir / "config.json").read_text())
    _without_architectures(tmp_path, "null")
    llm = LLM(model=tmp_path, max_model_len=64, max_num_seqs=2, precompile=False)
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert "Once upon a time" + out.outputs[0].text == STORIES_SENTENCE


@pytest.mark.parametrize("config", [{"architectures": None, "model_type": "gpt_neox"},
                                    {"model_type": "gemma3"}, {"architectures": []}])
def test_issue25_item8_an_unknown_model_type_is_refused_naming_the_supported_ones(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    supported = "['gemma3_text', 'llama', 'mistral', 'mixtral', 'phi3', 'qwen2', 'qwen3', 'qwen3_moe']"
    with pytest.raises(ValueError, match=re.escape(f"unsupported model_type {config.get('model_type')!r} "
                                                   f"(config.json names no architectures): jaxllm runs model_type "
                                                   f"{supported}")):
        load_model(tmp_path)
