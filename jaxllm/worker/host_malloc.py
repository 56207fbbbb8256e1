"""glibc's malloc, set for a process whose model steps run on the host (XLA's CPU backend).

Each step of XLA's CPU backend allocates its buffers (the lm_head's logits, ``[rows, vocab]`` float32: 37.7 MB for
192 rows of SmolLM2) and frees them when it ends. glibc serves an allocation that large with a fresh ``mmap`` (past
its 32 MB ceiling on the mmap threshold) or, in the per-thread arenas of XLA's worker threads, a fresh heap that is
unmapped again when it empties; either way the next step faults every page back in and the kernel zeroes it. On
``bench_throughput.py``'s short shape (2 AMD Zen 4 cores, float32) that was 0.76 million page faults and 2.0 s of
system time in a 25 s run. One arena that keeps its memory (the settings below) took it to 14 thousand faults and
0.5 s. vLLM's CPU backend answers the same cost by preloading tcmalloc into its workers; an engine that lives in
its user's process cannot preload a library, but glibc takes these settings at run time (``mallopt``).

They must come before JAX starts its CPU client: a thread that has allocated once keeps its arena, so set after
that they leave XLA's threads as they were (:func:`tune_host_malloc` says so). Memory freed below the thresholds
stays with the process for its next steps instead of returning to the system, as a preallocating engine expects.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
# What a process running steps on the host is given: one arena, and no mmap, trim or heap release below 1 GiB.
SETTINGS = {"arena_max": (_M_ARENA_MAX, 1), "mmap_threshold": (_M_MMAP_THRESHOLD, 1 << 30),
            "trim_threshold": (_M_TRIM_THRESHOLD, 1 << 30), "top_pad": (_M_TOP_PAD, 64 << 20)}
# The variable that turns the tuning off ("0"), and the environment that means someone already chose the allocator.
ENV_SWITCH = "JAXLLM_TUNE_MALLOC"
_OWN_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")

_done: Optional[str] = None


def _reason_to_skip(environ: dict) -> Optional[str]:
    """Why the settings are left alone in this environment, or None."""
    if environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    preload = environ.get("LD_PRELOAD", "")
    allocator = next((name for name in _OWN_ALLOCATORS if name in preload), None)
    if allocator is not None:
        return f"{allocator} is preloaded (LD_PRELOAD)"
    chosen = sorted(k for k in environ if k.startswith("MALLOC_"))
    if chosen or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return f"malloc is set from the environment ({', '.join(chosen) or 'GLIBC_TUNABLES'})"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    return None


def tune_host_malloc(environ: Optional[dict] = None) -> str:
    """Give glibc's malloc :data:`SETTINGS` once per process, before JAX's CPU client starts.

    Left alone where ``JAXLLM_TUNE_MALLOC=0``, where another allocator is preloaded (tcmalloc, jemalloc,
    mimalloc), where ``MALLOC_*`` variables or ``GLIBC_TUNABLES`` already set malloc, and off Linux glibc.

    Args:
      environ: the environment to read (default ``os.environ``).

    Returns:
      The start-up log's line saying what was done (the same line on every later call).
    """
    global _done
    if _done is not None:
        return _done
    skip = _reason_to_skip(dict(os.environ if environ is None else environ))
    if skip is None:
        try:
            libc = ctypes.CDLL(None)
            mallopt, version = libc.mallopt, libc.gnu_get_libc_version
        except (OSError, AttributeError):
            skip = "not glibc"
    if skip is not None:
        _done = f"host malloc: the C library's defaults ({skip})"
        return _done
    version.restype = ctypes.c_char_p
    refused = [name for name, (param, value) in SETTINGS.items() if mallopt(param, value) != 1]
    from jax._src import xla_bridge

    late = getattr(xla_bridge, "backends_are_initialized", lambda: False)()
    _done = ("host malloc: one arena, no mmap or trim below 1 GiB (glibc " + version().decode() + " mallopt; "
             f"{ENV_SWITCH}=0 keeps its defaults)"
             + (f"; refused: {', '.join(refused)}" if refused else "")
             + ("; JAX's CPU client started first, so its threads keep their own arenas (build the engine before other "
                "JAX work to include them)" if late else ""))
    return _done
