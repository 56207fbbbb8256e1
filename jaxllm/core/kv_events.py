"""KV cache events published as vLLM publishes them (``--kv-events-config``), so routers see the prefix cache.

vLLM's wire format: ZMQ PUB ``(topic, seq as 8 big-endian bytes, msgpack KVEventBatch)``, an optional ROUTER
replaying from a ``start_seq``; core ``i`` adds ``i`` to the ports. Hashes: 16-byte xxh3 of ``scheduler.block_hash``;
medium "GPU" is the device pool, "CPU" the host tier.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from typing import Optional, Union

import msgspec
import zmq

from jaxllm.config import KVEventsConfig
from scheduler.kv_events import AllBlocksCleared as HostAllBlocksCleared
from scheduler.kv_events import BlockRemoved as HostBlockRemoved
from scheduler.kv_events import KVEvent

logger = logging.getLogger("jaxllm.core.kv_events")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

ExternalBlockHash = Union[int, bytes]


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base of the events; ``tag=True`` writes the class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    """vLLM's ``BlockStored``: full blocks became cached (see ``scheduler.kv_events.BlockStored``)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]


class BlockRemoved(KVCacheEvent):
    """vLLM's ``BlockRemoved``: cached blocks were evicted."""

    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    """vLLM's ``AllBlocksCleared``: every cached block was forgotten (see ``scheduler.kv_events.AllBlocksCleared``)."""


WireEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: one step's events, a positional array ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: Optional[int] = None


def external_hash(block_hash: bytes, as_int: bool) -> ExternalBlockHash:
    """vLLM's ``maybe_convert_block_hash``: the low 64 bits of the hash read big-endian, or the bytes."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1) if as_int else block_hash


def to_wire(event: KVEvent, as_int: bool) -> WireEvent:
    """A ``scheduler.kv_events`` event as vLLM's struct."""
    if isinstance(event, HostAllBlocksCleared):
        return AllBlocksCleared()
    hashes = [external_hash(h, as_int) for h in event.block_hashes]
    if isinstance(event, HostBlockRemoved):
        return BlockRemoved(hashes, event.medium)
    parent = None if event.parent_block_hash is None else external_hash(event.parent_block_hash, as_int)
    return BlockStored(hashes, parent, list(event.token_ids), event.block_size, None, event.medium, None)


def offset_port(endpoint: Optional[str], rank: int) -> Optional[str]:
    """``endpoint`` for data-parallel ``rank`` (vLLM's ``offset_endpoint_port``). Raises ValueError: ipc, rank > 0."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"kv_events_config endpoint {endpoint!r}: with data_parallel_size > 1 each core needs "
                         "its own endpoint; use tcp:// (the port is offset by the core's index) or inproc://")
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"


class ZmqEventPublisher:
    """Publishes each step's events from a thread (``config.publishes`` true; ``rank`` the core's index)."""

    def __init__(self, config: KVEventsConfig, rank: int = 0) -> None:
        self.rank, self._topic = rank, config.topic.encode()
        self._as_int = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
        self._queue: queue.Queue[Optional[KVEventBatch]] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = offset_port(config.endpoint, rank)
        binds = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
        if binds:
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(offset_port(config.replay_endpoint, rank))
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"jaxllm-kv-events-{rank}")
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events as a batch (nothing when there are none)."""
        if events:
            self._queue.put(KVEventBatch(time.time(), [to_wire(e, self._as_int) for e in events], self.rank))

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        encoder, seq = msgspec.msgpack.Encoder(), 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("kv events replay: a request of %d frames, not (identity, b'', start seq)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))


def make_publisher(config: Optional[KVEventsConfig], rank: int) -> Optional[ZmqEventPublisher]:
    """The core's publisher, or None when events are off."""
    return ZmqEventPublisher(config, rank) if config is not None and config.publishes else None
