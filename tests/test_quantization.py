"""Weight-only int8 / fp8 quantization and quantized KV caches, end to end.

Two questions per model, kept apart:

* Is the quantized path exact? Logits of the quantized weights equal HF transformers run with
  the *dequantized* weights (``q * scale`` loaded into the torch model) within the float32
  parity tolerance (1e-4), greedy tokens equal.
* How much does quantization cost? Measured against float32 on the tiny random parity models
  (512 positions: 4 random sequences of 128 tokens), with bounds set from measurement with
  about 1.5x headroom (measured values next to each bound). Random tiny models have flat
  next-token distributions (logit std ~1.6 over 256 tokens), so top-1 flips under small
  perturbations far more often than in a trained model; the perplexity of the default model
  on an English text (below) is the quality check that matters: int8 within 2% of float32.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM
from jaxllm.config import EngineConfig
from jaxllm.frontend.llm_engine import LLMEngine
from jaxllm.worker.kv_cache import calibrate_kv_scales, calibration_ids, kv_number_dtype, resolve_num_blocks
from jaxllm.loader import load_model
from jaxllm.models import family
from jaxllm.worker.quantization import (
    QUANTIZED_KEYS,
    dequantize_weight,
    param_bytes,
    quantize_weight,
)
from jaxllm.worker.sharding import ModelSharding, make_mesh
from kernels_pallas.ops import get_attention_ops
from tests.test_model_parity import TOL, SingleSequence

torch = pytest.importorskip("torch")

SEQS, SEQ_LEN = 4, 128
# (arch, quantization) -> (max |logit - float32 logit|, top-1 agreement with float32) bounds;
# measured: llama int8 0.67 / 94.3%, fp8 2.57 / 79.7%; qwen3_moe int8 2.31 / 95.7% (a routing
# flip moves a token to other experts: a larger max, the same mean).
ERROR_BOUNDS = {("llama", "int8"): (1.0, 0.92), ("llama", "fp8"): (4.0, 0.75), ("qwen3_moe", "int8"): (3.5, 0.92)}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """Tiny HF models by arch, each built once: (folder, torch model, token ids [4, 128], float32 logits)."""
    from tests.hf_models import make_tiny_hf_model

    built = {}

    def get(arch):
        if arch not in built:
            folder = tmp_path_factory.mktemp(arch)
            hf = make_tiny_hf_model(arch, folder)
            ids = np.random.default_rng(0).integers(3, 256, size=(SEQS, SEQ_LEN))
            with torch.no_grad():
                built[arch] = (folder, hf, ids, hf(torch.tensor(ids)).logits.numpy())
        return built[arch]

    return get


def _hf_with_dequantized_weights(hf, cfg, params):
    """A copy of the torch model holding ``q * scale`` of every quantized jaxllm leaf."""
    names = {key: name for name, (key, _) in family(cfg).hf_layer_names.items()}
    state = {}
    layers = params["layers"]
    for key in QUANTIZED_KEYS & layers.keys():
        w = dequantize_weight(layers[key], layers[key + "_scale"])  # [L, (experts,) in, out]
        for i in range(cfg.num_layers):
            if "*" in names[key]:
                for j in range(cfg.num_experts):
                    state[f"model.layers.{i}.{names[key].replace('*', str(j))}"] = w[i, j].T
            else:
                state[f"model.layers.{i}.{names[key]}"] = w[i].T
    if "lm_head_scale" in params:
        state["lm_head.weight"] = dequantize_weight(params["lm_head"], params["lm_head_scale"]).T
    model = copy.deepcopy(hf)
    for i in range(cfg.num_layers):  # transformers holds each layer's experts fused: gate_up [X, 2F, E], down [X, E, F]
        prefix = f"model.layers.{i}.mlp.experts."
        if prefix + "gate_up_proj" in model.state_dict():
            per_expert = [[state.pop(f"{prefix}{j}.{part}_proj.weight") for j in range(cfg.num_experts)]
                          for part in ("gate", "up", "down")]
            state[prefix + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(*per_expert[:2])])
            state[prefix + "down_proj"] = np.stack(per_expert[2])
    missing = set(state) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False)
    return model


@pytest.mark.parametrize("arch, quantization", list(ERROR_BOUNDS), ids=["-".join(k) for k in ERROR_BOUNDS])
def test_quantized_logits_are_exact_for_the_dequantized_weights_and_near_float32(tiny_hf, arch, quantization):
    folder, hf, ids, ref = tiny_hf(arch)
    cfg, params, _ = load_model(folder, np.float32, quantization=quantization)
    quantized = {k for k in params["layers"] if not k.endswith("_scale") and k + "_scale" in params["layers"]}
    assert quantized == QUANTIZED_KEYS & family(cfg).layer_keys(cfg)
    assert "lm_head_scale" in params and params["embed"].dtype == np.float32
    got = np.stack([SingleSequence(cfg, params, num_blocks=SEQ_LEN // 4 + 2, backend="xla").run(row) for row in ids])

    with torch.no_grad():
        exact = _hf_with_dequantized_weights(hf, cfg, params)(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, exact, atol=TOL, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), exact.argmax(-1))

    max_diff, top1 = ERROR_BOUNDS[arch, quantization]
    assert np.abs(got - ref).max() <= max_diff
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= top1


def test_quantize_weight_is_per_output_channel_and_round_to_nearest():
    w = np.random.default_rng(0).standard_normal((3, 64, 10)).astype(np.float32)
    w[1, :, 4] = 0.0  # an all-zero channel
    q, scale = quantize_weight(w, "int8")
    assert q.dtype == np.int8 and scale.shape == (3, 10) and scale.dtype == np.float32
    np.testing.assert_allclose(scale, np.where(np.abs(w).max(1) > 0, np.abs(w).max(1) / 127, 1.0), rtol=1e-6)
    assert np.abs(q).max() == 127
    assert np.all(np.abs(dequantize_weight(q, scale) - w) <= scale[:, None, :] / 2 * (1 + 1e-6))
    q8, scale8 = quantize_weight(w, "fp8")
    assert q8.dtype.name == "float8_e4m3fn"
    np.testing.assert_allclose(np.abs(q8.astype(np.float32)).max(1)[scale8 != 1], 448.0)
    err = np.abs(dequantize_weight(q8, scale8) - w)
    assert np.all(err <= np.abs(w) * 2.0 ** -4 + scale8[:, None, :] * 2.0 ** -9)


# ---- GGUF Q8_0 kept as int8 ---------------------------------------------------------------------

def test_gguf_q8_0_projections_keep_their_int8_blocks_and_give_the_float_logits(tmp_path):
    from tests.test_gguf import TINY, TINY_TYPES, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", tied=False)
    cfg, f32, _ = load_model(path, np.float32)
    _, int8, _ = load_model(path, np.float32, quantization="int8")
    layers = int8["layers"]
    kept = {"wq": "attn_q.weight", "w_up": "ffn_up.weight"}
    assert {TINY_TYPES[name] for name in kept.values()} == {"Q8_0"}
    for key in kept:
        # One scale per 32-value block of each output channel: [L, in / 32, out], exactly the float tensor.
        assert layers[key].dtype == np.int8
        assert layers[key + "_scale"].shape == (cfg.num_layers, TINY["hidden"] // 32, layers[key].shape[-1])
        np.testing.assert_array_equal(dequantize_weight(layers[key], layers[key + "_scale"]), f32["layers"][key])
    # The other types (Q4_0, Q4_1, F16, BF16, F32) are quantized per output channel.
    assert layers["wk"].dtype == np.int8 and layers["wk_scale"].shape == (cfg.num_layers, layers["wk"].shape[-1])

    # Q8_0 leaves in otherwise float32 parameters: the logits of the float tensors, to rounding.
    mixed = {**f32, "layers": {**f32["layers"], **{k: layers[k] for k in layers if k.startswith(tuple(kept))}}}
    ids = np.random.default_rng(0).integers(0, TINY["vocab"], size=24)
    np.testing.assert_allclose(SingleSequence(cfg, mixed).run(ids), SingleSequence(cfg, f32).run(ids),
                               atol=1e-5, rtol=0)


def test_gguf_q8_0_kept_as_int8_are_read_as_blocks_not_from_the_dequantized_cache(tmp_path, monkeypatch):
    """Kept Q8_0 projections never go through gguf's dequantizer nor the float32 cache (which then
    holds the other quantized tensors only); a float load after it dequantizes and caches them all;
    a kept load after that reads the rest from the cache, the same arrays as the first."""
    import safetensors
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    import jaxllm.loader.gguf as loader
    from jaxllm.loader.gguf import load_gguf
    from tests.test_gguf import write_tiny_gguf

    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama")
    tensors = loader._reader(str(path)).tensors
    quantized = {t.name for t in tensors if t.tensor_type not in loader._FLOAT_TYPES}
    kept = {t.name for t in tensors if t.name.endswith(("attn_q.weight", "ffn_up.weight"))}
    assert {t.tensor_type for t in tensors if t.name in kept} == {GGMLQuantizationType.Q8_0}
    seen = []
    monkeypatch.setattr(loader, "dequantize", lambda data, qtype: seen.append(qtype) or dequantize(data, qtype))

    def cached_names():
        (cache,) = (tmp_path / "cache" / "gguf").glob("llama-*.safetensors")
        with safetensors.safe_open(cache, framework="numpy") as f:
            return set(f.keys())

    first = load_gguf(path, keep_q8_0=True)[1]
    assert GGMLQuantizationType.Q8_0 not in seen
    assert cached_names() == quantized - kept
    load_gguf(path)
    assert cached_names() == quantized
    seen.clear()
    again = load_gguf(path, keep_q8_0=True)[1]
    assert set(seen) <= set(loader._FLOAT_TYPES)
    assert set(again) == set(first)
    for name in first:
        np.testing.assert_array_equal(again[name], first[name], err_msg=name)


# ---- tensor parallelism: where the scales live (the 8-device run is tests/multidevice) --------------

@pytest.mark.parametrize("kv_heads", [4, 2])
def test_weight_scales_split_with_their_output_channels_and_kv_scales_with_the_cache_heads(kv_heads):
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from jaxllm.models.config import ModelConfig

    cfg = ModelConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=16))
    sharding = ModelSharding(cfg, AbstractMesh((1, 4), ("data", "model")))
    z = np.zeros
    layers = {"wq_scale": z((2, 128)), "wk_scale": z((2, kv_heads * 16)), "wo_scale": z((2, 64)),
              "w_up_scale": z((2, 128)), "w_down_scale": z((2, 4, 64)), "w_gate_scale": z((2, 2, 128)),
              "k_scale": z((2, sharding.num_cache_heads))}
    specs = sharding.param_specs({"lm_head_scale": z(256), "layers": layers})
    kv = "model" if kv_heads == 4 else None  # 2 KV heads over 4 devices: k/v projections replicated
    assert specs == {"lm_head_scale": P("model"), "layers": {
        "wq_scale": P(None, "model"), "wk_scale": P(None, kv), "wo_scale": P(None, None),
        "w_up_scale": P(None, "model"),
        # Group scales [L, G, out]: G follows the weight's input axis (w_down's is split, 4 groups).
        "w_down_scale": P(None, "model", None), "w_gate_scale": P(None, None, "model"),
        "k_scale": P(None, "model")}}


# ---- the engine: memory, KV blocks, orbax ---------------------------------------------------

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=8, precompile=False, compilation_cache=None)


def test_engine_prints_and_holds_int8_weights_in_a_quarter_of_their_float32_bytes(tiny_hf, capfd):
    folder = tiny_hf("llama")[0]
    f32 = LLMEngine(folder, num_kv_blocks=16, **ENGINE)
    int8 = LLMEngine(folder, num_kv_blocks=16, quantization="int8", **ENGINE)
    log = capfd.readouterr().err
    full, quantized = f32.param_bytes, int8.param_bytes
    assert quantized["quantized_as_float32"] == sum(
        x.nbytes for k, x in f32.runner.weights.params["layers"].items() if k in QUANTIZED_KEYS) + \
        f32.runner.weights.params["lm_head"].nbytes
    # int8 values plus a float32 scale per output channel: (in + 4) / (4 * in), in = 64 or 128 here.
    assert 0.25 < quantized["quantized"] / quantized["quantized_as_float32"] < 0.27
    assert full["total"] - quantized["total"] == quantized["quantized_as_float32"] - quantized["quantized"]
    assert f"parameters: {quantized['total'] / 2**20:.1f} MiB ({quantized['quantized'] / 2**20:.1f} MiB of int8" in log
    assert {x.dtype for k, x in int8.runner.weights.params["layers"].items() if k in QUANTIZED_KEYS} == {np.dtype(np.int8)}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e4m3"])
def test_one_byte_kv_caches_hold_twice_the_bf16_blocks_for_a_budget(stories_dir, kv_cache_dtype):
    cfg = load_model(stories_dir)[0]
    per_block_bf16 = cfg.kv_bytes_per_token * 16 * 2
    kw = dict(block_size=16, num_kv_blocks=None, kv_cache_memory_bytes=per_block_bf16 * 300, max_num_seqs=64,
              max_model_len=512, device=jax.devices()[0], gpu_memory_utilization=0.9)
    bf16 = resolve_num_blocks(cfg, dtype=jnp.bfloat16, **kw)
    assert resolve_num_blocks(cfg, dtype=kv_number_dtype(kv_cache_dtype, jnp.bfloat16), **kw) == 2 * bf16 == 600


def test_engine_with_an_fp8_cache_reports_twice_the_blocks_of_bf16(stories_dir, capfd):
    budget = dict(kv_cache_memory_bytes=load_model(stories_dir)[0].kv_bytes_per_token * 8 * 2 * 100,
                  **{**ENGINE, "max_num_seqs": 16})
    bf16 = LLMEngine(stories_dir, dtype="bfloat16", **budget)
    fp8 = LLMEngine(stories_dir, dtype="bfloat16", kv_cache_dtype="fp8_e4m3", **budget)
    assert (bf16.num_blocks, fp8.num_blocks) == (100, 200)
    assert "KV cache: 199 blocks of 8 tokens (1,592 tokens) and the null block, float8_e4m3fn, " in \
        capfd.readouterr().err
    # On CPU the float8 cache is held as its uint8 bits, with calibrated per-layer, per-head scales.
    assert fp8.runner.cache_engine.kv_cache[0].dtype == np.uint8
    k_scale = np.asarray(fp8.runner.weights.params["layers"]["k_scale"])
    assert k_scale.shape == (fp8.model_config.num_layers, fp8.model_config.num_kv_heads)
    assert np.all(k_scale > 0) and np.all(k_scale < 1)


def test_quantized_orbax_checkpoint_restores_the_int8_weights_bit_for_bit(stories_dir, tmp_path):
    from scripts.convert_checkpoint import convert

    convert(stories_dir, tmp_path / "ckpt", quantization="int8")
    restored = LLM(model=tmp_path / "ckpt", num_kv_blocks=32, **ENGINE)
    host = load_model(stories_dir, np.float32, quantization="int8")[1]
    flat = jax.tree_util.tree_leaves_with_path(host)
    assert len(flat) == len(jax.tree_util.tree_leaves(restored.get_params()))
    for (path, want), got in zip(flat, jax.tree_util.tree_leaves(restored.get_params())):
        assert got.dtype == want.dtype, path
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(path))
    with pytest.raises(ValueError, match="holds int8 weights; quantization='fp8'"):
        LLM(model=tmp_path / "ckpt", quantization="fp8", num_kv_blocks=32, **ENGINE)


@pytest.mark.parametrize("field, value", [("quantization", "int4"), ("quantization", "awq"),
                                          ("kv_cache_dtype", "fp8_e5m2"), ("kv_cache_dtype", "bfloat16")])
def test_unknown_quantization_settings_are_rejected_naming_the_value(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        EngineConfig(**{field: value})


# ---- the default model: perplexity on English text ---------------------------------------------

# Written for this test (about 330 SmolLM2 tokens); it opens with "The capital of France is Paris".
ENGLISH_TEXT = """The capital of France is Paris, but this story is about a smaller city. The river that runs through the middle of the city was once its main road. Long before there were \
bridges, ferries carried farmers, merchants and their animals from one bank to the other, and the market grew up \
where the boats came in. Today the old warehouses along the water have become shops, cafes and small museums, but \
the names of the streets still remember what was sold there: Salt Lane, Wool Street, the Corn Exchange.

Every spring the river rises after the snow melts in the mountains. For centuries the floods were a danger and a \
blessing at the same time. They destroyed houses and drowned fields, but they also left behind a layer of rich soil \
that made the valley one of the most fertile regions in the country. In the nineteenth century engineers built high \
stone walls and a system of locks to control the water, and the city has not been flooded for more than a hundred \
years.

Children who grow up here learn to swim in the summer, when the current is slow and the water is warm. Their \
grandparents tell them stories about the winter of the great frost, when the river froze so hard that people walked \
across it and held a fair on the ice, with music, roasted chestnuts and horse races.

Visitors often ask which is the best time of year to come. The answer depends on what you like. In autumn the trees \
on the hills turn red and gold, and in December the whole old town is lit with candles. Many travellers also \
continue to Paris, which is only a few hours away by train."""


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """(cfg, tokenizer, text ids, position predicting " Paris", float32 perplexity) of the default model."""
    from jaxllm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_gguf)
    ids = np.asarray(tokenizer.encode(ENGLISH_TEXT))
    paris = tokenizer.encode(" Paris")
    assert len(paris) == 1
    at = int(np.flatnonzero(ids == paris[0])[0]) - 1  # the position of "is", predicting " Paris"
    cfg, params, _ = load_model(smollm2_gguf, np.float32)
    ppl, predicted = _perplexity(cfg, params, ids)
    assert predicted[at] == paris[0]
    return cfg, tokenizer, ids, at, ppl


def _perplexity(cfg, params, ids, cache_dtype=jnp.float32):
    """(exp of the mean next-token NLL over the text, the greedy prediction at each position)."""
    logits = SingleSequence(cfg, params, num_blocks=len(ids) // 4 + 2, backend="xla", cache_dtype=cache_dtype).run(ids)
    logp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    nll = -np.asarray(logp[np.arange(len(ids) - 1), ids[1:]])
    return float(np.exp(nll.mean())), logits.argmax(-1)


# Measured (float32 22.45): int8 weights 22.48 (+0.1%), with an fp8 KV cache 22.31 (-0.6%); fp8
# weights 22.42 (-0.1%); float32 weights with an fp8 KV cache 22.35 (-0.5%), with an int8 one 22.05
# (-1.8%; KV_SCALE_MARGIN 2, while margin 1 gives 22.44 and margin 4 23.32, +3.8%).
@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_int8_weights_keep_perplexity_within_2_percent_and_paris(smollm2, smollm2_gguf, kv_cache_dtype):
    cfg, tokenizer, ids, at, ppl_f32 = smollm2
    _, params, _ = load_model(smollm2_gguf, np.float32, quantization="int8")
    bytes_ = param_bytes(params)
    assert 0.25 < bytes_["quantized"] / bytes_["quantized_as_float32"] < 0.252  # (576 + 4) / (4 * 576)
    cache_dtype = jnp.float32
    if kv_cache_dtype:
        sharding = ModelSharding(cfg, make_mesh(1))
        kv_dtype = kv_number_dtype(kv_cache_dtype, np.float32)
        k_scale, v_scale = calibrate_kv_scales(cfg, params, calibration_ids(tokenizer, cfg.vocab_size),
                                               ops=sharding.attention_ops(get_attention_ops("xla")),
                                               sharding=sharding, kv_dtype=kv_dtype)
        params = {**params, "layers": {**params["layers"], "k_scale": k_scale, "v_scale": v_scale}}
        cache_dtype = jnp.uint8  # float8 bits, as the CPU engine holds them
    ppl, predicted = _perplexity(cfg, params, ids, cache_dtype)
    assert abs(ppl / ppl_f32 - 1) <= 0.02, (ppl, ppl_f32)
    assert tokenizer.decode([int(predicted[at])]) == " Paris"
