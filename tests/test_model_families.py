"""The families beyond Llama (issue 18) end to end, the layer scan's grouping
and the MoE dispatch. Logit parity per family is tests/test_model_parity.py."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.models import moe
from jaxllm.models.common import layer_plan
from jaxllm.models.config import ModelConfig
from tests.helpers import assert_same_or_near_tie

torch = pytest.importorskip("torch")

NEW_TOKENS = 8


def _config(architecture: str, **extra) -> ModelConfig:
    return ModelConfig.from_hf_config(dict(
        architectures=[architecture], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=extra.pop("num_hidden_layers", 2), num_attention_heads=4, num_key_value_heads=2, **extra))


@pytest.mark.parametrize("layers, period, repeats, rest", [
    # Gemma 3 270M: 3 x (5 local, 1 global): two scan bodies, not six.
    (18, [(0, 5, 512), (5, 6, None)], 3, []),
    # Gemma 3 1B: 4 periods, then two local layers.
    (26, [(0, 5, 512), (5, 6, None)], 4, [(24, 26, 512)]),
    # Fewer layers than two periods: one scan per run.
    (8, [], 0, [(0, 5, 512), (5, 6, None), (6, 8, 512)]),
])
def test_gemma3_layer_pattern_scans_one_body_per_layer_kind(layers, period, repeats, rest):
    cfg = _config("Gemma3ForCausalLM", num_hidden_layers=layers, sliding_window=512)
    assert layer_plan(cfg) == (period, repeats, rest)


@pytest.mark.parametrize("architecture, extra", [("LlamaForCausalLM", {}),
                                                 ("MistralForCausalLM", dict(sliding_window=8))])
def test_one_kind_of_layer_is_one_scan(architecture, extra):
    assert layer_plan(_config(architecture, num_hidden_layers=6, **extra))[1:] == (0, [(0, 6, extra.get(
        "sliding_window"))])


def _dense_moe(layer, h, cfg, num_tokens):
    """Every expert on every token, weighted by the routing (zero for unchosen experts): the reference."""
    weights, experts = (np.asarray(a) for a in moe.route(jnp.asarray(h), jnp.asarray(layer["router"]), cfg))
    out = np.zeros_like(h)
    for e in range(cfg.num_experts):
        gate, up = h @ layer["experts_gate"][e], h @ layer["experts_up"][e]
        y = (gate / (1 + np.exp(-gate)) * up) @ layer["experts_down"][e]
        out += (weights * (experts == e)).sum(-1, keepdims=True) * y
    out[num_tokens:] = 0
    return out


# (tokens, experts, top-k, real tokens): decode-sized, padding rows, several chunks per expert.
@pytest.mark.parametrize("t, num_experts, k, num_tokens", [(5, 4, 2, 5), (64, 8, 3, 40), (512, 2, 1, 300)])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_sort_dispatch_equals_every_expert_on_every_token(t, num_experts, k, num_tokens, norm_topk_prob):
    cfg = dataclasses.replace(_config("MixtralForCausalLM"), num_experts=num_experts, num_experts_per_tok=k,
                              moe_intermediate_size=24, norm_topk_prob=norm_topk_prob)
    rng = np.random.default_rng(t)
    e, f = 16, 24
    layer = {"router": rng.standard_normal((e, num_experts)).astype(np.float32),
             "experts_gate": rng.standard_normal((num_experts, e, f)).astype(np.float32) / 4,
             "experts_up": rng.standard_normal((num_experts, e, f)).astype(np.float32) / 4,
             "experts_down": rng.standard_normal((num_experts, f, e)).astype(np.float32) / 4}
    h = rng.standard_normal((t, e)).astype(np.float32)
    got = np.asarray(moe.moe_mlp({k_: jnp.asarray(v) for k_, v in layer.items()}, jnp.asarray(h), cfg,
                                 jnp.int32(num_tokens)))
    np.testing.assert_allclose(got, _dense_moe(layer, h, cfg, num_tokens), atol=2e-5, rtol=1e-5)
    assert len(np.unique(np.asarray(moe.route(jnp.asarray(h), jnp.asarray(layer["router"]), cfg)[1]))) == \
        num_experts


def _hf_greedy(model, prompt):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# The engine's view of each new kind of step: Gemma 3's scan of local and global layers, the
# experts (padding rows, chunks). Phi-3 runs the Llama layer and Mixtral the same experts (their
# logits are tests/test_model_parity.py's).
@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe"])
def test_engine_greedy_tokens_equal_hf_for_a_batch(arch, tmp_path):
    from tests.hf_models import make_tiny_hf_model

    hf = make_tiny_hf_model(arch, tmp_path)
    # A token budget smaller than the prompts: chunked prefills batched with decode rows, and padded rows.
    llm = LLM(model=tmp_path, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
              num_kv_blocks=96, token_buckets=(8, 32), precompile=False)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 256, size=int(n)).tolist() for n in (3, 21, 9, 30, 14)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_same_or_near_tie(llm, prompt, _hf_greedy(hf, prompt), out.outputs[0].token_ids)


@pytest.mark.parametrize("extra, match", [
    (dict(mlp_only_layers=[1]), r"layers \[1\] are dense"),
    (dict(decoder_sparse_step=2), r"layers \[0\] are dense"),
])
def test_qwen3_moe_with_dense_layers_is_rejected(extra, match):
    with pytest.raises(ValueError, match=match):
        _config("Qwen3MoeForCausalLM", num_experts=4, **extra)


def test_unsupported_activation_is_named():
    with pytest.raises(ValueError, match="gelu_new"):
        _config("LlamaForCausalLM", hidden_act="gelu_new")


def _cache_copies_in_loops(hlo: str, cache_elements: int) -> int:
    """Copy instructions of ``cache_elements`` elements inside while loops (the layer scan and
    what it calls) of optimized HLO text: each runs once per layer."""
    import re

    comps = {}
    for block in hlo.split("\n\n"):
        header = re.match(r"(?:ENTRY )?%([\w.\-]+) ", block.strip())
        if header:
            comps[header[1]] = block
    callees = {name: re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", text)
               + re.findall(r"%([\w.\-]+)", " ".join(re.findall(r"branch_computations=\{([^}]*)\}", text)))
               for name, text in comps.items()}
    todo = [body for text in comps.values() for body in re.findall(r"body=%([\w.\-]+)", text)]
    seen = set()
    while todo:
        name = todo.pop()
        if name not in seen and name in comps:
            seen.add(name)
            todo += callees[name]
    sizes = [np.prod([int(d) for d in dims.split(",")]) for name in seen
             for dims in re.findall(r"= \w+\[([\d,]+)\]\{[^}]*\} copy\(", comps[name])]
    return sum(size == cache_elements for size in sizes)


# One KV head (Gemma 3 270M, many small models) gave the cache a unit axis that XLA's CPU layout
# assignment moved, copying the whole cache on every layer of every step (1000x slower steps).
@pytest.mark.parametrize("backend", ["xla", "reference"])
def test_layer_scan_does_not_copy_a_one_kv_head_cache_per_layer(tmp_path, backend):
    import jax

    from jaxllm.loader import load_model
    from jaxllm.models import forward
    from jaxllm.worker.step_batch import StepBatch
    from kernels_pallas.ops import get_attention_ops
    from tests.hf_models import make_tiny_hf_model

    make_tiny_hf_model("llama", tmp_path, num_hidden_layers=4, num_key_value_heads=1)
    cfg, params, _ = load_model(tmp_path, np.float32)
    cache = jax.ShapeDtypeStruct((cfg.num_layers, 64, 4, 1, cfg.head_dim), jnp.float32)
    batch = StepBatch(input_ids=jnp.arange(3, 8), positions=jnp.arange(5), slot_mapping=jnp.arange(4, 9),
                      block_tables=jnp.arange(1, 9)[None], seq_lens=jnp.asarray([5]),
                      query_start_loc=jnp.asarray([0, 5]), logits_indices=jnp.asarray([4]),
                      prev_token_index=jnp.full(5, -1), prompt_target_ids=jnp.full(5, -1),
                      num_spec_tokens=jnp.zeros(1, jnp.int32), num_seqs=jnp.int32(1))
    step = jax.jit(forward, static_argnames=("cfg", "ops", "all_logits"), donate_argnums=(1,))
    hlo = step.lower(params, (cache, cache), batch, cfg=cfg, ops=get_attention_ops(backend)).compile().as_text()
    # (XLA still copies K and V once per step, on the way out: a layout change of the unit axis
    # that moves no byte in memory.)
    assert "while" in hlo and _cache_copies_in_loops(hlo, np.prod(cache.shape)) == 0

