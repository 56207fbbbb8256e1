"""Batched token sampler: one jitted function for every row of a step (vLLM v1's ``Sampler``).

Every per-request control is an array row (no compilation per request), applied in vLLM's order; per-request
state lives on the device in :class:`SamplerTables`, indexed by a sampling slot (0 = padding). A row's key is
``fold_in(key(seed), num_generated)``, so its draws never depend on the batch. Design: docs/design/sampler.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from scheduler.sampling_params import GREEDY_EPS, MAX_LOGPROBS, SamplingParams

# Token rows whose logits are materialised at once for prompt logprobs: the
# [rows, V] float32 logits of a whole step (hundreds of MB with a 128k
# vocabulary) are never held together.
PROMPT_LOGPROBS_CHUNK = 128
# Ids banned by multi-token bad words in one step, per row (a fixed width so
# the step compiles once); each matching bad word bans one id.
MAX_BANNED_IDS = 16
# Out of range for any vocabulary: unused ``banned`` entries, dropped by the scatter.
_NO_TOKEN = _INT32_MAX = int(np.iinfo(np.int32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling controls of one step (numpy on the host, a pytree of device arrays in the sampler).

    Arrays are ``[S]`` (the padded sequence bucket) unless noted; padding rows are greedy, inert, slot 0:
      slot: int32 sampling slot (0 = none); temperature: float32 (0 = greedy); top_k: int32 (0 = off);
      top_p, min_p: float32; seed: uint32[S, 2] (:func:`seed_words`); num_generated: int32;
      presence_penalty, frequency_penalty, repetition_penalty: float32 (0, 0, 1 = off);
      use_bias: bool, add the slot's bias row; min_tokens: int32, the slot's stop row is banned before it;
      num_logprobs: int32 (0 = chosen token's only, -1 = none); sample_mask: bool, the token is counted;
      banned: int32[S, MAX_BANNED_IDS] ids banned this step, padded with an out-of-range id.
    """

    slot: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    num_generated: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    use_bias: np.ndarray
    min_tokens: np.ndarray
    num_logprobs: np.ndarray
    sample_mask: np.ndarray
    banned: np.ndarray

    @classmethod
    def empty(cls, num_rows: int) -> "SamplingArrays":
        """``num_rows`` inert (greedy, slot 0) rows: the layout of a bucket with no requests."""
        f32, i32 = np.float32, np.int32
        return cls(
            slot=np.zeros(num_rows, i32), temperature=np.zeros(num_rows, f32), top_k=np.zeros(num_rows, i32),
            top_p=np.ones(num_rows, f32), min_p=np.zeros(num_rows, f32), seed=np.zeros((num_rows, 2), np.uint32),
            num_generated=np.zeros(num_rows, i32), presence_penalty=np.zeros(num_rows, f32),
            frequency_penalty=np.zeros(num_rows, f32), repetition_penalty=np.ones(num_rows, f32),
            use_bias=np.zeros(num_rows, bool), min_tokens=np.zeros(num_rows, i32),
            num_logprobs=np.full(num_rows, -1, i32), sample_mask=np.zeros(num_rows, bool),
            banned=np.full((num_rows, MAX_BANNED_IDS), _NO_TOKEN, i32),
        )

    # The per-sequence columns of :meth:`row_values`, in its order (the rest, slot, num_generated, sample_mask
    # and banned, change from step to step).
    SEQUENCE_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed_high", "seed_low", "presence_penalty",
                       "frequency_penalty", "repetition_penalty", "use_bias", "min_tokens", "num_logprobs")

    @staticmethod
    def row_values(params: SamplingParams, seed: int, uses_bias: bool = False) -> tuple[float, ...]:
        """One sequence's fixed controls as ``SEQUENCE_FIELDS`` values, each exact in float64 and in its column's
        dtype (computed once per sequence, so that a step fills its rows with one array per field). A ``top_k`` or
        ``min_tokens`` past int32 is cut to int32's largest, which keeps every token / bans the stop ids for any
        length a sequence can reach."""
        high, low = seed_words(seed)
        return (0.0 if params.greedy else params.temperature, min(params.top_k, _INT32_MAX), params.top_p,
                params.min_p, high, low, params.presence_penalty, params.frequency_penalty,
                params.repetition_penalty, float(uses_bias), min(params.min_tokens, _INT32_MAX),
                -1 if params.logprobs is None else params.logprobs)

    def set_rows(self, rows: Sequence[int], values: np.ndarray, *, slot: Sequence[int],
                 num_generated: Sequence[int], sample: Sequence[bool]) -> None:
        """Fill ``rows`` at once: ``values`` float64[len(rows), len(SEQUENCE_FIELDS)] stacks their
        :meth:`row_values`; slot, num_generated, sample: one per row. Banned ids are left as they are."""
        rows = np.asarray(rows, np.intp)
        (self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows], self.seed[rows, 0],
         self.seed[rows, 1], self.presence_penalty[rows], self.frequency_penalty[rows],
         self.repetition_penalty[rows], self.use_bias[rows], self.min_tokens[rows],
         self.num_logprobs[rows]) = values.T
        self.slot[rows] = slot
        self.num_generated[rows] = num_generated
        self.sample_mask[rows] = sample

    def set_banned(self, row: int, banned: Sequence[int]) -> None:
        """Set row ``row``'s ids banned this step. Raises ValueError: more than ``MAX_BANNED_IDS`` (no change)."""
        if len(banned) > MAX_BANNED_IDS:
            raise ValueError(f"{len(banned)} ids banned by bad words in one step; at most {MAX_BANNED_IDS}")
        self.banned[row] = _NO_TOKEN
        self.banned[row, : len(banned)] = banned

    def repeat(self, num_positions: int) -> "SamplingArrays":
        """Each row repeated ``num_positions`` times: row ``s * P + j`` is row s at ``num_generated + j``."""
        wide = jax.tree_util.tree_map(lambda v: np.repeat(v, num_positions, axis=0), self)
        wide.num_generated += np.tile(np.arange(num_positions, dtype=np.int32), len(self.slot))
        return wide


def seed_words(seed: int) -> tuple[int, int]:
    """An int64 seed's two's-complement bits as (high, low) uint32 words: ``jax.random.key(seed)``'s data under x64."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


# ------------------------------------------------------------ device tables


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerTables:
    """Per-slot device state (``R`` slots, slot 0 the padding rows'), donated to every program that changes it:
    counts int32[R, V] output-token counts; prompt bool[R, V] prompt-token presence; bias float32[R, V] additive
    (-inf = banned); stop bool[R, V] ids banned before ``min_tokens``.
    """

    counts: jax.Array
    prompt: jax.Array
    bias: jax.Array
    stop: jax.Array


def init_tables(num_slots: int, vocab: int) -> SamplerTables:
    """Zeroed :class:`SamplerTables` for ``num_slots`` slots (slot 0 included) of a ``vocab``-token model."""
    return SamplerTables(
        counts=jnp.zeros((num_slots, vocab), jnp.int32),
        prompt=jnp.zeros((num_slots, vocab), bool),
        bias=jnp.zeros((num_slots, vocab), jnp.float32),
        stop=jnp.zeros((num_slots, vocab), bool),
    )


def fill_slot(tables: SamplerTables, slot: jax.Array, token_ids: jax.Array, num_prompt: jax.Array,
              num_tokens: jax.Array) -> SamplerTables:
    """Reset slot ``slot`` for a sequence (re)admitted with these tokens (recounted, never twice).
    tables: donated; slot, num_prompt, num_tokens: int32[]; token_ids: int32[L] prompt then output, padded.
    """
    pos = jnp.arange(token_ids.shape[0])
    in_prompt = pos < num_prompt
    in_output = (pos >= num_prompt) & (pos < num_tokens)
    vocab = tables.counts.shape[1]
    counts = jnp.zeros(vocab, jnp.int32).at[token_ids].add(in_output.astype(jnp.int32))
    prompt = jnp.zeros(vocab, bool).at[token_ids].max(in_prompt)
    return dataclasses.replace(tables, counts=tables.counts.at[slot].set(counts),
                               prompt=tables.prompt.at[slot].set(prompt))


def set_slot_rows(tables: SamplerTables, slot: jax.Array, bias: jax.Array, stop: jax.Array) -> SamplerTables:
    """Write a slot's bias row (``float32[V]``) and stop row (``bool[V]``); tables donated."""
    return dataclasses.replace(tables, bias=tables.bias.at[slot].set(bias), stop=tables.stop.at[slot].set(stop))


# ------------------------------------------------------------------ outputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """The sampler's outputs: ``[S]`` rows from :func:`sample`, ``[S, P]`` (emitted tokens first) from :func:`verify`.

      token_ids: int32 the tokens; logprobs: float32 their logprobs (or logits, per the ``logprobs_mode``);
      ranks: int32 1-based ranks among those values.
      top_ids: int32[..., K], top_logprobs: float32[..., K] the top ``K = min(MAX_LOGPROBS, V)``, descending
        (zeros when no row asked).
      num_emitted: int32[S] accepted drafts + 1; None from :func:`sample`.
    On the host (``StepOutput.fetch_rows``) logprobs, ranks, top_ids and top_logprobs are None when no row of the
    step asked for logprobs.
    """

    token_ids: jax.Array
    logprobs: Optional[jax.Array]
    ranks: Optional[jax.Array]
    top_ids: Optional[jax.Array]
    top_logprobs: Optional[jax.Array]
    num_emitted: Optional[jax.Array] = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobRows:
    """:func:`prompt_logprobs`' outputs per token row ``T`` (zeros where none was wanted): logprobs float32[T],
    ranks int32[T] (1-based), top_ids int32[T, K] and top_logprobs float32[T, K], descending.
    """

    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


# --------------------------------------------------------------- transforms


def apply_logit_processors(logits: jax.Array, arrays: SamplingArrays, tables: SamplerTables,
                           extra_counts: jax.Array | None = None) -> jax.Array:
    """Bias row, bad-word bans and min_tokens, then penalties (vLLM v1 order: CTRL repetition, OpenAI
    frequency/presence over output tokens). logits: float32[S, V], same shape out. extra_counts: int32[S, V]
    output tokens counted on top of the slot's (drafts before a verified position), or None.
    """
    slot = arrays.slot
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits + jnp.where(arrays.use_bias[:, None], tables.bias[slot], 0.0)
    logits = logits.at[rows, arrays.banned].set(-jnp.inf, mode="drop")
    before_min = (arrays.num_generated < arrays.min_tokens)[:, None]
    logits = jnp.where(before_min & tables.stop[slot], -jnp.inf, logits)
    counts = tables.counts[slot]
    if extra_counts is not None:
        counts = counts + extra_counts
    output_seen = counts > 0
    seen = output_seen | tables.prompt[slot]
    rep = arrays.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - arrays.frequency_penalty[:, None] * counts
    return logits - arrays.presence_penalty[:, None] * output_seen


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf on the tokens a packed bitmask does not allow. logits: [S, V] float32; bitmask: int32[S, ceil(V / 32)],
    token ``t`` allowed when bit ``t % 32`` of word ``t // 32`` is set (llguidance's layout). Returns [S, V].
    """
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def apply_top_k_top_p_min_p(
    logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
) -> jax.Array:
    """Mask logits outside each row's min-p / top-k / top-p set with -inf (vLLM's rules, one sort per row).

    logits: float32[S, V] (temperature-scaled); top_k: int32[S] (0 = off); top_p, min_p: float32[S]. Top-p is
    measured after min-p and top-k; the top token always survives and ties at a cut-off all survive.
    """
    vocab = logits.shape[-1]
    sorted_logits = -jnp.sort(-logits, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = rank < jnp.where(top_k > 0, top_k, vocab)[:, None]
    # p_i >= min_p * p_max in log space, where it cannot underflow.
    keep &= sorted_logits >= sorted_logits[:, :1] + jnp.log(min_p)[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    keep = keep.at[:, 0].set(True)
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


# Chunk widths argmax_rows tries, in order: the first that divides the vocabulary into at least 2 chunks.
ARGMAX_CHUNKS = (128, 256, 64, 512, 32)


def argmax_rows(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, axis=-1)`` of float ``[R, V]`` as int32 ``[R]``, the same index, in two vectorized
    passes over :data:`ARGMAX_CHUNKS` (why: docs/design/sampler.md)."""
    num_rows, vocab = logits.shape
    chunk = next((c for c in ARGMAX_CHUNKS if vocab % c == 0 and vocab // c >= 2), None)
    if chunk is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def chunked() -> jax.Array:
        blocks = logits.reshape(num_rows, vocab // chunk, chunk)
        best = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
        within = jnp.take_along_axis(blocks, best[:, None, None], axis=1)[:, 0]
        return (best * chunk + jnp.argmax(within, axis=-1)).astype(jnp.int32)

    return jax.lax.cond(jnp.any(jnp.isnan(jnp.sum(logits, axis=-1))),
                        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32), chunked)


def _row_keys(seed: jax.Array, num_generated: jax.Array) -> jax.Array:
    # threefry named, not the configured default: the seed words are its key data (seed_words).
    return jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(seed, impl="threefry2x32"), num_generated)


def _draw(logits: jax.Array, arrays: SamplingArrays, filtered: bool) -> jax.Array:
    temperature = arrays.temperature
    scaled = logits / jnp.where(temperature < GREEDY_EPS, 1.0, temperature)[:, None]
    if filtered:
        scaled = apply_top_k_top_p_min_p(scaled, arrays.top_k, arrays.top_p, arrays.min_p)
    keys = _row_keys(arrays.seed, arrays.num_generated)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    return argmax_rows(scaled + gumbel)


def processed_logits(raw: jax.Array, arrays: SamplingArrays, tables: SamplerTables, bitmask: Optional[jax.Array],
                     extra_counts: jax.Array | None = None) -> jax.Array:
    """The logits each row samples from (vLLM's "processed" logits): bitmask, processors and penalties, then for
    a sampled row its temperature and min-p / top-k / top-p (-inf outside the kept set); a greedy row stops after
    the penalties. raw: float32[R, V]; extra_counts: as :func:`apply_logit_processors`. Returns float32[R, V].
    """
    masked = _with_bitmask(raw, bitmask)
    out = apply_logit_processors(masked, arrays, tables, extra_counts)
    out = jnp.where(jnp.all(out == -jnp.inf, axis=-1, keepdims=True), masked, out)
    greedy = arrays.temperature < GREEDY_EPS
    scaled = out / jnp.where(greedy, 1.0, arrays.temperature)[:, None]
    filters = ~greedy & ((arrays.top_k > 0) | (arrays.top_p < 1.0) | (arrays.min_p > 0.0))
    # A row without a filter keeps every token (top_p = 1 alone could drop a float-rounded tail).
    filtered = jax.lax.cond(jnp.any(filters), lambda: jnp.where(filters[:, None], apply_top_k_top_p_min_p(
        scaled, arrays.top_k, arrays.top_p, arrays.min_p), scaled), lambda: scaled)
    return jnp.where(greedy[:, None], out, filtered)


def _logprobs(raw: jax.Array, tokens: jax.Array, normalize: bool = True
              ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Logprobs of ``tokens`` [N] (``raw`` log-softmaxed, or as given without ``normalize``), 1-based ranks (vLLM's
    rule) and the top ``MAX_LOGPROBS``, descending."""
    logprobs = jax.nn.log_softmax(raw, axis=-1) if normalize else raw
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(logprobs >= chosen[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, raw.shape[-1]))
    return chosen, ranks, top_ids.astype(jnp.int32), top_logprobs


def _maybe_logprobs(raw: jax.Array, tokens: jax.Array, arrays: SamplingArrays, tables: SamplerTables,
                    bitmask: Optional[jax.Array], logprobs_mode: str,
                    extra_counts: Callable[[], jax.Array] | None = None) -> tuple[jax.Array, ...]:
    """:func:`_logprobs` when some row asks for logprobs, else zeros: of ``raw`` with the bitmask applied for the
    "raw_*" modes, of :func:`processed_logits` for the "processed_*" ones; "*_logits" modes are not normalized."""
    num_rows, width = raw.shape[0], min(MAX_LOGPROBS, raw.shape[-1])

    def values() -> jax.Array:
        if logprobs_mode.startswith("raw"):
            return _with_bitmask(raw, bitmask)
        return processed_logits(raw, arrays, tables, bitmask, None if extra_counts is None else extra_counts())

    return jax.lax.cond(
        jnp.any(arrays.num_logprobs >= 0),
        lambda: _logprobs(values(), tokens, normalize=logprobs_mode.endswith("logprobs")),
        lambda: (jnp.zeros(num_rows, jnp.float32), jnp.zeros(num_rows, jnp.int32),
                 jnp.zeros((num_rows, width), jnp.int32), jnp.zeros((num_rows, width), jnp.float32)),
    )


def _with_bitmask(raw: jax.Array, bitmask: Optional[jax.Array]) -> jax.Array:
    """``raw`` [R, V] with :func:`apply_token_bitmask` of ``bitmask`` (None: ``raw``)."""
    return raw if bitmask is None else apply_token_bitmask(raw, bitmask)


def _choose(raw: jax.Array, arrays: SamplingArrays, tables: SamplerTables, bitmask: Optional[jax.Array],
            extra_counts: Callable[[], jax.Array] | None = None) -> jax.Array:
    """One token per row of float32 ``raw`` [R, V]: bitmask, processors, then argmax or a draw."""
    constrained = False if bitmask is None else jnp.any(bitmask != -1)
    needs_processing = constrained | jnp.any(
        arrays.use_bias | (arrays.presence_penalty != 0) | (arrays.frequency_penalty != 0)
        | (arrays.repetition_penalty != 1) | (arrays.num_generated < arrays.min_tokens)
        | jnp.any(arrays.banned < raw.shape[-1], axis=-1)
    )
    greedy = arrays.temperature < GREEDY_EPS
    needs_filter = jnp.any(~greedy & ((arrays.top_k > 0) | (arrays.top_p < 1.0) | (arrays.min_p > 0.0)))

    def pick(logits: jax.Array) -> jax.Array:
        argmax = argmax_rows(logits)
        sampled = jax.lax.cond(
            jnp.all(greedy),
            lambda: argmax,
            lambda: jax.lax.cond(needs_filter, lambda: _draw(logits, arrays, True),
                                 lambda: _draw(logits, arrays, False)),
        )
        return jnp.where(greedy, argmax, sampled)

    def processed() -> jax.Array:
        # Processors that no row asked for leave the masked logits as they are.
        masked = _with_bitmask(raw, bitmask)
        out = apply_logit_processors(masked, arrays, tables, None if extra_counts is None else extra_counts())
        return pick(jnp.where(jnp.all(out == -jnp.inf, axis=-1, keepdims=True), masked, out))

    return jax.lax.cond(needs_processing, processed, lambda: pick(raw))


def sample(logits: jax.Array, arrays: SamplingArrays, tables: SamplerTables,
           bitmask: Optional[jax.Array] = None, logprobs_mode: str = "raw_logprobs"
           ) -> tuple[SamplerOutput, SamplerTables]:
    """Draw one token per row and count it in the row's slot; each stage runs only when some row needs it.

    Args:
      logits: float32[S, V]. arrays: the rows' :class:`SamplingArrays`. tables: :class:`SamplerTables` (donated).
      bitmask: int32[S, ceil(V / 32)] allowed tokens, or None.
      logprobs_mode: static, one of ``jaxllm.config.LOGPROBS_MODES`` (vLLM's): what the logprobs are taken from.

    Returns:
      ``(out, tables)``: a :class:`SamplerOutput` of ``[S]`` rows and the tables with used samples counted.
    """
    raw = logits.astype(jnp.float32)
    tokens = _choose(raw, arrays, tables, bitmask)
    chosen, ranks, top_ids, top_logprobs = _maybe_logprobs(raw, tokens, arrays, tables, bitmask, logprobs_mode)
    counted = (arrays.sample_mask & (arrays.slot > 0)).astype(jnp.int32)
    tables = dataclasses.replace(tables, counts=tables.counts.at[arrays.slot, tokens].add(counted))
    return SamplerOutput(tokens, chosen, ranks, top_ids, top_logprobs), tables


# ------------------------------------------------------ speculative decoding


def _draft_counts(drafts: jax.Array, vocab: int) -> jax.Array:
    """int32[S * P, V]: at position j of row s, one count for each of the drafts ``drafts[s, :j]`` (-1 = none)."""
    num_rows, width = drafts.shape
    before = jnp.arange(width)[None, :] < jnp.arange(width)[:, None]  # [j, i]: draft i comes before position j
    ids = jnp.broadcast_to(drafts[:, None, :], (num_rows, width, width))
    ids = jnp.where(before[None] & (ids >= 0), ids, vocab)
    rows = jnp.broadcast_to(jnp.arange(num_rows * width).reshape(num_rows, width, 1), ids.shape)
    return jnp.zeros((num_rows * width, vocab), jnp.int32).at[rows.ravel(), ids.ravel()].add(1, mode="drop")


def verify(logits: jax.Array, drafts: jax.Array, arrays: SamplingArrays, tables: SamplerTables,
           bitmask: Optional[jax.Array] = None, logprobs_mode: str = "raw_logprobs"
           ) -> tuple[SamplerOutput, SamplerTables]:
    """Verify each row's drafts and emit its accepted drafts plus one token (speculative decoding): position j
    samples as without speculation and a row accepts its longest run of matching drafts, so a seeded request emits
    exactly what it would without speculation (Leviathan et al. 2023, point-mass drafts).

    Args:
      logits: float32[S * P, V], row ``s * P + j`` = row s at position j.
      drafts: int32[S, P], -1 where a position verifies nothing.
      arrays: ``SamplingArrays.repeat(P)`` on the device. tables: donated.
      bitmask: int32[S, ceil(V / 32)] applied at position 0 only, or None. logprobs_mode: as :func:`sample`.

    Returns:
      ``(out, tables)``: a :class:`SamplerOutput` of ``[S, P]`` rows with ``num_emitted: int32[S]``.
    """
    num_rows, width = drafts.shape
    if bitmask is not None:
        at_first = (jnp.arange(width) == 0)[None, :, None]
        bitmask = jnp.where(at_first, bitmask[:, None, :], -1).reshape(num_rows * width, -1)
    raw = logits.astype(jnp.float32)
    draft_counts = functools.partial(_draft_counts, drafts, raw.shape[-1])
    tokens = _choose(raw, arrays, tables, bitmask, draft_counts)
    chosen, ranks, top_ids, top_logprobs = _maybe_logprobs(raw, tokens, arrays, tables, bitmask, logprobs_mode,
                                                           draft_counts)
    accepted = ((tokens == drafts.reshape(-1)) & (drafts.reshape(-1) >= 0)).reshape(num_rows, width)
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1, dtype=jnp.int32)
    used = (jnp.arange(width)[None, :] <= num_accepted[:, None]).reshape(-1)
    counted = (used & arrays.sample_mask & (arrays.slot > 0)).astype(jnp.int32)
    tables = dataclasses.replace(tables, counts=tables.counts.at[arrays.slot, tokens].add(counted))
    out = SamplerOutput(token_ids=tokens.reshape(num_rows, width), logprobs=chosen.reshape(num_rows, width),
                        ranks=ranks.reshape(num_rows, width), top_ids=top_ids.reshape(num_rows, width, -1),
                        top_logprobs=top_logprobs.reshape(num_rows, width, -1), num_emitted=num_accepted + 1)
    return out, tables


def sample_or_verify(compute_logits: Callable[[jax.Array], jax.Array], hidden: jax.Array, input_ids: jax.Array,
                     logits_indices: jax.Array, num_spec_tokens: jax.Array, arrays: SamplingArrays,
                     tables: SamplerTables, num_positions: int, bitmask: Optional[jax.Array] = None,
                     logprobs_mode: str = "raw_logprobs") -> tuple[SamplerOutput, SamplerTables]:
    """:func:`verify` when some row carries drafts, else :func:`sample` (as ``verify``'s outputs).

    Args:
      compute_logits: hidden ``[N, E]`` -> float32 logits ``[N, V]``. hidden: ``[T, E]``.
      input_ids: int32[T] (a row's drafts are its last ``num_spec_tokens``). logits_indices,
      num_spec_tokens: int32[S]. arrays: ``SamplingArrays.repeat(num_positions)``. tables: donated.
      num_positions: static P = 1 + the most drafts a row may carry. bitmask, logprobs_mode: as :func:`verify`.
    """
    position = jnp.arange(num_positions)[None, :]
    first = (logits_indices - num_spec_tokens)[:, None]
    rows = jnp.minimum(first + position, logits_indices[:, None])
    has_draft = position < num_spec_tokens[:, None]
    drafts = jnp.where(has_draft, input_ids[jnp.minimum(first + position + 1, input_ids.shape[0] - 1)], -1)

    def drafted() -> tuple[SamplerOutput, SamplerTables]:
        return verify(compute_logits(hidden[rows.reshape(-1)]), drafts, arrays, tables, bitmask, logprobs_mode)

    def plain() -> tuple[SamplerOutput, SamplerTables]:
        out, new_tables = sample(compute_logits(hidden[logits_indices]),
                                 jax.tree_util.tree_map(lambda a: a[::num_positions], arrays), tables, bitmask,
                                 logprobs_mode)
        pad = [(0, 0), (0, num_positions - 1)]
        wide = jax.tree_util.tree_map(lambda v: jnp.pad(v[:, None], pad + [(0, 0)] * (v.ndim - 1)), out)
        return dataclasses.replace(wide, num_emitted=jnp.ones(logits_indices.shape, jnp.int32)), new_tables

    return jax.lax.cond(jnp.any(num_spec_tokens > 0), drafted, plain)


def prompt_logprobs(compute_logits: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                    target_ids: jax.Array) -> PromptLogprobRows:
    """Raw logprobs of each token row's next prompt token, and its top tokens (vLLM's prompt logprobs, raw
    whatever the ``logprobs_mode``).
    compute_logits: hidden ``[N, E]`` -> float32 ``[N, V]``; hidden: ``[T, E]``; target_ids: int32[T], -1 where
    none is wanted. Returns :class:`PromptLogprobRows` of ``[T]`` rows (zeros at -1).
    """
    def row(h_and_target: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        h, target = h_and_target
        out = _logprobs(compute_logits(h[None]), jnp.maximum(target, 0)[None])
        return tuple(jnp.where(target >= 0, x[0], 0) for x in out)

    def computed() -> tuple[jax.Array, ...]:
        return jax.lax.map(row, (hidden, target_ids), batch_size=PROMPT_LOGPROBS_CHUNK)

    def skipped() -> tuple[jax.Array, ...]:
        return jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(computed))

    return PromptLogprobRows(*jax.lax.cond(jnp.any(target_ids >= 0), computed, skipped))
