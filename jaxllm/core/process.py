"""An engine core in its own process: ``python -m jaxllm.core.process`` (started by ``client.MPClient``).

A single-threaded busy loop (vLLM's ``EngineCoreProc``). It exits with its parent, on ``Shutdown``, or after
sending ``CoreFailed`` (status 1); SIGINT is ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Optional, Sequence

import msgspec
import zmq

from jaxllm.core.messages import (
    AbortRequests,
    CoreFailed,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
    StopSequences,
    UtilityCall,
    UtilityResult,
    decode_input,
    decode_params,
    encode,
)
from jaxllm.logger import init_logger

logger = init_logger("jaxllm.core.process")  # not __name__: the module runs as __main__

# How often the watchdog looks for the parent, seconds.
PARENT_CHECK_SECONDS = 0.5


def _exit_when_parent_dies(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_CHECK_SECONDS)
        if os.getppid() != parent_pid:
            os._exit(1)


def run_core_loop(core, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
    """Serve ``core`` (an ``EngineCore``) until a ``Shutdown`` arrives."""
    while True:
        timeout = 0 if core.can_step else None
        changed = False
        while inputs.poll(timeout):
            message = decode_input(inputs.recv())
            timeout = 0
            if isinstance(message, Shutdown):
                core.abort_all()
                core.profiler.stop_quietly()  # a trace still recording is written, not lost
                core.runner.programs.stop_warmup()
                if core.kv_events is not None:
                    core.kv_events.shutdown()
                return
            if isinstance(message, UtilityCall):
                outputs.send(encode(_call(core, message)))
                continue
            changed = True
            if isinstance(message, EngineCoreRequest):
                core.add_request(message)
            elif isinstance(message, AbortRequests):
                core.abort_requests(message.request_ids)
            elif isinstance(message, StopSequences):
                core.stop_sequences(message.sequences)
        if core.can_step:
            outputs.send(encode(core.step()))
        elif changed:
            outputs.send(encode(EngineCoreOutputs([], core.stats(), core.core_index)))


def _call(core, call: UtilityCall) -> UtilityResult:
    if call.method not in core.UTILITY_METHODS:
        return UtilityResult(call.call_id, error=f"{call.method!r} is not a utility method "
                                                 f"({sorted(core.UTILITY_METHODS)})")
    try:
        return UtilityResult(call.call_id, getattr(core, call.method)(*call.args))
    except Exception as e:  # the caller gets the error; the core goes on
        return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}", error_type=type(e).__name__)


def read_params_file(path: str) -> dict:
    """The weights a front end wrote for its core processes (``client.write_params_file``), as numpy arrays."""
    with open(path, "rb") as f:
        return decode_params(msgspec.msgpack.decode(f.read()))


def replica_mesh(config, core_index: int):
    """Core ``core_index``'s mesh: its row of the ``(data, model)`` mesh when all devices are visible, else the
    first ``tensor_parallel_size`` devices.
    """
    import jax

    from jaxllm.worker.sharding import make_mesh, replica_meshes

    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    if len(jax.devices()) >= tp * dp:
        return replica_meshes(make_mesh(tp, dp))[core_index]
    return make_mesh(tp)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Start one core: load the model, send its ``CoreInfo``, serve until told to stop; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m jaxllm.core.process")
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", required=True, help="the EngineConfig fields as JSON")
    parser.add_argument("--core-index", type=int, default=0)
    parser.add_argument("--input", required=True, help="ZMQ address of this core's input socket")
    parser.add_argument("--output", required=True, help="ZMQ address of the front end's output socket")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--registrations", default="[]",
                        help="the front end's registered architectures (jaxllm.registry.registrations_json)")
    parser.add_argument("--params", help="a file of the weights to serve (messages.encode_params, msgpack)")
    args = parser.parse_args(argv)
    # First, before any thread or JAX's CPU client (replica_mesh below starts it) allocates: see host_malloc.
    from jaxllm.worker.host_malloc import tune_host_malloc

    tune_host_malloc()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_parent_dies, args=(args.parent_pid,), daemon=True,
                     name="jaxllm-parent-watchdog").start()
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inputs.connect(args.input)
    outputs.connect(args.output)
    try:
        from jaxllm import registry
        from jaxllm.config import EngineConfig
        from jaxllm.core.build import build_engine_core

        registry.replay_registrations(args.registrations)
        config = EngineConfig(**json.loads(args.config))
        try:
            core = build_engine_core(args.model, dataclasses.replace(config, data_parallel_size=1),
                                     mesh=replica_mesh(config, args.core_index), core_index=args.core_index,
                                     params=None if args.params is None else read_params_file(args.params))
        except ValueError as e:
            # Mostly a setting or model the engine cannot serve, named by the message, which the server prints
            # once; the traceback, for a ValueError that is a bug, is at debug level (--log-level debug).
            logger.debug(f"engine core {args.core_index} failed to build:\n{traceback.format_exc()}")
            outputs.send(encode(CoreFailed(args.core_index, str(e) or repr(e))))
            ctx.destroy(linger=2000)
            return 1
        outputs.send(encode(core.info()))
        run_core_loop(core, inputs, outputs)
    except Exception:
        traceback.print_exc()
        outputs.send(encode(CoreFailed(args.core_index, traceback.format_exc(limit=-3))))
        ctx.destroy(linger=2000)
        return 1
    ctx.destroy(linger=0)  # after Shutdown: nothing left is wanted, and no reader may be left to take it
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
