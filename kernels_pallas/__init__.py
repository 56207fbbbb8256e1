"""Paged-attention kernels for jaxllm: Pallas GPU kernels and their jnp references.

Knows nothing of models or the scheduler. See ``reference.py`` for the cache
layout and the exact semantics every kernel here shares. The engine picks an
implementation with :func:`get_attention_ops`.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax

from kernels_pallas.cache_write import kv_cache_write
from kernels_pallas.decode import paged_attention
from kernels_pallas.ragged import ragged_paged_attention
from kernels_pallas.reference import (
    kv_cache_write_reference,
    paged_attention_reference,
    ragged_paged_attention_reference,
)

ATTENTION_BACKENDS = ("pallas", "reference")


class AttentionOps(NamedTuple):
    """The three cache/attention ops, with the reference functions' signatures."""

    ragged_paged_attention: Callable[..., jax.Array]
    paged_attention: Callable[..., jax.Array]
    kv_cache_write: Callable[..., tuple[jax.Array, jax.Array]]


def get_attention_ops(backend: str, *, interpret: bool = False) -> AttentionOps:
    """The attention ops of one backend.

    Args:
      backend: ``"pallas"`` (the Pallas GPU kernels) or ``"reference"`` (plain
        ``jnp``, any backend).
      interpret: for ``"pallas"``, bind ``interpret=True`` so the kernels run in
        the Pallas interpreter (slow; CPU tests). Ignored for ``"reference"``.

    Returns:
      AttentionOps whose members take the arguments of
      ``ragged_paged_attention_reference``, ``paged_attention_reference`` and
      ``kv_cache_write_reference``.

    Raises:
      ValueError: for an unknown backend.
    """
    if backend == "pallas":
        return AttentionOps(
            ragged_paged_attention=functools.partial(ragged_paged_attention, interpret=interpret),
            paged_attention=functools.partial(paged_attention, interpret=interpret),
            kv_cache_write=functools.partial(kv_cache_write, interpret=interpret),
        )
    if backend == "reference":
        return AttentionOps(
            ragged_paged_attention=ragged_paged_attention_reference,
            paged_attention=paged_attention_reference,
            kv_cache_write=kv_cache_write_reference,
        )
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {ATTENTION_BACKENDS}")


def default_attention_backend() -> str:
    """``"pallas"`` when JAX's default backend is a GPU, else ``"reference"``."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionOps",
    "default_attention_backend",
    "get_attention_ops",
    "kv_cache_write",
    "kv_cache_write_reference",
    "paged_attention",
    "paged_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
