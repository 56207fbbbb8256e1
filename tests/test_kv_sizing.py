"""KV cache sizing and ``max_model_len`` (issue 25 item 7): a model whose own length outgrows the KV budget runs
with the defaults, at the longest length the budget holds (vLLM's ``max_model_len=-1``); a length the user set
and the budget cannot hold is refused naming the largest that fits and the flags that change it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm import LLM, SamplingParams
from jaxllm.loader import read_model_config
from jaxllm.worker import kv_cache
from jaxllm.worker.kv_cache import bytes_per_block, fit_max_model_len, resolve_num_blocks
from tests.conftest import STORIES_SENTENCE, log_messages

NATIVE = 65536  # the long-context copy's max_position_embeddings: far more than its test budgets hold
BUDGET_BLOCKS = 41  # of 16 tokens: 40 besides the null block, 640 tokens
FIT = (BUDGET_BLOCKS - 1) * 16


@pytest.fixture(scope="module")
def long_context_dir(stories_dir, tmp_path_factory):
    """stories260K claiming 65536 positions (its rope has no limit; its outputs below 512 tokens do not change)."""
    folder = tmp_path_factory.mktemp("long_context")
    for f in stories_dir.iterdir():
        (folder / f.name).symlink_to(f.resolve())
    (folder / "config.json").unlink()
    config = json.loads((stories_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": NATIVE}))
    return folder


@pytest.fixture(scope="module")
def per_block(long_context_dir):
    return bytes_per_block(read_model_config(long_context_dir)[0], 16, np.float32)


def _llm(model, **kw):
    return LLM(model=model, max_num_seqs=4, max_num_batched_tokens=64, precompile=False, **kw)


def test_issue25_item7_an_unset_max_model_len_is_fitted_to_the_kv_budget_with_a_warning(long_context_dir, per_block,
                                                                                          capfd):
    llm = _llm(long_context_dir, kv_cache_memory_bytes=per_block * BUDGET_BLOCKS)
    err = capfd.readouterr().err
    assert any(m.startswith(f"max_model_len={FIT}, below the model's {NATIVE}") for m in log_messages(err, "WARNING"))
    assert f"kv_cache_memory_bytes={per_block * BUDGET_BLOCKS} holds {BUDGET_BLOCKS} KV blocks" in err
    assert llm.engine.core.max_model_len == FIT and llm.engine.core.num_blocks == BUDGET_BLOCKS
    out = llm.generate([[5] * (FIT - 8)], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"  # the fitted length caps it
    with pytest.raises(ValueError, match=f"longer than max_model_len={FIT}"):
        llm.generate([[5] * (FIT + 1)], SamplingParams(max_tokens=1), use_tqdm=False)


def test_issue25_item7_the_default_budget_is_fitted_too(long_context_dir, per_block, monkeypatch, capfd):
    # The reported case (gemma3-270m's 32768 positions over the CPU's 1 GiB), scaled down: no flag but the model.
    monkeypatch.setattr(kv_cache, "CPU_DEFAULT_KV_BYTES", per_block * BUDGET_BLOCKS)
    llm = _llm(long_context_dir)
    assert llm.engine.core.max_model_len == FIT
    assert f"kv_cache_memory_bytes={per_block * BUDGET_BLOCKS} (the default on cpu) holds" in capfd.readouterr().err


@pytest.mark.parametrize("max_model_len", [NATIVE, FIT + 1])
def test_issue25_item7_a_max_model_len_the_budget_cannot_hold_names_the_largest_that_fits(long_context_dir, per_block,
                                                                                          max_model_len):
    message = (f"kv_cache_memory_bytes={per_block * BUDGET_BLOCKS} holds {BUDGET_BLOCKS} KV blocks of {per_block} "
               f"bytes (16 tokens); one max_model_len={max_model_len} sequence needs {-(-max_model_len // 16) + 1} "
               f"(null block included), {(-(-max_model_len // 16) + 1) * per_block} bytes: the largest max_model_len "
               f"that fits is {FIT}. Change max_model_len (--max-model-len), kv_cache_memory_bytes "
               "(--kv-cache-memory-bytes) or kv_cache_dtype='fp8' (--kv-cache-dtype fp8")
    with pytest.raises(ValueError, match=re.escape(message)):
        _llm(long_context_dir, kv_cache_memory_bytes=per_block * BUDGET_BLOCKS, max_model_len=max_model_len)


def test_issue25_item7_a_set_max_model_len_that_fits_is_kept_and_num_kv_blocks_is_not_fitted(long_context_dir,
                                                                                               per_block):
    assert _llm(long_context_dir, kv_cache_memory_bytes=per_block * BUDGET_BLOCKS,
                max_model_len=FIT).engine.core.max_model_len == FIT
    # Blocks given by count: the scheduler ignores a request that can never fit, as before.
    assert _llm(long_context_dir, num_kv_blocks=BUDGET_BLOCKS).engine.core.max_model_len == NATIVE


def test_issue25_item7_a_budget_below_two_blocks_holds_no_length(long_context_dir, per_block):
    with pytest.raises(ValueError, match=r"holds 1 KV blocks .* a sequence needs 2 or more .*--kv-cache-memory-bytes"):
        _llm(long_context_dir, kv_cache_memory_bytes=per_block * 2 - 1)


@given(native=st.integers(1, 1 << 20), block_size=st.sampled_from([1, 4, 8, 16, 32]),
       budget_blocks=st.integers(2, 5000), extra_bytes=st.integers(0, 10_000),
       dtype=st.sampled_from([np.float32, np.float16, np.int8]))
@settings(max_examples=200, deadline=None)
def test_issue25_item7_the_fitted_length_is_the_longest_the_budget_serves(stories_dir, native, block_size,
                                                                          budget_blocks, extra_bytes, dtype):
    # The class: any native length, block size, cache dtype and budget. The fitted length is the model's own when
    # one sequence of it fits, and otherwise one that resolve_num_blocks accepts while a block more is refused.
    cfg = read_model_config(stories_dir)[0]
    per = bytes_per_block(cfg, block_size, dtype)
    budget = per * budget_blocks + extra_bytes % per
    kw = dict(block_size=block_size, dtype=dtype, kv_cache_memory_bytes=budget, device=jax.devices()[0],
              gpu_memory_utilization=0.9)
    fit = fit_max_model_len(cfg, max_model_len=native, **kw)
    sizing = dict(kw, num_kv_blocks=None, max_num_seqs=4)
    assert resolve_num_blocks(cfg, max_model_len=fit, **sizing) >= -(-fit // block_size) + 1
    if fit < native:
        assert fit == (budget_blocks - 1) * block_size
        with pytest.raises(ValueError, match=f"the largest max_model_len that fits is {fit}"):
            resolve_num_blocks(cfg, max_model_len=fit + 1, **sizing)
    else:
        assert fit == native


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxllm.generate", *args], capture_output=True, text=True,
                          timeout=600)


def test_issue25_item7_the_cli_runs_a_long_context_model_with_no_length_flag(long_context_dir, per_block):
    # The report's command shape (model, prompt, max tokens, greedy), on a model whose length the budget cannot hold.
    budget = str(per_block * BUDGET_BLOCKS)
    proc = _cli("--model", str(long_context_dir), "--kv-cache-memory-bytes", budget, "--prompt", "Once upon a time",
                "--max-tokens", "40", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == STORIES_SENTENCE
    assert any(m.startswith(f"max_model_len={FIT}, below the model's {NATIVE}")
               for m in log_messages(proc.stderr, "WARNING"))
    refused = _cli("--model", str(long_context_dir), "--kv-cache-memory-bytes", budget, "--max-model-len", str(NATIVE))
    assert refused.returncode == 2
    assert f"the largest max_model_len that fits is {FIT}. Change max_model_len (--max-model-len)" in refused.stderr
    too_long = _cli("--model", str(long_context_dir), "--kv-cache-memory-bytes", budget, "--prompt",
                    "Once upon a time " * 200)
    assert too_long.returncode == 2
    assert re.search(rf"error: prompt 0 has \d+ tokens, more than max_model_len={FIT} \(fitted to the KV cache\)",
                     too_long.stderr), too_long.stderr


@pytest.mark.parametrize("kwargs, line", [
    # The default 1 GiB holds far more than 8 requests of 512 tokens: the cache is capped at what steps can use.
    (dict(max_model_len=512, max_num_seqs=8), "KV cache: 256 blocks of 16 tokens (4,096 tokens) and the null block, "
     "float32, 5.0 MiB; maximum concurrency for 512-token requests: 8.00x (max_num_seqs=8 requests of "
     "max_model_len=512: the budget would hold more, and no step could use them)"),
    (dict(max_model_len=256, num_kv_blocks=100), "KV cache: 99 blocks of 16 tokens (1,584 tokens) and the null block, "
     "float32, 2.0 MiB; maximum concurrency for 256-token requests: 6.19x"),
])
def test_start_up_states_the_kv_cache_and_its_maximum_concurrency(stories_dir, capfd, kwargs, line):
    llm = LLM(stories_dir, precompile=False, **kwargs)
    assert llm.engine.core.num_blocks == int(line.split()[2]) + 1
    assert line in log_messages(capfd.readouterr().err, "INFO", "build.py")


def test_start_up_states_a_compressed_pool_beside_the_kv_cache(stories_dir, capfd):
    LLM(stories_dir, precompile=False, max_model_len=256, kv_cache_compression="int8", enable_prefix_caching=True)
    lines = log_messages(capfd.readouterr().err, "INFO", "build.py")
    kv = next(i for i, line in enumerate(lines) if line.startswith("KV cache: "))
    assert lines[kv + 1].startswith("KV compression (int8): ")
