"""The ops table: which backend runs each op on which platform, and the ops the models call.

=============  ==============================================================================================
op             backends (one folder each, beside its plain ``jnp`` reference)
=============  ==============================================================================================
attention      ``pallas`` (GPU: ragged, and decode-only steps by the split-K decode kernel), ``xla`` (``jnp``
               tiles; on XLA's CPU backend every row goes to the C++ kernel where ``xla.native_applies``),
               ``reference``
cache_write    ``pallas`` (GPU), ``reference`` (the ``jnp`` scatter, for every other backend)
matmul         ``cpu`` (C++, a layer's weight read in place from the stack), ``xla`` (XLA's dot of the slice)
lm_head        ``cpu`` (C++, the tied embedding optionally packed in panels), ``xla`` (XLA's dot)
=============  ==============================================================================================

:func:`select` picks a backend from data alone (the platform, the device count, the CPU's flags, a step's rows and
the weight's dtype), by the tables below, whose limits are the crossovers measured with ``scripts/bench_matmul.py``
(``docs/design/kernels.md``). The entry points the models call (:func:`layer_matmul`, :func:`lm_head`) take the
C++ kernel where the table picks it, the kernel takes the weight's shape and the library is built
(``cpu_build.available``).
The C++ kernels have no derivative: the differentiable forward keeps XLA's dots.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_build, cpu_features
from kernels_pallas.attention.pallas_decode import paged_attention
from kernels_pallas.attention.pallas_ragged import ragged_paged_attention
from kernels_pallas.attention.reference import ragged_paged_attention_reference
from kernels_pallas.attention.xla import ragged_paged_attention_xla
from kernels_pallas.cache_write.pallas import kv_cache_write
from kernels_pallas.cache_write.reference import kv_cache_write_reference
from kernels_pallas.lm_head.cpu import matmul_nt_cpu, matmul_nt_supports, nt_panels_shape, pack_nt_panels
from kernels_pallas.lm_head.xla import lm_head_xla
from kernels_pallas.matmul.cpu import matmul_supports, stacked_matmul_cpu
from kernels_pallas.matmul.xla import matmul_xla
from kernels_pallas.storage import BITS_STORAGE, CompressedKV, from_storage, to_storage

OPS = ("attention", "cache_write", "matmul", "lm_head")
ATTENTION_BACKENDS = ("pallas", "xla", "reference")
# Platform -> attention (and KV write) backend; every platform not named: "xla".
DEFAULT_ATTENTION_BACKEND = {"gpu": "pallas"}
# The most rows (tokens) of a step whose projections the C++ matmul computes, by the weight's number type and the
# CPU's flags: the first entry whose flags the CPU has all of. float32: AVX-512's tiles of 6 rows by 64 columns
# beat XLA's dots plus the slice copies up to 512 rows, AVX2's of 6 by 16 up to 192. bfloat16: where the CPU has
# AMX, XLA's dots run on its tiles and the kernel wins only the smallest bucket; with AVX-512-BF16 alone they run at
# about the kernel's rate and it keeps the copy it saves; without either the kernel would convert every weight to
# float32 as it reads it (unmeasured against XLA's dots): none.
PROJECTION_MAX_ROWS = {
    "float32": ((frozenset({"avx512f"}), 512), (frozenset(), 192)),
    "bfloat16": ((frozenset({"avx512_bf16", "amx_bf16"}), 4), (frozenset({"avx512_bf16"}), 128), (frozenset(), 0)),
}
# The lm_head takes the C++ kernel from this many rows (float32 weights only; below it XLA's dot streams the
# embedding faster), from one row with the tied embedding packed.
LM_HEAD_MIN_ROWS = 4
# The parameter key of the tied embedding packed for the lm_head's kernel (:func:`with_lm_head_panels`), and the
# largest embedding packed so (bytes; the packed copy holds it twice).
HEAD_PANELS = "embed_panels"
HEAD_PANELS_MAX_BYTES = 256 * 2**20
# The key of a scanned layer's dict holding (the stacked layer leaves, the layer index, the step's token count).
_STACKED = "_stacked"

__all__ = [
    "ATTENTION_BACKENDS", "BITS_STORAGE", "DEFAULT_ATTENTION_BACKEND", "HEAD_PANELS", "HEAD_PANELS_MAX_BYTES",
    "LM_HEAD_MIN_ROWS", "OPS", "PROJECTION_MAX_ROWS", "AttentionOps", "CompressedKV", "decode_fast_path",
    "default_attention_backend", "from_storage", "get_attention_ops", "layer_matmul", "lm_head", "lm_head_backend",
    "lm_head_panels", "matmul_backend", "projection_max_rows", "select", "to_storage", "with_lm_head_panels",
    "with_stacked_weights",
]


def projection_max_rows(dtype: Any, features: frozenset[str]) -> int:
    """The most rows the C++ matmul takes for a weight of ``dtype`` (float32; bfloat16 or its uint16 bits) on a
    CPU with ``features`` (``cpu_features.cpu_flags()``), by :data:`PROJECTION_MAX_ROWS`; 0 for other dtypes."""
    dtype = jnp.dtype(dtype)
    kind = "float32" if dtype == jnp.float32 else "bfloat16" if dtype in (jnp.bfloat16, jnp.uint16) else None
    if kind is None:
        return 0
    return next((rows for needed, rows in PROJECTION_MAX_ROWS[kind] if needed <= features), 0)


def select(op: str, *, platform: str, features: frozenset[str] = frozenset(), rows: int = 1,
           dtype: Any = jnp.float32, devices: int = 1, packed: bool = False) -> str:
    """The backend the table picks for ``op`` (one of :data:`OPS`).

    Args:
      platform: JAX's backend name (``"cpu"``, ``"gpu"``, ``"tpu"``).
      features: the CPU's flags (``cpu_features.cpu_flags()``).
      rows: the step's rows (tokens for ``matmul``, sequences for ``lm_head``).
      dtype: the weight's dtype (``matmul``, ``lm_head``).
      devices: the device count (the C++ calls are not partitioned: one device only).
      packed: for ``lm_head``, whether the tied embedding is packed (:data:`HEAD_PANELS`).

    Returns:
      ``attention``: :data:`DEFAULT_ATTENTION_BACKEND`'s; ``cache_write``: ``"pallas"`` where attention is, else
      ``"reference"``; ``matmul``: ``"cpu"`` on one CPU device up to :func:`projection_max_rows`, else ``"xla"``;
      ``lm_head``: ``"cpu"`` on one CPU device for a float32 weight from :data:`LM_HEAD_MIN_ROWS` rows (any with
      ``packed``), else ``"xla"``.

    Raises:
      ValueError: an op not in :data:`OPS`.
    """
    attention = DEFAULT_ATTENTION_BACKEND.get(platform, "xla")
    one_cpu = platform == "cpu" and devices == 1
    if op == "attention":
        return attention
    if op == "cache_write":
        return "pallas" if attention == "pallas" else "reference"
    if op == "matmul":
        return "cpu" if one_cpu and rows <= projection_max_rows(dtype, features) else "xla"
    if op == "lm_head":
        enough_rows = packed or rows >= LM_HEAD_MIN_ROWS
        return "cpu" if one_cpu and jnp.dtype(dtype) == jnp.float32 and enough_rows else "xla"
    raise ValueError(f"unknown op {op!r}; the table has {OPS}")


def _select_here(op: str, **kwargs: Any) -> str:
    return select(op, platform=jax.default_backend(), features=cpu_features.cpu_flags(),
                  devices=jax.device_count(), **kwargs)


# ------------------------------------------------------------------ attention and the KV write

class AttentionOps(NamedTuple):
    """The two cache/attention ops, with the reference functions' signatures."""

    ragged_paged_attention: Callable[..., jax.Array]
    kv_cache_write: Callable[..., tuple[jax.Array, jax.Array]]


def get_attention_ops(backend: str, *, interpret: bool = False) -> AttentionOps:
    """The attention ops of one backend.

    Args:
      backend: ``"pallas"`` (the Pallas GPU kernels), ``"xla"`` (tiled plain ``jnp`` whose cost follows the
        sequences, handing rows to the C++ kernel on XLA's CPU backend; ``attention.xla``) or ``"reference"``
        (the simplest plain ``jnp``, the ground truth).
      interpret: for ``"pallas"``, bind ``interpret=True`` so the kernels run in the Pallas interpreter (slow; CPU
        tests). Ignored otherwise.

    Returns:
      AttentionOps whose members take the arguments of ``ragged_paged_attention_reference`` and
      ``kv_cache_write_reference``. The Pallas decode kernel serves decode-only steps inside
      ``ragged_paged_attention`` (:func:`decode_fast_path`).

    Raises:
      ValueError: for an unknown backend.
    """
    if backend == "pallas":
        return AttentionOps(
            ragged_paged_attention=decode_fast_path(functools.partial(ragged_paged_attention, interpret=interpret),
                                                    functools.partial(paged_attention, interpret=interpret)),
            kv_cache_write=functools.partial(kv_cache_write, interpret=interpret),
        )
    if backend == "xla":
        return AttentionOps(ragged_paged_attention=ragged_paged_attention_xla, kv_cache_write=kv_cache_write_reference)
    if backend == "reference":
        return AttentionOps(ragged_paged_attention=ragged_paged_attention_reference,
                            kv_cache_write=kv_cache_write_reference)
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {ATTENTION_BACKENDS}")


def decode_fast_path(ragged: Callable[..., jax.Array], decode: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """A ragged attention that hands decode-only steps to a decode kernel.

    Args:
      ragged: with ``ragged_paged_attention_reference``'s signature.
      decode: with ``paged_attention_reference``'s signature (one query per sequence; rows with ``seq_lens`` 0
        give zeros).

    Returns:
      A function with the ragged signature. When every live sequence row of the step has exactly one new token,
      it gathers those queries (``[S, Hq, D]``), runs ``decode`` and scatters the rows back to their token
      positions; otherwise it runs ``ragged``. The choice is a ``lax.cond`` on the batch arrays, so both live in
      one compiled program.
    """
    def attend(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, **static):
        num_tokens, num_rows = q.shape[0], block_tables.shape[0]
        starts = query_start_loc[:-1]
        live = jnp.arange(num_rows) < num_seqs
        decode_only = jnp.all(jnp.where(live, query_start_loc[1:] - starts == 1, True))

        def decode_rows():
            rows = decode(q[jnp.minimum(starts, num_tokens - 1)], k_cache, v_cache, block_tables,
                          jnp.where(live, seq_lens, 0), **static)
            return jnp.zeros_like(q).at[jnp.where(live, starts, num_tokens)].set(rows, mode="drop")

        def ragged_rows():
            return ragged(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, **static)

        return jax.lax.cond(decode_only, decode_rows, ragged_rows)

    return attend


def default_attention_backend() -> str:
    """The attention backend :func:`select` picks for JAX's default backend: ``"pallas"`` on a GPU, else
    ``"xla"``."""
    return select("attention", platform=jax.default_backend())


# ------------------------------------------------------------------ the projection matmul

def matmul_backend(x: jax.Array, stacked_w: jax.Array) -> str:
    """``"cpu"`` where the projection ``x [M, K] @ stacked_w[layer]`` runs on ``stacked_matmul_cpu`` here: the
    table picks it for M rows of this dtype on this machine (:func:`select`), the kernel takes the stacked weight
    (``matmul.cpu.matmul_supports``) and the library is built; else ``"xla"``. Raises nothing."""
    picked = _select_here("matmul", rows=x.shape[0], dtype=stacked_w.dtype)
    return "cpu" if picked == "cpu" and matmul_supports(stacked_w) and cpu_build.available() else "xla"


def with_stacked_weights(layer: dict[str, jax.Array], stacked: dict[str, jax.Array], index: jax.Array,
                         rows: jax.Array) -> dict[str, jax.Array]:
    """``layer`` (one layer's weights, sliced from ``stacked`` at ``index``) with what :func:`layer_matmul` needs
    to read a weight in place from the stack instead: ``stacked`` (the layer leaves ``[L, ...]``), ``index`` (int32
    []) and ``rows`` (int32 [], the step's real tokens). Slices nothing reads are dropped by XLA."""
    return {**layer, _STACKED: (stacked, index, rows)}


def layer_matmul(layer: dict[str, jax.Array], key: str, x: jax.Array) -> jax.Array:
    """``x @ layer[key]`` accumulated in float32: x [T, in] -> float32 [T, out], for an unquantized weight.

    In a layer given :func:`with_stacked_weights`, where :func:`matmul_backend` is ``"cpu"``, the weight is read in
    place from the stack and only the step's rows are computed (the padding rows of its bucket are zeros);
    elsewhere XLA's dot of ``layer[key]``.
    """
    if _STACKED in layer:
        stacked, index, rows = layer[_STACKED]
        if matmul_backend(x, stacked[key]) == "cpu":
            return stacked_matmul_cpu(x, stacked[key], index, rows)
    return matmul_xla(x, layer[key])


# ------------------------------------------------------------------ the lm_head

def lm_head_backend(hidden: jax.Array, weight: jax.Array, *, tied: bool, packed: bool = False) -> str:
    """``"cpu"`` where :func:`lm_head` with ``kernels=True`` runs on the C++ kernel here: the table picks it
    (:func:`select`) and the kernel takes the weight (the tied embedding [V, E] through ``matmul_nt_cpu``, an
    lm_head [E, V] as a one-layer stack through ``stacked_matmul_cpu``), once the library is built; else ``"xla"``.
    Raises nothing."""
    if _select_here("lm_head", rows=hidden.shape[0], dtype=weight.dtype, packed=packed) != "cpu":
        return "xla"
    supported = (matmul_nt_supports(weight) if tied
                 else matmul_supports(jax.ShapeDtypeStruct((1, *weight.shape), weight.dtype)))
    return "cpu" if supported and cpu_build.available() else "xla"


def lm_head(hidden: jax.Array, weight: jax.Array, *, tied: bool, rows: Optional[jax.Array] = None,
            panels: Optional[jax.Array] = None, kernels: bool = False) -> jax.Array:
    """Logits float32 [N, V] of hidden [N, E], accumulated in float32.

    Args:
      weight: the tied embedding [V, E] (``tied``) or an lm_head [E, V].
      rows: int32 [], the leading rows that are real (a step's sequences); on the C++ kernel only those are
        computed and the others are zeros, on XLA's dot every row is. None: all N.
      panels: the tied embedding packed (:func:`lm_head_panels`), or None.
      kernels: whether the C++ kernel may run (where :func:`lm_head_backend` picks it); False keeps XLA's dot,
        which ``jax.grad`` goes through.
    """
    if kernels and lm_head_backend(hidden, weight, tied=tied, packed=panels is not None) == "cpu":
        if tied:
            return matmul_nt_cpu(hidden, weight, rows, panels)
        return stacked_matmul_cpu(hidden, weight[None], 0, rows)
    return lm_head_xla(hidden, weight, tied=tied)


def lm_head_panels(params: dict[str, Any]) -> Optional[jax.Array]:
    """The packed tied embedding :func:`with_lm_head_panels` added to ``params``, or None."""
    return params.get(HEAD_PANELS)


_pack_panels = jax.jit(pack_nt_panels)


def with_lm_head_panels(params: dict[str, Any], embed: jax.Array) -> dict[str, Any]:
    """The lm_head's ``prepare`` hook for a tied embedding: ``params`` with :data:`HEAD_PANELS` added where the C++
    kernel takes ``embed`` packed (float32 [V, E] of at most :data:`HEAD_PANELS_MAX_BYTES`, V a multiple of the
    kernels' panel width P and E of 16: ``lm_head.cpu.nt_panels_shape``, on one CPU device); else ``params`` itself
    (the same dict). The panels are ``pack_nt_panels`` of the embedding, float32 [V / P, E, P], as much memory
    again; a new embedding needs them packed again. Raises nothing."""
    # nt_panels_shape is None unless the embedding is float32 with whole panels and the kernels are built.
    applies = (embed.nbytes <= HEAD_PANELS_MAX_BYTES and jax.default_backend() == "cpu" and jax.device_count() == 1
               and nt_panels_shape(embed) is not None)
    return {**params, HEAD_PANELS: _pack_panels(embed)} if applies else params
