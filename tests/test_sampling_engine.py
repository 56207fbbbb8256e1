"""Sampling through the engine: logprobs vs HF, seeded reproducibility, n > 1, stop strings, streaming."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.frontend.llm_engine import LLMEngine
from scheduler import RequestStatus

SEEDED = SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.5,
                        frequency_penalty=0.3, max_tokens=24, seed=11, ignore_eos=True)


def _prompts(n, seed=0, low=4, high=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=int(k)).tolist() for k in rng.integers(low, high, size=n)]


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, max_num_seqs=16, max_num_batched_tokens=64, block_size=4, precompile=False,
               num_kv_blocks=256)


def test_logprobs_equal_log_softmax_of_hf_logits(tiny_llama_dir, tiny_llm):
    import torch
    import transformers

    prompt = _prompts(1, seed=4)[0]
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=6, logprobs=5, ignore_eos=True,
                            repetition_penalty=1.5)
    out = tiny_llm.generate([prompt], params)[0].outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].double()
    hf = torch.log_softmax(logits, dim=-1).numpy()[len(prompt) - 1: -1]
    assert len(out.logprobs) == len(out.token_ids) == 6
    for row, entry, token in zip(hf, out.logprobs, out.token_ids):
        top5 = np.argsort(-row)[:5]
        assert set(entry) == set(top5.tolist()) | {token}
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t]) < 1e-4
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)),
                                                   abs=1e-4)


def test_a_step_reads_back_sampled_logprobs_only_when_a_row_asked_for_them(tiny_llm, monkeypatch):
    """Steps without a logprobs row fetch their tokens alone; in a batch where one request asks, that request
    gets an entry per token (equal to its logprobs run alone) and its neighbour none."""
    from jaxllm.worker.model_runner import StepOutput

    fetched = []
    fetch = StepOutput.fetch_rows

    def spy(self, num_rows, num_token_rows=0, logprobs=True):
        host = fetch(self, num_rows, num_token_rows, logprobs)
        fetched.append((logprobs, host.sampled.top_ids is not None))
        return host

    monkeypatch.setattr(StepOutput, "fetch_rows", spy)
    plain, asking = _prompts(2, seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    tiny_llm.generate([plain], greedy, use_tqdm=False)
    assert fetched and all(flags == (False, False) for flags in fetched)
    fetched.clear()
    alone = tiny_llm.generate([asking], with_logprobs, use_tqdm=False)[0].outputs[0]
    both = tiny_llm.generate([plain, asking], [greedy, with_logprobs], use_tqdm=False)
    assert fetched and all(flags == (True, True) for flags in fetched)
    assert both[0].outputs[0].logprobs is None
    assert both[1].outputs[0].token_ids == alone.token_ids and len(alone.logprobs) == 5
    for got, want in zip(both[1].outputs[0].logprobs, alone.logprobs):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-5 for t in got)


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_batch_of_16(tiny_llm):
    target = _prompts(1, seed=7)[0]
    alone = tiny_llm.generate([target], SEEDED)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=int(n), seed=int(n)) for n in range(5, 20)]
    batch = tiny_llm.generate(_prompts(15, seed=8) + [target], others + [SEEDED])
    assert batch[-1].outputs[0].token_ids == alone


def test_seeded_request_gives_the_same_tokens_after_preemption(tiny_llama_dir, tiny_llm):
    target = _prompts(1, seed=7)[0]
    alone = tiny_llm.generate([target], SEEDED)[0].outputs[0].token_ids
    engine = LLMEngine(tiny_llama_dir, max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=24,
                       precompile=False, enable_prefix_caching=False)
    for i, prompt in enumerate(_prompts(5, seed=9, low=20, high=30)):
        engine.add_request(f"other{i}", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.add_request("target", target, SEEDED)
    request = engine.scheduler.get_request("target")
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == "target" and o.finished), final)
    assert request.num_preemptions > 0
    assert final.outputs[0].token_ids == alone


def test_seeded_request_gives_the_same_tokens_with_prefix_cache_hits(tiny_llm):
    target = _prompts(1, seed=7, low=25, high=30)[0]
    first = tiny_llm.generate([target], SEEDED)[0].outputs[0].token_ids
    hits = tiny_llm.engine.scheduler.prefix_cache_hits
    second = tiny_llm.generate([target], SEEDED)[0].outputs[0].token_ids
    assert tiny_llm.engine.scheduler.prefix_cache_hits > hits
    assert second == first


def test_n_4_shares_the_prompt_blocks_and_returns_4_different_outputs(tiny_llama_dir):
    # Synchronous steps: the fork is visible right after the first one.
    engine = LLMEngine(tiny_llama_dir, max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=64,
                       precompile=False, async_scheduling=False)
    prompt = list(range(10, 20))
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    engine.add_request("x", prompt, params)
    pool = engine.scheduler.block_pool
    engine.step()  # the parent prefills 9 tokens (two full blocks, one partial), then forks
    tables = [engine.scheduler.kv_cache_manager.get_block_ids(f"{i}_x") for i in range(4)]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert [pool.blocks[b].ref_cnt for b in tables[0][:2]] == [4, 4]
    assert len({t[2] for t in tables}) == 4
    assert pool.num_blocks - 1 - pool.num_free_blocks == 2 + 4
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    outs = final.outputs
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) == 4
    assert pool.num_free_blocks == pool.num_blocks - 1
    for i, o in enumerate(outs):
        single = SamplingParams(temperature=1.0, seed=5 + i, max_tokens=8, ignore_eos=True)
        engine.add_request(f"single{i}", prompt, single)
        done = None
        while engine.has_unfinished_requests():
            done = next((x for x in engine.step() if x.finished), done)
        assert done.outputs[0].token_ids == o.token_ids


@pytest.fixture(scope="module")
def stories_llm(stories_dir):
    """One stories260K engine with the default configuration for the text tests below."""
    return LLM(model=stories_dir, precompile=False)


def test_stop_string_split_across_two_tokens_stops_and_is_cut(stories_llm):
    llm = stories_llm
    greedy = SamplingParams(temperature=0, max_tokens=40)
    full = llm.generate("Once upon a time", greedy)[0].outputs[0]
    pieces = [llm.tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    k = next(i for i in range(5, len(pieces) - 1)
             if len(pieces[i]) - len(pieces[i - 1]) >= 3 and len(pieces[i + 1]) - len(pieces[i]) >= 3)
    # The last two characters of token k and the first two of token k + 1.
    stop = pieces[k][-2:] + pieces[k + 1][len(pieces[k]): len(pieces[k]) + 2]
    where = full.text.find(stop)
    assert where > 0
    for keep in (False, True):
        out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                                              include_stop_str_in_output=keep))[0].outputs[0]
        assert out.text == full.text[: where + (len(stop) if keep else 0)]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert len(out.token_ids) <= k + 2


def test_multi_byte_character_split_across_tokens_streams_whole(stories_llm):
    llm = stories_llm
    ids = [llm.tokenizer.backend.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    # Force the three bytes in order: each is biased below the previous one,
    # and the repetition penalty pushes an emitted byte below the next.
    params = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=ids, repetition_penalty=1000.0,
                            logit_bias={ids[0]: 300.0, ids[1]: 200.0, ids[2]: 100.0})
    steps = list(llm.generate_stream("Once upon a time", params))
    assert [o.delta_token_ids for o in steps] == [[ids[0]], [ids[1]], [ids[2]]]
    assert [o.delta_text for o in steps] == ["", "", "€"]
    assert steps[-1].finished and steps[-1].outputs[0].text == "€"


def test_bad_words_are_never_generated(stories_llm):
    llm = stories_llm
    greedy = SamplingParams(temperature=0, max_tokens=40)
    assert "Lily" in llm.generate("Once upon a time", greedy)[0].outputs[0].text
    banned = SamplingParams(temperature=0, max_tokens=40, bad_words=["Lily", "big red"])
    assert "Lily" not in llm.generate("Once upon a time", banned)[0].outputs[0].text


def test_streamed_deltas_add_up_to_the_final_text(stories_llm):
    llm = stories_llm
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=30)
    stream = list(llm.generate_stream(["Once upon a time", "One day"], params))
    final = {o.request_id: o for o in stream if o.finished}
    for rid, out in final.items():
        deltas = [o for o in stream if o.request_id == rid]
        assert "".join(o.delta_text for o in deltas) == out.outputs[0].text
        assert sum((o.delta_token_ids for o in deltas), []) == out.outputs[0].token_ids


@pytest.fixture(scope="module")
def hf_log_softmax(tiny_llama_dir):
    """prompt -> float64 [len, V] log_softmax of HF's float32 logits at each position."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def run(prompt):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1).numpy()
    return run


def assert_prompt_logprobs_match_hf(entries, prompt, k, hf):
    """vLLM's layout: None, then per position the prompt token's logprob plus the top k."""
    assert len(entries) == len(prompt) and entries[0] is None
    for pos in range(1, len(prompt)):
        row = hf[pos - 1]
        assert set(entries[pos]) == set(np.argsort(-row)[:k].tolist()) | {prompt[pos]}
        assert next(iter(entries[pos])) == prompt[pos]
        for token, logprob in entries[pos].items():
            assert abs(logprob.logprob - row[token]) < 1e-4


def test_prompt_logprobs_of_a_prompt_longer_than_the_token_budget_equal_log_softmax_of_hf_logits(
        tiny_llm, hf_log_softmax):
    prompt = _prompts(1, seed=12, low=150, high=151)[0]  # 3 chunks of max_num_batched_tokens=64
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5))[0]
    assert_prompt_logprobs_match_hf(out.prompt_logprobs, prompt, 5, hf_log_softmax(prompt))
    plain = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_prompt_logprobs_compute_a_prompt_the_prefix_cache_holds(tiny_llm, hf_log_softmax):
    prompt = _prompts(1, seed=13, low=40, high=41)[0]
    tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    scheduler = tiny_llm.engine.scheduler
    hits = scheduler.prefix_cache_hits
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert scheduler.prefix_cache_hits == hits
    assert_prompt_logprobs_match_hf(out.prompt_logprobs, prompt, 0, hf_log_softmax(prompt))
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_are_recorded_once_when_preemption_recomputes_the_prompt(tiny_llama_dir, hf_log_softmax,
                                                                                  async_scheduling):
    engine = LLMEngine(tiny_llama_dir, max_num_seqs=8, max_num_batched_tokens=16, block_size=4, num_kv_blocks=24,
                       precompile=False, async_scheduling=async_scheduling)
    for i, prompt in enumerate(_prompts(4, seed=14, low=12, high=13)):
        engine.add_request(f"other{i}", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    target = _prompts(1, seed=15, low=60, high=61)[0]
    engine.add_request("target", target, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    request = engine.scheduler.get_request("target")
    recorded_at_preemption, final = [], None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if request.status == RequestStatus.PREEMPTED:
            recorded_at_preemption.append(engine.core.requests["target"].prompt_logprobs.num_recorded)
        final = next((o for o in outs if o.request_id == "target" and o.finished), final)
    assert 1 < min(recorded_at_preemption) < len(target)  # preempted part-way through its prompt
    assert_prompt_logprobs_match_hf(final.prompt_logprobs, target, 3, hf_log_softmax(target))


def test_n_2_returns_prompt_logprobs_computed_by_the_prefill_parent(tiny_llm, hf_log_softmax):
    prompt = _prompts(1, seed=16, low=30, high=31)[0]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, prompt_logprobs=2)
    out = tiny_llm.generate([prompt], params)[0]
    assert len(out.outputs) == 2
    assert_prompt_logprobs_match_hf(out.prompt_logprobs, prompt, 2, hf_log_softmax(prompt))


def test_prompt_logprobs_above_20_are_rejected(tiny_llm):
    with pytest.raises(ValueError, match="prompt_logprobs=21"):
        tiny_llm.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=21))


def test_issue25_item6_seeds_beyond_32_bits_give_their_own_tokens_in_any_batch(stories_dir):
    # The report (stories260K, T=1): 5 and 5 + 2**32, 7 and 7 - 2**32, 0 and 2**40 gave the same tokens; with
    # int64's edges every seed has its own stream, and a seeded request's tokens do not depend on its neighbours.
    llm = LLM(model=stories_dir, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, precompile=False)
    pairs = [(5, 5 + 2**32), (7, 7 - 2**32), (0, 2**40)]
    seeds = [s for pair in pairs for s in pair] + [2**63 - 1, -(2**63)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True) for s in seeds]
    batch = llm.generate(["Once upon a time"] * len(seeds), params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in batch]
    assert len({tuple(t) for t in tokens}) == len(seeds)
    for p, together in zip(params, tokens):
        assert llm.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].token_ids == together
