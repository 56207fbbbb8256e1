"""``LLM`` called from many threads at once (issue 56, gap 3): the callers' requests share the engine's steps
(``jaxllm.entrypoints.llm.SharedSteps``), each caller gets exactly its own outputs (greedy float32 tokens equal
to the prompt's run alone), a caller's bad request raises in that caller only, and no KV block is lost."""

from __future__ import annotations

import threading

import pytest

from jaxllm import LLM, SamplingParams
from tests.conftest import STORIES

NUM_THREADS = 16
ENGINE = dict(max_model_len=96, num_kv_blocks=160, block_size=8, max_num_seqs=NUM_THREADS,
              max_num_batched_tokens=128, precompile=False)
# Different lengths, so callers finish at different steps and the steps mix prefills with decodes.
PROMPTS = [[1 + (7 * i + 3 * j) % 500 for j in range(3 + i % 5)] for i in range(NUM_THREADS)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8 + 2 * (i % 4), ignore_eos=True) for i in range(NUM_THREADS)]


@pytest.fixture(scope="module")
def llm():
    return LLM(STORIES, **ENGINE)


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's greedy tokens, generated alone."""
    return [llm.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids for p, s in zip(PROMPTS, PARAMS)]


@pytest.fixture()
def batch_sizes(llm, monkeypatch):
    """The number of requests the engine holds at each step, recorded while a test runs."""
    sizes: list[int] = []
    step, scheduler = llm.engine.step, llm.engine.scheduler

    def counted():
        sizes.append(len(scheduler.running) + len(scheduler.waiting))
        return step()

    monkeypatch.setattr(llm.engine, "step", counted)
    return sizes


def _in_threads(calls):
    """Run the ``calls`` (no-argument functions) in one thread each, released together; their results (or the
    exception each raised), in order."""
    results: list = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i):
        barrier.wait()
        try:
            results[i] = calls[i]()
        except Exception as error:  # noqa: BLE001 - handed back to the test, which asserts on it
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    return results


def test_sixteen_threads_share_steps_and_each_gets_its_own_exact_tokens(llm, alone, batch_sizes):
    free = llm.engine.core.num_free_blocks()

    def call(i):
        if i % 4 == 3:  # some callers stream; their deltas add up to the final tokens
            tokens = []
            for out in llm.generate_stream(PROMPTS[i], PARAMS[i]):
                tokens += out.outputs[0].delta_token_ids
            return tokens
        # Two callers show progress bars, which must not disturb the others.
        out = llm.generate(PROMPTS[i], PARAMS[i], use_tqdm=i in (0, 5))
        assert out[0].prompt_token_ids == PROMPTS[i]
        return out[0].outputs[0].token_ids

    results = _in_threads([lambda i=i: call(i) for i in range(NUM_THREADS)])
    assert results == alone
    # Shared steps: the callers' requests ran in the same steps, not one caller after another.
    assert max(batch_sizes) == NUM_THREADS
    assert len(batch_sizes) < sum(len(tokens) for tokens in alone) // 2
    assert llm.engine.core.num_free_blocks() == free


@pytest.mark.parametrize("bad", [
    pytest.param(lambda llm: llm.generate([[3, 4, 5], [100_000]], PARAMS[0], use_tqdm=False),
                 id="token-id-outside-the-vocabulary-after-a-good-prompt"),
    pytest.param(lambda llm: llm.generate([[3] * 200], PARAMS[0], use_tqdm=False), id="prompt-too-long"),
    pytest.param(lambda llm: llm.generate([[3, 4], [5, 6]], [PARAMS[0]] * 3, use_tqdm=False),
                 id="params-for-other-prompts"),
    pytest.param(lambda llm: llm.generate([[3, 4]], PARAMS[0], priority=[1], use_tqdm=False),
                 id="priority-under-fcfs"),
])
def test_a_bad_request_raises_in_its_caller_only_and_loses_no_block(llm, alone, bad):
    free = llm.engine.core.num_free_blocks()
    calls = [lambda i=i: llm.generate(PROMPTS[i], PARAMS[i], use_tqdm=False)[0].outputs[0].token_ids
             for i in range(NUM_THREADS - 2)]
    calls.append(lambda: bad(llm))

    def stop_early():
        # A stream whose consumer stops after the first output: its request is aborted, its blocks freed.
        for out in llm.generate_stream(PROMPTS[0], PARAMS[0]):
            return out.outputs[0].token_ids

    calls.append(stop_early)
    results = _in_threads(calls)
    assert results[:NUM_THREADS - 2] == alone[:NUM_THREADS - 2]
    assert isinstance(results[-2], ValueError)
    assert results[-1] == alone[0][:len(results[-1])]
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.num_free_blocks() == free


def test_a_stream_consumer_that_holds_its_outputs_does_not_hold_up_the_other_callers(llm, alone):
    """A consumer that stops reading (its thread busy elsewhere) keeps its outputs waiting for it; the other callers'
    requests keep stepping without it and finish, and it then reads its own tokens whole."""
    released, held = threading.Event(), []

    def slow():
        tokens = []
        for out in llm.generate_stream(PROMPTS[0], PARAMS[0]):
            tokens += out.outputs[0].delta_token_ids
            if len(held) == 0:
                held.append(released.wait(timeout=120))  # False: the others never finished without it
        return tokens

    slow_result: list = []
    thread = threading.Thread(target=lambda: slow_result.append(slow()))
    thread.start()
    others = _in_threads([lambda i=i: llm.generate(PROMPTS[i], PARAMS[i], use_tqdm=False)[0].outputs[0].token_ids
                          for i in range(1, NUM_THREADS)])
    released.set()
    thread.join(timeout=300)
    assert others == alone[1:]
    assert held == [True] and slow_result == [alone[0]]
