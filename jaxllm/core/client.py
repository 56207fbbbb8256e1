"""Core clients (vLLM's ``EngineCoreClient``): :class:`InprocClient` calls an ``EngineCore`` in this process;
:class:`MPClient` runs one core process per data-parallel replica over ZMQ msgpack frames, routing a request to
the longest cached prefix (``router.PrefixRouter``), then the fewest unfinished requests, then the lowest index.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any, Iterable, Optional, Sequence, Union

import msgspec
import zmq
import zmq.asyncio

from jaxllm import registry
from jaxllm.config import EngineConfig
from jaxllm.core.messages import (
    AbortRequests,
    CoreFailed,
    CoreInfo,
    CoreStats,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    StopSequences,
    UtilityCall,
    UtilityResult,
    decode_message,
    encode,
    encode_params,
)
from jaxllm.core.router import PrefixRouter

# How often a wait for outputs checks that every core process is alive, seconds.
POLL_SECONDS = 0.5


class EngineDeadError(RuntimeError):
    """An engine core process died or failed; no request in flight will finish."""


class QueueFullError(RuntimeError):
    """A new request was refused: ``max_waiting_requests`` sequences already wait (the server answers 503)."""


def check_waiting_limit(limit: Optional[int], num_open_sequences: int, infos: Sequence[CoreInfo],
                        latest_stats: dict[int, CoreStats]) -> None:
    """Refuse a new request while ``limit`` sequences or more wait for a batch seat (the larger of the open
    sequences beyond the seats and the cores' ``num_waiting`` in ``latest_stats``).
    Raises QueueFullError: ``limit`` is not None and reached (both numbers named).
    """
    if limit is None:
        return
    seats = sum(latest_stats[i].max_num_seqs if i in latest_stats else info.max_num_seqs for i, info in enumerate(infos))
    waiting = max(num_open_sequences - seats, sum(s.num_waiting for s in latest_stats.values()), 0)
    if waiting >= limit:
        raise QueueFullError(f"{waiting} requests are waiting for a batch seat, max_waiting_requests={limit}; "
                             "try again later")


class InprocClient:
    """An ``EngineCore`` in this process: ``core``, and ``infos`` its ``CoreInfo`` in a one-item list."""

    def __init__(self, core) -> None:
        self.core = core
        self.infos = [core.info()]

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: Optional[int] = None) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        self.core.abort_requests(request_ids)

    def stop_sequences(self, sequences: Sequence[tuple[str, int]]) -> None:
        self.core.stop_sequences(sequences)

    def requests_finished(self, request_ids: Sequence[str]) -> None:
        """Nothing to do: the one core knows its requests."""

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_outputs(self) -> list[EngineCoreOutputs]:
        """Run one core step."""
        return [self.core.step()]

    def wait_for_warmup(self, timeout: Optional[float] = None) -> bool:
        return self.core.wait_for_warmup(timeout)

    def preload_prefixes(self, prompts: Sequence[Sequence[int]]) -> None:
        """Compute ``prompts`` into the core's prefix cache (``EngineCore.preload_prefixes``)."""
        self.core.preload_prefixes(prompts)

    def shutdown(self) -> None:
        self.core.profiler.stop_quietly()  # a trace still recording is written, not lost
        self.core.runner.programs.stop_warmup()


def write_params_file(params: Any, folder: str) -> str:
    """Write a parameter tree for the core processes to read at start-up; returns the file's path."""
    path = os.path.join(folder, "params.msgpack")
    with open(path, "wb") as f:
        f.write(msgspec.msgpack.encode(encode_params(params)))
    return path


@dataclasses.dataclass
class _CoreProcess:
    index: int
    process: subprocess.Popen
    input: zmq.Socket


class MPClient:
    """``data_parallel_size`` engine-core processes behind one front end, over ZMQ.

    Args:
      model: as for ``EngineCore``; replica ``d`` runs on row ``d`` of the ``(data, model)`` mesh.
      config: the ``EngineConfig``; ``scheduling_policy`` must be a name.
      params: weights for every core instead of the model's, passed through a file.

    Attributes:
      infos: each core's ``CoreInfo``. router: the :class:`PrefixRouter`. routed: request id -> core index.
      num_routed: requests each core has been given.

    Raises:
      ValueError: a policy object, a ``ModelConfig`` as ``model``, or a registered family not importable.
      EngineDeadError: a core process failed while starting (its error in the message).
    """

    def __init__(self, model: Union[str, os.PathLike], config: EngineConfig, params: Optional[Any] = None) -> None:
        if not isinstance(config.scheduling_policy, str):
            raise ValueError(f"scheduling_policy={config.scheduling_policy!r}: a core in another process takes a "
                             "policy name ('fcfs', 'priority', 'sjf', 'aging', 'load_aware')")
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"model={type(model).__name__}: a core in another process reads its model config from "
                             "a path (a HF folder, a GGUF file or an orbax folder), not a ModelConfig")
        registrations = registry.registrations_json()
        self._dir = tempfile.mkdtemp(prefix="jaxllm-core-")
        extra = [] if params is None else ["--params", write_params_file(params, self._dir)]
        self._ctx = zmq.Context()
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(f"ipc://{self._dir}/outputs")
        self._async_output: Optional[zmq.asyncio.Socket] = None
        self._cores: list[_CoreProcess] = []
        self._pending: collections.deque[EngineCoreOutputs] = collections.deque()
        self._results: dict[int, UtilityResult] = {}
        self._call_ids = itertools.count()
        self._dead: Optional[str] = None
        config_json = json.dumps(dataclasses.asdict(config))
        for d in range(config.data_parallel_size):
            sock = self._ctx.socket(zmq.PUSH)
            address = f"ipc://{self._dir}/input{d}"
            sock.bind(address)
            process = subprocess.Popen([
                sys.executable, "-m", "jaxllm.core.process", "--model", str(model), "--config", config_json,
                "--core-index", str(d), "--input", address, "--output", f"ipc://{self._dir}/outputs",
                "--parent-pid", str(os.getpid()), "--registrations", registrations, *extra,
            ])
            self._cores.append(_CoreProcess(d, process, sock))
        self._finalizer = weakref.finalize(self, _stop_cores, self._cores, self._ctx, self._dir)
        self.infos = self._wait_ready()
        if extra:
            os.unlink(extra[1])  # every core has read its weights
        self.router = PrefixRouter(self.infos)
        self.routed: dict[str, int] = {}
        self.num_routed = [0] * len(self._cores)
        self._loads = [0] * len(self._cores)

    def _wait_ready(self) -> list[CoreInfo]:
        infos: dict[int, CoreInfo] = {}
        try:
            while len(infos) < len(self._cores):
                if not self._output.poll(POLL_SECONDS * 1000):
                    self._check_alive()
                    continue
                message = decode_message(self._output.recv())
                if isinstance(message, CoreFailed):
                    raise EngineDeadError(f"engine core {message.core_index} failed to start: {message.message}")
                infos[message.core_index] = message
        except BaseException:
            self.shutdown()
            raise
        return [infos[d] for d in range(len(self._cores))]

    @property
    def dead(self) -> Optional[str]:
        """Why the cores are dead (None while they run)."""
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is None:
            for core in self._cores:
                status = core.process.poll()
                if status is not None:
                    self._dead = f"engine core {core.index} (pid {core.process.pid}) exited with status {status}"
                    break
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _send(self, core: int, message: Any) -> None:
        self._check_alive()
        self._cores[core].input.send(encode(message), copy=False)

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: Optional[int] = None) -> None:
        """Route a request to a core (``data_parallel_rank``: this one) and send it.
        Raises ValueError: a rank outside ``[0, data_parallel_size)``; EngineDeadError: the cores are dead.
        """
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < len(self._cores):
            raise ValueError(f"data_parallel_rank={data_parallel_rank} must be in [0, {len(self._cores)})")
        ids, salt = request.prompt_token_ids, request.cache_salt
        core = data_parallel_rank if data_parallel_rank is not None else self.router.choose(ids, salt, self._loads)
        self._send(core, request)
        self.router.record(core, ids, salt)
        self.routed[request.request_id] = core
        self.num_routed[core] += 1
        self._loads[core] += 1

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Abort requests in whichever core holds them; their blocks are freed in its next loop turn."""
        by_core: dict[int, list[str]] = collections.defaultdict(list)
        for rid in request_ids:
            core = self._release(rid)
            if core is not None:
                by_core[core].append(rid)
        if self._dead is None:
            for core, ids in by_core.items():
                self._send(core, AbortRequests(ids))

    def stop_sequences(self, sequences: Sequence[tuple[str, int]]) -> None:
        by_core: dict[int, list[tuple[str, int]]] = collections.defaultdict(list)
        for rid, index in sequences:
            if rid in self.routed:
                by_core[self.routed[rid]].append((rid, index))
        for core, seqs in by_core.items():
            self._send(core, StopSequences(seqs))

    def requests_finished(self, request_ids: Sequence[str]) -> None:
        """The front end saw these requests finish: they no longer load their cores."""
        for rid in request_ids:
            self._release(rid)

    def _release(self, request_id: str) -> Optional[int]:
        core = self.routed.pop(request_id, None)
        if core is not None:
            self._loads[core] -= 1
        return core

    def _drain(self) -> None:
        """Take every frame waiting on the output socket."""
        while True:
            try:
                frame = self._output.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = decode_message(frame)
            if isinstance(message, EngineCoreOutputs):
                self._pending.append(message)
            elif isinstance(message, UtilityResult):
                self._results[message.call_id] = message
            elif isinstance(message, CoreFailed):
                self._dead = f"engine core {message.core_index} failed: {message.message}"

    def _take_pending(self) -> list[EngineCoreOutputs]:
        outputs = list(self._pending)
        self._pending.clear()
        return outputs

    def get_outputs(self, timeout: Optional[float] = None) -> list[EngineCoreOutputs]:
        """Wait until some core reports; its outputs in arrival order ([] after ``timeout`` seconds).
        Raises EngineDeadError: a core died or failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            self._check_alive()
            wait = POLL_SECONDS if deadline is None else min(POLL_SECONDS, max(deadline - time.monotonic(), 0))
            if self._output.poll(wait * 1000):
                self._drain()
            elif deadline is not None and time.monotonic() >= deadline:
                break
        self._check_alive()
        return self._take_pending()

    async def get_outputs_async(self) -> list[EngineCoreOutputs]:
        """:meth:`get_outputs` without blocking the event loop. Raises EngineDeadError: a core died or failed."""
        while not self._pending:
            self._check_alive()
            if await self._async_socket().poll(POLL_SECONDS * 1000):
                self._drain()
        self._check_alive()
        return self._take_pending()

    def call_utility(self, core: int, method: str, *args: Any) -> Any:
        """Call ``EngineCore.<method>(*args)`` in core ``core`` between its steps and return the value.
        Raises RuntimeError: the core refused or the call raised; EngineDeadError: the cores are dead."""
        call_id = next(self._call_ids)
        self._send(core, UtilityCall(call_id, method, list(args)))
        while call_id not in self._results:
            self._check_alive()
            if self._output.poll(POLL_SECONDS * 1000):
                self._drain()
        return self._utility_result(core, method, call_id)

    async def call_utility_async(self, core: int, method: str, *args: Any) -> Any:
        """:meth:`call_utility` without blocking the event loop. Raises as :meth:`call_utility`."""
        call_id = next(self._call_ids)
        self._send(core, UtilityCall(call_id, method, list(args)))
        while call_id not in self._results:
            self._check_alive()
            if await self._async_socket().poll(POLL_SECONDS * 1000):
                self._drain()
        return self._utility_result(core, method, call_id)

    def _utility_result(self, core: int, method: str, call_id: int) -> Any:
        result = self._results.pop(call_id)
        if result.error is not None:
            # A refused argument stays a ValueError across the process boundary, as it is in the core.
            error = ValueError if result.error_type == "ValueError" else RuntimeError
            raise error(f"engine core {core}: {method}: {result.error}")
        return result.result

    def _async_socket(self) -> zmq.asyncio.Socket:
        if self._async_output is None:
            self._async_output = zmq.asyncio.Socket.from_socket(self._output)
        return self._async_output

    def has_unfinished_requests(self) -> bool:
        return bool(self.routed)

    def wait_for_warmup(self, timeout: Optional[float] = None) -> bool:
        return all([self.call_utility(d, "wait_for_warmup", timeout) for d in range(len(self._cores))])

    def preload_prefixes(self, prompts: Sequence[Sequence[int]]) -> None:
        """Compute ``prompts`` into every core's prefix cache (``EngineCore.preload_prefixes``)."""
        for d in range(len(self._cores)):
            self.call_utility(d, "preload_prefixes", [list(p) for p in prompts])
            for ids in prompts:
                self.router.record(d, ids, None)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every core, killing after ``timeout`` seconds; a second call does nothing."""
        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        if self._async_output is not None:
            self._async_output.close(linger=0)
        _stop_cores(self._cores, self._ctx, self._dir, timeout)


def _stop_cores(cores: Iterable[_CoreProcess], ctx: zmq.Context, folder: str, timeout: float = 5.0) -> None:
    cores = list(cores)
    for core in cores:
        if core.process.poll() is None:
            try:
                core.input.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    deadline = time.monotonic() + timeout
    for core in cores:
        try:
            core.process.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            core.process.kill()
            core.process.wait()
    ctx.destroy(linger=0)
    shutil.rmtree(folder, ignore_errors=True)
