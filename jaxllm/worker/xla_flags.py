"""XLA's GPU flags that jaxllm's GPU runs choose between, in one place: CUDA-graph command buffers.

XLA reads ``XLA_FLAGS`` once, when its backend starts, so :func:`apply_gpu_xla_flags` runs before the first JAX
device use (``python -m jaxllm.worker.xla_flags MODE`` prints the value for a shell to export). The mode comes from
``JAXLLM_XLA_COMMAND_BUFFER``; ``default`` leaves XLA's own choice (the default until measured otherwise).
Flag names: XLA's ``xla/debug_options_flags.cc`` (``--xla_gpu_enable_command_buffer``, a list of command types
captured into CUDA graphs; an empty list turns them off; ``--xla_gpu_graph_min_graph_size``).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

ENV = "JAXLLM_XLA_COMMAND_BUFFER"
# Mode -> the command types captured; None: no flag, XLA's default set.
COMMAND_BUFFER_MODES: dict[str, Optional[str]] = {
    "default": None,
    "off": "",
    # Control flow too (CONDITIONAL, WHILE): a branch or loop inside a graph keeps its predicate on the device.
    "all": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE",
}
_OWN = ("--xla_gpu_enable_command_buffer=", "--xla_gpu_graph_min_graph_size=")


def gpu_xla_flags(mode: str) -> list[str]:
    """The XLA flags of command-buffer ``mode`` (a key of :data:`COMMAND_BUFFER_MODES`); ValueError otherwise."""
    if mode not in COMMAND_BUFFER_MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {sorted(COMMAND_BUFFER_MODES)}")
    types = COMMAND_BUFFER_MODES[mode]
    if types is None:
        return []
    # One op is worth a graph where every launch is dispatch overhead.
    return [f"--xla_gpu_enable_command_buffer={types}"] + (["--xla_gpu_graph_min_graph_size=1"] if types else [])


def with_gpu_xla_flags(xla_flags: str, mode: str) -> str:
    """``xla_flags`` (an ``XLA_FLAGS`` value) with its command-buffer flags replaced by ``mode``'s."""
    kept = [flag for flag in xla_flags.split() if not flag.startswith(_OWN)]
    return " ".join(kept + gpu_xla_flags(mode))


def apply_gpu_xla_flags(mode: Optional[str] = None) -> str:
    """Set ``XLA_FLAGS`` for ``mode`` (None: ``$JAXLLM_XLA_COMMAND_BUFFER``, else ``default``); returns the value.
    Takes effect only before JAX's backend starts. ValueError for an unknown mode."""
    mode = mode or os.environ.get(ENV) or "default"
    os.environ["XLA_FLAGS"] = value = with_gpu_xla_flags(os.environ.get("XLA_FLAGS", ""), mode)
    return value


if __name__ == "__main__":
    print(with_gpu_xla_flags(os.environ.get("XLA_FLAGS", ""), sys.argv[1] if len(sys.argv) > 1 else "default"))
