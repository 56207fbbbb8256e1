"""A GPT-J-style decoder jaxllm does not ship, defined only here: the architecture tests/test_custom_model.py
registers (``jaxllm.register_model``), a checkpoint writer, and a plain dense-attention reference.

The model: a parallel residual ``x + attn(ln(x)) + mlp(ln(x))`` with one LayerNorm (with bias) per layer;
attention without biases, rotate-half rope on the first ``rotary_dim`` dimensions of each head; a GELU MLP
(tanh form, GPT-J's ``gelu_new``) with biases, not gated; a final LayerNorm with bias and an untied lm_head.
The checkpoint and its config.json use GPT-J's names (``transformer.h.{i}.attn.q_proj.weight``, ``n_embd``,
``n_head``, ``rotary_dim``, ...), mapped by the family's ``hf_config`` and ``hf_*_names``.

``register`` is the entry point a ``jaxllm.general_plugins`` plugin names (the server test installs one).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxllm.models import Family, LayerContext
from jaxllm.models.common import project

MODEL_TYPE = "tiny_gptj_test"
ARCHITECTURE = "TinyGPTJForCausalLM"
IMPORT_STRING = "tests.custom_model_gptj:FAMILY"
# config.json of the test checkpoints, in GPT-J's names: head_dim 16, rope on half of it.
HF_CONFIG = {
    "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": 512, "n_embd": 64, "n_head": 4,
    "n_layer": 3, "n_inner": 160, "n_positions": 512, "rotary_dim": 8, "layer_norm_epsilon": 1e-5,
    "activation_function": "gelu_new", "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

HF_LAYER_NAMES = {
    "ln_1.weight": ("ln", False), "ln_1.bias": ("ln_bias", False),
    "attn.q_proj.weight": ("wq", True), "attn.k_proj.weight": ("wk", True), "attn.v_proj.weight": ("wv", True),
    "attn.out_proj.weight": ("wo", True),
    "mlp.fc_in.weight": ("w_fc", True), "mlp.fc_in.bias": ("b_fc", False),
    "mlp.fc_out.weight": ("w_proj", True), "mlp.fc_out.bias": ("b_proj", False),
}
HF_TOP_NAMES = {
    "transformer.wte.weight": ("embed", False), "transformer.ln_f.weight": ("final_norm", False),
    "transformer.ln_f.bias": ("final_norm_bias", False), "lm_head.weight": ("lm_head", True),
}
# The MLP splits as a Megatron MLP; the norms' leaves are left to the default (replicated).
PARAM_AXES = {"w_fc": ("embed", "mlp"), "b_fc": ("mlp",), "w_proj": ("mlp", "embed"), "b_proj": ("embed",)}


def hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-J's config.json names -> those ``ModelConfig.from_hf_config`` reads (a missing one stays missing)."""
    embed, heads, rotary = cfg.get("n_embd"), cfg.get("n_head"), cfg.get("rotary_dim")
    head_dim = embed // heads if embed and heads else None
    return {**cfg, "hidden_size": embed, "num_attention_heads": heads, "num_hidden_layers": cfg.get("n_layer"),
            "intermediate_size": cfg.get("n_inner") or (4 * embed if embed else None),
            "max_position_embeddings": cfg.get("n_positions", 2048), "rms_norm_eps": cfg.get("layer_norm_epsilon"),
            "partial_rotary_factor": rotary / head_dim if rotary and head_dim else 1.0,
            "hidden_act": cfg.get("activation_function")}


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis in float32, returned in x's dtype. x: [..., E]; weight, bias: [E]."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * weight + bias).astype(x.dtype)


def decoder_layer(w: dict[str, jax.Array], x: jax.Array, kv: Any, ctx: LayerContext) -> tuple[jax.Array, Any]:
    """One parallel-residual layer. x: [T, E] -> ([T, E], the caches with this layer's K/V)."""
    cfg, t = ctx.cfg, x.shape[0]
    h = layer_norm(x, w["ln"], w["ln_bias"], cfg.rms_norm_eps)
    q, k, v = (project(w, key, h).reshape(t, -1, cfg.head_dim) for key in ("wq", "wk", "wv"))
    attn, kv = ctx.attend(q, k, v, kv)
    mlp = project(w, "w_proj", jax.nn.gelu(project(w, "w_fc", h, "b_fc"), approximate=True), "b_proj")
    return x + project(w, "wo", attn) + mlp, kv


def final_norm(params: dict[str, Any], x: jax.Array, cfg: Any) -> jax.Array:
    """The final LayerNorm (``transformer.ln_f``) of x [T, E]."""
    return layer_norm(x, params["final_norm"], params["final_norm_bias"], cfg.rms_norm_eps)


def leaf_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Shapes of this family's own layer leaves, without the layer axis."""
    e, f = cfg.hidden_size, cfg.intermediate_size
    return {"ln": (e,), "ln_bias": (e,), "w_fc": (e, f), "b_fc": (f,), "w_proj": (f, e), "b_proj": (e,)}


FAMILY = Family(
    hf_layer_names=HF_LAYER_NAMES, layer_keys=lambda cfg: {key for key, _ in HF_LAYER_NAMES.values()},
    layer=decoder_layer, final_norm=final_norm, hf_top_names=HF_TOP_NAMES, hf_layer_prefix="transformer.h.",
    hf_config=hf_config, param_axes=PARAM_AXES, leaf_shapes=leaf_shapes,
)


def register() -> None:
    """The ``jaxllm.general_plugins`` entry point: register this architecture by its import string."""
    import jaxllm

    jaxllm.register_model(MODEL_TYPE, IMPORT_STRING, hf_architectures=[ARCHITECTURE])


def hf_tensors(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights in GPT-J's names and HF orientation (``[out, in]``)."""
    rng = np.random.default_rng(seed)
    e, f, v = cfg["n_embd"], cfg["n_inner"], cfg["vocab_size"]

    def normal(*shape, std=0.08):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    tensors = {"transformer.wte.weight": normal(v, e, std=0.5), "lm_head.weight": normal(v, e, std=0.2),
               "transformer.ln_f.weight": 1 + normal(e), "transformer.ln_f.bias": normal(e)}
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        tensors.update({p + "ln_1.weight": 1 + normal(e), p + "ln_1.bias": normal(e),
                        p + "mlp.fc_in.weight": normal(f, e, std=0.15), p + "mlp.fc_in.bias": normal(f),
                        p + "mlp.fc_out.weight": normal(e, f), p + "mlp.fc_out.bias": normal(e)})
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            tensors[p + f"attn.{name}.weight"] = normal(e, e, std=0.25)
    return tensors


def write_checkpoint(folder: Path, tokenizer_from: Path, seed: int = 0, **config: Any) -> Path:
    """A HF folder of the model: config.json (``HF_CONFIG`` updated by ``config``), random weights in
    model.safetensors, the tokenizer files of ``tokenizer_from``. Returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**HF_CONFIG, **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(hf_tensors(cfg, seed), str(folder / "model.safetensors"))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


def _reference_layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * w + b


def _reference_rope(x: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """Rotate-half rope of x [N, H, D] at positions 0..N-1 on its first ``rotary_dim`` dimensions."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
    angles = jnp.arange(x.shape[0], dtype=jnp.float32)[:, None] * inv_freq
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def dense_forward(folder: Path) -> Callable[[Any], np.ndarray]:
    """The reference model of ``folder``: token ids int[N] of one sequence -> logits float32 ``[N, vocab]`` of
    every position, computed from the safetensors file in HF names with full causal softmax attention in plain
    ``jnp`` (no cache, no jaxllm code); compiled once per length N."""
    cfg = json.loads((folder / "config.json").read_text())
    t = {name: jnp.asarray(a) for name, a in load_file(str(folder / "model.safetensors")).items()}
    heads, eps = cfg["n_head"], cfg["layer_norm_epsilon"]
    d = cfg["n_embd"] // heads

    @jax.jit
    def logits(ids):
        n = ids.shape[0]
        x = t["transformer.wte.weight"][ids]
        causal = jnp.tril(jnp.ones((n, n), bool))
        for i in range(cfg["n_layer"]):
            w = {name[len(f"transformer.h.{i}."):]: a for name, a in t.items()
                 if name.startswith(f"transformer.h.{i}.")}
            h = _reference_layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps)
            q, k, v = ((h @ w[f"attn.{p}_proj.weight"].T).reshape(n, heads, d) for p in "qkv")
            q, k = (_reference_rope(a, cfg["rotary_dim"], cfg["rope_theta"]) for a in (q, k))
            scores = jnp.where(causal[None], jnp.einsum("qhd,khd->hqk", q, k) * d ** -0.5, -jnp.inf)
            attn = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v).reshape(n, heads * d)
            fc = jax.nn.gelu(h @ w["mlp.fc_in.weight"].T + w["mlp.fc_in.bias"], approximate=True)
            x = x + attn @ w["attn.out_proj.weight"].T + fc @ w["mlp.fc_out.weight"].T + w["mlp.fc_out.bias"]
        x = _reference_layer_norm(x, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"], eps)
        return x @ t["lm_head.weight"].T

    return lambda ids: np.asarray(logits(jnp.asarray(ids, jnp.int32)))
