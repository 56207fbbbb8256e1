"""The ops table: which backend runs each op on which platform, and the ops the models call.

=============  ==============================================================================================
op             backends (one folder each, beside its plain ``jnp`` reference)
=============  ==============================================================================================
attention      ``pallas`` (GPU: ragged, and decode-only steps' programs by the split-K decode kernel, through Triton or
               on Hopper Mosaic GPU: :data:`PALLAS_LOWERINGS`), ``xla`` (``jnp``
               tiles; on XLA's CPU backend every row goes to the C++ kernel where
               :func:`attention_native_applies`: :func:`xla_attention`), ``reference``
cache_write    ``pallas`` (GPU), ``reference`` (the ``jnp`` scatter, for every other backend)
matmul         ``cpu`` (C++, a layer's weight read in place from the stack), ``xla`` (XLA's dot of the slice)
lm_head        ``cpu`` (C++, the tied embedding optionally packed in panels), ``xla`` (XLA's dot)
=============  ==============================================================================================

:func:`select` picks a backend from data alone (platform, device count, CPU flags, rows, weight dtype);
limits measured in docs/design/kernels.md. The C++ kernels have no derivative. This is the one module that loads
them (``cpu_build``): :func:`native_kernels` registers the FFI targets each C++ backend declares.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_build, cpu_features
from kernels_pallas.attention import cpu as attention_cpu
from kernels_pallas.attention import mosaic_decode, mosaic_ragged
from kernels_pallas.attention.pallas_decode import paged_attention
from kernels_pallas.attention.pallas_ragged import ragged_paged_attention
from kernels_pallas.attention.reference import ragged_paged_attention_reference
from kernels_pallas.attention.xla import ragged_paged_attention_xla
from kernels_pallas.cache_write.pallas import kv_cache_write
from kernels_pallas.cache_write.reference import kv_cache_write_reference
from kernels_pallas.lm_head import cpu as lm_head_cpu
from kernels_pallas.lm_head.xla import lm_head_xla
from kernels_pallas.matmul import cpu as matmul_cpu
from kernels_pallas.matmul.xla import matmul_xla
from kernels_pallas.storage import BITS_STORAGE, ScaledKV, check_pool_scales, from_storage, to_storage

OPS = ("attention", "cache_write", "matmul", "lm_head")
ATTENTION_BACKENDS = ("pallas", "xla", "reference")
# Platform -> attention (and KV write) backend; every platform not named: "xla".
DEFAULT_ATTENTION_BACKEND = {"gpu": "pallas"}
# The lowering of the pallas backend's attention kernels: "triton" (attention.pallas_ragged, .pallas_decode) or
# "mosaic" (attention.mosaic_ragged, .mosaic_decode: Mosaic GPU, Hopper, bf16/f16 caches; any other input takes
# Triton's kernel). $JAXLLM_PALLAS_LOWERING picks; triton stays the default until a GPU run shows mosaic at least
# as fast (scripts/bench_kernels.py, docs/benchmarks/gpu.md). The KV write stays on Triton's kernel either way.
PALLAS_LOWERINGS = ("triton", "mosaic")
DEFAULT_PALLAS_LOWERING = "triton"
PALLAS_LOWERING_ENV = "JAXLLM_PALLAS_LOWERING"
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
# Every (FFI target, C symbol) of the C++ backends, registered together when the library loads.
NATIVE_TARGETS = tuple(sorted({**attention_cpu.FFI_TARGETS, **matmul_cpu.FFI_TARGETS,
                               **lm_head_cpu.FFI_TARGETS}.items()))

__all__ = [
    "ATTENTION_BACKENDS", "BITS_STORAGE", "DEFAULT_ATTENTION_BACKEND", "DEFAULT_PALLAS_LOWERING", "HEAD_PANELS",
    "HEAD_PANELS_MAX_BYTES", "LM_HEAD_MIN_ROWS", "NATIVE_TARGETS", "OPS", "PALLAS_LOWERINGS", "PROJECTION_MAX_ROWS",
    "AttentionOps", "ScaledKV", "attention_native_applies", "cascade_units_formed", "decode_step_attention",
    "default_attention_backend", "from_storage", "get_attention_ops", "layer_matmul", "lm_head", "lm_head_backend",
    "lm_head_panel_columns", "lm_head_panels", "matmul_backend", "mosaic_or_triton_decode", "mosaic_or_triton_ragged",
    "native_kernels", "native_unavailable_reason", "pack_lm_head_panels", "projection_max_rows", "select",
    "to_storage", "with_lm_head_panels", "with_stacked_weights", "xla_attention",
]


def native_kernels() -> bool:
    """Whether the C++ CPU kernels are built, loaded and :data:`NATIVE_TARGETS` registered (decided once per
    process, by ``cpu_build.load``; why not: :func:`native_unavailable_reason`). Raises nothing."""
    return cpu_build.load(NATIVE_TARGETS)


def native_unavailable_reason() -> Optional[str]:
    """Why :func:`native_kernels` is False (None while it is True or not yet asked)."""
    return cpu_build.unavailable_reason()


def cascade_units_formed() -> int:
    """Cascade units (decode rows sharing leading blocks) the C++ attention formed in this process; 0 without the
    kernels. Raises nothing."""
    return cpu_build.library_int(attention_cpu.CASCADE_UNITS_SYMBOL) if native_kernels() else 0


def lm_head_panel_columns() -> int:
    """The panel width P of the loaded build's packed lm_head (64 with AVX-512, 16 with AVX2).

    Raises:
      ValueError: the kernels are not :func:`native_kernels`.
    """
    if not native_kernels():
        raise ValueError(f"the C++ CPU kernels are not available: {native_unavailable_reason()}")
    return cpu_build.library_int(lm_head_cpu.PANEL_COLUMNS_SYMBOL)


def projection_max_rows(dtype: Any, features: frozenset[str]) -> int:
    """Most rows the C++ matmul takes for a ``dtype`` weight (float32; bfloat16 or its uint16 bits) on a CPU with
    ``features``, by :data:`PROJECTION_MAX_ROWS`; 0 for other dtypes.
    """
    dtype = jnp.dtype(dtype)
    kind = "float32" if dtype == jnp.float32 else "bfloat16" if dtype in (jnp.bfloat16, jnp.uint16) else None
    if kind is None:
        return 0
    return next((rows for needed, rows in PROJECTION_MAX_ROWS[kind] if needed <= features), 0)


def select(op: str, *, platform: str, features: frozenset[str] = frozenset(), rows: int = 1,
           dtype: Any = jnp.float32, devices: int = 1, packed: bool = False) -> str:
    """The backend the table picks for ``op`` (one of :data:`OPS`), from data alone.

    ``platform``: JAX's backend name; ``features``: ``cpu_features.cpu_flags()``; ``rows``: tokens (``matmul``) or
    sequences (``lm_head``); ``dtype``: the weight's; ``devices``: device count (C++ needs one); ``packed``: tied
    embedding packed. Returns ``attention``: :data:`DEFAULT_ATTENTION_BACKEND`'s (else ``"xla"``); ``cache_write``:
    ``"pallas"`` with Pallas attention, else ``"reference"``; ``matmul``: ``"cpu"`` on one CPU device up to
    :func:`projection_max_rows`; ``lm_head``: ``"cpu"`` on one CPU device for float32 from :data:`LM_HEAD_MIN_ROWS`
    rows (any if ``packed``); otherwise ``"xla"``. Raises ValueError for an op not in :data:`OPS`.
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
    """The two cache/attention ops, with the reference functions' signatures, and the attention of decode-only steps.

    ``decode_attention``: ``ragged_paged_attention``'s signature, for steps whose every live row has one new token
    (a program of their own, so that no branch on the batch sits in the layer loop); None: the ragged op serves them.
    """

    ragged_paged_attention: Callable[..., jax.Array]
    kv_cache_write: Callable[..., tuple[jax.Array, jax.Array]]
    decode_attention: Optional[Callable[..., jax.Array]] = None

    def for_decode_steps(self) -> "AttentionOps":
        """These ops with ``decode_attention`` as the attention (unchanged where it is None)."""
        if self.decode_attention is None:
            return self
        return self._replace(ragged_paged_attention=self.decode_attention)


def get_attention_ops(backend: str, *, interpret: bool = False, decode_steps: Optional[bool] = None,
                      lowering: Optional[str] = None) -> AttentionOps:
    """The attention ops of ``backend``: ``"pallas"`` (GPU kernels: ragged, and the split-K decode kernel for
    decode-only steps via :func:`decode_step_attention`; ``interpret`` runs the Pallas interpreter), ``"xla"``
    (``attention.xla``, with its decode-only variant) or ``"reference"`` (no decode-only variant).

    ``decode_steps``: give decode-only steps their own attention (:attr:`AttentionOps.decode_attention`); None: for
    ``pallas``, and for ``xla`` off XLA's CPU backend (there the C++ kernel takes every row the same way).
    ``lowering``: the ``pallas`` attention kernels', one of :data:`PALLAS_LOWERINGS` (None:
    ``$JAXLLM_PALLAS_LOWERING``, else :data:`DEFAULT_PALLAS_LOWERING`). Members take
    ``ragged_paged_attention_reference``'s and ``kv_cache_write_reference``'s arguments.
    Raises ValueError for an unknown backend or lowering, or ``mosaic`` compiled for a device that is not a Hopper
    GPU.
    """
    if decode_steps is None:
        decode_steps = backend == "pallas" or (backend == "xla" and jax.default_backend() != "cpu")
    if backend == "pallas":
        ragged, decode = _pallas_kernels(lowering, interpret)
        return AttentionOps(
            ragged_paged_attention=functools.partial(ragged, interpret=interpret),
            kv_cache_write=functools.partial(kv_cache_write, interpret=interpret),
            decode_attention=decode_step_attention(functools.partial(decode, interpret=interpret))
            if decode_steps else None,
        )
    if backend == "xla":
        return AttentionOps(ragged_paged_attention=xla_attention, kv_cache_write=kv_cache_write_reference,
                            decode_attention=functools.partial(xla_attention, decode_only=True)
                            if decode_steps else None)
    if backend == "reference":
        return AttentionOps(ragged_paged_attention=ragged_paged_attention_reference,
                            kv_cache_write=kv_cache_write_reference)
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {ATTENTION_BACKENDS}")


def _pallas_kernels(lowering: Optional[str], interpret: bool) -> tuple[Callable[..., jax.Array], ...]:
    """(ragged, decode) attention of the lowering :func:`get_attention_ops` names, with the reference functions'
    signatures plus ``interpret``."""
    source = f"lowering={lowering!r}"
    if lowering is None:
        lowering, source = os.environ.get(PALLAS_LOWERING_ENV) or DEFAULT_PALLAS_LOWERING, f"${PALLAS_LOWERING_ENV}"
    if lowering not in PALLAS_LOWERINGS:
        raise ValueError(f"unknown Pallas lowering {lowering!r} (from {source}); expected one of {PALLAS_LOWERINGS}")
    if lowering == "triton":
        return ragged_paged_attention, paged_attention
    device = jax.devices()[0]
    if not interpret and not str(getattr(device, "compute_capability", "")).startswith("9"):
        raise ValueError(f"Pallas lowering 'mosaic' (from {source}) compiles for Hopper GPUs (compute capability 9.x); "
                         f"the device is {device.device_kind}")
    return mosaic_or_triton_ragged, mosaic_or_triton_decode


def _mosaic_takes(module: Any, q: jax.Array, k_cache: jax.Array, block_tables: jax.Array,
                  k_scale: Optional[jax.Array], v_scale: Optional[jax.Array]) -> bool:
    _, num_q_heads, head_dim = q.shape
    return module.unsupported_reason(q.dtype, k_cache.dtype, head_dim, k_cache.shape[1],
                                     num_q_heads // k_cache.shape[2], k_scale is not None or v_scale is not None,
                                     table_width=block_tables.shape[1]) is None


def mosaic_or_triton_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                            seq_lens: jax.Array, *, interpret: bool = False, k_scale: Optional[jax.Array] = None,
                            v_scale: Optional[jax.Array] = None, **static: Any) -> jax.Array:
    """Decode attention by ``attention.mosaic_decode`` where it takes the inputs (chosen while tracing, from their
    dtypes and shapes: ``mosaic_decode.unsupported_reason``), else by Triton's ``attention.pallas_decode``.
    Arguments and result as ``paged_attention_reference``."""
    if _mosaic_takes(mosaic_decode, q, k_cache, block_tables, k_scale, v_scale):
        return mosaic_decode.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, interpret=interpret,
                                             **static)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, interpret=interpret, k_scale=k_scale,
                           v_scale=v_scale, **static)


def mosaic_or_triton_ragged(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                            seq_lens: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array, *,
                            interpret: bool = False, k_scale: Optional[jax.Array] = None,
                            v_scale: Optional[jax.Array] = None, **static: Any) -> jax.Array:
    """Ragged attention by ``attention.mosaic_ragged`` where it takes the inputs (as
    :func:`mosaic_or_triton_decode`), else by Triton's ``attention.pallas_ragged``. Arguments and result as
    ``ragged_paged_attention_reference``."""
    batch = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs)
    if _mosaic_takes(mosaic_ragged, q, k_cache, block_tables, k_scale, v_scale):
        return mosaic_ragged.ragged_paged_attention(*batch, interpret=interpret, **static)
    return ragged_paged_attention(*batch, interpret=interpret, k_scale=k_scale, v_scale=v_scale, **static)


def decode_step_attention(decode: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """A decode kernel behind the ragged signature, for steps whose every live row has one new token.

    decode: ``paged_attention_reference``'s signature (rows with ``seq_lens`` 0 give zeros). Returns a function
    with ``ragged_paged_attention_reference``'s signature that runs ``decode`` on each live row's token (gathered
    ``[S, Hq, D]`` queries) and scatters the results back, zeros elsewhere. A row of more than one new token is
    attended as its first token alone: wrong, so only decode-only steps' programs take it.
    """
    def attend(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, **static):
        num_tokens, num_rows = q.shape[0], block_tables.shape[0]
        starts = query_start_loc[:-1]
        live = jnp.arange(num_rows) < num_seqs
        rows = decode(q[jnp.minimum(starts, num_tokens - 1)], k_cache, v_cache, block_tables,
                      jnp.where(live, seq_lens, 0), **static)
        return jnp.zeros_like(q).at[jnp.where(live, starts, num_tokens)].set(rows, mode="drop")

    return attend


def attention_native_applies(k_cache: jax.Array, num_q_heads: int, k_scale: Optional[jax.Array] = None,
                             scaled_pool: Optional[ScaledKV] = None) -> bool:
    """Whether :func:`xla_attention` sends every row to the C++ kernel by default.

    True on XLA's CPU backend for a float32 or bfloat16 (uint16) cache ``[N, block_size, Hkv, D]`` without
    KV scales or pool, in shapes ``attention.cpu.supports``, once :func:`native_kernels`. Raises nothing.
    """
    _, block_size, num_kv_heads, _ = k_cache.shape
    return (jax.default_backend() == "cpu" and k_scale is None and scaled_pool is None
            and jnp.dtype(k_cache.dtype) in attention_cpu.CACHE_DTYPES
            and attention_cpu.supports(num_q_heads, block_size, num_kv_heads) and native_kernels())


def xla_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                  seq_lens: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array, *, scale: float,
                  sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                  k_scale: Optional[jax.Array] = None, scaled_pool: Optional[ScaledKV] = None,
                  use_native: Optional[bool] = None, **tiles: Any) -> jax.Array:
    """The ``xla`` attention backend: every row through ``attention.cpu.ragged_paged_attention_cpu`` where
    ``use_native`` (None: :func:`attention_native_applies`), else ``attention.xla.ragged_paged_attention_xla``.

    Arguments and result as ``ragged_paged_attention_reference`` (q ``[T, Hq, D]`` -> ``[T, Hq, D]`` in q's dtype);
    ``tiles``: the jnp tiles' other keywords (``v_scale``, tile sizes, ``decode_only``, ``interpret``).

    Raises:
      ValueError: ``use_native=True`` where :func:`attention_native_applies` is False; ``k_scale`` together with
        ``scaled_pool``.
    """
    check_pool_scales(k_scale, scaled_pool)
    applies = attention_native_applies(k_cache, q.shape[1], k_scale, scaled_pool)
    if use_native and not applies:
        raise ValueError("use_native=True needs XLA's CPU backend, a float32 or bfloat16 cache without KV scales "
                         "or a scaled pool, shapes the kernel takes (attention.cpu.supports) and the built C++ "
                         f"kernel ({native_unavailable_reason() or 'built'}); got backend {jax.default_backend()!r}, "
                         f"cache {k_cache.dtype} {k_cache.shape}, {q.shape[1]} query heads, "
                         f"scales {k_scale is not None}, pool {scaled_pool is not None}")
    if applies if use_native is None else use_native:
        row, pos = attention_cpu.token_rows_and_positions(query_start_loc, seq_lens, num_seqs, q.shape[0])
        out = attention_cpu.ragged_paged_attention_cpu(q, k_cache, v_cache, block_tables, row, pos, scale=scale,
                                                       soft_cap=soft_cap, sliding_window=sliding_window)
        return out.astype(q.dtype)
    return ragged_paged_attention_xla(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                                      scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
                                      scaled_pool=scaled_pool, **tiles)


def default_attention_backend() -> str:
    """:func:`select`'s attention backend for JAX's default backend."""
    return select("attention", platform=jax.default_backend())


# ------------------------------------------------------------------ the projection matmul

def matmul_backend(x: jax.Array, stacked_w: jax.Array) -> str:
    """``"cpu"`` where ``x [M, K] @ stacked_w[layer]`` runs on ``stacked_matmul_cpu`` here (table, ``matmul_supports``,
    library built); else ``"xla"``. Raises nothing.
    """
    picked = _select_here("matmul", rows=x.shape[0], dtype=stacked_w.dtype)
    return "cpu" if picked == "cpu" and matmul_cpu.matmul_supports(stacked_w) and native_kernels() else "xla"


def with_stacked_weights(layer: dict[str, jax.Array], stacked: dict[str, jax.Array], index: jax.Array,
                         rows: jax.Array) -> dict[str, jax.Array]:
    """``layer`` plus what :func:`layer_matmul` needs to read weights in place: ``stacked`` (layer leaves ``[L, ...]``),
    ``index`` (int32[]) and ``rows`` (int32[] real tokens).
    """
    return {**layer, _STACKED: (stacked, index, rows)}


def layer_matmul(layer: dict[str, jax.Array], key: str, x: jax.Array) -> jax.Array:
    """``x @ layer[key]`` accumulated in float32: x [T, in] -> float32 [T, out], unquantized weight.

    With :func:`with_stacked_weights` and the ``"cpu"`` backend, read in place and only ``rows`` computed
    (padding rows zeros); else XLA's dot.
    """
    if _STACKED in layer:
        stacked, index, rows = layer[_STACKED]
        if matmul_backend(x, stacked[key]) == "cpu":
            return matmul_cpu.stacked_matmul_cpu(x, stacked[key], index, rows)
    return matmul_xla(x, layer[key])


# ------------------------------------------------------------------ the lm_head

def lm_head_backend(hidden: jax.Array, weight: jax.Array, *, tied: bool, packed: bool = False) -> str:
    """``"cpu"`` where :func:`lm_head` with ``kernels=True`` runs the C++ kernel here (tied [V, E]:
    ``matmul_nt_cpu``; lm_head [E, V]: ``stacked_matmul_cpu``); else ``"xla"``. Raises nothing.
    """
    if _select_here("lm_head", rows=hidden.shape[0], dtype=weight.dtype, packed=packed) != "cpu":
        return "xla"
    supported = (lm_head_cpu.matmul_nt_supports(weight) if tied
                 else matmul_cpu.matmul_supports(jax.ShapeDtypeStruct((1, *weight.shape), weight.dtype)))
    return "cpu" if supported and native_kernels() else "xla"


def lm_head(hidden: jax.Array, weight: jax.Array, *, tied: bool, rows: Optional[jax.Array] = None,
            panels: Optional[jax.Array] = None, kernels: bool = False) -> jax.Array:
    """Logits float32 [N, V] of hidden [N, E], accumulated in float32.

    ``weight``: tied embedding [V, E] (``tied``) or lm_head [E, V]; ``rows``: int32[] leading real rows (None: all;
    on the C++ kernel the rest are zeros); ``panels``: :func:`lm_head_panels` or None; ``kernels``: allow the C++
    kernel (no derivative), False keeps XLA's dot.
    """
    if kernels and lm_head_backend(hidden, weight, tied=tied, packed=panels is not None) == "cpu":
        if tied:
            return lm_head_cpu.matmul_nt_cpu(hidden, weight, rows, panels)
        return matmul_cpu.stacked_matmul_cpu(hidden, weight[None], 0, rows)
    return lm_head_xla(hidden, weight, tied=tied)


def lm_head_panels(params: dict[str, Any]) -> Optional[jax.Array]:
    """The packed tied embedding :func:`with_lm_head_panels` added to ``params``, or None."""
    return params.get(HEAD_PANELS)


_pack_panels = jax.jit(lm_head_cpu.pack_nt_panels, static_argnums=1)


def pack_lm_head_panels(embed: jax.Array) -> jax.Array:
    """``embed`` float32 [V, E] packed in the loaded build's panels: float32 [V / P, E, P]
    (``lm_head.cpu.pack_nt_panels`` with :func:`lm_head_panel_columns`).

    Raises:
      ValueError: no kernels, or V not a whole number of panels (``pack_nt_panels`` names the shape).
    """
    return _pack_panels(embed, lm_head_panel_columns())


def with_lm_head_panels(params: dict[str, Any], embed: jax.Array) -> dict[str, Any]:
    """``params`` plus :data:`HEAD_PANELS` (float32 [V / P, E, P], ``lm_head.cpu.pack_nt_panels``) where the C++
    kernel takes ``embed`` packed (float32 [V, E] up to :data:`HEAD_PANELS_MAX_BYTES`, ``nt_panels_shape`` not
    None, one CPU device, :func:`native_kernels`); else ``params`` itself. A new embedding must be packed again.
    Raises nothing.
    """
    applies = (embed.nbytes <= HEAD_PANELS_MAX_BYTES and jax.default_backend() == "cpu" and jax.device_count() == 1
               and native_kernels() and lm_head_cpu.nt_panels_shape(embed, lm_head_panel_columns()) is not None)
    return {**params, HEAD_PANELS: pack_lm_head_panels(embed)} if applies else params
