"""The CPU kernels in C++ (``paged_attention_cpu.cc``, ``matmul_cpu.cc``), built on first use and called through
XLA's FFI.

XLA's CPU dots cannot read through a gather, so the plain-``jnp`` kernels
(``kernels_pallas.xla``) copy every KV block a query tile needs into a
contiguous buffer and then read it again: three passes over the cached bytes
where one would do, and on a CPU the bytes are the cost
(``scripts/profile_step.py``). The C++ attention kernel reads the blocks in place
through the block table, for runs of up to 16 query tokens of one sequence at
a time (a decode row is a run of one) on XLA's intra-op threads, with the
online softmax of flash-attention; a run of several tokens (a prefill chunk)
is computed as register-tiled multiply-adds over its (token, head) pairs, so
prefill attention runs near the machine's matmul rate rather than at the rate
of many small dots.

The matmuls: :func:`stacked_matmul_cpu` reads a layer's weight (float32 or bfloat16) in place from the
stacked parameters (XLA's dynamic-slice of it is a copy per layer per step), and
:func:`matmul_nt_cpu` multiplies by a row-major ``[N, K]`` weight transposed (the tied
embedding as the lm_head); both compute only the leading rows a padded step
fills.

The library is compiled once per source, compiler flags, jaxlib version and
CPU (its instruction-set flags) with the system's C++ compiler (``$CXX`` or ``c++``) into
``$XDG_CACHE_HOME/jaxllm/native`` (default ``~/.cache/jaxllm/native``; a
``JAXLLM_NATIVE_CACHE`` path overrides it) and registered as the FFI targets
:data:`TARGET`, :data:`MATMUL_TARGET`, :data:`MATMUL_BF16_TARGET`, :data:`MATMUL_NT_TARGET` and
:data:`MATMUL_NT_PACKED_TARGET` (the latter with the weight's panels packed once: :func:`pack_nt_panels`).
Where no compiler is found or the build fails, :func:`available` is False (the reason in
:func:`unavailable_reason`) and the callers keep the ``jnp`` path and XLA's dots;
``JAXLLM_NATIVE_KERNELS=0`` turns the kernels off.
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
import jax.numpy as jnp
import numpy as np

# One library of both sources (and the header they share: part of the cache key); its FFI targets and symbols.
SOURCES = (Path(__file__).with_name("paged_attention_cpu.cc"), Path(__file__).with_name("matmul_cpu.cc"))
HEADERS = (Path(__file__).with_name("cpu_vectors.h"),)
TARGET = "jaxllm_paged_attention_cpu"
MATMUL_TARGET = "jaxllm_matmul_cpu"
MATMUL_BF16_TARGET = "jaxllm_matmul_bf16_cpu"
MATMUL_NT_TARGET = "jaxllm_matmul_nt_cpu"
MATMUL_NT_PACKED_TARGET = "jaxllm_matmul_nt_packed_cpu"
_SYMBOLS = {TARGET: "JaxllmPagedAttentionCpu", MATMUL_TARGET: "JaxllmMatmulCpu",
            MATMUL_BF16_TARGET: "JaxllmMatmulBf16Cpu", MATMUL_NT_TARGET: "JaxllmMatmulNtCpu",
            MATMUL_NT_PACKED_TARGET: "JaxllmMatmulNtPackedCpu"}
# -march=native: the library is built on the machine that runs it, for its vector instructions.
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16))
# The kernel's largest block (paged_attention_cpu.cc: kMaxBlockSize).
MAX_BLOCK_SIZE = 256
# stacked_matmul_cpu's weights: float32 or bfloat16 (then an even contracted axis), output columns a multiple of
# this; matmul_nt_cpu's: float32, the contracted axis a multiple of it.
MATMUL_COLUMN_MULTIPLE = 16
_reason: Optional[str] = None
_lib: Optional[ctypes.CDLL] = None  # the loaded kernels, once available() has built them


def _cache_dir() -> Path:
    if os.environ.get("JAXLLM_NATIVE_CACHE"):
        return Path(os.environ["JAXLLM_NATIVE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxllm" / "native"


def _cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first CPU's ``flags`` line ("" where unreadable): part of the library's cache key, since ``-march=native``
    code from a machine with AVX-512 dies of an illegal instruction on one without (a shared home directory, an
    image built elsewhere)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def library_path(compiler: str) -> Path:
    """Where the library built by ``compiler`` (a path or name) for this source, these flags, this jaxlib and this
    CPU is cached: ``<cache dir>/paged_attention_cpu-<16 hex digits of their SHA-256>.so``. Builds nothing.

    Raises:
      OSError: the C++ source cannot be read.
    """
    import jaxlib

    key = hashlib.sha256("\0".join([*(source.read_text() for source in SOURCES + HEADERS), compiler, *_FLAGS,
                                    jaxlib.__version__, jax.ffi.include_dir(), _cpu_flags()]).encode())
    return _cache_dir() / f"paged_attention_cpu-{key.hexdigest()[:16]}.so"


def _build(compiler: str) -> Path:
    """The compiled library's path (:func:`library_path`), compiling it unless it is there.

    Raises:
      subprocess.CalledProcessError / OSError: the compiler failed or could not write the cache.
    """
    include = jax.ffi.include_dir()
    out = library_path(compiler)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, f"-I{include}", *map(str, SOURCES), "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the kernel is built and registered (once per process; False where it cannot be, see the module)."""
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
        for target, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        _reason = f"the C++ CPU kernels did not build or load: {detail.strip()[:500]}"
        print(f"[kernels_pallas] {_reason}; using the jnp attention and XLA's dots", file=sys.stderr)
        return False
    return True


def cascade_units_formed() -> int:
    """How many cascade units the attention kernel has formed in this process (decode rows whose block tables begin
    with the same blocks, attended over them together: ``paged_attention_cpu.cc``'s ``form_cascades``); 0 where the
    kernel is not loaded. A count for tests and profiles; raises nothing."""
    if _lib is None:
        return 0
    count = _lib.jaxllm_cascade_units
    count.restype = ctypes.c_int64
    return int(count())


def supports(num_q_heads: int, block_size: int, num_kv_heads: int) -> bool:
    """Whether the kernel takes these shapes: query heads a multiple of the KV heads, at most
    :data:`MAX_BLOCK_SIZE` tokens per block."""
    return num_q_heads % num_kv_heads == 0 and block_size <= MAX_BLOCK_SIZE


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False (None while it is True or not yet asked)."""
    return _reason


def ragged_paged_attention_cpu(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, tables: jax.Array,
                               token_row: jax.Array, token_pos: jax.Array, *, scale: float,
                               soft_cap: Optional[float] = None, sliding_window: Optional[int] = None) -> jax.Array:
    """Every query token over its sequence's paged KV, in place through the block table (the C++ kernel).

    Args:
      q: [T, Hq, D], any float dtype (computed in float32).
      k_cache, v_cache: [N, block_size, Hkv, D], float32, bfloat16 or uint16 bit patterns of bfloat16.
      tables: int32 [S, W], block ids in [0, N).
      token_row: int32 [T], the row of ``tables`` each token belongs to; -1 marks a padding token (zeros out).
      token_pos: int32 [T], each token's position in its sequence: it sees positions ``[0, pos]`` (the last
        ``sliding_window`` of them when set).
      scale: the score scale (``1 / sqrt(D)`` or the model's).
      soft_cap: scores become ``soft_cap * tanh(scores / soft_cap)``; None: no cap.
      sliding_window: None: no window.

    Returns:
      float32 [T, Hq, D].

    Raises:
      ValueError: a cache dtype other than those above, shapes it does not take (:func:`supports`), or the
        kernel is not :func:`available`.
      JaxRuntimeError (at run time): a row outside [0, S), a position at or past ``W * block_size``, or a block
        id outside [0, N) that a token would read (named in the message).
    """
    if not available():
        raise ValueError(f"ragged_paged_attention_cpu is not available: {unavailable_reason()}")
    if jnp.dtype(k_cache.dtype) not in CACHE_DTYPES or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"ragged_paged_attention_cpu: cache dtypes {k_cache.dtype}, {v_cache.dtype}; expected both "
                         f"one of {[str(d) for d in CACHE_DTYPES]}")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if not supports(q.shape[1], block_size, num_kv_heads):
        raise ValueError(f"ragged_paged_attention_cpu: {q.shape[1]} query heads, {num_kv_heads} KV heads, block_size "
                         f"{block_size}; the kernel takes query heads a multiple of the KV heads and block_size <= "
                         f"{MAX_BLOCK_SIZE}")
    if k_cache.dtype == jnp.bfloat16:
        # As bit patterns: XLA's CPU backend would otherwise convert a bfloat16 operand of the call.
        k_cache, v_cache = (jax.lax.bitcast_convert_type(c, jnp.uint16) for c in (k_cache, v_cache))
    # Each block one row: with one KV head, a [N, block_size, 1, D] operand lets XLA's CPU layout assignment move
    # the unit axis and copy the whole cache on every layer.
    rows = (k_cache.shape[0], block_size * num_kv_heads * head_dim)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k_cache.reshape(rows), v_cache.reshape(rows), tables.astype(jnp.int32),
                token_row.astype(jnp.int32), token_pos.astype(jnp.int32), scale=np.float32(scale),
                soft_cap=np.float32(soft_cap or 0.0), sliding_window=np.int32(sliding_window or 0),
                block_size=np.int32(block_size), num_kv_heads=np.int32(num_kv_heads))


@functools.lru_cache(maxsize=None)
def has_avx512(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU has AVX-512 (the ``avx512f`` flag of the first CPU in ``cpuinfo``), which the kernels,
    built with ``-march=native``, then use: 16 float32 lanes and :func:`stacked_matmul_cpu`'s tiles of 6 rows by
    64 columns, against 8 lanes and tiles of 6 by 16 on AVX2 (3 by 32 for x of at most 6 rows). False where the
    file is unreadable (not Linux); raises nothing. Read once per path."""
    return "avx512f" in _cpu_flags(cpuinfo).split()


@functools.lru_cache(maxsize=None)
def has_bf16_pairs(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU multiplies pairs of bfloat16 in one instruction (the ``avx512_bf16`` flag of the first CPU
    in ``cpuinfo``: ``vdpbf16ps``), which :func:`stacked_matmul_cpu`'s bfloat16 kernel then uses (built with
    ``-march=native``). False where the file is unreadable (not Linux). Read once per path."""
    return "avx512_bf16" in _cpu_flags(cpuinfo).split()


@functools.lru_cache(maxsize=None)
def has_amx_tiles(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU has AMX's bfloat16 tile multiplies (the ``amx_bf16`` flag of the first CPU in ``cpuinfo``),
    which XLA's own bfloat16 dots use (so the engine hands fewer of them to :func:`stacked_matmul_cpu`: see
    ``jaxllm.models.common.native_bf16_matmul_max_rows``). False where the file is unreadable (not Linux); raises
    nothing. Read once per path."""
    return "amx_bf16" in _cpu_flags(cpuinfo).split()


def matmul_supports(w: jax.Array) -> bool:
    """Whether :func:`stacked_matmul_cpu` takes this stacked weight: ``[L, K, N]`` with N a multiple of
    :data:`MATMUL_COLUMN_MULTIPLE`, float32, or bfloat16 (or uint16 bfloat16 bits, as the engine stores its layer
    weights on CPU: ``models.loop_storage``) with K even (its kernel takes K two rows at a time)."""
    if w.ndim != 3 or w.shape[2] % MATMUL_COLUMN_MULTIPLE != 0:
        return False
    return w.dtype == jnp.float32 or (w.dtype in (jnp.bfloat16, jnp.uint16) and w.shape[1] % 2 == 0)


def _valid_rows(rows: Optional[jax.Array], m: int) -> jax.Array:
    return jnp.asarray(m if rows is None else rows, jnp.int32)


def stacked_matmul_cpu(x: jax.Array, w: jax.Array, layer: jax.Array, rows: Optional[jax.Array] = None) -> jax.Array:
    """``x @ w[layer]`` with the layer's weight read in place from the stacked ``w`` (the C++ kernel).

    Inside a scan over layers, ``w[layer]`` would be a dynamic-slice that XLA's CPU backend copies on every step;
    passing the whole stack and the index reads each weight once (``matmul_cpu.cc``). A bfloat16 ``w`` (or its
    uint16 bits) multiplies bfloat16 x (x is rounded to it, as XLA's bfloat16 dot does), products summed in
    float32: with the CPU's ``vdpbf16ps`` where it has AVX-512-BF16, else converted to float32 as they are read.

    Args:
      x: [M, K], any float dtype (computed in float32 against a float32 ``w``, in bfloat16 against a bfloat16 one).
      w: float32, bfloat16 or uint16 (bfloat16 bits) [L, K, N], N a multiple of :data:`MATMUL_COLUMN_MULTIPLE` (K
        even unless float32).
      layer: int32 [] in [0, L).
      rows: int32 [], the leading rows of x to compute (a padded step's tokens), clamped to [0, M]; the other
        rows of the result are zeros. None: all M.

    Returns:
      float32 [M, N], accumulated in float32.

    Raises:
      ValueError: a weight :func:`matmul_supports` does not take, K not matching x, or the kernel is not
        :func:`available`.
      JaxRuntimeError (at run time): a layer outside [0, L) (named in the message).
    """
    if not available():
        raise ValueError(f"stacked_matmul_cpu is not available: {unavailable_reason()}")
    if not matmul_supports(w) or x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"stacked_matmul_cpu: x {x.shape}, w {w.dtype} {w.shape}; expected x [M, K] and a float32 "
                         f"or bfloat16 w [L, K, N] with N a multiple of {MATMUL_COLUMN_MULTIPLE} (K even for bfloat16)")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32)
    layer, rows = jnp.asarray(layer, jnp.int32), _valid_rows(rows, x.shape[0])
    if w.dtype != jnp.float32:
        return jax.ffi.ffi_call(MATMUL_BF16_TARGET, out)(x.astype(jnp.bfloat16), w, layer, rows)
    return jax.ffi.ffi_call(MATMUL_TARGET, out)(x.astype(jnp.float32), w, layer, rows)


def matmul_nt_supports(w: jax.Array) -> bool:
    """Whether :func:`matmul_nt_cpu` takes this weight: float32 ``[N, K]`` with K a multiple of
    :data:`MATMUL_COLUMN_MULTIPLE`."""
    return w.ndim == 2 and w.dtype == jnp.float32 and w.shape[1] % MATMUL_COLUMN_MULTIPLE == 0 and w.shape[0] > 0


def nt_panel_columns() -> int:
    """Columns per panel of :func:`pack_nt_panels` on this build of the kernels, the matmul tiles' width: 64 with
    AVX-512, 16 without (AVX2). Raises ValueError where the kernels are not :func:`available`."""
    if not available():
        raise ValueError(f"nt_panel_columns: the kernels are not available: {unavailable_reason()}")
    columns = _lib.jaxllm_matmul_panel_columns
    columns.restype = ctypes.c_int64
    return int(columns())


def nt_panels_shape(w: jax.Array) -> Optional[tuple[int, int, int]]:
    """The shape :func:`pack_nt_panels` gives ``w`` [N, K]: ``(N / P, K, P)`` with P :func:`nt_panel_columns`, or
    None where w is not a weight :func:`matmul_nt_supports` takes with N a multiple of P (or the kernels are not
    :func:`available`)."""
    if not available() or not matmul_nt_supports(w):
        return None
    p = nt_panel_columns()
    return (w.shape[0] // p, w.shape[1], p) if w.shape[0] % p == 0 else None


def pack_nt_panels(w: jax.Array) -> jax.Array:
    """``w`` [N, K] float32 as :func:`matmul_nt_cpu`'s ``panels``: float32 ``[N / P, K, P]`` with
    ``panels[p, k, j] = w[p * P + j, k]`` (P :func:`nt_panel_columns`), each panel of P rows of w transposed and
    contiguous. With them the kernel reads each panel where it lies instead of transposing it on every call (the
    tied lm_head: ``scripts/bench_matmul.py``'s last table); they take as much memory as w.

    Raises:
      ValueError: the kernels are not :func:`available`, or w is not a weight :func:`nt_panels_shape` takes (the
        message names its shape and the panel width).
    """
    if not available():
        raise ValueError(f"pack_nt_panels: the kernels are not available: {unavailable_reason()}")
    shape = nt_panels_shape(w)
    if shape is None:
        raise ValueError(f"pack_nt_panels: w {w.dtype} {w.shape}; expected float32 [N, K] with K a multiple of "
                         f"{MATMUL_COLUMN_MULTIPLE} and N a multiple of the panel width {nt_panel_columns()}")
    return jnp.transpose(w.reshape(shape[0], shape[2], shape[1]), (0, 2, 1))


def matmul_nt_cpu(x: jax.Array, w: jax.Array, rows: Optional[jax.Array] = None,
                  panels: Optional[jax.Array] = None) -> jax.Array:
    """``x @ w.T`` for a row-major ``w`` [N, K] (a tied embedding as the lm_head), by the C++ kernel: each output a
    dot of a row of x with a row of w, register-tiled (``matmul_cpu.cc``).

    Args:
      x: [M, K], any float dtype (computed in float32).
      w: float32 [N, K], K a multiple of :data:`MATMUL_COLUMN_MULTIPLE`.
      rows: int32 [], the leading rows of x to compute (a padded step's sequences), clamped to [0, M]; the other
        rows of the result are zeros. None: all M.
      panels: :func:`pack_nt_panels` of w, or None (each panel transposed as it is read). Given, the kernel reads
        the panels in place of w's values (only their shape is checked against w: panels of another weight give
        that weight's product).

    Returns:
      float32 [M, N], accumulated in float32.

    Raises:
      ValueError: a weight :func:`matmul_nt_supports` does not take, K not matching x, panels not of w's packed
        shape, or the kernel is not :func:`available`.
    """
    if not available():
        raise ValueError(f"matmul_nt_cpu is not available: {unavailable_reason()}")
    if not matmul_nt_supports(w) or x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul_nt_cpu: x {x.shape}, w {w.dtype} {w.shape}; expected x [M, K] and float32 w "
                         f"[N, K] with K a multiple of {MATMUL_COLUMN_MULTIPLE}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    if panels is not None:
        if panels.shape != nt_panels_shape(w) or panels.dtype != jnp.float32:
            raise ValueError(f"matmul_nt_cpu: panels {panels.dtype} {panels.shape}; expected float32 "
                             f"{nt_panels_shape(w)} (pack_nt_panels of w)")
        return jax.ffi.ffi_call(MATMUL_NT_PACKED_TARGET, out)(x.astype(jnp.float32), w, panels,
                                                              _valid_rows(rows, x.shape[0]))
    return jax.ffi.ffi_call(MATMUL_NT_TARGET, out)(x.astype(jnp.float32), w, _valid_rows(rows, x.shape[0]))
