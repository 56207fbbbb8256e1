"""Issue 11 item 4, end to end: a fully cached, block-aligned prompt that needs the whole cache must not stall.

The scheduler-level kind (any request whose admission cannot succeed even
with nothing else running) is tested in tests/test_scheduler_scenarios.py and
as the liveness invariant of tests/test_scheduler_stateful.py.
"""

from __future__ import annotations

from jaxllm import LLMEngine, SamplingParams

GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
GREEDY_FOUR = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [1] + [3 + (i * 7) % 400 for i in range(31)]  # 32 tokens: two whole 16-token blocks
SMALL = [1, 403, 407, 261]


def _run(engine: LLMEngine, max_steps: int = 40) -> dict[str, list[int]]:
    """Step until nothing is unfinished (at most ``max_steps`` steps); finished request id -> its token ids."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert not engine.has_unfinished_requests(), f"still unfinished after {max_steps} steps; finished: {sorted(done)}"
    return done


def test_issue11_fully_cached_prompt_filling_the_cache_is_served_and_does_not_block_the_queue(stories_dir):
    # 3 KV blocks, the null block included: 2 usable blocks of 16 tokens, exactly the 32-token prompt.
    engine = LLMEngine(stories_dir, block_size=16, num_kv_blocks=3, max_model_len=64, precompile=False)
    engine.add_request("first", PROMPT, GREEDY_ONE)
    first = _run(engine)["first"]
    hits_before = engine.scheduler.prefix_cache_hits

    engine.add_request("again", PROMPT, GREEDY_ONE)
    engine.add_request("small", SMALL, GREEDY_FOUR)
    done = _run(engine)

    assert done["again"] == first
    # Copying the cached last block would need a third block, so the second
    # send takes only the first block's 16 tokens from the cache.
    assert engine.scheduler.prefix_cache_hits - hits_before == 16
    engine.add_request("small alone", SMALL, GREEDY_FOUR)
    assert done["small"] == _run(engine)["small alone"]
    assert len(done["small"]) == 4
    assert engine.scheduler.block_pool.num_free_blocks == 2
