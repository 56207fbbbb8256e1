"""vLLM's prompt forms in LLM, LLMEngine and AsyncLLM: text, token ids, TextPrompt and TokensPrompt dicts (with a
cache_salt and multimodal options left empty); what a text-only decoder cannot serve is refused naming the key, and
a refused prompt leaves nothing queued."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxllm import LLM, AsyncLLM, SamplingParams, TextPrompt, TokensPrompt
from jaxllm.frontend.input_processor import IGNORED_PROMPT_KEYS, REFUSED_PROMPT_KEYS
from tests.conftest import STORIES

GREEDY = SamplingParams(temperature=0, max_tokens=6)
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, precompile=False)
TEXT = "Once upon a time"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(STORIES, **ENGINE)


@pytest.fixture(scope="module")
def ids(llm) -> list[int]:
    return llm.engine.encode_prompt(TEXT)[1]


@pytest.fixture(scope="module")
def want(llm) -> list[int]:
    return llm.generate(TEXT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_the_reported_tokens_prompt_dict_generates_as_its_ids(llm, ids, want):
    # vLLM's TokensPrompt, the form a vLLM user passes pre-tokenized prompts in, was read as a list of ids before.
    [out] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == want and out.prompt_token_ids == ids and out.prompt is None


def test_every_prompt_form_generates_the_same_tokens(llm, ids, want):
    forms = [TEXT, ids, np.asarray(ids, np.int32), TextPrompt(prompt=TEXT),
             TokensPrompt(prompt_token_ids=ids, prompt=TEXT),
             {"prompt": TEXT, "multi_modal_data": None, **{key: None for key in IGNORED_PROMPT_KEYS}},
             {"prompt_token_ids": ids, "multi_modal_data": {}, "mm_processor_kwargs": {"x": 1}}]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want] * len(forms)
    assert [o.prompt_token_ids for o in outs] == [ids] * len(forms)
    # The text reported is the one given, for ids too (TokensPrompt's "prompt").
    assert [o.prompt for o in outs] == [TEXT, None, None, TEXT, TEXT, TEXT, None]


def test_a_prompt_dicts_cache_salt_keeps_its_prefix_apart(llm, ids):
    long = ids * 3
    salted = {"prompt_token_ids": long, "cache_salt": "a"}
    llm.generate(salted, GREEDY, use_tqdm=False)
    cached = [llm.generate(p, GREEDY, use_tqdm=False)[0].num_cached_tokens
              for p in (salted, {"prompt_token_ids": long, "cache_salt": "b"}, {"prompt_token_ids": long})]
    # The same salt reads the salted prefix's full blocks (16 tokens each); another salt, or none, reads nothing.
    assert cached == [len(long) // 16 * 16, 0, 0]
    assert llm.generate(salted, GREEDY, cache_salt="a", use_tqdm=False)[0].num_cached_tokens == cached[0]
    with pytest.raises(ValueError, match="the prompt's cache_salt 'a' differs from cache_salt='b'"):
        llm.generate(salted, GREEDY, cache_salt="b", use_tqdm=False)


@pytest.mark.parametrize("prompt, match", [
    *[({"prompt": TEXT, key: [1]}, f"prompt key '{key}': ") for key in REFUSED_PROMPT_KEYS],
    ({"prompt": TEXT, "multi_modal_data": {"image": object()}}, r"prompt key 'multi_modal_data' \(image\): the "
                                                                 "models take text and token ids only"),
    ({"cache_salt": "a"}, r"a prompt dict needs 'prompt' .* or 'prompt_token_ids' .*; it has \['cache_salt'\]"),
    ({"prompt": 7}, "prompt key 'prompt' must be a string"),
    ({"prompt_token_ids": [1, 2.5]}, r"prompt token ids must be integers; got 2.5 \(float\)"),
    ([1, True], r"prompt token ids must be integers; got True \(bool\)"),
    ({"prompt_token_ids": "1 2"}, "prompt token ids must be a list of integers; got str"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [1, 600]}, r"outside the vocabulary \[0, 512\)"),
])
def test_a_refused_prompt_names_its_key_and_queues_nothing(llm, prompt, match):
    free = llm.engine.core.num_free_blocks()
    with pytest.raises(ValueError, match=match):
        llm.generate([TEXT, prompt], GREEDY, use_tqdm=False)
    # The good prompt queued before it was aborted with it: nothing is open, no block is held.
    assert not llm.engine.output_processor.requests and not llm.engine.core.requests
    assert llm.engine.core.num_free_blocks() == free


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.integers(-5, 600), st.floats(allow_nan=False), st.booleans(), st.text(max_size=2)),
                max_size=6))
def test_token_ids_are_taken_only_when_all_are_integers_in_the_vocabulary(llm, values):
    ok = bool(values) and all(type(v) is int and 0 <= v < 512 for v in values)
    processor = llm.engine.input_processor
    if ok:
        assert processor.parse_prompt({"prompt_token_ids": values}).token_ids == values
    else:
        with pytest.raises(ValueError):
            processor.parse_prompt({"prompt_token_ids": values})


def test_async_llm_generate_takes_vllms_prompt_forms_and_arguments(ids, want):
    async def tokens(engine, prompt, request_id, **kwargs):
        outs = [o async for o in engine.generate(prompt, GREEDY, request_id, **kwargs)]
        assert outs[-1].finished
        return outs[-1]

    async def scenario():
        engine = AsyncLLM(STORIES, **ENGINE)
        try:
            text = await tokens(engine, TEXT, "a", trace_headers={"x": "y"}, priority=0, data_parallel_rank=0)
            as_ids = await tokens(engine, {"prompt_token_ids": ids}, "b", prompt_text=TEXT)
            bare = await tokens(engine, TEXT, "c", tokenization_kwargs={"add_special_tokens": False})
            with pytest.raises(ValueError, match=r"tokenization_kwargs keys \['truncation'\] are not supported"):
                await tokens(engine, TEXT, "d", tokenization_kwargs={"truncation": True})
            # Leaving the loop after the first output aborts the request: nothing stays open.
            stream = engine.generate(TEXT, SamplingParams(temperature=0, max_tokens=40), "e")
            async for _ in stream:
                break
            await stream.aclose()
            assert not engine.output_processor.requests
            return text, as_ids, bare
        finally:
            await engine.shutdown()

    text, as_ids, bare = asyncio.run(scenario())
    assert text.outputs[0].token_ids == as_ids.outputs[0].token_ids == want
    assert (text.prompt, as_ids.prompt, as_ids.prompt_token_ids) == (TEXT, TEXT, ids)
    # stories260K's tokenizer adds a BOS: without special tokens the prompt is one token shorter.
    assert bare.prompt_token_ids == ids[1:]
