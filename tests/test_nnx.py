"""From a Flax NNX model to jaxllm (``jaxllm.loader.nnx``): an NNX Llama defined here, with HF's module names and
its own dense-attention forward, randomly initialised on stories260K's config, converted to jaxllm's pytree and
run by jaxllm's Llama (the model step over the paged cache, whole and chunked; ``LLM`` from the folder
``save_nnx_as_hf`` writes): float32 logits within 1e-5 of the NNX model's own, greedy tokens identical.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from jaxllm import LLM, SamplingParams  # noqa: E402
from jaxllm.loader.nnx import hf_tensors_from_nnx, params_from_nnx, save_nnx_as_hf  # noqa: E402
from tests.conftest import STORIES  # noqa: E402
from tests.helpers import BLOCK_SIZE, SingleSequence  # noqa: E402

TOL = 1e-5
HF_CONFIG = json.loads((STORIES / "config.json").read_text())
MAX_TOKENS = 8


def _scale_init(key, shape, dtype):
    return 1 + 0.2 * jax.random.normal(key, shape, dtype)  # not ones, so a dropped norm weight shows


def _rope(x, theta):
    """HF Llama's rotate-half rope of x [N, H, D] at positions 0..N-1."""
    d = x.shape[-1]
    angles = jnp.arange(x.shape[0], dtype=jnp.float32)[:, None] / theta ** (jnp.arange(0, d, 2) / d)
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):
    def __init__(self, c, rngs):
        self.heads, self.kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.theta = c["rope_theta"]
        e = c["hidden_size"]
        self.q_proj = nnx.Linear(e, self.heads * self.head_dim, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(e, self.kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(e, self.kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(self.heads * self.head_dim, e, use_bias=False, rngs=rngs)

    def __call__(self, x):
        n, group = x.shape[0], self.heads // self.kv_heads
        q = _rope(self.q_proj(x).reshape(n, self.heads, self.head_dim), self.theta)
        k = _rope(self.k_proj(x).reshape(n, self.kv_heads, self.head_dim), self.theta).repeat(group, axis=1)
        v = self.v_proj(x).reshape(n, self.kv_heads, self.head_dim).repeat(group, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(self.head_dim)
        scores = jnp.where(jnp.tril(jnp.ones((n, n), bool)), scores, -jnp.inf)
        return self.o_proj(jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, -1), v).reshape(n, -1))


class MLP(nnx.Module):
    def __init__(self, c, rngs):
        e, f = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nnx.Linear(e, f, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(e, f, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(f, e, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, c, rngs):
        norm = dict(epsilon=c["rms_norm_eps"], scale_init=_scale_init, rngs=rngs)
        self.input_layernorm = nnx.RMSNorm(c["hidden_size"], **norm)
        self.self_attn = Attention(c, rngs)
        self.post_attention_layernorm = nnx.RMSNorm(c["hidden_size"], **norm)
        self.mlp = MLP(c, rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    def __init__(self, c, rngs):
        self.embed_tokens = nnx.Embed(c["vocab_size"], c["hidden_size"], rngs=rngs)
        self.layers = nnx.List([DecoderLayer(c, rngs) for _ in range(c["num_hidden_layers"])])
        self.norm = nnx.RMSNorm(c["hidden_size"], epsilon=c["rms_norm_eps"], scale_init=_scale_init, rngs=rngs)


class LlamaForCausalLM(nnx.Module):
    """An NNX Llama with tied embeddings, named as HF's ``LlamaForCausalLM``. ids int[N] -> logits [N, V]."""

    def __init__(self, c, rngs):
        self.model = LlamaModel(c, rngs)

    def __call__(self, ids):
        x = self.model.embed_tokens(jnp.asarray(ids))
        for layer in self.model.layers:
            x = layer(x)
        return self.model.embed_tokens.attend(self.model.norm(x))


@nnx.jit
def _nnx_logits(model, ids):
    return model(ids)


@pytest.fixture(scope="module")
def nnx_llama():
    return LlamaForCausalLM(HF_CONFIG, nnx.Rngs(0))


def test_nnx_llama_converted_runs_in_jaxllm_llama_with_its_logits(nnx_llama):
    cfg, params = params_from_nnx(nnx_llama, HF_CONFIG)
    assert cfg.model_type == "llama" and params["layers"]["wq"].shape == (5, 64, 64)
    ids = np.random.default_rng(0).integers(3, 512, size=40)
    ref = np.asarray(nnx_llama(ids))
    whole = SingleSequence(cfg, params, num_blocks=len(ids) // BLOCK_SIZE + 2, backend="xla").run(ids)
    np.testing.assert_allclose(whole, ref, atol=TOL, rtol=0)
    seq = SingleSequence(cfg, params, num_blocks=len(ids) // BLOCK_SIZE + 2, backend="reference")
    pieces = [seq.run(ids[:13]), seq.run(ids[13:30])] + [seq.run(ids[i:i + 1]) for i in range(30, 40)]
    np.testing.assert_allclose(np.concatenate(pieces), ref, atol=TOL, rtol=0)


def test_nnx_llama_saved_as_a_hf_folder_serves_through_llm_with_its_greedy_tokens(nnx_llama, tmp_path):
    folder = save_nnx_as_hf(nnx_llama, HF_CONFIG, tmp_path / "nnx_llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(STORIES / name, folder / name)
    prompt = np.random.default_rng(1).integers(3, 512, size=20).tolist()
    ids, rows = list(prompt), []
    for _ in range(MAX_TOKENS):
        # Padded to one length (causal: the padding after a position does not change its logits), one program.
        logits = np.asarray(_nnx_logits(nnx_llama, jnp.asarray(ids + [0] * (32 - len(ids))))[len(ids) - 1],
                            np.float64)
        rows.append(logits - logits.max() - np.log(np.exp(logits - logits.max()).sum()))
        ids.append(int(logits.argmax()))
    llm = LLM(model=folder, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=(16,),
              precompile=False)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == ids[len(prompt):]
    for chosen, row in zip(out.logprobs, rows):
        np.testing.assert_allclose([lp.logprob for lp in chosen.values()], row[list(chosen)], atol=TOL, rtol=0)


def test_a_module_the_family_needs_is_named_when_the_nnx_model_lacks_it(nnx_llama):
    def drop_one(path):
        return None if path == "model.layers.2.mlp.up_proj.kernel" else path

    with pytest.raises(ValueError, match=r"the NNX model is missing tensors .*'model.layers.2.mlp.up_proj.weight'"):
        params_from_nnx(nnx_llama, HF_CONFIG, rename=drop_one)


def test_nnx_leaves_other_than_linear_embed_and_norm_are_named():
    class Odd(nnx.Module):
        def __init__(self):
            self.mix = nnx.Param(jnp.zeros(3))
            self.proj = nnx.LinearGeneral(4, (2, 3), rngs=nnx.Rngs(0))

    with pytest.raises(ValueError, match="NNX leaf 'mix': the last name must be one of"):
        list(hf_tensors_from_nnx(Odd()))
    with pytest.raises(ValueError, match=r"'proj.kernel' has shape \(4, 2, 3\): kernels must be 2-D"):
        list(hf_tensors_from_nnx(Odd(), rename=lambda path: None if path == "mix" else path))


class Renamed(nnx.Module):
    """The same modules under other names: ``decoder.embed_tokens``, ``decoder.layers.{i}...``."""

    def __init__(self, llama):
        self.decoder = llama.model


def test_a_model_named_otherwise_converts_through_rename(nnx_llama):
    cfg, want = params_from_nnx(nnx_llama, HF_CONFIG)
    _, got = params_from_nnx(Renamed(nnx_llama), HF_CONFIG, rename=lambda p: p.replace("decoder.", "model.", 1))
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)
