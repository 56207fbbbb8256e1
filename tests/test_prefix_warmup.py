"""Prefix-cache warm-up (preload_prompts): the file formats, and the first request sharing a preloaded prompt
reading it from the prefix cache on stories260K."""

from __future__ import annotations

import json

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineConfig, read_preload_prompts

SYSTEM = "Once upon a time, there was a little girl named Lily."
ENGINE = dict(max_model_len=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, num_kv_blocks=17,
              precompile=False, token_buckets=[32])


def test_a_json_list_or_one_prompt_per_line(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(["a\nb", "c"]))
    (tmp_path / "p.txt").write_text("first prompt\n\n  \nsecond prompt\n")
    assert read_preload_prompts(tmp_path / "p.json") == ["a\nb", "c"]
    assert read_preload_prompts(tmp_path / "p.txt") == ["first prompt", "second prompt"]


@pytest.mark.parametrize("name, content, words", [
    ("missing.txt", None, "cannot read it"),
    ("bad.json", "[1, 2]", "JSON list of non-empty strings"),
    ("broken.json", "[", "not valid JSON"),
    ("empty.txt", "\n\n", "holds no prompt"),
])
def test_a_bad_file_is_refused_by_the_config_naming_it(tmp_path, name, content, words):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=words) as e:
        EngineConfig(preload_prompts=str(path))
    assert name in str(e.value)


def test_first_request_sharing_a_preloaded_prompt_hits_its_full_blocks(stories_dir, tmp_path):
    path = tmp_path / "system.txt"
    path.write_text(SYSTEM + "\n")
    llm = LLM(model=stories_dir, preload_prompts=str(path), **ENGINE)
    system_ids = llm.get_tokenizer().encode(SYSTEM)
    full = len(system_ids) // 4 * 4
    report = llm.kv_cache_report()
    # Pinned (graceful degradation is on), so no request could have evicted them; nothing counted as traffic yet.
    assert report["num_pinned_blocks"] == full // 4 and report["num_running"] == 0
    registry = llm.engine.metrics.registry
    out = llm.generate([SYSTEM + " She loved to play"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert out[0].num_cached_tokens == full
    assert registry.get_sample_value("jaxllm:prefix_cache_hits_total") == full
    assert registry.get_sample_value("jaxllm:prefix_cache_queries_total") == len(out[0].prompt_token_ids)
    assert registry.get_sample_value("jaxllm:prompt_tokens_total") == len(out[0].prompt_token_ids)
    assert full == 16 and out[0].prompt_token_ids[:full] == system_ids[:full]


def test_preloaded_prompt_too_long_for_the_model_is_refused_naming_it(stories_dir, tmp_path):
    path = tmp_path / "long.json"
    path.write_text(json.dumps(["fine", "word " * 100]))
    with pytest.raises(ValueError, match=r"long.json', prompt 1: prompt of \d+ tokens is longer than max_model_len=64"):
        LLM(model=stories_dir, preload_prompts=str(path), **ENGINE)
