"""LoRA adapters: PEFT folders made and run by ``peft`` (the reference), served in device slots.

Numerics against HF transformers + PEFT in float32 (the engine and ``dense_forward``), batch invariance across a mix
of adapters (also over int8 base weights, swap preemption and the host prefix tier), zero compilations across
loads, evictions, switches and updates, prefix-cache isolation, the max_loras admission rule, and errors.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, LoRARequest, SamplingParams
from jaxllm.config import EngineConfig
from jaxllm.loader import load_model
from jaxllm.models import dense_forward, family, forward
from jaxllm.models.common import lora_delta, lora_rows
from jaxllm.worker.lora import LoRAManager, LoRASlots
from jaxllm.worker.model_runner import with_lora
from jaxllm.worker.programs import CompileStats
from jaxllm.worker.sharding import ModelSharding, make_mesh
from jaxllm.worker.step_batch import StepBatch
from kernels_pallas.ops import get_attention_ops
from scheduler import Request, Scheduler, SchedulerConfig
from tests.helpers import counted_dispatches

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

# Each adapter: (rank, lora_alpha, use_rslora, target modules).
ADAPTERS = {
    1: (4, 8, False, ["q_proj", "v_proj", "down_proj"]),
    2: (8, 16, True, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    3: (2, 4, False, ["o_proj", "up_proj"]),
}
PROMPTS = [[1, 5, 9, 22, 13, 7, 100, 3, 44], [1, 77, 12, 200, 31], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 9, 250]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_adapter(base: Path, folder: Path, seed: int, rank: int, alpha: int, rslora: bool, targets: list[str]):
    """A PEFT LoRA adapter of ``base`` with random non-zero A and B, saved to ``folder``; returns the PEFT model."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    peft_model = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)  # PEFT starts B at zero: an adapter that changes nothing would prove nothing
    peft_model.save_pretrained(folder)
    return peft_model.eval()


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """{id: (LoRARequest, PEFT model)} for ``ADAPTERS`` over the session's tiny Llama."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for i, (rank, alpha, rslora, targets) in ADAPTERS.items():
        folder = root / f"adapter{i}"
        out[i] = (LoRARequest(f"adapter{i}", i, str(folder)),
                  make_adapter(tiny_llama_dir, folder, 100 + i, rank, alpha, rslora, targets))
    return out


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, adapters):
    """Two slots for three adapters: mixes evict and reload."""
    return LLM(model=str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2,
               block_size=4, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[8, 64],
               precompile=True)


def test_logits_equal_hf_peft_in_float32_prefill_and_decode(tiny_llama_dir, adapters):
    cfg, params, _ = load_model(tiny_llama_dir, np.float32)
    slots = LoRASlots(cfg, family(cfg).layer_keys(cfg), np.float32, max_loras=3, max_lora_rank=8,
                      sharding=ModelSharding(cfg, make_mesh()), stats=CompileStats())
    manager = LoRAManager(slots, cfg, family(cfg), max_cpu_loras=3)
    ops = get_attention_ops("reference")
    prompt, decoded = PROMPTS[0], [17, 42, 5]
    ids = prompt + decoded
    for lora_id, (request, reference) in adapters.items():
        manager.add(request)
        slot = int(manager.row_slots([lora_id], 1)[0])
        step_params = with_lora(jax.device_put(params), slots.leaves)
        shape = (cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim)
        kv = (jnp.zeros(shape), jnp.zeros(shape))
        logits, done = [], 0
        for chunk in (prompt, *([t] for t in decoded)):  # a prefill, then one decode row per token
            n = len(chunk)
            pos = np.arange(done, done + n, dtype=np.int32)
            batch = StepBatch(
                input_ids=jnp.asarray(chunk, jnp.int32), positions=jnp.asarray(pos),
                slot_mapping=jnp.asarray((1 + pos // 4) * 4 + pos % 4, jnp.int32),
                block_tables=jnp.arange(1, 8, dtype=jnp.int32)[None], seq_lens=jnp.asarray([done + n], jnp.int32),
                query_start_loc=jnp.asarray([0, n], jnp.int32), logits_indices=jnp.asarray([n - 1], jnp.int32),
                prev_token_index=jnp.full(n, -1, jnp.int32), prompt_target_ids=jnp.full(n, -1, jnp.int32),
                num_spec_tokens=jnp.zeros(1, jnp.int32), num_seqs=jnp.int32(1),
                lora_slots=jnp.asarray([slot], jnp.int32))
            out, kv = forward(step_params, kv, batch, cfg=cfg, ops=ops, all_logits=True)
            logits.append(np.asarray(out))
            done += n
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0].numpy()
            base = reference.get_base_model()
            with reference.disable_adapter():
                base_logits = base(torch.tensor([ids])).logits[0].numpy()
        got = np.concatenate(logits)
        assert np.abs(want - base_logits).max() > 0.05, "the adapter must change the logits"
        assert np.abs(got - want).max() <= 1e-4, (lora_id, np.abs(got - want).max())


def test_mixed_batch_gives_each_request_its_solo_output_with_zero_compilations(llm, adapters):
    requests = [None, adapters[1][0], adapters[2][0], adapters[3][0]]
    stats = llm.engine.runner.compile_stats
    compiled = stats.num_compilations
    solo = [llm.generate([p], GREEDY, lora_request=r, use_tqdm=False)[0].outputs[0].token_ids
            for p, r in zip(PROMPTS, requests)]
    # Every request under each adapter: four adapters (base included) over two slots switch and evict.
    with counted_dispatches(llm.engine.runner) as records:
        mixed = llm.generate(PROMPTS * 2, GREEDY, lora_request=requests + requests[::-1], use_tqdm=False)
    # The rows' LoRA slots ride in the step's one packed transfer.
    assert records and all(has_slots and puts == 1 for *_, has_slots, puts in records)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == solo
    for prompt, request, out in zip(PROMPTS, requests[::-1], mixed[4:]):
        alone = llm.generate([prompt], GREEDY, lora_request=request, use_tqdm=False)[0].outputs[0].token_ids
        assert out.outputs[0].token_ids == alone
    # The adapters change what is generated.
    assert len({tuple(llm.generate([PROMPTS[0]], GREEDY, lora_request=r, use_tqdm=False)[0].outputs[0].token_ids)
                for r in requests}) == 4
    assert stats.num_compilations == compiled
    assert [r.lora_int_id for r in llm.list_loras()] == [1, 2, 3]


def test_matches_hf_peft_greedy_tokens(llm, adapters):
    prompt = PROMPTS[2]
    for request, reference in adapters.values():
        got = llm.generate([prompt], GREEDY, lora_request=request, use_tqdm=False)[0].outputs[0].token_ids
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        assert list(got) == ids[len(prompt):]


def test_prefix_cache_blocks_are_never_shared_across_adapters_or_the_base(llm, adapters):
    sched = llm.engine.scheduler
    prompt = [1] + list(range(30, 50))  # 21 tokens: 5 full blocks of 4
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def hits(request):
        before = sched.prefix_cache_hits
        llm.generate([prompt], params, lora_request=request, use_tqdm=False)
        return sched.prefix_cache_hits - before

    assert [hits(None), hits(adapters[1][0]), hits(adapters[2][0])] == [0, 0, 0]
    assert [hits(adapters[2][0]), hits(adapters[1][0]), hits(None)] == [20, 20, 20]


def test_update_lora_replaces_an_adapter_in_place_without_compiling(llm, adapters):
    sched, stats = llm.engine.scheduler, llm.engine.runner.compile_stats
    compiled = stats.num_compilations
    request, _ = adapters[3]
    copy = LoRARequest("copy", 4, request.lora_path)  # adapter 3 under another id, rank 2
    prompt = [1] + list(range(60, 80))  # 5 full blocks of 4
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(lora):
        hits = sched.prefix_cache_hits
        tokens = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
        return tokens, sched.prefix_cache_hits - hits

    three, _ = run(request)
    assert run(copy)[0] == three
    old = llm.engine.core.lora.weights(4)
    with pytest.raises(ValueError, match=r"'layers/wq_lora_a' has shape \(2, 64, 4\)"):
        llm.update_lora("copy", {"layers": {"wq_lora_a": np.zeros((2, 64, 4))}})
    with pytest.raises(ValueError, match="'layers/lm_head_lora_a' is not a LoRA leaf"):
        llm.update_lora(4, {"layers/lm_head_lora_a": np.zeros(3)})
    with pytest.raises(ValueError, match="LoRA adapter 'nope' is not known"):
        llm.update_lora("nope", {})
    assert run(copy) == (three, 20)  # the old adapter kept, its blocks still hit
    zeros = {f"layers/{key}_lora_{ab}": np.zeros_like(arrays[i]) for key, arrays in old.tensors.items()
             for i, ab in enumerate("ab")}
    report = llm.update_lora("copy", zeros)
    assert report == {"lora_int_id": 4, "num_leaves": len(zeros), "num_preempted": 0}
    base = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert base != three
    assert run(copy) == (base, 0)  # the blocks of the old values are not read
    back = {f"layers/{key}_lora_{ab}": jnp.asarray(arrays[i]) for key, arrays in old.tensors.items()
            for i, ab in enumerate("ab")}
    llm.update_lora(4, back)
    assert run(copy) == (three, 0)
    # Device-held adapters are padded on the devices: one program, built by the first such update of a shape.
    assert stats.num_compilations == compiled + 1
    llm.update_lora(4, back)
    assert run(copy) == (three, 0) and stats.num_compilations == compiled + 1


@pytest.mark.parametrize("row_slots", [[2, -1, 0, 2], [-1, -1, -1, -1], [1, 1, 1, 1], [3, 2, 1, 0]])
def test_lora_delta_reads_only_the_slots_the_rows_use_and_gives_base_rows_exact_zeros(row_slots):
    # Rows of 3, 2, 4 and 3 tokens, then 4 padding tokens; 4 slots of rank 3 over 2 stacked layers.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    a, b = rng.standard_normal((2, 4, 8, 3)).astype(np.float32), rng.standard_normal((2, 4, 3, 5)).astype(np.float32)
    rows = lora_rows(jnp.asarray(row_slots, jnp.int32), jnp.asarray([0, 3, 5, 9, 12], jnp.int32), jnp.int32(4), 16,
                     4)
    token_slots = np.repeat(row_slots + [-1], [3, 2, 4, 3, 4])
    np.testing.assert_array_equal(rows.slots, token_slots)
    used = sorted(set(row_slots) - {-1})
    assert int(rows.count) == len(used) and list(np.asarray(rows.used)[:len(used)]) == used
    # A slot no row uses is not read: NaN there changes nothing.
    for s in set(range(4)) - set(used):
        a[:, s], b[:, s] = np.nan, np.nan
    got = np.asarray(jax.jit(lora_delta)(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), rows._replace(layer=1)))
    want = np.stack([x[t] @ a[1, s] @ b[1, s] if s >= 0 else np.zeros(5, np.float32)
                     for t, s in enumerate(token_slots)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got[token_slots < 0] == 0).all()


def test_dense_forward_with_an_adapter_equals_hf_peft_and_the_engines_prompt_logprobs(tiny_llama_dir, adapters, llm):
    """The training forward under an adapter (its ``LoRAWeights.tree``) is the engine's maths: logits equal HF +
    PEFT's and the engine's prompt logprobs under the same adapter within 1e-4 (float32), two rows at once."""
    cfg, params, _ = load_model(tiny_llama_dir, np.float32)
    rows = [PROMPTS[0], PROMPTS[2][:len(PROMPTS[0])]]
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    for lora_id, (request, reference) in adapters.items():
        llm.add_lora(request)
        weights = llm.engine.core.lora.weights(lora_id)
        got = np.asarray(dense_forward(params, jnp.asarray(rows, jnp.int32), cfg=cfg, lora=weights.tree(),
                                       lora_scale=weights.scale))
        with torch.no_grad():
            want = reference(torch.tensor(rows)).logits.numpy()
        assert np.abs(got - want).max() <= 1e-4, (lora_id, np.abs(got - want).max())
        out = llm.generate([rows[0]], with_logprobs, lora_request=request, use_tqdm=False)[0]
        engine = [entry[token].logprob for token, entry in zip(rows[0][1:], out.prompt_logprobs[1:])]
        dense = np.asarray(jax.nn.log_softmax(got[0], axis=-1))[np.arange(len(rows[0]) - 1), rows[0][1:]]
        assert np.abs(np.asarray(engine) - dense).max() <= 1e-4, lora_id
    nested = {"layers": {k.removeprefix("layers/"): v for k, v in weights.tree().items()}}
    assert np.array_equal(np.asarray(dense_forward(params, jnp.asarray(rows, jnp.int32), cfg=cfg, lora=nested,
                                                   lora_scale=weights.scale)), got)
    # The training forward differentiates through the adapter: jax.grad along a random direction of one B leaf
    # equals the central difference of the loss within 5% (float32, step 1e-3 on a loss of order 1).
    tree = {k: jnp.asarray(v) for k, v in weights.tree().items()}
    leaf = next(k for k in tree if k.endswith("_lora_b"))
    direction = jnp.asarray(np.random.default_rng(1).standard_normal(tree[leaf].shape), jnp.float32)

    def loss(b):
        logits = dense_forward(params, jnp.asarray(rows, jnp.int32), cfg=cfg, lora={**tree, leaf: b},
                               lora_scale=weights.scale)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    slope = float(jnp.vdot(jax.grad(loss)(tree[leaf]), direction))
    h = 1e-3
    numeric = float(loss(tree[leaf] + h * direction) - loss(tree[leaf] - h * direction)) / (2 * h)
    assert slope != 0.0 and abs(slope - numeric) <= 0.05 * abs(numeric), (slope, numeric)
    with pytest.raises(ValueError, match="'layers/wq_lora_a' has no 'layers/wq_lora_b'"):
        dense_forward(params, jnp.asarray(rows, jnp.int32), cfg=cfg, lora={"layers/wq_lora_a": np.zeros((2, 64, 4))})
    with pytest.raises(ValueError, match="'layers/embed_lora_a' is not the A or B"):
        dense_forward(params, jnp.asarray(rows, jnp.int32), cfg=cfg, lora={"layers/embed_lora_a": np.zeros(3)})


def test_adapter_errors_name_the_adapter_and_the_limit(llm, tiny_llama_dir, tmp_path):
    wide = tmp_path / "wide"
    make_adapter(tiny_llama_dir, wide, 7, 16, 16, False, ["q_proj"])
    with pytest.raises(ValueError, match=r"'wide': rank r=16 is above max_lora_rank=8"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("wide", 9, str(wide)), use_tqdm=False)
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("gone", 10, str(tmp_path / "no")),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id=1 already names adapter 'adapter1'"):
        llm.add_lora(LoRARequest("other", 1, str(wide)))
    with pytest.raises(ValueError, match="lora_int_id=0 must be an int >= 1"):
        LoRARequest("zero", 0, str(wide))
    assert not llm.engine.has_unfinished_requests()


def test_remove_lora_lets_running_requests_finish_under_it_and_a_later_adapter_never_reads_its_blocks(llm, adapters):
    engine, core = llm.engine, llm.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    temp = LoRARequest("temp", 5, adapters[1][0].lora_path)
    prompt = PROMPTS[2]  # 11 tokens: 2 full blocks of 4, cached under adapter 5
    want = {"temp": llm.generate([prompt], params, lora_request=temp, use_tqdm=False)[0].outputs[0].token_ids,
            "base": llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids}
    free, preemptions = core.num_free_blocks(), core.kv_cache_report(False)["num_preemptions"]
    engine.add_request("temp", prompt, params, lora_request=temp)
    engine.add_request("base", PROMPTS[0], params)
    got = {}
    for _ in range(3):
        got.update({out.request_id: out for out in engine.step()})
    assert not any(out.finished for out in got.values())
    assert llm.remove_lora(5) is True
    assert 5 not in [r.lora_int_id for r in llm.list_loras()] and llm.remove_lora(5) is False
    while engine.has_unfinished_requests():
        got.update({out.request_id: out for out in engine.step()})
    assert {rid: out.outputs[0].token_ids for rid, out in got.items()} == want
    assert core.kv_cache_report(False)["num_preemptions"] == preemptions and core.num_free_blocks() == free
    assert 5 not in core.lora.known and 5 not in core.lora.slot_ids and not core.lora.retiring
    # Id 5 again, now adapter 3: the blocks cached under the removed adapter are not hits.
    three = llm.generate([prompt], params, lora_request=adapters[3][0], use_tqdm=False)[0].outputs[0].token_ids
    again = LoRARequest("temp", 5, adapters[3][0].lora_path)
    hits = core.scheduler.prefix_cache_hits
    assert llm.generate([prompt], params, lora_request=again, use_tqdm=False)[0].outputs[0].token_ids == three
    assert core.scheduler.prefix_cache_hits == hits
    assert llm.remove_lora(5) is True



def test_removing_an_idle_adapter_keeps_a_removed_one_whose_request_still_runs(llm, adapters):
    """Regression: removing an idle adapter dropped every removed adapter, also one a running request still used
    (the next step then failed to find its weights)."""
    engine, core = llm.engine, llm.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    busy, idle = LoRARequest("busy", 6, adapters[1][0].lora_path), LoRARequest("idle", 7, adapters[2][0].lora_path)
    want = llm.generate([PROMPTS[1]], params, lora_request=busy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.add_lora(idle) is True
    free = core.num_free_blocks()
    engine.add_request("busy", PROMPTS[1], params, lora_request=busy)
    got = {}
    for _ in range(2):
        got.update({out.request_id: out for out in engine.step()})
    assert llm.remove_lora(6) is True and llm.remove_lora(7) is True
    assert 7 not in core.lora.known and 6 in core.lora.known
    while engine.has_unfinished_requests():
        got.update({out.request_id: out for out in engine.step()})
    assert got["busy"].finished and got["busy"].outputs[0].token_ids == want
    assert 6 not in core.lora.known and core.num_free_blocks() == free

# Tiny Llama: 2 layers * (K + V) * 2 heads * 16 dims * 4 bytes * 4 tokens = 1024 bytes a block; a tier of 64.
TIER_GIB = 64 * 1024 / 2**30


@pytest.fixture(scope="module")
def llm_int8_swap(tiny_llama_dir, adapters):
    """int8 base weights, and 19 usable KV blocks of 4 tokens with swap preemption and a host prefix tier: a
    batch of eight 30-token requests does not fit."""
    return LLM(model=str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, quantization="int8",
               preemption_mode="swap", num_host_blocks=16, kv_offloading_size=TIER_GIB, block_size=4,
               num_kv_blocks=20, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[8, 64], precompile=False)


def test_int8_base_weights_mixed_batch_gives_each_request_its_solo_output(llm_int8_swap, adapters):
    assert llm_int8_swap.engine.runner.weights.params["layers"]["wq"].dtype == np.int8
    requests = [None, adapters[1][0], adapters[2][0], adapters[3][0]]
    solo = [llm_int8_swap.generate([p], GREEDY, lora_request=r, use_tqdm=False)[0].outputs[0].token_ids
            for p, r in zip(PROMPTS, requests)]
    mixed = llm_int8_swap.generate(PROMPTS, GREEDY, lora_request=requests, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == solo
    under = [llm_int8_swap.generate([PROMPTS[0]], GREEDY, lora_request=r, use_tqdm=False)[0].outputs[0].token_ids
             for r in requests]
    assert len({tuple(t) for t in under}) == 4, "each adapter changes the quantized model's output"


def test_swap_preemption_and_the_host_tier_keep_each_request_its_solo_output(llm_int8_swap, adapters):
    sched = llm_int8_swap.engine.core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True)
    # Every prompt under the base model and two adapters, the same prompt under each (their blocks must not mix).
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3], PROMPTS[1]]
    requests = [None, adapters[1][0], adapters[1][0], None, adapters[2][0], adapters[2][0], adapters[1][0], None]
    solo = [llm_int8_swap.generate([p], params, lora_request=r, use_tqdm=False)[0].outputs[0].token_ids
            for p, r in zip(prompts, requests)]
    assert len({tuple(t) for p, t in zip(prompts, solo) if p == PROMPTS[2]}) == 3
    preempted, host_hits = sched.num_preemptions, sched.prefix_cache_hits_host
    mixed = llm_int8_swap.generate(prompts, params, lora_request=requests, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == solo
    assert sched.num_preemptions > preempted
    # Again: the device lost most prefixes to the batch, so some come back from the host tier.
    again = llm_int8_swap.generate(prompts, params, lora_request=requests, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == solo
    assert sched.prefix_cache_hits_host > host_hits


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(batching="static"), "enable_lora=True cannot be used with batching='static'"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras=2 must be an int >= max_loras=4"),
    (dict(max_lora_rank=0), "max_lora_rank=0 must be an int >= 1"),
])
def test_config_refuses_what_lora_does_not_run_with(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(enable_lora=True, **kwargs)


def _run(sched: Scheduler, steps: int) -> list[set[int]]:
    """Schedule ``steps`` steps, each row a one-token decode; returns the adapters of each step's rows."""
    seen = []
    for _ in range(steps):
        out = sched.schedule()
        seen.append({row.request.lora_int_id for row in out.scheduled} - {0})
        sched.update_from_output(out, np.zeros(len(out.scheduled), np.int32))
    return seen


def test_scheduler_admits_at_most_max_loras_adapters_and_starves_none():
    sched = Scheduler(SchedulerConfig(num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                      max_loras=2))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    # Adapter 3 arrives second; a stream of adapter 1 and 2 requests keeps coming behind it.
    sched.add_request(Request("a", [1, 2], params, lora_int_id=1))
    sched.add_request(Request("b", [1, 2], params, lora_int_id=2))
    sched.add_request(Request("c", [1, 2], params, lora_int_id=3))
    sched.add_request(Request("base", [1, 2], params))
    seen = _run(sched, 1)
    assert seen == [{1, 2}] and {r.request_id for r in sched.running} == {"a", "b", "base"}
    for i in range(6):
        sched.add_request(Request(f"more{i}", [1, 2], params, lora_int_id=1 + i % 2))
        seen += _run(sched, 1)
        if any(3 in s for s in seen):
            break
    assert all(len(s) <= 2 for s in seen)
    assert any(3 in s for s in seen), "the adapter-3 request must get its turn"
