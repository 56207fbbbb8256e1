"""--kv-events-config: the prefix cache's stored and evicted blocks, published over ZMQ in vLLM's wire format and
decoded here with vLLM's own struct layout (vllm/distributed/kv_events.py)."""

from __future__ import annotations

import time
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineConfig
from scheduler.block_hash import hash_block_tokens


# vLLM's structs, as a vLLM subscriber declares them.
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VllmKVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Any]] = None
    group_idx: Optional[int] = None


class BlockRemoved(VllmKVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(VllmKVCacheEvent):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=VllmKVEventBatch)
GREEDY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def vllm_hashes(tokens: list[int], block_size: int = 16) -> list[int]:
    """vLLM's default ExternalBlockHash of each full block: the low 64 bits of its hash, big-endian."""
    out, parent = [], None
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[i:i + block_size])
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def receive(sub: zmq.Socket, until: float = 10.0) -> list[tuple[bytes, int, VllmKVEventBatch]]:
    """Every message that arrives within 0.5 s of the last one (or ``until`` seconds in all)."""
    got, deadline = [], time.monotonic() + until
    while time.monotonic() < deadline and sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        got.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return got


@pytest.fixture(scope="module")
def published(stories_dir, tmp_path_factory):
    """Two prompts through an engine whose 8 usable blocks make the second evict the first's, and what a
    subscriber received (it connects before the first step, so it misses nothing)."""
    folder = tmp_path_factory.mktemp("kv_events")
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{folder}/events",
              "replay_endpoint": f"ipc://{folder}/replay", "topic": "kv"}
    llm = LLM(model=stories_dir, max_model_len=128, num_kv_blocks=9, max_num_seqs=4, max_num_batched_tokens=64,
              precompile=False, kv_events_config=config)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(config["endpoint"])
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.5)  # ZMQ's slow joiner: the subscription reaches the publisher before anything is sent
    first, second = [3 + (i * 7) % 400 for i in range(40)], [5 + (i * 11) % 400 for i in range(120)]
    llm.generate([first], GREEDY, use_tqdm=False)
    llm.generate([second], GREEDY, use_tqdm=False)
    yield first, second, receive(sub), config, ctx
    llm.engine.core.kv_events.shutdown()
    ctx.destroy(linger=0)


def events(messages, kind):
    return [e for _, _, batch in messages for e in batch.events if isinstance(e, kind)]


def test_messages_are_topic_sequence_payload_from_rank_0(published):
    messages = published[2]
    assert [(topic, seq) for topic, seq, _ in messages] == [(b"kv", i) for i in range(len(messages))]
    assert all(batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 120 for _, _, batch in messages)


def test_stored_blocks_carry_vllms_int_hashes_their_parents_and_tokens(published):
    first, second, messages = published[:3]
    stored = events(messages, BlockStored)
    assert stored[0] == BlockStored(vllm_hashes(first), None, first[:32], 16, None, "GPU", None)
    later = stored[1:]
    assert [h for e in later for h in e.block_hashes] == vllm_hashes(second)
    assert [t for e in later for t in e.token_ids] == second[:112]
    assert later[0].parent_block_hash is None
    for before, after in zip(later, later[1:]):
        assert after.parent_block_hash == before.block_hashes[-1]


def test_blocks_evicted_for_the_second_prompt_are_removed_tail_first(published):
    first, _, messages = published[:3]
    removed = events(messages, BlockRemoved)
    assert [h for e in removed for h in e.block_hashes] == vllm_hashes(first)[::-1]
    assert {e.medium for e in removed} == {"GPU"}


def test_replay_sends_the_buffered_batches_from_the_asked_sequence_then_minus_one(published):
    messages, config, ctx = published[2:]
    # A DEALER, which takes the many replies of one request (the ROUTER reads (identity, b"", start seq)).
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(config["replay_endpoint"])
    dealer.send_multipart((b"", (1).to_bytes(8, "big")))
    replayed = []
    while True:
        assert dealer.poll(10_000)
        _, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            assert payload == b""
            break
        replayed.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    assert replayed == [(seq, batch) for _, seq, batch in messages[1:]]


@pytest.fixture(scope="module")
def wiped(stories_dir, tmp_path_factory):
    """An engine with events, sleep mode and a host tier, whose 8 usable blocks make a second prompt push the
    first's blocks to the host; and a subscriber connected before its first step."""
    folder = tmp_path_factory.mktemp("kv_wipes")
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{folder}/events"}
    llm = LLM(model=stories_dir, max_model_len=128, num_kv_blocks=9, max_num_seqs=4, max_num_batched_tokens=64,
              precompile=False, kv_events_config=config, enable_sleep_mode=True, kv_offloading_size=0.001)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(config["endpoint"])
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)  # ZMQ's slow joiner
    yield llm, sub
    llm.engine.core.kv_events.shutdown()
    ctx.destroy(linger=0)


def router_view(messages, view: Optional[set] = None) -> set:
    """The (medium, hash) pairs a KV-aware router holds after ``messages``, applied in order to ``view``."""
    view = set() if view is None else view
    for _, _, batch in messages:
        for e in batch.events:
            if isinstance(e, BlockStored):
                view |= {(e.medium, h) for h in e.block_hashes}
            elif isinstance(e, BlockRemoved):
                view -= {(e.medium, h) for h in e.block_hashes}
            else:
                view.clear()
    return view


WIPES = {
    "reset_prefix_cache": lambda llm, path: llm.reset_prefix_cache(),
    "sleep": lambda llm, path: llm.sleep(level=1),
    "update_weights_from_path": lambda llm, path: llm.update_weights_from_path(path),
}


@pytest.mark.parametrize("wipe", list(WIPES))
def test_every_cache_wipe_publishes_all_blocks_cleared_at_once_host_tier_included(wiped, stories_dir, wipe):
    llm, sub = wiped
    first, second = [3 + (i * 7) % 400 for i in range(40)], [5 + (i * 11) % 400 for i in range(120)]
    llm.generate([first], GREEDY, use_tqdm=False)
    llm.generate([second], GREEDY, use_tqdm=False)
    view = router_view(receive(sub))
    pool = llm.engine.scheduler.block_pool
    assert {m for m, _ in view} == {"GPU", "CPU"} and pool.cached and pool.host_tier.num_cached
    WIPES[wipe](llm, stories_dir)
    try:
        # Published by the wipe itself: no step has run since.
        after = receive(sub, until=3.0)
        assert [e for _, _, batch in after for e in batch.events] == [AllBlocksCleared()]
        assert router_view(after, view) == set()
        assert not pool.cached and pool.host_tier.num_cached == 0
    finally:
        if llm.is_sleeping():
            llm.wake_up()


@pytest.mark.parametrize("value, words", [
    ('{"enable_kv_cache_events": true, "endpoints": "tcp://*:1"}', "unknown field 'endpoints'"),
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher='kafka' must be 'zmq' or 'null'"),
    ({"enable_kv_cache_events": True, "hwm": 0}, "hwm=0 must be a positive int"),
    ({"endpoint": "localhost:5557"}, "must be a tcp://, ipc:// or inproc:// address"),
    ("{not json", "is not JSON"),
])
def test_a_bad_kv_events_config_is_refused_naming_the_field(value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        EngineConfig(kv_events_config=value)


def test_events_are_off_unless_enabled_with_the_zmq_publisher():
    assert EngineConfig(kv_events_config={"endpoint": "tcp://*:5557"}).scheduler_config(
        num_blocks=4, max_model_len=8).enable_kv_cache_events is False
    assert EngineConfig(kv_events_config='{"enable_kv_cache_events": true}').scheduler_config(
        num_blocks=4, max_model_len=8).enable_kv_cache_events is True


def test_data_parallel_cores_offset_the_endpoint_as_vllm_does():
    from jaxllm.core.kv_events import offset_port

    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_port("tcp://127.0.0.1:6000", 1) == "tcp://127.0.0.1:6001"
    assert offset_port("inproc://events", 1) == "inproc://events_dp1"
    assert offset_port(None, 1) is None
    with pytest.raises(ValueError, match="each core needs its own endpoint"):
        offset_port("ipc:///tmp/events", 1)


def test_publisher_connects_to_a_listening_subscriber_and_replays_only_its_last_buffer_steps(tmp_path):
    from jaxllm.config import KVEventsConfig
    from jaxllm.core.kv_events import ZmqEventPublisher
    from scheduler.kv_events import BlockRemoved as HostBlockRemoved
    from tests.server_process import free_port

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}",  # no '*': connects
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}", buffer_steps=2, hwm=7,
                            max_queue_size=5)
    publisher = ZmqEventPublisher(config, rank=0)
    try:
        assert (publisher._pub.getsockopt(zmq.SNDHWM), publisher._queue.maxsize) == (7, 5)
        probes = 0
        while not sub.poll(100):  # until the connection and the subscription have settled
            publisher.publish([HostBlockRemoved([b"\xff" * 16])])
            probes += 1
        receive(sub)
        for i in range(3):
            publisher.publish([HostBlockRemoved([bytes([i]) * 16])])
        publisher.publish([])  # a step without events sends nothing
        got = receive(sub)
        assert [(seq, batch.events) for _, seq, batch in got] == [
            (probes + i, [BlockRemoved([int.from_bytes(bytes([i]) * 8, "big")], "GPU")]) for i in range(3)]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(config.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs = []
        while True:
            assert dealer.poll(10_000)
            _, seq, _ = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            seqs.append(int.from_bytes(seq, "big"))
        assert seqs == [probes + 1, probes + 2]  # buffer_steps=2 keeps the last two batches
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)


def test_the_null_publisher_records_nothing():
    config = EngineConfig(kv_events_config={"enable_kv_cache_events": True, "publisher": "null"})
    assert config.scheduler_config(num_blocks=4, max_model_len=8).enable_kv_cache_events is False


def test_vllms_switch_sends_hashes_as_their_bytes(monkeypatch, tmp_path):
    from jaxllm.config import KVEventsConfig
    from jaxllm.core.kv_events import ZmqEventPublisher
    from scheduler.kv_events import BlockStored as HostBlockStored

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/ev"))
    try:
        sub.connect(f"ipc://{tmp_path}/ev")
        while not sub.poll(100):  # the same batch until the subscription has settled
            publisher.publish([HostBlockStored([b"h" * 16], b"p" * 16, list(range(4)), 4)])
        _, _, batch = receive(sub)[0]
        assert batch.events == [BlockStored([b"h" * 16], b"p" * 16, [0, 1, 2, 3], 4, None, "GPU", None)]
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)
