"""glibc's malloc, set for a process whose model steps run on the host (XLA's CPU backend).

Each step of XLA's CPU backend allocates its buffers (the lm_head's logits, ``[rows, vocab]`` float32: 37.7 MB for
192 rows of SmolLM2) and frees them when it ends. glibc serves an allocation that large with a fresh ``mmap`` (its
mmap threshold adapts up to 32 MiB, no further) or, in the per-thread arenas of XLA's worker threads, a fresh heap
that is unmapped again when it empties; either way the next step faults every page back in and the kernel zeroes
it. One arena that keeps its memory (:data:`SETTINGS`) avoids that (``docs/design/worker.md`` has the figures).
vLLM's CPU backend answers the same cost by preloading tcmalloc into its workers; an engine that lives in its
user's process cannot preload a library, but glibc takes these settings at run time (``mallopt``).

They must come before JAX starts its CPU client: a thread that has allocated once keeps its arena, so set after
that they leave XLA's threads as they were (:func:`tune_host_malloc`'s line says so). Memory freed below the
thresholds stays with the process for its next steps (and its next engine) instead of returning to the system, as
a preallocating engine expects: the process's resident memory does not fall when an engine is dropped.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pkgutil
import sys
from typing import Mapping, Optional

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
# What a process running steps on the host is given: one arena, and no mmap, trim or heap release below 1 GiB.
# Older glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit); it then gets that.
SETTINGS = {"arena_max": (_M_ARENA_MAX, 1), "mmap_threshold": (_M_MMAP_THRESHOLD, 1 << 30),
            "trim_threshold": (_M_TRIM_THRESHOLD, 1 << 30), "top_pad": (_M_TOP_PAD, 64 << 20)}
_OLD_GLIBC_MMAP_THRESHOLD = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
# The variable that turns the tuning off ("0").
ENV_SWITCH = "JAXLLM_TUNE_MALLOC"

_done: Optional[str] = None


def _accelerator_plugin(environ: Mapping[str, str]) -> Optional[str]:
    """The installed PJRT plugin (or libtpu) JAX would run steps on instead of the host, unless ``JAX_PLATFORMS``
    puts the CPU first; found without starting a backend."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms.split(",")[0].strip() == "cpu":
        return None
    if importlib.util.find_spec("libtpu") is not None:
        return "libtpu"
    try:
        import jax_plugins
    except ImportError:
        return None
    return next((m.name for m in pkgutil.iter_modules(jax_plugins.__path__)), None)


def _reason_to_skip(environ: Mapping[str, str]) -> Optional[str]:
    """Why the settings are left alone in this environment, or None (the C library is checked apart)."""
    if environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    chosen = sorted(k for k in environ if k.startswith("MALLOC_"))
    if chosen or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return f"malloc is set from the environment ({', '.join(chosen) or 'GLIBC_TUNABLES glibc.malloc'})"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    plugin = _accelerator_plugin(environ)
    if plugin is not None:
        return f"steps run on the accelerator of {plugin}"
    return None


def _glibc() -> tuple[Optional[ctypes.CDLL], str]:
    """(glibc, its version) where ``malloc`` is glibc's own, else (None, why not)."""
    try:
        process, libc = ctypes.CDLL(None), ctypes.CDLL("libc.so.6")
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None, "not glibc"
    # An allocator loaded ahead of glibc (LD_PRELOAD, /etc/ld.so.preload, linked in) owns the process's malloc.
    if ctypes.cast(process.malloc, ctypes.c_void_p).value != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return None, "malloc is not glibc's (another allocator is loaded)"
    version.restype = ctypes.c_char_p
    return libc, version().decode()


def tune_host_malloc(environ: Optional[Mapping[str, str]] = None) -> str:
    """Give glibc's malloc :data:`SETTINGS` once per process, before JAX's CPU client starts.

    Left alone where ``JAXLLM_TUNE_MALLOC=0``, where ``MALLOC_*`` variables or ``glibc.malloc`` entries of
    ``GLIBC_TUNABLES`` already set malloc, where an accelerator plugin is installed (steps do not run on the host)
    unless ``JAX_PLATFORMS`` puts the CPU first, where another allocator than glibc's serves ``malloc``, and off
    Linux.

    Args:
      environ: the environment to read (default ``os.environ``); read on the first call only.

    Returns:
      The start-up log's line saying what was done, with the values glibc took (the same line on every later
      call).

    Raises nothing: a setting glibc refuses is named "refused" in the line. Follows glibc's ``mallopt(3)``
    parameters (malloc.h); vLLM's CPU platform preloads tcmalloc for the same cost.
    """
    global _done
    if _done is not None:
        return _done
    skip = _reason_to_skip(os.environ if environ is None else environ)
    libc, version = (None, "") if skip is not None else _glibc()
    if libc is None:
        _done = f"host malloc: the C library's defaults ({skip or version})"
        return _done
    taken = []
    for name, (param, value) in SETTINGS.items():
        if libc.mallopt(param, value) != 1:
            retry = name == "mmap_threshold" and libc.mallopt(param, _OLD_GLIBC_MMAP_THRESHOLD) == 1
            value = _OLD_GLIBC_MMAP_THRESHOLD if retry else None
        taken.append(f"{name} " + ("refused" if value is None else str(value) if name == "arena_max"
                                   else f"{value >> 20} MiB"))
    from jax._src import xla_bridge

    _done = (f"host malloc: {', '.join(taken)} (glibc {version} mallopt; {ENV_SWITCH}=0 keeps its defaults)"
             + ("; JAX's CPU client started first, so its threads keep their own arenas (build the engine before "
                "other JAX work to include them)" if xla_bridge.backends_are_initialized() else ""))
    return _done
