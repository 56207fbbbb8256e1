"""Data parallelism on 8 CPU devices: replicas behind one LLM, routed by load and by cached prefix."""

from __future__ import annotations

from jaxllm import LLM, SamplingParams
from jaxllm.replicas import cached_prefix_tokens
from tests.multidevice.conftest import ENGINE, GREEDY, prompts


def test_dp2_tp2_serves_32_requests_correctly_across_both_replicas(kv4_dir):
    batch = prompts(32, seed=1)
    want = [o.outputs[0].token_ids for o in LLM(model=kv4_dir, **ENGINE).generate(batch, GREEDY)]
    llm = LLM(model=kv4_dir, data_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    assert got == want
    assert llm.engine.num_routed == [16, 16]
    devices = [set(e.runner.kv_cache[0].sharding.device_set) for e in llm.engine.replicas]
    assert len(devices[0]) == len(devices[1]) == 2 and not devices[0] & devices[1]


def test_request_goes_to_the_replica_caching_its_prefix_even_when_busier(kv4_dir):
    llm = LLM(model=kv4_dir, data_parallel_size=2, **ENGINE)
    shared = list(range(10, 42))
    llm.generate([shared + [50]], SamplingParams(temperature=0, max_tokens=1))
    holder = next(i for i, e in enumerate(llm.engine.replicas) if cached_prefix_tokens(e, shared + [60]) > 0)
    assert cached_prefix_tokens(llm.engine.replicas[holder], shared + [60]) == 32
    assert cached_prefix_tokens(llm.engine.replicas[1 - holder], shared + [60]) == 0
    llm.engine.replicas[holder].add_request("busy", [7, 8, 9], GREEDY)
    llm.engine.add_request("prefix", shared + [60], GREEDY)
    assert llm.engine.routed["prefix"] == holder
    llm.engine.add_request("fresh", [3, 4, 5], GREEDY)
    assert llm.engine.routed["fresh"] == 1 - holder
