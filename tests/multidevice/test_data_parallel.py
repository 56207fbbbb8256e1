"""Data parallelism on 8 CPU devices: one engine-core process per replica behind one LLM, routed by cached prefix
and by load."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from tests.multidevice.conftest import ENGINE, GREEDY, prompts


def test_dp2_tp2_serves_32_requests_correctly_across_both_replicas(kv4_dir):
    batch = prompts(32, seed=1)
    want = [o.outputs[0].token_ids for o in LLM(model=kv4_dir, **ENGINE).generate(batch, GREEDY)]
    llm = LLM(model=kv4_dir, data_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    assert got == want
    client = llm.engine.client
    assert client.num_routed == [16, 16]
    devices = [set(info.device_ids) for info in client.infos]
    assert devices == [{0, 1}, {2, 3}]
    assert [client.call_utility(d, "num_free_blocks") for d in (0, 1)] == [ENGINE["num_kv_blocks"] - 1] * 2
    llm.engine.shutdown()


def test_request_goes_to_the_replica_caching_its_prefix_even_when_busier(kv4_dir):
    llm = LLM(model=kv4_dir, data_parallel_size=2, **ENGINE)
    client = llm.engine.client
    shared = list(range(10, 42))
    llm.generate([shared + [50]], SamplingParams(temperature=0, max_tokens=1))
    holder = next(i for i in (0, 1) if client.call_utility(i, "cached_prefix_tokens", shared + [60]) > 0)
    assert client.call_utility(holder, "cached_prefix_tokens", shared + [60]) == 32
    assert client.call_utility(1 - holder, "cached_prefix_tokens", shared + [60]) == 0
    assert client.router.cached_prefix_tokens(holder, shared + [60]) == 32
    assert client.router.cached_prefix_tokens(1 - holder, shared + [60]) == 0
    llm.engine.add_request("busy", [7, 8, 9], GREEDY, data_parallel_rank=holder)
    llm.engine.add_request("prefix", shared + [60], GREEDY)
    assert client.routed["prefix"] == holder
    llm.engine.add_request("fresh", [3, 4, 5], GREEDY)
    assert client.routed["fresh"] == 1 - holder
    with pytest.raises(ValueError, match=r"data_parallel_rank=2 must be in \[0, 2\)"):
        llm.engine.add_request("nowhere", [3, 4, 5], GREEDY, data_parallel_rank=2)
    # Aborted in their core processes: every block is free again (cached ones count as free).
    llm.engine.abort_request(["busy", "prefix", "fresh"])
    assert not llm.engine.has_unfinished_requests()
    assert [client.call_utility(d, "num_free_blocks") for d in (0, 1)] == [ENGINE["num_kv_blocks"] - 1] * 2
    llm.engine.shutdown()
