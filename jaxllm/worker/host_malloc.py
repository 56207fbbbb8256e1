"""glibc's malloc, set for a process whose model steps run on the host (XLA's CPU backend): one arena that keeps its
memory (:data:`SETTINGS`), so per-step buffers are not faulted in and zeroed again each step (vLLM's CPU backend
preloads tcmalloc for the same cost). Must run before JAX starts its CPU client; memory freed stays with the process.
docs/design/worker.md has the reasoning and figures."""

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
    """The installed PJRT plugin (or libtpu) that would run steps, unless ``JAX_PLATFORMS`` puts CPU first."""
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
    """Why the settings are left alone in this environment, or None."""
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
    """Give glibc's malloc :data:`SETTINGS` (``mallopt(3)``) once per process, before JAX's CPU client starts.

    Left alone with ``JAXLLM_TUNE_MALLOC=0``, ``MALLOC_*`` or ``GLIBC_TUNABLES`` glibc.malloc set, an accelerator plugin
    installed (unless ``JAX_PLATFORMS`` puts CPU first), another allocator than glibc's, or off Linux.

    Args:
      environ: the environment to read (default ``os.environ``), on the first call only.

    Returns:
      The start-up log's line saying what was done (the same on later calls); a refused setting is named "refused".
      Raises nothing.
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
