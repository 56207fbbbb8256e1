"""End to end through the engine: scheduler -> bucketed batch -> jitted step -> sampler."""

from __future__ import annotations

import dataclasses
import json
import shutil

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


# ---- eos ids from the model's configs (issue 11, item 6) ----------------------------------------

STORIES_PROMPT_IDS = [1, 403, 407, 261, 378]
SMALL = dict(precompile=False, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def stories_copy(stories_dir, dest, *, generation_eos=2, config_eos=2, tokenizer_files=True):
    """stories260K with the given ``eos_token_id`` in generation_config.json and config.json
    (None: the key is left out), with or without its tokenizer files."""
    dest.mkdir()
    for file in stories_dir.iterdir():
        if tokenizer_files or file.name not in TOKENIZER_FILES:
            shutil.copy(file, dest)
    for name, eos in (("generation_config.json", generation_eos), ("config.json", config_eos)):
        config = json.loads((dest / name).read_text())
        config.pop("eos_token_id")
        if eos is not None:
            config["eos_token_id"] = eos
        (dest / name).write_text(json.dumps(config))
    return dest


def test_issue11_eos_list_from_generation_config(stories_dir, tmp_path):
    model = stories_copy(stories_dir, tmp_path / "m", generation_eos=[2, 426], tokenizer_files=False)
    llm = LLM(model=model, **SMALL)
    assert llm.tokenizer is None
    out = llm.generate([STORIES_PROMPT_IDS], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    # ", there was a little girl named Lily." and no further.
    assert out.token_ids == [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426]
    assert (out.finish_reason, out.stop_reason) == ("stop", 426)
    late = llm.generate([STORIES_PROMPT_IDS], SamplingParams(temperature=0, max_tokens=40, min_tokens=15))[0]
    assert len(late.outputs[0].token_ids) > 15 and 426 not in late.outputs[0].token_ids[:15]


# (eos_token_id of generation_config.json, of config.json, tokenizer files?) -> the engine's eos ids.
EOS_SOURCES = [
    ([2, 426], 2, False, [2, 426]),
    (426, 2, False, [426, 2]),
    (None, [2, 426], False, [2, 426]),
    (None, 426, False, [426]),
    ([2, 426], 2, True, [2, 426]),
    (426, [2, 300], True, [2, 426, 300]),  # tokenizer_config's "</s>" (2) first
]


@pytest.mark.parametrize("generation_eos, config_eos, tokenizer_files, expected", EOS_SOURCES)
def test_issue11_every_eos_id_stops_and_is_banned_until_min_tokens(stories_dir, tmp_path, generation_eos,
                                                                  config_eos, tokenizer_files, expected):
    model = stories_copy(stories_dir, tmp_path / "m", generation_eos=generation_eos, config_eos=config_eos,
                         tokenizer_files=tokenizer_files)
    llm = LLM(model=model, **SMALL)
    assert llm.engine.eos_token_ids == expected
    assert_every_eos_stops_after_min_tokens(llm, expected, STORIES_PROMPT_IDS)


def assert_every_eos_stops_after_min_tokens(llm, eos_ids, prompt, min_tokens=5):
    """A large logit bias makes each eos id the greedy choice: it ends the request at once, and
    with ``min_tokens`` no eos id at all appears before it."""
    for eos in eos_ids:
        pushed = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100.0})
        out = llm.generate([prompt], pushed, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == ([eos], "stop"), eos
        pushed = dataclasses.replace(pushed, min_tokens=min_tokens)
        out = llm.generate([prompt], pushed, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == min_tokens + 1 and out.token_ids[-1] == eos, (eos, out.token_ids)
        assert not set(eos_ids) & set(out.token_ids[:min_tokens]), (eos, out.token_ids)


def test_swap_out_in_a_step_without_rows_still_copies_the_blocks(stories_dir):
    # A step may schedule nothing but swap its one running request out (async
    # scheduling, swap preemption): the copy must still happen, or the request
    # resumes from whatever the host pool held.
    from jaxllm.frontend.llm_engine import LLMEngine
    from scheduler import SchedulerOutput
    from scheduler.kv.tier import BlockCopy, CopyKind

    engine = LLMEngine(stories_dir, preemption_mode="swap", num_host_blocks=4, num_kv_blocks=8, max_model_len=64,
                       precompile=False)
    k, v = engine.runner.cache_engine.kv_cache
    engine.runner.cache_engine.kv_cache = (k.at[:, 3].set(1.0), v.at[:, 3].set(2.0))
    out = SchedulerOutput(block_size=engine.config.block_size)
    out.block_copies = [BlockCopy(CopyKind.SWAP_OUT, 3, 1)]
    assert engine.core._launch(out, None).dispatched is None
    host_k, host_v = engine.runner.cache_engine.host_pool
    assert np.all(host_k[:, 1] == 1.0) and np.all(host_v[:, 1] == 2.0)
    assert np.all(host_k[:, 0] == 0.0) and np.all(host_k[:, 2:] == 0.0)


def test_llm_engine_takes_a_named_model_as_llm_does(stories_dir, monkeypatch):
    """The new user's report: ``LLMEngine("smollm2-135m-instruct")`` said "does not exist". A name (and None, the
    default model) resolves in LLMEngine as in LLM, with the ``revision`` and ``download_dir`` it is given."""
    from jaxllm import named_models
    from jaxllm.frontend.llm_engine import LLMEngine

    asked = []

    def resolve(model, revision=None, download_dir=None):
        asked.append((model, revision, download_dir))
        return stories_dir if model == "a-named-model" else named_models.resolve_model(model, revision, download_dir)

    monkeypatch.setattr(named_models, "resolve_model", resolve)
    engine = LLMEngine("a-named-model", download_dir="/nowhere", max_model_len=64, precompile=False)
    engine.add_request("r", "Once upon a time", SamplingParams(temperature=0, max_tokens=8))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert asked == [("a-named-model", None, "/nowhere")]
    assert outs[-1].finished and outs[-1].outputs[0].text == ", there was a little girl"
    assert len(outs[-1].outputs[0].token_ids) == 8
    engine.shutdown()
