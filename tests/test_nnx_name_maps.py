"""Name maps (jaxllm.loader.nnx_names) and dense_forward's padding and Explicit sharding, without tunix.

The NNX models here carry tunix's module names and einsum shapes (tunix/models/<family>/model.py), filled from the
stories260K fixture so that the converted tree can be compared with jaxllm's own loader leaf by leaf.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.loader import load_model
from jaxllm.loader.nnx import params_from_nnx
from jaxllm.loader.nnx_names import GEMMA3, LLAMA3, NameMap, _parse, jaxllm_leaves, jaxllm_lora_leaves
from jaxllm.models import dense_forward

from tests.conftest import STORIES


@pytest.fixture(scope="module")
def stories():
    cfg, params, _ = load_model(STORIES, np.float32)
    return cfg, params, json.loads((STORIES / "config.json").read_text())


class _Leaf(nnx.Module):
    def __init__(self, **arrays):
        for name, a in arrays.items():
            setattr(self, name, nnx.Param(jnp.asarray(a)))


def _llama3_like(cfg, params) -> nnx.Module:
    """tunix Llama 3's names and shapes: q/k/v ``w [E, N, H]``, o ``w [N, H, E]``, norms ``w``."""
    e, h, n, k = cfg.hidden_size, cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    lay = params["layers"]
    model = nnx.Module()
    model.embedder = _Leaf(input_embedding=params["embed"])
    model.final_norm = _Leaf(w=params["final_norm"])
    model.layers = nnx.List([nnx.Module() for _ in range(cfg.num_layers)])
    for i, layer in enumerate(model.layers):
        layer.input_layernorm = _Leaf(w=lay["attn_norm"][i])
        layer.post_attention_layernorm = _Leaf(w=lay["mlp_norm"][i])
        layer.attn = nnx.Module()
        layer.attn.q_proj = _Leaf(w=lay["wq"][i].reshape(e, n, h))
        layer.attn.k_proj = _Leaf(w=lay["wk"][i].reshape(e, k, h))
        layer.attn.v_proj = _Leaf(w=lay["wv"][i].reshape(e, k, h))
        layer.attn.o_proj = _Leaf(w=lay["wo"][i].reshape(n, h, e))
        layer.mlp = nnx.Module()
        for name, key in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            setattr(layer.mlp, name, _Leaf(kernel=lay[key][i]))
    return model


def _assert_same_tree(got, want):
    flat_got = dict(jax.tree_util.tree_flatten_with_path(got)[0])
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    assert flat_got.keys() == flat_want.keys()
    for path, leaf in flat_want.items():
        np.testing.assert_array_equal(np.asarray(flat_got[path]), np.asarray(leaf), err_msg=str(path))


def test_llama3_einsum_kernels_convert_to_the_loaders_tree_on_device(stories):
    cfg, params, hf = stories
    _, got = params_from_nnx(_llama3_like(cfg, params), hf, name_map=LLAMA3)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(got))
    _assert_same_tree(got, params)


def test_conversion_makes_no_host_transfer(stories):
    cfg, params, hf = stories
    model = _llama3_like(cfg, params)
    params_from_nnx(model, hf, name_map=LLAMA3)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        _, got = params_from_nnx(model, hf, name_map=LLAMA3)
    _assert_same_tree(got, params)


@pytest.mark.parametrize("fused", [True, False], ids=["qkv_einsum", "q_and_kv_einsum"])
def test_gemma3_fused_einsums_split_into_wq_wk_wv(fused):
    """Gemma 3's ``qkv_einsum [3, N, E, H]`` (heads == KV heads) or ``q_einsum [N, E, H]`` + ``kv_einsum
    [2, K, E, H]``, and ``attn_vec_einsum [N, H, E]``, to ``[E, N*H]`` / ``[N*H, E]``."""
    rng = np.random.default_rng(0)
    e, n, h = 6, 2, 4
    k = n if fused else 1
    q, kk, v = rng.normal(size=(n, e, h)), rng.normal(size=(k, e, h)), rng.normal(size=(k, e, h))
    o = rng.normal(size=(n, h, e))
    attn = _Leaf(qkv_einsum=np.stack([q, kk, v])) if fused else _Leaf(q_einsum=q, kv_einsum=np.stack([kk, v]))
    names = {"attn.qkv_einsum": (("wq", "wk", "wv"), "s n e h -> s e (n h)"),
             "attn.q_einsum": GEMMA3.layer["attn.q_einsum.w"], "attn.kv_einsum": GEMMA3.layer["attn.kv_einsum.w"],
             "attn.o": GEMMA3.layer["attn.attn_vec_einsum.w"]}
    model = nnx.Module()
    model.layers = nnx.List([nnx.Module()])
    model.layers[0].attn = attn
    model.layers[0].attn.o = nnx.Param(jnp.asarray(o))
    from jaxllm.loader.nnx import nnx_param_arrays
    from jaxllm.loader.nnx_names import jaxllm_leaves
    got = dict(jaxllm_leaves(nnx_param_arrays(model), NameMap(top={}, layer=names), 1))
    want = {"layers/wq": q.transpose(1, 0, 2).reshape(e, n * h), "layers/wk": kk.transpose(1, 0, 2).reshape(e, k * h),
            "layers/wv": v.transpose(1, 0, 2).reshape(e, k * h), "layers/wo": o.reshape(n * h, e)}
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_allclose(np.asarray(got[key][0]), value, rtol=0, atol=1e-6, err_msg=key)


def test_a_leaf_outside_the_map_is_named(stories):
    cfg, params, hf = stories
    model = _llama3_like(cfg, params)
    model.layers[2].attn.extra = _Leaf(w=np.zeros(3))
    with pytest.raises(ValueError, match=r"layers\.2\.attn\.extra\.w"):
        params_from_nnx(model, hf, name_map=LLAMA3)


def test_a_misshapen_einsum_kernel_is_named(stories):
    cfg, params, hf = stories
    model = _llama3_like(cfg, params)
    for layer in model.layers:
        layer.attn.q_proj.w = nnx.Param(layer.attn.q_proj.w.get_value().reshape(cfg.hidden_size, -1))
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q_proj\.w.*axes e n h"):
        params_from_nnx(model, hf, name_map=LLAMA3)


@pytest.mark.parametrize("pads", [(0, 0), (3, 0), (0, 2), (2, 3), (5, 1)], ids=lambda p: f"left{p[0]}-right{p[1]}")
def test_dense_forward_padded_rows_match_the_unpadded_row(stories, pads):
    """Any left/right padding with an attention mask: real positions' logits equal the unpadded row's."""
    cfg, params, _ = stories
    rng = np.random.default_rng(sum(pads))
    row = rng.integers(3, cfg.vocab_size, 9).astype(np.int32)
    left, right = pads
    ids = np.concatenate([np.zeros(left, np.int32), row, np.zeros(right, np.int32)])[None]
    mask = np.concatenate([np.zeros(left), np.ones(len(row)), np.zeros(right)]).astype(bool)[None]
    want = np.asarray(dense_forward(params, jnp.asarray(row[None]), cfg=cfg))[0]
    got = np.asarray(dense_forward(params, jnp.asarray(ids), cfg=cfg, attention_mask=jnp.asarray(mask)))[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[left:left + len(row)], want, rtol=0, atol=1e-5)


def test_dense_forward_under_an_explicit_mesh(stories):
    """jax.make_mesh's default axes are Explicit (JAX 0.10): rows sharded on one, jitted and eager."""
    cfg, params, _ = stories
    ids = jnp.asarray(np.random.default_rng(1).integers(3, cfg.vocab_size, (2, 7)), jnp.int32)
    want = np.asarray(dense_forward(params, ids, cfg=cfg))
    mesh = jax.make_mesh((1,), ("data",))
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
    with jax.set_mesh(mesh):
        rows = jax.device_put(ids, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
        placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        jitted = jax.jit(lambda p, i: dense_forward(p, i, cfg=cfg, attention_mask=i > 0))(placed, rows)
    np.testing.assert_allclose(np.asarray(jitted), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name_map", [LLAMA3, GEMMA3], ids=["llama3", "gemma3"])
def test_every_kernels_lora_pair_converts_to_the_same_update_of_the_engines_leaf(name_map):
    """qwix's pair of a kernel with axes ``lhs`` (A: the kernel's input axes then the rank, B: the rank then the
    rest) adds ``sum_r A B`` to the kernel; the engine's pair adds ``A @ B`` to its ``[in, out]`` leaf. For every
    kernel of the maps (einsum merges, o's two input axes, Gemma's fused qkv / kv split), the converted pair's
    product is the converted kernel update."""
    rng = np.random.default_rng(0)
    size = {"e": 6, "n": 2, "h": 3, "k": 1, "f": 5, "s": 3}
    for kernel, (keys, spec) in name_map.layer.items():
        lhs, groups = _parse(spec)
        if len(lhs) < 2:
            continue  # norms and biases: no LoRA
        fan_in = groups[1] if isinstance(keys, tuple) else groups[0]
        size["s"] = len(keys) if isinstance(keys, tuple) else 1
        a_axes, b_axes = [x for x in lhs if x in fan_in], [x for x in lhs if x not in fan_in]
        a = rng.standard_normal([size[x] for x in a_axes] + [4]).astype(np.float32)
        b = rng.standard_normal([4] + [size[x] for x in b_axes]).astype(np.float32)
        delta = np.einsum(f"{''.join(a_axes)}r,r{''.join(b_axes)}->{''.join(lhs)}", a, b)
        one = NameMap(top={}, layer={kernel: (keys, spec)})
        want = dict(jaxllm_leaves({f"layers.0.{kernel}": delta}, one, 1))
        got = dict(jaxllm_lora_leaves({f"layers.0.{kernel}_lora_a": a, f"layers.0.{kernel}_lora_b": b}, one, 1))
        assert sorted(got) == sorted(f"{p}_lora_{x}" for p in want for x in "ab"), (kernel, sorted(got))
        for path, update in want.items():
            product = np.asarray(got[path + "_lora_a"][0]) @ np.asarray(got[path + "_lora_b"][0])
            np.testing.assert_allclose(product, np.asarray(update[0]), rtol=1e-5, atol=1e-5, err_msg=kernel)


def test_a_lora_leaf_the_map_cannot_adapt_is_named():
    with pytest.raises(ValueError, match=r"'embedder\.input_embedding_lora_a' is not the LoRA pair"):
        dict(jaxllm_lora_leaves({"embedder.input_embedding_lora_a": np.zeros((8, 2))}, LLAMA3, 1))
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q_proj\.w_lora_a has no b half"):
        dict(jaxllm_lora_leaves({"layers.0.attn.q_proj.w_lora_a": np.zeros((6, 2))}, LLAMA3, 1))
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q_proj\.w_lora_b has shape \(2, 6\); .* r n h"):
        dict(jaxllm_lora_leaves({"layers.0.attn.q_proj.w_lora_a": np.zeros((6, 2)),
                                 "layers.0.attn.q_proj.w_lora_b": np.zeros((2, 6))}, LLAMA3, 1))
