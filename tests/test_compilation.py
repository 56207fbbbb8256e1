"""Compilation discipline: after warm-up, serving never compiles."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from jax import monitoring

from jaxllm import SamplingParams, StructuredOutputsParams
from jaxllm.frontend.llm_engine import LLMEngine

_EVENTS: list[str] = []
_WATCHED = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits")


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event in _WATCHED:
        _EVENTS.append(event)


def _on_event(event: str, **kwargs) -> None:
    if event in _WATCHED:
        _EVENTS.append(event)


monitoring.register_event_duration_secs_listener(_on_duration)
monitoring.register_event_listener(_on_event)

MAX_MODEL_LEN = 96


def _random_params(rng) -> SamplingParams:
    kind = rng.integers(4)
    max_tokens = int(rng.integers(1, 24))
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return SamplingParams(
        temperature=float(rng.uniform(0.3, 1.5)), top_p=float(rng.choice([1.0, 0.9, 0.5])),
        top_k=int(rng.choice([0, 1, 5, 50])), min_p=float(rng.choice([0.0, 0.05])), max_tokens=max_tokens,
        seed=int(rng.integers(1 << 30)) if kind == 2 else None,
    )


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    pytest.importorskip("torch")
    from tests.hf_models import make_tiny_hf_model

    folder = tmp_path_factory.mktemp("tiny_qwen3_moe")
    make_tiny_hf_model("qwen3_moe", folder, seed=3)
    return folder


# Structured-output requests mixed into the waves: (wave, constraint, n, temperature).
STRUCTURED = [
    (1, StructuredOutputsParams(choice=["yes", "no", "maybe"]), 1, 0.0),
    (2, StructuredOutputsParams(regex=r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."), 2, 1.0),
    (4, StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}},
                                      "required": ["n"], "additionalProperties": False},
                                disable_any_whitespace=True), 1, 1.0),
]
# The swap case runs quantized: int8 weights and a float8 KV cache (held as uint8 bits on CPU, with
# calibrated scales), swapped out and in (block copies do not depend on the cache dtype; one case for
# both keeps the suite's time).
QUANTIZED = dict(quantization="int8", kv_cache_dtype="fp8_e4m3")


# The tiny MoE (no tokenizer, so no structured requests) routes every step's tokens to other
# experts (random prompts, random samples): the dispatch has fixed shapes, so routing never compiles.
@pytest.mark.parametrize("model, preemption_mode, quant", [
    ("stories_dir", "recompute", {}), ("stories_dir", "swap", QUANTIZED), ("tiny_moe_dir", "recompute", {})],
    ids=["stories-recompute", "stories-swap-int8-fp8kv", "moe-recompute"])
def test_mixed_workload_after_warmup_triggers_zero_compilations(request, model, preemption_mode, quant):
    structured_requests = STRUCTURED if model == "stories_dir" else []
    engine = LLMEngine(
        request.getfixturevalue(model), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN, block_size=8,
        num_kv_blocks=24, preemption_mode=preemption_mode, num_host_blocks=64, compilation_cache=None,
        precompile=True, **quant,
    )
    compiled_at_warmup = engine.runner.compile_stats.num_compilations
    # Besides the steps: block copy, slot fill and slot rows (and swap out/in).
    assert compiled_at_warmup == len(engine.buckets) + (5 if preemption_mode == "swap" else 3)
    events_at_warmup = len(_EVENTS)

    rng = np.random.default_rng(0)
    shared = rng.integers(3, 256, size=40).tolist()
    next_id, aborted, outputs = 0, 0, []
    for wave in range(6):
        for _ in range(int(rng.integers(1, 9))):
            n = int(rng.integers(1, MAX_MODEL_LEN - 24))
            prompt = (shared[: int(rng.integers(8, 40))] + rng.integers(3, 256, size=n).tolist())[:n] \
                if rng.random() < 0.5 else rng.integers(3, 256, size=n).tolist()
            engine.add_request(f"r{next_id}", prompt, _random_params(rng))
            next_id += 1
        for at, constraint, n, temperature in structured_requests:
            if wave == at:
                engine.add_request(f"structured{at}", rng.integers(3, 256, size=20).tolist(), SamplingParams(
                    n=n, temperature=temperature, seed=at, max_tokens=32, structured_outputs=constraint))
        if wave == 2:
            # Prompt logprobs over a chunked prefill of a prompt sharing a prefix with others.
            engine.add_request("prompt-logprobs", shared + rng.integers(3, 256, size=40).tolist(),
                               SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=5))
        for _ in range(int(rng.integers(2, 8))):
            outputs += engine.step()
        running = [r.request_id for r in engine.scheduler.running]
        if running and wave % 2:
            engine.abort_request(running[0])
            aborted += 1
    engine.add_request("full-length", rng.integers(3, 256, size=MAX_MODEL_LEN - 1).tolist(),
                       SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        outputs += engine.step()

    assert [len(o.prompt_logprobs) for o in outputs if o.request_id == "prompt-logprobs" and o.finished] == [80]
    # Decoded alone: the detokenizer joins an output to the tail of its random prompt.
    if structured_requests:
        structured = {o.request_id: [engine.tokenizer.decode(c.token_ids) for c in o.outputs if c.finish_reason == "stop"]
                      for o in outputs if o.request_id.startswith("structured") and o.finished}
        assert structured["structured1"][0] in ("yes", "no", "maybe")
        assert len(structured["structured2"]) == 2
        assert all(re.fullmatch(STRUCTURED[1][1].regex, text) for text in structured["structured2"])
        assert json.loads(structured["structured4"][0])["n"] in range(10)
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert aborted > 0
    assert engine.runner.compile_stats.num_compilations == compiled_at_warmup
    assert _EVENTS[events_at_warmup:] == []
    assert stats.num_free_blocks == engine.num_blocks - 1


def test_moe_layer_compiles_once_whatever_the_routing():
    # Routings from spread out to every token on one expert, and fewer real tokens: one program.
    import jax
    import jax.numpy as jnp

    from jaxllm.models import moe
    from jaxllm.models.config import ModelConfig

    cfg = ModelConfig.from_hf_config(dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8))
    rng = np.random.default_rng(0)
    layer = {"router": rng.standard_normal((16, 4)), "experts_gate": rng.standard_normal((4, 16, 8)),
             "experts_up": rng.standard_normal((4, 16, 8)), "experts_down": rng.standard_normal((4, 8, 16))}
    layer = {k: jnp.asarray(v, jnp.float32) for k, v in layer.items()}
    run = jax.jit(moe.moe_mlp, static_argnames="cfg")
    h = rng.standard_normal((32, 16)).astype(np.float32)
    one_expert = np.tile(np.asarray(layer["router"])[:, 0] * 10, (32, 1))  # every token's top choice: expert 0
    routings = set()
    for x, num_tokens in [(h, 32), (-h, 32), (h[::-1].copy(), 7), (one_expert, 32)]:
        x, n = jnp.asarray(x), jnp.int32(num_tokens)
        run(layer, x, cfg=cfg, num_tokens=n).block_until_ready()
        experts = np.asarray(moe.route(x, layer["router"], cfg)[1])[:num_tokens]
        routings.add(tuple(np.bincount(experts.ravel(), minlength=4)))
    assert len(routings) == 4
    # One program for every routing. Counted on this function's own cache, not on JAX's global compile events,
    # which other threads (an earlier engine's background warm-up in this process) may also fire.
    assert run._cache_size() == 1


@pytest.mark.parametrize("num_kv_blocks", [29, 31])
def test_sleep_and_wake_up_compile_nothing_not_even_the_zeroed_kv_cache(stories_dir, num_kv_blocks):
    """wake_up's zeroed KV cache is filled by a program built with the cache, whatever the pool's shape (block
    counts no other test uses, so no earlier test has compiled a fill of that shape)."""
    engine = LLMEngine(stories_dir, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                       num_kv_blocks=num_kv_blocks, precompile=False, enable_sleep_mode=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def tokens():
        engine.add_request("r", [3, 9, 27, 81, 243], params)
        while engine.has_unfinished_requests():
            outs = engine.step()
        return outs[0].outputs[0].token_ids

    before = tokens()
    events = len(_EVENTS)
    engine.sleep(level=1)
    engine.wake_up()
    engine.sleep(level=1)
    engine.wake_up(tags=["weights"])
    engine.wake_up(tags=["kv_cache"])
    assert tokens() == before
    assert _EVENTS[events:] == []
