"""The host CPU's vector instruction sets, read from ``/proc/cpuinfo``.

Which dtype is fast on XLA's CPU backend, and how close a step comes to the machine's matmul rate, depend on them:
without AVX-512-BF16 (or AMX) a bfloat16 dot is converted to float32 and back around float32 arithmetic.
"""

from __future__ import annotations

from pathlib import Path

# /proc/cpuinfo flag -> the name people know it by, in the order they appeared.
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512-BF16", "amx_bf16": "AMX-BF16"}


def cpu_instruction_sets(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The names (``ISA_FLAGS``' values) of the instruction sets the first CPU of ``cpuinfo`` lists; empty where
    the file is missing (not Linux) or names none of them."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [name for flag, name in ISA_FLAGS.items() if flag in flags]


def describe_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """``"AVX2, AVX-512, AVX-512-BF16"`` (or ``"no AVX2"``): the line every benchmark and the start-up log print."""
    sets = cpu_instruction_sets(cpuinfo)
    return ", ".join(sets) if sets else "no AVX2"
