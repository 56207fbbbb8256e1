"""Batched token sampler: one jitted function for every row of a step.

Every per-request control is an array argument (one row per sequence), so no
request property triggers a compilation. Follows vLLM v1's ``Sampler``:

0. the structured-output bitmask: tokens a row's grammar does not allow
   get -inf (``jaxllm.structured_output``; vLLM applies it to the logits
   before its sampler);
1. log-probabilities, when some row asks, of the *raw* model distribution
   (``log_softmax`` of the logits before any processing but the bitmask;
   vLLM's default ``logprobs_mode="raw_logprobs"``);
2. logit processors: ``allowed_token_ids`` and single-token ``bad_words``
   and ``logit_bias`` (one additive bias row per request), multi-token bad
   words (ids banned this step), ``min_tokens`` (eos and stop ids banned);
3. penalties: CTRL's repetition penalty (Keskar et al. 2019) over prompt and
   output tokens, OpenAI's frequency and presence penalties over output
   tokens;
4. greedy rows (temperature 0) take the argmax of the processed logits;
5. the others: temperature, then min-p, top-k and top-p from one descending
   sort, then a Gumbel-max draw (equivalent to vLLM's exponential race).

Per-request state lives on the device in :class:`SamplerTables` rows indexed by
a *sampling slot* (slot 0 is padding) that the engine assigns while a
sequence runs: output-token counts, prompt-token presence, the bias row and
the stop-id row. The step gathers each row's slot and adds the sampled token
to its counts (the tables are donated).

Prompt logprobs (:func:`prompt_logprobs`) are computed in the same step, from
the hidden states of every token row, only when some row asks for them.

Randomness: each row's key is ``fold_in(key(seed), num_generated)``, so a
request's draws depend only on its own seed and how many tokens it has
produced -- not on the batch it shares, the bucket, or preemption. The key
holds all 64 bits of the seed (threefry's two key words: two int64 seeds
never share a stream); JAX's own ``key(seed)`` would keep 32 of them
without ``jax_enable_x64``.
"""

from __future__ import annotations

import dataclasses
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
_NO_TOKEN = np.iinfo(np.int32).max


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling controls of one step: numpy on the host, where
    :meth:`set_row` fills them; a pytree, so ``jax.device_put`` gives the
    same class of device arrays, which the sampler reads.

    Arrays are ``[S]`` (the padded sequence bucket) unless noted:

      slot: int32, the row's sampling slot in :class:`SamplerTables` (0 = none).
      temperature: float32, 0 = greedy. top_k: int32, 0 = off. top_p,
        min_p: float32. seed: uint32[S, 2], the seed's two's-complement
        64 bits as (high, low) words, the threefry key data of the row's
        ``key(seed)`` (:func:`seed_words`). num_generated: int32, tokens the
        sequence has generated before this step.
      presence_penalty, frequency_penalty, repetition_penalty: float32
        (0, 0, 1 = off).
      use_bias: bool, add the slot's bias row (logit_bias, allowed ids,
        single-token bad words).
      min_tokens: int32, the slot's stop row is banned while
        ``num_generated < min_tokens``.
      num_logprobs: int32, top log-probabilities wanted (0 = only the chosen
        token's), -1 = none.
      sample_mask: bool, the sample is used (its token is counted).
      banned: int32[S, MAX_BANNED_IDS], ids banned this step, padded with an
        out-of-range id.

    Padding rows are greedy, inert and use slot 0.
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

    def set_row(self, row: int, params: SamplingParams, *, slot: int, seed: int, num_generated: int,
                sample: bool = True, uses_bias: bool = False, banned: Sequence[int] = ()) -> None:
        """Fill row ``row`` from one sequence's parameters and state.

        Raises:
          ValueError: more than ``MAX_BANNED_IDS`` banned ids.
        """
        self.set_banned(row, banned)
        self.slot[row] = slot
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.seed[row] = seed_words(seed)
        self.num_generated[row] = num_generated
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.use_bias[row] = uses_bias
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.sample_mask[row] = sample

    def set_banned(self, row: int, banned: Sequence[int]) -> None:
        """Set row ``row``'s ids banned this step (the rest of its entries out of range).

        Raises:
          ValueError: more than ``MAX_BANNED_IDS`` banned ids (nothing is changed).
        """
        if len(banned) > MAX_BANNED_IDS:
            raise ValueError(f"{len(banned)} ids banned by bad words in one step; at most {MAX_BANNED_IDS}")
        self.banned[row] = _NO_TOKEN
        self.banned[row, : len(banned)] = banned

    def repeat(self, num_positions: int) -> "SamplingArrays":
        """Each row repeated for ``num_positions`` consecutive positions of
        its sequence (speculative verification): row ``s * num_positions + j``
        is row ``s`` with ``num_generated + j``."""
        wide = jax.tree_util.tree_map(lambda v: np.repeat(v, num_positions, axis=0), self)
        wide.num_generated += np.tile(np.arange(num_positions, dtype=np.int32), len(self.slot))
        return wide


def seed_words(seed: int) -> tuple[int, int]:
    """An int64 seed's threefry key data: its two's-complement bits as (high, low) uint32 words, what
    ``jax.random.key(seed)`` holds under ``jax_enable_x64`` (a seed in ``[0, 2**32)`` is ``(0, seed)``).
    ``SamplingParams`` keeps seeds in ``[-2**63, 2**63)``, where this is one-to-one."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


# ------------------------------------------------------------ device tables


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerTables:
    """Per-slot state on the device, one row per sampling slot (``R`` slots, slot 0 the padding rows'),
    donated to every program that changes it.

      counts: int32[R, V] output-token counts.
      prompt: bool[R, V] prompt-token presence.
      bias: float32[R, V] additive bias (-inf = banned).
      stop: bool[R, V] ids banned before ``min_tokens`` (eos and stop ids).
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
    """Reset slot ``slot`` for a sequence admitted (or readmitted) with these tokens.

    Args:
      tables: the tables (donated).
      slot: int32[] the slot.
      token_ids: int32[L] prompt then output tokens, padded to a fixed L so
        this compiles once.
      num_prompt: int32[] prompt length; num_tokens: int32[] prompt + output.

    Recounting from the token list on every (re)admission means a preempted
    and recomputed sequence never counts a token twice.
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
    """The sampler's outputs, one row per sequence row ``S`` of the step.

    :func:`sample` gives one token per row, ``[S]``; :func:`verify` and
    :func:`sample_or_verify` (steps that may carry drafts) give ``P``
    positions per row, ``[S, P]``, the emitted tokens first, and set
    ``num_emitted``: whether it is None tells the two apart.

      token_ids: int32[S] / int32[S, P] the sampled tokens.
      logprobs: float32[S] / [S, P] each token's raw logprob.
      ranks: int32[S] / [S, P] its 1-based rank in the raw distribution.
      top_ids: int32[S, K] / [S, P, K] and top_logprobs: float32 of the same
        shape, the top ``K = min(MAX_LOGPROBS, V)`` tokens, descending
        (zeros when no row asked for logprobs).
      num_emitted: int32[S] tokens each row emits (accepted drafts + 1);
        None from :func:`sample`.
    """

    token_ids: jax.Array
    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    num_emitted: Optional[jax.Array] = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobRows:
    """:func:`prompt_logprobs`' outputs, one row per token row ``T`` of the step (zeros where none was wanted).

      logprobs: float32[T] the raw logprob of the prompt token after the row's token.
      ranks: int32[T] its 1-based rank.
      top_ids: int32[T, K] and top_logprobs: float32[T, K] the top
        ``K = min(MAX_LOGPROBS, V)`` tokens, descending.
    """

    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


# --------------------------------------------------------------- transforms


def apply_logit_processors(logits: jax.Array, arrays: SamplingArrays, tables: SamplerTables,
                           extra_counts: jax.Array | None = None) -> jax.Array:
    """Bias row, bad-word bans and min_tokens, then penalties (vLLM v1 order).

    logits: [S, V] float32; returns the same shape. ``extra_counts``: int32
    [S, V] output tokens to count on top of the slot's (the drafts before a
    verified position), or None. Repetition penalty
    (CTRL): a logit of a token seen in the prompt or output is divided by the
    penalty when positive, multiplied when negative. Frequency and presence
    (OpenAI): ``logit -= frequency * count + presence * (count > 0)`` over
    output tokens.
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
    """-inf on the tokens a packed bitmask does not allow.

    logits: [S, V] float32; bitmask: int32[S, ceil(V / 32)], token ``t``
    allowed when bit ``t % 32`` of word ``t // 32`` is set (llguidance's and
    vLLM's layout); bits past V are ignored. Returns [S, V].
    """
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def apply_top_k_top_p_min_p(
    logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
) -> jax.Array:
    """Mask logits outside each row's min-p / top-k / nucleus set with -inf.

    logits: [S, V] float32 (already temperature-scaled); top_k int32[S]
    (0 = off); top_p, min_p float32[S]. As vLLM: min-p keeps tokens with
    probability >= ``min_p`` times the top one's; top-k the k most likely;
    top-p the smallest most-likely set whose mass reaches ``top_p``,
    measured on the distribution renormalised after min-p and top-k. One
    descending sort per row; the most likely token always survives, and ties
    at the cut-off all survive.
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
    """``jnp.argmax(logits, axis=-1)`` of float ``logits`` [R, V] as int32 [R], the same index (the first of
    the row's maxima; a row with NaN, its first NaN), in two cheap passes.

    XLA's CPU backend compiles ``argmax`` as a reduction over (value, index) pairs that it does not vectorize:
    measured 5.5 ms for 48 rows of a 49152-token vocabulary against 0.3 ms here (and 22 -> 1.8 ms at 192 rows).
    Here each row is cut into chunks of ``c`` tokens (the first width of :data:`ARGMAX_CHUNKS` that divides V):
    a plain vectorized max per chunk, the argmax over those [R, V / c] maxima (the first chunk holding the
    row's maximum), then the argmax within that chunk. The vectorized max may skip NaN, so when some row's
    sum is NaN (a NaN, or +inf beside -inf) the whole batch takes ``jnp.argmax`` instead. A vocabulary no
    width divides takes ``jnp.argmax`` too.
    """
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


def _logprobs(raw: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Raw logprobs of ``tokens`` [N], their ranks (1-based: how many tokens
    are at least as likely, vLLM's rule) and the top ``MAX_LOGPROBS`` ids and
    logprobs, descending (always computed, so shapes stay static; rows keep
    what they asked for)."""
    logprobs = jax.nn.log_softmax(raw, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(logprobs >= chosen[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, raw.shape[-1]))
    return chosen, ranks, top_ids.astype(jnp.int32), top_logprobs


def _maybe_logprobs(raw: jax.Array, tokens: jax.Array, arrays: SamplingArrays,
                    bitmask: Optional[jax.Array]) -> tuple[jax.Array, ...]:
    """:func:`_logprobs` of ``raw`` with the ``bitmask`` applied (:func:`_with_bitmask`) when some row asks for
    logprobs, else zeros of the same shapes."""
    num_rows, width = raw.shape[0], min(MAX_LOGPROBS, raw.shape[-1])
    return jax.lax.cond(
        jnp.any(arrays.num_logprobs >= 0),
        lambda: _logprobs(_with_bitmask(raw, bitmask), tokens),
        lambda: (jnp.zeros(num_rows, jnp.float32), jnp.zeros(num_rows, jnp.int32),
                 jnp.zeros((num_rows, width), jnp.int32), jnp.zeros((num_rows, width), jnp.float32)),
    )


def _with_bitmask(raw: jax.Array, bitmask: Optional[jax.Array]) -> jax.Array:
    """``raw`` [R, V] with :func:`apply_token_bitmask` of ``bitmask`` [R, W] (None: ``raw``); called inside a
    ``lax.cond`` branch only, where it costs nothing unless the branch runs."""
    return raw if bitmask is None else apply_token_bitmask(raw, bitmask)


def _choose(raw: jax.Array, arrays: SamplingArrays, tables: SamplerTables, bitmask: Optional[jax.Array],
            extra_counts: Callable[[], jax.Array] | None = None) -> jax.Array:
    """One token per row of float32 logits ``raw`` [R, V]: the structured-output ``bitmask`` (None: no row is
    constrained), the processors (with ``extra_counts()`` counted as outputs, when given), then the argmax
    (greedy rows) or a draw. A row the processors leave without a token (all -inf) chooses from the masked
    logits as if it had no processors, so a constrained row always takes a token its grammar accepts.

    Every ``lax.cond`` here returns tokens, never logits: a branch that passed ``raw`` through would make XLA's
    CPU backend copy the [R, V] logits into the cond's result on every step (measured 2.5 ms of a 48-row
    greedy step's 2.8, 11 of 12 ms at 192 rows, 49152-token vocabulary). The bitmask is one more reason to
    take the processing branch, so the sampler is traced twice (processed or not), not once per branch.
    """
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
           bitmask: Optional[jax.Array] = None) -> tuple[SamplerOutput, SamplerTables]:
    """Draw one token per row and count it in the row's slot.

    Args:
      logits: [S, V] float32.
      arrays: the rows' :class:`SamplingArrays`, ``[S]``, on the device.
      tables: the :class:`SamplerTables` (:func:`init_tables`); donate them.
      bitmask: int32[S, ceil(V / 32)] the tokens each row may take
        (:func:`apply_token_bitmask`); all ones (-1) for unconstrained rows;
        None: no row is constrained.

    Returns:
      ``(out, tables)``: ``out`` a :class:`SamplerOutput` of ``[S]`` rows
      (``num_emitted`` None); ``tables`` has each used sample added to its
      slot's counts.

    The bitmask, the processors, the sort, the random draw and the logprobs
    each run only when some row needs them (``lax.cond``), so a plain greedy
    step pays for an argmax alone. A row whose bans (``allowed_token_ids``,
    bad words, ``min_tokens``) leave no token its bitmask allows samples as
    if it had no processors, so a constrained row always takes a token its
    grammar accepts.
    """
    raw = logits.astype(jnp.float32)
    tokens = _choose(raw, arrays, tables, bitmask)
    chosen, ranks, top_ids, top_logprobs = _maybe_logprobs(raw, tokens, arrays, bitmask)
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
           bitmask: Optional[jax.Array] = None) -> tuple[SamplerOutput, SamplerTables]:
    """Verify each row's draft tokens and emit its accepted drafts plus one token (speculative decoding).

    Position j of a row holds the target's logits after the row's known
    tokens and its first j drafts; it verifies draft ``drafts[s, j]``. Each
    position samples its token as it would without speculation: the
    penalties count the drafts before it as output tokens, ``min_tokens``
    and the random key see ``num_generated + j``
    (``SamplingArrays.repeat``), bad-word bans are per position, and the
    draw is :func:`sample`'s (argmax for greedy rows, the row's seeded
    Gumbel draw otherwise). A row accepts its longest run of drafts equal to
    those tokens and emits them and the token after them.

    For temperature > 0 this is the rejection-sampling rule of Leviathan et
    al. 2023 / Chen et al. 2023 (accept draft ``d`` with probability
    ``min(1, p(d) / q(d))``, on rejection draw from ``max(0, p - q)``
    renormalised) for a draft distribution ``q`` that is a point mass on
    ``d`` -- the n-gram proposer's, and the draft model's, which proposes
    greedily -- realised by coupling: the token ``x ~ p`` equals ``d`` with
    probability ``p(d)``, and given ``x != d`` it is distributed as ``p``
    without ``d``, renormalised. So every emitted token is distributed as
    without speculation, and, as the draws are keyed by seed and
    ``num_generated`` alone, a seeded request emits exactly the tokens it
    would without speculation, in any batch.

    Args:
      logits: [S * P, V] float32, row ``s * P + j`` = row s at position j.
      drafts: int32[S, P], -1 where a position verifies nothing (always
        the last, and past a row's drafts).
      arrays: ``SamplingArrays.repeat(P)`` (``[S * P]``) on the device.
      tables: the :class:`SamplerTables`; donate them.
      bitmask: int32[S, ceil(V / 32)] structured-output bitmask (as in
        :func:`sample`), applied to each row's first position only (all
        ones elsewhere): a constrained row never carries drafts (the
        proposers skip it), so it samples its one token at position 0.
        None: no row is constrained.

    Returns:
      ``(out, tables)``: ``out`` a :class:`SamplerOutput` of ``[S, P]``
      rows, the emitted tokens first, with ``num_emitted: int32[S]``
      (accepted drafts + 1); ``tables`` counts the emitted tokens.
    """
    num_rows, width = drafts.shape
    if bitmask is not None:
        at_first = (jnp.arange(width) == 0)[None, :, None]
        bitmask = jnp.where(at_first, bitmask[:, None, :], -1).reshape(num_rows * width, -1)
    raw = logits.astype(jnp.float32)
    tokens = _choose(raw, arrays, tables, bitmask, lambda: _draft_counts(drafts, raw.shape[-1]))
    chosen, ranks, top_ids, top_logprobs = _maybe_logprobs(raw, tokens, arrays, bitmask)
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
                     tables: SamplerTables, num_positions: int,
                     bitmask: Optional[jax.Array] = None) -> tuple[SamplerOutput, SamplerTables]:
    """The sampler of a step that may carry draft tokens: :func:`verify` when some row does, else :func:`sample`.

    Args:
      compute_logits: hidden ``[N, E]`` -> logits float32 ``[N, V]``.
      hidden: ``[T, E]`` final hidden states of the step's tokens.
      input_ids: int32[T] the step's tokens (a row's drafts are its last
        ``num_spec_tokens`` tokens).
      logits_indices: int32[S] each row's last token; num_spec_tokens: int32[S].
      arrays: ``SamplingArrays.repeat(num_positions)`` on the device.
      tables: the :class:`SamplerTables`; donate them.
      num_positions: P = 1 + the most drafts a row may carry (static).
      bitmask: int32[S, ceil(V / 32)] structured-output bitmask (see
        :func:`sample`, :func:`verify`), None: no row is constrained.

    Returns:
      :func:`verify`'s outputs (a step without drafts fills position 0 of
      each row, ``num_emitted`` 1). The lm_head runs on ``S * P`` rows only
      when some row has drafts (``lax.cond``).
    """
    position = jnp.arange(num_positions)[None, :]
    first = (logits_indices - num_spec_tokens)[:, None]
    rows = jnp.minimum(first + position, logits_indices[:, None])
    has_draft = position < num_spec_tokens[:, None]
    drafts = jnp.where(has_draft, input_ids[jnp.minimum(first + position + 1, input_ids.shape[0] - 1)], -1)

    def drafted() -> tuple[SamplerOutput, SamplerTables]:
        return verify(compute_logits(hidden[rows.reshape(-1)]), drafts, arrays, tables, bitmask)

    def plain() -> tuple[SamplerOutput, SamplerTables]:
        out, new_tables = sample(compute_logits(hidden[logits_indices]),
                                 jax.tree_util.tree_map(lambda a: a[::num_positions], arrays), tables, bitmask)
        pad = [(0, 0), (0, num_positions - 1)]
        wide = jax.tree_util.tree_map(lambda v: jnp.pad(v[:, None], pad + [(0, 0)] * (v.ndim - 1)), out)
        return dataclasses.replace(wide, num_emitted=jnp.ones(logits_indices.shape, jnp.int32)), new_tables

    return jax.lax.cond(jnp.any(num_spec_tokens > 0), drafted, plain)


def prompt_logprobs(compute_logits: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                    target_ids: jax.Array) -> PromptLogprobRows:
    """Raw logprobs of each token row's next prompt token, and its top tokens (vLLM's prompt logprobs).

    Args:
      compute_logits: hidden ``[N, E]`` -> logits float32 ``[N, V]`` (the lm_head).
      hidden: ``[T, E]`` the final hidden states of every token row.
      target_ids: int32[T] the prompt token that follows each row's token,
        -1 where no logprob is wanted.

    Returns:
      :class:`PromptLogprobRows` of ``[T]`` rows: the target's
      ``log_softmax`` of the float32 logits, its rank and the top tokens;
      zeros where the target is -1. When no row wants them the
      lm_head over the T rows is skipped (``lax.cond``), so the cost is paid
      only by steps that carry such rows, and the shapes never change.
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
