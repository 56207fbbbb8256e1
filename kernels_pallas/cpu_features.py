"""The host CPU's instruction sets, read from ``/proc/cpuinfo`` (the one reader of that file)."""

from __future__ import annotations

import functools
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# /proc/cpuinfo flag -> the name people know it by, in the order they appeared.
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512-BF16", "amx_bf16": "AMX-BF16"}


def flags_line(cpuinfo: Path = CPUINFO) -> str:
    """The first CPU's ``flags`` line as written; "" where unreadable or absent. Raises nothing."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


@functools.lru_cache(maxsize=None)
def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first CPU's flags (``{"avx2", "avx512f", ...}``); empty where unreadable. Cached per path; raises nothing."""
    line = flags_line(cpuinfo)
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def cpu_instruction_sets(cpuinfo: Path = CPUINFO) -> list[str]:
    """Names (``ISA_FLAGS``' values) of the instruction sets the first CPU lists; empty if none or unreadable."""
    flags = cpu_flags(cpuinfo)
    return [name for flag, name in ISA_FLAGS.items() if flag in flags]


def describe_cpu(cpuinfo: Path = CPUINFO) -> str:
    """``"AVX2, AVX-512, AVX-512-BF16"`` (or ``"no AVX2"``): the line every benchmark and the start-up log print."""
    sets = cpu_instruction_sets(cpuinfo)
    return ", ".join(sets) if sets else "no AVX2"
