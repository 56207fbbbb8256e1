"""Paged-attention kernels for jaxllm: Pallas GPU kernels and their jnp references.

Knows nothing of models or the scheduler. See ``reference.py`` for the cache
layout and the exact semantics every kernel here shares. The engine picks an
implementation with :func:`get_attention_ops`.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.cache_write import kv_cache_write
from kernels_pallas.decode import paged_attention
from kernels_pallas.ragged import ragged_paged_attention
from kernels_pallas.reference import (
    kv_cache_write_reference,
    paged_attention_reference,
    ragged_paged_attention_reference,
)
from kernels_pallas.xla import ragged_paged_attention_xla

ATTENTION_BACKENDS = ("pallas", "xla", "reference")


class AttentionOps(NamedTuple):
    """The two cache/attention ops, with the reference functions' signatures."""

    ragged_paged_attention: Callable[..., jax.Array]
    kv_cache_write: Callable[..., tuple[jax.Array, jax.Array]]


def get_attention_ops(backend: str, *, interpret: bool = False) -> AttentionOps:
    """The attention ops of one backend.

    Args:
      backend: ``"pallas"`` (the Pallas GPU kernels), ``"xla"`` (tiled plain
        ``jnp`` whose cost follows the sequences, for XLA's CPU backend; see
        ``kernels_pallas.xla``) or ``"reference"`` (the simplest plain ``jnp``,
        the ground truth).
      interpret: for ``"pallas"``, bind ``interpret=True`` so the kernels run in
        the Pallas interpreter (slow; CPU tests). Ignored for ``"reference"``.

    Returns:
      AttentionOps whose members take the arguments of
      ``ragged_paged_attention_reference`` and ``kv_cache_write_reference``.
      The Pallas decode kernel serves decode-only steps inside
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
        return AttentionOps(
            ragged_paged_attention=ragged_paged_attention_xla,
            kv_cache_write=kv_cache_write_reference,
        )
    if backend == "reference":
        return AttentionOps(
            ragged_paged_attention=ragged_paged_attention_reference,
            kv_cache_write=kv_cache_write_reference,
        )
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {ATTENTION_BACKENDS}")


def decode_fast_path(ragged: Callable[..., jax.Array], decode: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """A ragged attention that hands decode-only steps to a decode kernel.

    Args:
      ragged: with ``ragged_paged_attention_reference``'s signature.
      decode: with ``paged_attention_reference``'s signature (one query per
        sequence; rows with ``seq_lens`` 0 give zeros).

    Returns:
      A function with the ragged signature. When every live sequence row of
      the step has exactly one new token, it gathers those queries
      (``[S, Hq, D]``), runs ``decode`` (the split-K decode kernel reads each
      sequence's KV once for all its query heads, with no ragged bookkeeping)
      and scatters the rows back to their token positions; otherwise it runs
      ``ragged``. The choice is a ``lax.cond`` on the batch arrays, so both
      live in one compiled program.
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
    """``"pallas"`` when JAX's default backend is a GPU, else ``"xla"``."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionOps",
    "decode_fast_path",
    "default_attention_backend",
    "get_attention_ops",
    "kv_cache_write",
    "kv_cache_write_reference",
    "paged_attention",
    "paged_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_xla",
]
