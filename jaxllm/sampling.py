"""Batched token sampler: one jitted function for every row of a step.

Every per-request control is an array argument (one row per sequence), so no
request property triggers a compilation. Follows vLLM's sampler order:
temperature, then top-k / top-p / min-p from one descending sort, then a
Gumbel-max draw; rows with temperature 0 take the argmax of the raw logits.

Randomness: each row's key is ``fold_in(key(seed), num_generated)``, so a
request's draws depend only on its own seed and how many tokens it has
produced — not on the batch it shares, the bucket, or preemption.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from scheduler.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5


@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling controls of one step (numpy, host side).

    All arrays are ``[S]`` (the padded sequence bucket): ``temperature``
    float32 (0 = greedy), ``top_k`` int32 (0 = off), ``top_p`` float32,
    ``min_p`` float32, ``seed`` uint32, ``num_generated`` int32. Padding rows
    are greedy and inert.
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    num_generated: np.ndarray

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        num_generated: Sequence[int],
        num_rows: int,
    ) -> "SamplingArrays":
        """Pack per-request params into ``num_rows``-long arrays.

        Args:
          params: one SamplingParams per real row, in row order.
          seeds: each row's seed (the request's own, or one the engine drew).
          num_generated: tokens each row has generated so far.
          num_rows: the padded row count S (>= len(params)).
        """
        n = len(params)
        out = cls(
            temperature=np.zeros(num_rows, np.float32),
            top_k=np.zeros(num_rows, np.int32),
            top_p=np.ones(num_rows, np.float32),
            min_p=np.zeros(num_rows, np.float32),
            seed=np.zeros(num_rows, np.uint32),
            num_generated=np.zeros(num_rows, np.int32),
        )
        out.temperature[:n] = [0.0 if p.greedy else p.temperature for p in params]
        out.top_k[:n] = [p.top_k for p in params]
        out.top_p[:n] = [p.top_p for p in params]
        out.min_p[:n] = [p.min_p for p in params]
        out.seed[:n] = np.asarray(seeds, dtype=np.uint64) & 0xFFFFFFFF
        out.num_generated[:n] = num_generated
        return out

    @classmethod
    def empty(cls, num_rows: int) -> "SamplingArrays":
        """``num_rows`` inert (greedy) rows: the layout of a bucket with no requests."""
        return cls.build([], [], [], num_rows)

    def as_dict(self) -> dict[str, np.ndarray]:
        return dataclasses.asdict(self)


def _row_keys(seed: jax.Array, num_generated: jax.Array) -> jax.Array:
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seed, num_generated)


def apply_top_k_top_p_min_p(
    logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
) -> jax.Array:
    """Mask logits outside each row's top-k / nucleus / min-p set with -inf.

    logits: [S, V] float32 (already temperature-scaled); top_k int32[S]
    (0 = off); top_p, min_p float32[S]. One descending sort per row; the most
    likely token always survives. Ties at the cut-off all survive.
    """
    vocab = logits.shape[-1]
    sorted_logits = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    keep = rank < k
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < top_p[:, None]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def _draw(logits: jax.Array, arrays: dict[str, jax.Array], filtered: bool) -> jax.Array:
    temperature = arrays["temperature"]
    scaled = logits / jnp.where(temperature < _GREEDY_EPS, 1.0, temperature)[:, None]
    if filtered:
        scaled = apply_top_k_top_p_min_p(scaled, arrays["top_k"], arrays["top_p"], arrays["min_p"])
    keys = _row_keys(arrays["seed"], arrays["num_generated"])
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    return jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, arrays: dict[str, jax.Array]) -> jax.Array:
    """Draw one token per row.

    Args:
      logits: [S, V] float32.
      arrays: ``SamplingArrays.as_dict()`` on the device.

    Returns:
      int32[S] token ids.

    The sort (top-k/top-p/min-p) and the random draw run only when some row
    needs them (``lax.cond``), so all-greedy steps pay for an argmax alone.
    """
    greedy = arrays["temperature"] < _GREEDY_EPS
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    needs_filter = jnp.any(~greedy & ((arrays["top_k"] > 0) | (arrays["top_p"] < 1.0) | (arrays["min_p"] > 0.0)))
    sampled = jax.lax.cond(
        jnp.all(greedy),
        lambda: argmax,
        lambda: jax.lax.cond(needs_filter, lambda: _draw(logits, arrays, True), lambda: _draw(logits, arrays, False)),
    )
    return jnp.where(greedy, argmax, sampled)
