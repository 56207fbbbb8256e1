"""A dense-attention, differentiable forward over the engine's parameter pytree (for training).

:func:`dense_forward` runs any family's ``Family.layer`` over ``[B, L]`` whole sequences with plain
causal attention (:class:`DenseContext` stands in for ``LayerContext``): no paged cache, works with
``jax.grad``. Rows may be padded on either side: an ``attention_mask`` (as HF's and tunix's) numbers each row's
real tokens from position 0 and hides its padding from every query.
"""

from __future__ import annotations

import types
from typing import Any, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxllm.models.common import (LORA_A, LORA_B, LORA_ROWS, KVCache, LoRARows, Params, apply_rope, compute_logits,
                                  layer_segments, rope_cos_sin)
from jaxllm.models.config import ModelConfig


class DenseContext(NamedTuple):
    """Stands in for ``LayerContext`` (same field names layers read).

    shape: ``(B, L)`` (static); window: static or None; cos, sin: ``[B * L, R // 2]`` float32;
    num_tokens: int32[] ``B * L``; positions: int32 ``[B, L]``; keys: bool ``[B, L]``, the tokens a query may see.
    """

    cfg: ModelConfig
    shape: tuple[int, int]
    window: Optional[int]
    cos: jax.Array
    sin: jax.Array
    num_tokens: jax.Array
    positions: jax.Array
    keys: jax.Array

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, kv: KVCache) -> tuple[jax.Array, KVCache]:
        """Rope, then causal attention per row; ``LayerContext.attend``'s contract, ``kv`` returned untouched."""
        cfg, (b, n) = self.cfg, self.shape
        q, k = apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
        group = cfg.num_q_heads // cfg.num_kv_heads
        q = q.reshape(b, n, cfg.num_kv_heads, group, cfg.head_dim)
        k, v = (a.reshape(b, n, cfg.num_kv_heads, cfg.head_dim) for a in (k, v))
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * cfg.attention_scale
        # Causal by index (padding never sits between a row's tokens), the window by position.
        causal = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]
        mask = causal[None] & self.keys[:, None, :]
        if self.window is not None:
            mask &= self.positions[:, None, :] > self.positions[:, :, None] - self.window
        # A query at a padded position sees no key: its row of scores stays finite so the softmax has no NaN.
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v, preferred_element_type=jnp.float32).astype(q.dtype)
        return out.reshape(b * n, cfg.num_q_heads * cfg.head_dim), kv


def dense_forward(params: Params, input_ids: jax.Array, *, cfg: ModelConfig, family=None,
                  attention_mask: Optional[jax.Array] = None, lora: Optional[Mapping[str, Any]] = None,
                  lora_scale: float = 1.0) -> jax.Array:
    """Logits of every position of whole sequences, through the family's layers and dense causal attention.

    Args:
      params: the engine's pytree (``jaxllm.models.common``), float leaves (not bit storage, not quantized);
        single-device, replicated or sharded arrays, under ``jax.jit`` or not, on any mesh (Explicit axes too).
      input_ids: int32 ``[B, L]``.
      cfg: static. family: default ``jaxllm.models.family(cfg)``.
      attention_mask: bool or int ``[B, L]``, nonzero at real tokens (left, right or both sides padded); None: every
        token real. Each row's real tokens take positions ``0, 1, ...`` in order (HF's and tunix's convention).
      lora: one LoRA adapter every row runs under, in ``LLM.update_lora``'s layout: ``{"layers": {"<key>_lora_a":
        [L, in, r], "<key>_lora_b": [L, r, out]}}`` (or ``"layers/<key>_lora_a"`` paths) for a subset of ``wq wk wv
        wo w_gate w_up w_down``, PEFT's values transposed and unscaled (``LoRAWeights.tree``); differentiable.
        None: the base model.
      lora_scale: the factor of ``x A B`` (PEFT's ``lora_alpha / r``, ``LoRAWeights.scale``).

    Returns:
      float32 ``[B, L, vocab]``; at real tokens equal to the engine's logits of the unpadded row (under the same
      adapter) within float32 rounding; at padded positions finite and meaningless.

    Raises:
      ValueError: a ``lora`` leaf that is not an A or B of a projection the model has, or a projection given
        only one of its A and B (named).
    """
    b, n = input_ids.shape
    keys = jnp.ones((b, n), bool) if attention_mask is None else attention_mask.astype(bool)
    if lora is not None:
        params = {**params, "layers": {**params["layers"], **_adapter_slot(params, lora, lora_scale)}}
    mesh = jax.sharding.get_abstract_mesh()
    explicit = [name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == jax.sharding.AxisType.Explicit]
    if not explicit:
        return _dense_forward(params, input_ids, keys, cfg, family)
    # The families' ops (embedding gathers, head reshapes) leave sharding to the compiler, which Explicit axes
    # forbid; the logits keep the rows' sharding.
    rows = jax.typeof(input_ids).sharding.spec[0] if jax.typeof(input_ids).sharding.spec else None
    body = jax.sharding.auto_axes(lambda p, i, k: _dense_forward(p, i, k, cfg, family), axes=tuple(explicit),
                                  out_sharding=jax.sharding.PartitionSpec(rows, None, None))
    return body(params, input_ids, keys)


def _adapter_slot(params: Params, lora: Mapping[str, Any], scale: float) -> dict[str, jax.Array]:
    """``lora`` (``dense_forward``'s) as the engine's slot leaves with one slot: ``"<key>_lora_a": [L, 1, in, r]``,
    ``"<key>_lora_b": [L, 1, r, out]`` with ``scale`` folded into B (``jaxllm.worker.lora``), in the params' dtype."""
    flat = {f"layers/{k}": v for k, v in lora["layers"].items()} if "layers" in lora else dict(lora)
    layers, out = params["layers"], {}
    for path, value in flat.items():
        key, _, which = path.removeprefix("layers/").rpartition("_lora_")
        if not path.startswith("layers/") or which not in ("a", "b") or key not in layers:
            raise ValueError(f"lora leaf {path!r} is not the A or B of one of the model's projections "
                             "('layers/<key>_lora_a' or '_lora_b')")
        other = f"layers/{key}_lora_{'b' if which == 'a' else 'a'}"
        if other not in flat:
            raise ValueError(f"lora leaf {path!r} has no {other!r}")
        # Quantized projections (int8, bits-stored) compute in float32: A and B are never stored quantized.
        dtype = layers[key].dtype if jnp.issubdtype(layers[key].dtype, jnp.floating) else jnp.float32
        out[key + (LORA_A if which == "a" else LORA_B)] = (
            jnp.asarray(value, dtype)[:, None] if which == "a" else (jnp.asarray(value) * scale).astype(dtype)[:, None])
    return out


def _dense_forward(params: Params, input_ids: jax.Array, keys: jax.Array, cfg: ModelConfig, family) -> jax.Array:
    from jaxllm.models import family as family_of

    fam = family if family is not None else family_of(cfg)
    b, n = input_ids.shape
    positions = jnp.maximum(jnp.cumsum(keys, axis=1, dtype=jnp.int32) - 1, 0)
    flat = input_ids.reshape(-1)
    # rope_cos_sin reads a batch's positions (and, for LongRoPE, each row's length and start).
    rows = types.SimpleNamespace(positions=positions.reshape(-1), seq_lens=keys.sum(1, dtype=jnp.int32),
                                 query_start_loc=jnp.arange(b + 1, dtype=jnp.int32) * n)
    ropes = {None: rope_cos_sin(cfg.rope, cfg.head_dim, rows)}
    if cfg.local_rope is not None:
        ropes["local"] = rope_cos_sin(cfg.local_rope, cfg.head_dim, rows)
    x = fam.embed(params, flat, cfg)
    layers = params["layers"]
    for start, stop, window in layer_segments(cfg.sliding_windows or (None,) * cfg.num_layers):
        cos, sin = ropes["local" if window is not None and cfg.local_rope is not None else None]
        ctx = DenseContext(cfg, (b, n), window, cos, sin, jnp.int32(b * n), positions, keys)

        def step(x, layer, ctx=ctx):
            if any(k.endswith(LORA_A) for k in layer):
                # Every token in the adapter's one slot (the engine's slot layout, so ``project`` adds its term); a
                # fixed count keeps the loop differentiable.
                layer = {**layer, LORA_ROWS: LoRARows(jnp.zeros(b * n, jnp.int32), jnp.zeros(1, jnp.int32), 1)}
            return fam.layer(layer, x, None, ctx)[0], None

        x, _ = jax.lax.scan(step, x, jax.tree_util.tree_map(lambda a: a[start:stop], layers))
    x = fam.final_norm(params, x, cfg)
    return compute_logits(params, x, cfg=cfg).reshape(b, n, -1)
