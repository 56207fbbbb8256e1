"""End to end through the engine: scheduler -> bucketed batch -> jitted step -> sampler."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from tests.conftest import STORIES_SENTENCE
from tests.helpers import assert_same_or_near_tie

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


def test_stories260k_greedy_gives_reference_sentence(stories_dir):
    llm = LLM(model=stories_dir, max_num_seqs=4)
    out = llm.generate("Once upon a time", GREEDY)[0]
    assert out.prompt_token_ids == [1, 403, 407, 261, 378]
    assert out.prompt + out.outputs[0].text == STORIES_SENTENCE
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 40


def test_batch_of_16_generates_what_each_prompt_generates_alone(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, max_num_seqs=16, max_num_batched_tokens=64, block_size=4, precompile=False,
              num_kv_blocks=256)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=int(n)).tolist() for n in rng.integers(1, 40, size=16)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    together = llm.generate(prompts, params)
    for prompt, out in zip(prompts, together):
        alone = llm.generate([prompt], params)[0].outputs[0].token_ids
        batched = out.outputs[0].token_ids
        assert_same_or_near_tie(llm, prompt, alone, batched)


def test_generate_accepts_text_token_ids_and_per_prompt_params(stories_dir):
    llm = LLM(model=stories_dir, precompile=False)
    outs = llm.generate(["Once upon a time", [1, 403, 407]],
                        [SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0, max_tokens=5)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [1, 403, 407]


def test_stop_token_and_eos_finish_with_reason_stop(stories_dir):
    llm = LLM(model=stories_dir, precompile=False)
    full = llm.generate("Once upon a time", GREEDY)[0].outputs[0].token_ids
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40,
                                                          stop_token_ids=[full[5]]))[0].outputs[0]
    assert out.token_ids == full[:6]
    assert out.finish_reason == "stop" and out.stop_reason == full[5]


def test_stop_string_cuts_text(stories_dir):
    llm = LLM(model=stories_dir, precompile=False)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=["Lily"]))[0]
    assert out.outputs[0].text == ", there was a little girl named "
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "Lily"


def test_seeded_sampling_is_reproducible(stories_dir):
    llm = LLM(model=stories_dir, precompile=False)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=7)
    a = llm.generate("Once upon a time", params)[0].outputs[0].token_ids
    b = llm.generate(["Once upon a time", "One day"], params)[0].outputs[0].token_ids
    assert a == b


def test_chat_renders_the_template(smollm2_gguf):
    llm = LLM(model=smollm2_gguf, max_model_len=256, precompile=False)
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=4))[0]
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    assert rendered.endswith("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) >= 1
