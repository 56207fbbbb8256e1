"""Beam search (vLLM's ``LLM.beam_search``): the beams HF transformers' beam search keeps, in its order and with its
scores, on a tiny float32 llama; eos completes a beam; width 1 is greedy; bad parameters are refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxllm import LLM, BeamSearchParams, SamplingParams
from jaxllm.beam_search import BeamSearchSequence, beam_score

PROMPTS = [[1, 17, 33, 90, 5], [1, 200, 3]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, max_model_len=64, max_num_seqs=16, max_num_batched_tokens=64, precompile=False)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # the beams run their full length, as ignore_eos does
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("beam_width, max_tokens", [(2, 6), (4, 8)])
def test_the_beams_are_hfs_in_its_order_with_its_scores(llm, hf_model, beam_width, max_tokens):
    import torch

    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        hf = hf_model.generate(torch.tensor([prompt]), num_beams=beam_width, num_return_sequences=beam_width,
                               max_new_tokens=max_tokens, do_sample=False, length_penalty=1.0,
                               return_dict_in_generate=True, output_scores=True)
        assert [s.tokens for s in out.sequences] == hf.sequences.tolist()
        # HF's sequence score is the length-normalized cumulative logprob (float32 logits: within 1e-4).
        np.testing.assert_allclose([beam_score(s, 1.0) for s in out.sequences], hf.sequences_scores.numpy(),
                                   atol=1e-4)
        assert all(len(s.logprobs) == max_tokens and s.finish_reason == "length" for s in out.sequences)


def test_width_one_is_greedy_and_eos_completes_a_beam(llm):
    [greedy] = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                         logprobs=0), use_tqdm=False)
    [one] = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))
    assert one.sequences[0].tokens == PROMPTS[0] + greedy.outputs[0].token_ids
    np.testing.assert_allclose(one.sequences[0].cum_logprob, greedy.outputs[0].cumulative_logprob, atol=1e-4)
    # Without ignore_eos a candidate ending in the model's eos (2) is complete at once and kept if it ranks.
    wide = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=8, max_tokens=12))
    assert any(s.finish_reason == "stop" for out in wide for s in out.sequences)  # the second prompt's has one
    for out in wide:
        for s in out.sequences:
            assert (s.finish_reason == "stop") == (s.tokens[-1] == 2)
            assert 2 not in s.tokens[len(s.tokens) - len(s.logprobs):-1]  # no beam goes on past an eos
        scores = [beam_score(s, 1.0) for s in out.sequences]
        assert scores == sorted(scores, reverse=True) and len(out.sequences) == 8


def test_length_penalty_ranks_as_transformers_does():
    short = BeamSearchSequence([1, 2], [{}], cum_logprob=-1.0)
    long = BeamSearchSequence([1, 2, 3, 4], [{}] * 3, cum_logprob=-2.4)
    assert beam_score(short, 1.0) < beam_score(long, 1.0)  # -1.0 against -0.8
    assert beam_score(short, 0.0) > beam_score(long, 0.0)  # the sums alone


@pytest.mark.parametrize("kwargs, match", [
    (dict(beam_width=0, max_tokens=4), r"beam_width=0 must be an int in \[1, 10\]"),
    (dict(beam_width=11, max_tokens=4), r"beam_width=11 must be an int in \[1, 10\]"),
    (dict(beam_width=2, max_tokens=0), "max_tokens=0 must be an int >= 1"),
    (dict(beam_width=2, max_tokens=4, allowed_token_ids=[3]), "allowed_token_ids is not supported"),
])
def test_bad_parameters_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_a_width_past_max_logprobs_is_refused_before_anything_runs(tiny_llama_dir):
    narrow = LLM(tiny_llama_dir, max_model_len=64, max_logprobs=4, precompile=False)
    with pytest.raises(ValueError, match=r"beam_width=3 reads the top 6 logprobs a step, more than max_logprobs=4"):
        narrow.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=4))
    assert narrow.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=2))[0].sequences


def test_the_servers_beam_search_admits_its_own_steps_refuses_before_streaming_and_leaves_nothing_open():
    """In process (AsyncLLM and the OpenAI serving layer over stories260K): a search wider than the waiting room
    runs (its later steps are not held to max_waiting_requests again); a refused first step is an error before
    any response; a streamed search gives the non-streamed beams; a search left early leaves no request open."""
    import asyncio

    from jaxllm import AsyncLLM
    from jaxllm.entrypoints.openai.protocol import CompletionRequest
    from jaxllm.entrypoints.openai.serving import APIError, OpenAIServing
    from tests.conftest import STORIES
    from tests.server_process import ENGINE

    async def run(serving, stream=False, **body):
        request = CompletionRequest(model="stories", prompt="Once upon a time", use_beam_search=True, temperature=0,
                                    **body)
        started = serving.prepare_completion(request)
        if stream:
            return [chunk async for chunk in serving.completion_stream(request, started)]
        return await serving.completion(request, started)

    async def scenario():
        engine = AsyncLLM(STORIES, **{**ENGINE, "max_num_seqs": 1, "max_waiting_requests": 1})
        serving = OpenAIServing(engine, "stories", {})
        try:
            whole = await run(serving, max_tokens=4, n=3)
            streamed = b"".join(await run(serving, stream=True, max_tokens=4, n=3)).decode()
            with pytest.raises(APIError, match="priority=5"):
                await run(serving, stream=True, max_tokens=4, priority=5)
            added = []
            add_request = engine.add_request
            engine.add_request = lambda rid, *args, **kwargs: (added.append(rid), add_request(rid, *args, **kwargs))[1]
            left = asyncio.ensure_future(run(serving, max_tokens=400, n=2, ignore_eos=True))
            # Mid-search: some steps done (each step adds 2 requests), far from the 400th.
            await asyncio.wait_for(_until(lambda: len(added) >= 8), timeout=120)
            assert not left.done()
            left.cancel()
            with pytest.raises(asyncio.CancelledError):
                await left
            await asyncio.sleep(0.5)
            return whole, streamed, dict(engine._queues), dict(engine.output_processor.requests)
        finally:
            engine.shutdown()

    whole, streamed, queues, open_requests = asyncio.run(scenario())
    texts = [c["text"] for c in whole["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 3
    assert all(f'"text":{json.dumps(t)}' in streamed.replace(" ", "") or json.dumps(t) in streamed for t in texts)
    assert queues == {} and open_requests == {}


async def _until(condition) -> None:
    """Return once ``condition()`` holds, checking between event-loop turns."""
    import asyncio

    while not condition():
        await asyncio.sleep(0.001)
