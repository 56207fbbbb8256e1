"""``AsyncLLM``'s pause and sleep calls in every order a caller may chain them (vLLM's ``pause_generation``,
``resume_generation``, ``sleep``, ``wake_up``, ``abort``): none waits forever, a request ends whole or with
finish_reason "abort", and no KV block is left held. The server's routes over them are tested in
``test_server_weights``.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from jaxllm import AsyncLLM, SamplingParams
from tests.conftest import STORIES
from tests.server_process import ENGINE

PROMPT = "Once upon a time"
LONG = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
# Each call under test returns within this many seconds, or the test fails (rather than hangs).
BOUND = 60


class Run:
    """One streamed request: ``started`` once its first token came, ``last`` its last output."""

    def __init__(self, engine: AsyncLLM, request_id: str, params: SamplingParams = LONG) -> None:
        self.started = asyncio.Event()
        self.last = None
        self.task = asyncio.ensure_future(self._read(engine, request_id, params))

    async def _read(self, engine, request_id, params):
        async for out in engine.generate(PROMPT, params, request_id):
            self.last = out
            self.started.set()

    async def end(self):
        await asyncio.wait_for(self.task, BOUND)
        return self.last.outputs[0]


async def _bounded(call):
    return await asyncio.wait_for(call, BOUND)


async def _idle(engine) -> bool:
    report = await engine.kv_cache_report(0, False)
    return report["num_used_blocks"] == 1 and not engine.output_processor.requests  # the null block alone


@pytest.fixture(scope="module")
def scenarios():
    """Runs each scenario in one event loop over one engine (sleep mode on), in order; their results by name."""
    results = {}

    async def run_all():
        engine = AsyncLLM(STORIES, **ENGINE, enable_sleep_mode=True)
        try:
            for name, scenario in SCENARIOS.items():
                results[name] = await scenario(engine)
                assert await _idle(engine), name
        finally:
            engine.shutdown()

    asyncio.run(run_all())
    return results


async def keep_then_abort_in_flight(engine):
    run = Run(engine, "a")
    await _bounded(run.started.wait())
    await _bounded(engine.pause_generation(mode="keep"))
    aborted = await _bounded(engine.abort_in_flight())
    out = await run.end()
    await _bounded(engine.resume_generation())
    return aborted, out.finish_reason, len(out.token_ids)


async def keep_then_wait(engine):
    run = Run(engine, "b", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    await _bounded(run.started.wait())
    await _bounded(engine.pause_generation(mode="keep"))
    await _bounded(engine.pause_generation(mode="wait"))  # lifts the keep: the request runs to its end
    out = await run.end()
    await _bounded(engine.resume_generation())
    return out.finish_reason, len(out.token_ids)


async def keep_then_sleep(engine):
    run = Run(engine, "c")
    await _bounded(run.started.wait())
    await _bounded(engine.pause_generation(mode="keep"))
    await _bounded(engine.sleep(level=1))
    out = await run.end()
    awake = await _bounded(engine.wake_up())
    return out.finish_reason, awake, await engine.is_paused()


async def level_0_keep_then_level_1(engine):
    run = Run(engine, "d")
    await _bounded(run.started.wait())
    await _bounded(engine.sleep(level=0, mode="keep"))
    with pytest.raises(RuntimeError, match="mode 'wait': 1 requests wait in a sleeping engine"):
        await _bounded(engine.pause_generation(mode="wait"))
    assert not await engine.is_paused()  # a refused pause changes nothing
    await _bounded(engine.sleep(level=1))
    out = await run.end()
    return out.finish_reason, await _bounded(engine.wake_up())


async def abort_is_vllms(engine):
    run = Run(engine, "e")
    await _bounded(run.started.wait())
    await _bounded(engine.abort(["e", "unknown"]))
    out = await run.end()
    return out.finish_reason, len(out.token_ids) > 0


SCENARIOS = {f.__name__: f for f in (keep_then_abort_in_flight, keep_then_wait, keep_then_sleep,
                                     level_0_keep_then_level_1, abort_is_vllms)}


def test_aborting_a_kept_request_ends_it_at_once(scenarios):
    aborted, reason, num_tokens = scenarios["keep_then_abort_in_flight"]
    assert (aborted, reason) == (1, "abort") and 0 < num_tokens < LONG.max_tokens


def test_a_wait_pause_after_a_keep_pause_lets_the_request_finish_whole(scenarios):
    assert scenarios["keep_then_wait"] == ("length", 40)


def test_sleep_aborts_a_kept_request_and_a_full_wake_up_ends_the_pause_as_vllms(scenarios):
    assert scenarios["keep_then_sleep"] == ("abort", True, False)


def test_a_deeper_sleep_over_a_level_0_one_aborts_the_kept_request(scenarios):
    assert scenarios["level_0_keep_then_level_1"] == ("abort", True)


def test_abort_takes_vllms_ids_and_ends_the_stream_with_an_abort_output(scenarios):
    assert scenarios["abort_is_vllms"] == ("abort", True)


def test_sleep_without_sleep_mode_is_refused_before_it_touches_a_request():
    async def scenario():
        engine = AsyncLLM(STORIES, **ENGINE)
        try:
            run = Run(engine, "f", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
            await _bounded(run.started.wait())
            with pytest.raises(ValueError, match="enable_sleep_mode"):
                await engine.sleep(level=1)
            return (await run.end()).finish_reason
        finally:
            engine.shutdown()

    assert asyncio.run(scenario()) == "length"


def test_shutdown_from_another_thread_ends_the_streams_and_stops_the_cores():
    """vLLM's shutdown may come from any thread: the event loop's own thread ends the streams and the output task
    before the cores stop."""
    async def scenario():
        engine = AsyncLLM(STORIES, **ENGINE)
        run = Run(engine, "g")
        await _bounded(run.started.wait())
        stopper = threading.Thread(target=engine.shutdown)
        stopper.start()
        with pytest.raises(RuntimeError, match="the engine was shut down"):
            await asyncio.wait_for(run.task, BOUND)
        await asyncio.to_thread(stopper.join, BOUND)
        return [core.process.poll() for core in engine.client._cores]

    assert None not in asyncio.run(scenario())
