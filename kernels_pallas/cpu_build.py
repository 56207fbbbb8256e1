"""Builds the C++ CPU kernels (``attention/paged_attention_cpu.cc``, ``matmul/matmul_cpu.cc``) into one cached
library, loads it and registers the XLA FFI targets it is asked for. Only the ops table (``kernels_pallas.ops``)
calls this module: it names the targets, which each backend module declares beside its kernel. Where no compiler
is found, the build fails or ``JAXLLM_NATIVE_KERNELS=0``, :func:`load` is False (why: :func:`unavailable_reason`).
Cache location and key: docs/design/kernels.md.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import jax

from kernels_pallas import cpu_features

_HERE = Path(__file__).parent
# One library of both sources (and the header they share: part of the cache key).
SOURCES = (_HERE / "attention" / "paged_attention_cpu.cc", _HERE / "matmul" / "matmul_cpu.cc")
HEADERS = (_HERE / "cpu_vectors.h",)
# -march=native: the library is built on the machine that runs it, for its vector instructions.
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
_reason: Optional[str] = None
_lib: Optional[ctypes.CDLL] = None  # the loaded kernels, once load() has built them


def _cache_dir() -> Path:
    """``$JAXLLM_NATIVE_CACHE``, else ``jaxllm/native`` in ``$XDG_CACHE_HOME`` (default ``~/.cache``)."""
    if os.environ.get("JAXLLM_NATIVE_CACHE"):
        return Path(os.environ["JAXLLM_NATIVE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxllm" / "native"


def library_path(compiler: str) -> Path:
    """Cache path of the library for ``compiler`` and these sources, flags, jaxlib and CPU: ``jaxllm_cpu-<16 hex>.so``.

    Builds nothing. Raises OSError where a source cannot be read.
    """
    import jaxlib

    key = hashlib.sha256("\0".join([*(source.read_text() for source in SOURCES + HEADERS), compiler, *_FLAGS,
                                    jaxlib.__version__, jax.ffi.include_dir(),
                                    cpu_features.flags_line()]).encode())
    return _cache_dir() / f"jaxllm_cpu-{key.hexdigest()[:16]}.so"


def _build(compiler: str) -> Path:
    """The library's path, compiled unless cached (CalledProcessError / OSError on failure)."""
    include = jax.ffi.include_dir()
    out = library_path(compiler)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, f"-I{include}", f"-I{_HERE}", *map(str, SOURCES), "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.lru_cache(maxsize=None)
def load(targets: tuple[tuple[str, str], ...]) -> bool:
    """Build (unless cached) and load the library, and register each ``(FFI target, C symbol)`` of ``targets``
    for XLA's CPU platform; whether that succeeded (decided once per process and ``targets``). Raises nothing.
    """
    global _reason
    if os.environ.get("JAXLLM_NATIVE_KERNELS", "1") == "0":
        _reason = "JAXLLM_NATIVE_KERNELS=0"
        return False
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not compiler:
        _reason = "no C++ compiler (c++, g++ or clang++ on PATH, or $CXX)"
        return False
    try:
        global _lib
        lib = _lib = ctypes.CDLL(str(_build(compiler)))
        for target, symbol in targets:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        _reason = f"the C++ CPU kernels did not build or load: {detail.strip()[:500]}"
        print(f"[kernels_pallas] {_reason}; using the jnp attention and XLA's dots", file=sys.stderr)
        return False
    return True


def unavailable_reason() -> Optional[str]:
    """Why :func:`load` is False (None while it is True or not yet asked)."""
    return _reason


def library_int(symbol: str) -> int:
    """The int64 a no-argument C function of the loaded library returns (a count or a build constant).

    Raises:
      ValueError: the library is not loaded (:func:`load` not asked, or False).
    """
    if _lib is None:
        raise ValueError(f"the C++ CPU kernels are not available: {unavailable_reason() or 'not loaded'}")
    function = getattr(_lib, symbol)
    function.restype = ctypes.c_int64
    return int(function())
