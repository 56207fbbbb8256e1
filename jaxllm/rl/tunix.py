"""jaxllm as a rollout engine of tunix's RL trainers (GRPO, DAPO, PPO): ``pip install 'jaxllm[tunix]'``.

tunix's ``RLCluster`` builds a rollout engine from a ``BaseRollout`` subclass (or a ``functools.partial`` of one)
given as ``ClusterConfig(rollout_engine=...)``, calling it with ``rollout_actor``, ``tokenizer``, ``mesh`` and
``rollout_config``; :class:`JaxllmRollout` takes jaxllm's own arguments through the partial::

    rollout_engine=functools.partial(JaxllmRollout, model="path/to/hf_folder", max_num_seqs=64)

What maps where (tunix ``RolloutConfig`` -> jaxllm ``SamplingParams``, vLLM's names): ``temperature``, ``top_p``,
``top_k``, ``max_tokens_to_generate`` -> ``max_tokens``, ``eos_tokens`` (default: the tokenizer's eos) ->
``stop_token_ids`` (the eos stays in the completion, as with tunix's vLLM rollout), ``return_logprobs`` ->
``logprobs``, ``rollout_vllm_logprobs_mode`` -> the engine's ``logprobs_mode``. ``seed``: tunix passes one seed for
a batch whose prompts repeat G times per group; one seed for every row would make a group's G samples identical
(zero advantage, nothing learned), so row ``i`` gets its own seed drawn from ``(seed, i)`` by
``numpy.random.SeedSequence``: the batch is reproducible and its rows independent.

Prompts are tokenized by tunix's tokenizer adapter (its bos rule), completions decoded by it. Weights come from the
trainer's NNX state through the model class's name map (``jaxllm.loader.nnx_names``), converted on the device and
handed to ``LLM.update_weights`` one jaxllm leaf at a time: no host copy, no compilation after the first sync, and
extra device memory of one stacked leaf (e.g. every layer's ``w_gate``) rather than a second copy of the model.

A LoRA actor (qwix's ``apply_lora_to_model``: ``nnx.LoRAParam`` leaves beside the frozen ``nnx.Param`` ones) is
served through one engine adapter slot: pass the ``qwix.LoraProvider`` the actor was made with
(``functools.partial(JaxllmRollout, model=..., lora_provider=provider)``). The base weights go to the engine once,
the adapter's rank is the LoRA leaves', its scale the provider's ``alpha / rank`` (qwix's), and its targets the
kernels the leaves adapt, mapped through the same name map. tunix's sync of a LoRA actor then hands over its
``nnx.LoRAParam`` leaves only, and they reach the engine's slot through ``LLM.update_lora``, on the devices.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

try:
    from flax import nnx
    from tunix.rl.rollout import base_rollout
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("jaxllm.rl.tunix needs tunix: pip install 'jaxllm[tunix]'") from e

from jaxllm import LLM, LoRARequest, SamplingParams
from jaxllm.config import EngineConfig
from jaxllm.loader.nnx import nnx_param_arrays, params_from_nnx
from jaxllm.loader.nnx_names import NameMap, jaxllm_leaves, jaxllm_lora_leaves, name_map_of
from jaxllm.models import family
from jaxllm.models.config import ModelConfig
from jaxllm.models.dense import dense_forward

logger = logging.getLogger(__name__)


def row_seeds(seed: Any, num_rows: int) -> list[Optional[int]]:
    """One independent seed per row from tunix's batch ``seed`` (int, int array or PRNG key; None: unseeded rows).

    Returns ``num_rows`` ints in ``[0, 2**31)``, row ``i`` from ``SeedSequence(entropy of seed + [i])``.
    """
    if seed is None:
        return [None] * num_rows
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        seed = jax.random.key_data(seed)
    entropy = [int(x) for x in np.asarray(seed).ravel().astype(np.uint64)]
    return [int(np.random.SeedSequence(entropy + [i]).generate_state(1)[0] % 2**31) for i in range(num_rows)]


def completion_logps(params: Any, prompt_tokens: jax.Array, completion_tokens: jax.Array, *, cfg: ModelConfig,
                     pad_id: int, temperature: float = 1.0, lora: Any = None, lora_scale: float = 1.0) -> jax.Array:
    """Log-probabilities of the completion tokens under ``params``, on tunix's padding convention.

    Args:
      params: the engine's pytree. prompt_tokens: int32 ``[B, P]`` left-padded with ``pad_id``.
      completion_tokens: int32 ``[B, C]`` right-padded with ``pad_id``. temperature: logits divided by it unless
        0 or 1 (tunix's ``compute_per_token_logps``). lora, lora_scale: an adapter every row runs under
        (``dense_forward``'s).

    Returns:
      float32 ``[B, C]``; values at padded completion positions are meaningless.
    """
    ids = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
    logits = dense_forward(params, ids, cfg=cfg, attention_mask=ids != pad_id, lora=lora,
                           lora_scale=lora_scale)[:, prompt_tokens.shape[1] - 1:-1]
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    chosen = jnp.take_along_axis(logits, completion_tokens[..., None], axis=-1)[..., 0]
    return chosen - jax.nn.logsumexp(logits, axis=-1)


def lora_alpha_of(provider: Any, rank: int) -> float:
    """The ``alpha`` of a ``qwix.LoraProvider`` whose LoRA rules all have rank ``rank`` and one alpha.

    Raises:
      ValueError: no LoRA rule, rules of several ranks or alphas (one engine adapter has one scale), or a rank
        other than ``rank`` (the actor's LoRA leaves').
    """
    # qwix keeps a provider's rules in ``_rules`` (no public accessor); a LoraRule carries rank and alpha.
    rules = [r for r in getattr(provider, "_rules", ()) if hasattr(r, "rank") and hasattr(r, "alpha")]
    pairs = sorted({(int(r.rank), float(r.alpha)) for r in rules})
    if len(pairs) != 1:
        raise ValueError(f"lora_provider {provider!r}: its LoRA rules give (rank, alpha) {pairs}; the rollout "
                         "serves one adapter, so they must give one")
    if pairs[0][0] != rank:
        raise ValueError(f"lora_provider's rank {pairs[0][0]} is not the actor's LoRA rank {rank}")
    return pairs[0][1]


def _write_zero_peft_folder(folder: Path, cfg: ModelConfig, tree: dict[str, Any], rank: int, alpha: float) -> None:
    """A PEFT folder declaring an adapter of ``rank``, ``alpha`` and the targets of ``tree`` (engine LoRA paths),
    its tensors zeros: how the engine learns an adapter's rank, scale and targets (``read_peft_adapter``)."""
    from safetensors.numpy import save_file

    fam = family(cfg)
    module_of = {key: name.rsplit(".weight", 1)[0] for name, (key, _) in fam.hf_layer_names.items()}
    targets = sorted({path.removeprefix("layers/").rsplit("_lora_", 1)[0] for path in tree})
    tensors = {}
    for key in targets:
        fan_in, fan_out = tree[f"layers/{key}_lora_a"].shape[1], tree[f"layers/{key}_lora_b"].shape[2]
        name = f"base_model.model.{fam.hf_layer_prefix}0.{module_of[key]}"
        tensors[f"{name}.lora_A.weight"] = np.zeros((rank, fan_in), np.float32)
        tensors[f"{name}.lora_B.weight"] = np.zeros((fan_out, rank), np.float32)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha,
        "target_modules": sorted({module_of[key].rsplit(".", 1)[-1] for key in targets})}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def _engine_has(field: str) -> bool:
    return field in {f.name for f in dataclasses.fields(EngineConfig)}


def _sampling_has(field: str) -> bool:
    return field in {f.name for f in dataclasses.fields(SamplingParams)}


class JaxllmRollout(base_rollout.BaseRollout):
    """A tunix rollout engine over ``jaxllm.LLM(params=...)`` (module docstring: what maps where).

    Args:
      rollout_actor: the trainer's NNX model (its class in ``nnx_names.NAME_MAPS``, or pass ``name_map``).
      tokenizer: tunix's ``TokenizerAdapter`` (``encode``, ``decode``, ``bos_id``, ``eos_id``, ``pad_id``).
      mesh: tunix's rollout mesh (unused: the engine places its weights by its own sharding options).
      rollout_config: tunix's ``RolloutConfig``; its ``rollout_vllm_logprobs_mode`` picks the engine's
        ``logprobs_mode`` where the engine has that option (else raw logprobs, logged once).
      model: HF folder (``config.json`` and tokenizer files) of the actor's architecture.
      name_map: the actor's ``nnx_names.NameMap`` (default: its class's).
      dtype: the engine's compute dtype.
      lora_provider: the ``qwix.LoraProvider`` of a LoRA actor (its alpha gives the adapter's scale); needed
        when the actor has ``nnx.LoRAParam`` leaves. engine_kwargs: further ``LLM`` arguments (``max_num_seqs``,
        ...); a LoRA actor sets ``enable_lora``, ``max_loras=1`` and ``max_lora_rank`` (its rank) by default.

    Attributes:
      lora_request: the engine adapter the rollouts run under (a LoRA actor), or None.

    Raises:
      ValueError: the actor has no name map, its leaves do not fit ``model``'s config (named), or a LoRA actor
        without ``lora_provider``, or one whose leaves the engine cannot adapt (named).
    """

    def __init__(self, rollout_actor: Any, tokenizer: Any, mesh: Any = None,
                 rollout_config: Optional[base_rollout.RolloutConfig] = None, *, model: str,
                 name_map: Optional[NameMap] = None, dtype: Any = jnp.float32, lora_provider: Any = None,
                 **engine_kwargs: Any):
        self._tokenizer = tokenizer
        self._name_map = name_map or name_map_of(rollout_actor)
        if self._name_map is None:
            cls = type(rollout_actor)
            raise ValueError(f"no jaxllm name map for {cls.__module__}.{cls.__qualname__}: pass name_map "
                             "(jaxllm.loader.nnx_names.NameMap)")
        hf_config = json.loads((Path(model) / "config.json").read_text())
        self.cfg, params = params_from_nnx(rollout_actor, hf_config, dtype, name_map=self._name_map)
        mode = (rollout_config or base_rollout.RolloutConfig()).rollout_vllm_logprobs_mode
        if _engine_has("logprobs_mode"):
            engine_kwargs.setdefault("logprobs_mode", mode)
            self.logprobs_mode = engine_kwargs["logprobs_mode"]
        else:
            if mode != "raw_logprobs":
                logger.warning("this jaxllm has no logprobs_mode: rollout logprobs are raw, not %s", mode)
            self.logprobs_mode = "raw_logprobs"
        lora = nnx_param_arrays(nnx.state(rollout_actor, nnx.LoRAParam), lora=True)
        self.lora_request: Optional[LoRARequest] = None
        self.lora_scale = 1.0
        if lora:
            ranks = {int(leaf.shape[-1]) for path, leaf in lora.items() if path.endswith("_lora_a")}
            if len(ranks) != 1:
                raise ValueError(f"the actor's LoRA A leaves have ranks {sorted(ranks)}; one adapter has one rank")
            if lora_provider is None:
                raise ValueError("the actor has LoRA (nnx.LoRAParam) leaves: pass lora_provider, the "
                                 "qwix.LoraProvider it was made with")
            rank = ranks.pop()
            alpha = lora_alpha_of(lora_provider, rank)
            self.lora_scale = alpha / rank  # qwix's: x A B * alpha / rank
            engine_kwargs = {"enable_lora": True, "max_loras": 1, "max_lora_rank": rank, **engine_kwargs}
        self.llm = LLM(model, params=params, dtype=np.dtype(dtype).name, **engine_kwargs)
        self._logps = jax.jit(functools.partial(completion_logps, cfg=self.cfg),
                              static_argnames=("pad_id", "temperature", "lora_scale"))
        self._lora_shapes = {path: tuple(leaf.shape) for path, leaf in lora.items()}
        self._lora: Optional[dict[str, jax.Array]] = None
        if lora:
            sharding = self.llm.get_params()["embed"].sharding
            if isinstance(sharding, jax.sharding.NamedSharding):  # the adapter slots are replicated
                sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
            self._lora_sharding = sharding
            self._lora = self._engine_lora(lora)
            self.lora_request = LoRARequest("tunix-actor", 1)
            # The engine reads an adapter's rank, scale and targets from a PEFT folder; its zeros are replaced at
            # once by the actor's values, which the engine keeps from then on (the folder is not read again).
            with tempfile.TemporaryDirectory() as folder:
                _write_zero_peft_folder(Path(folder), self.cfg, self._lora, rank, alpha)
                self.llm.add_lora(LoRARequest("tunix-actor", 1, folder))
                self.llm.update_lora(1, self._lora)
        self.last_sync: dict[str, float] = {}

    def prompt_ids(self, prompt: str) -> list[int]:
        """``prompt``'s token ids as tunix's samplers make them: the bos (if any) once, then the text's ids."""
        bos = self._tokenizer.bos_id()
        return list(self._tokenizer.dedup_bos_ids(([bos] if bos else []) + list(self._tokenizer.encode(prompt))))

    def sampling_params(self, rollout_config: base_rollout.RolloutConfig, num_rows: int) -> list[SamplingParams]:
        """One ``SamplingParams`` per row from ``rollout_config`` (module docstring: the mapping, the seeds)."""
        eos = list(rollout_config.eos_tokens or [self.eos_id()])
        extra = {"detokenize": False} if _sampling_has("detokenize") else {}
        return [SamplingParams(
            temperature=rollout_config.temperature,
            top_p=1.0 if rollout_config.top_p is None else rollout_config.top_p,
            top_k=-1 if rollout_config.top_k is None else rollout_config.top_k,
            max_tokens=rollout_config.max_tokens_to_generate, seed=seed, stop_token_ids=eos,
            logprobs=1 if rollout_config.return_logprobs else None, **extra)
            for seed in row_seeds(rollout_config.seed, num_rows)]

    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs: Any) -> base_rollout.RolloutOutput:
        """Sample a completion per prompt: ``BaseRollout.generate``'s contract (tokens unpadded with the eos kept,
        prompts left-padded to ``max_prompt_length`` or the next power of 2 above the longest, logprobs of the
        chosen tokens as float32 arrays when ``return_logprobs``)."""
        ids = [self.prompt_ids(p) for p in prompts]
        outs = self.llm.generate(ids, self.sampling_params(rollout_config, len(ids)), use_tqdm=False,
                                 lora_request=self.lora_request)
        completions = [out.outputs[0] for out in outs]
        tokens = [np.asarray(c.token_ids, np.int32) for c in completions]
        logprobs = None
        if rollout_config.return_logprobs:
            logprobs = [np.asarray([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], np.float32)
                        for c in completions]
        longest = max(map(len, ids))
        width = rollout_config.max_prompt_length
        if width < longest:
            width = 1 << (longest - 1).bit_length()
        padded = np.full((len(ids), width), self.pad_id(), np.int32)
        for row, prompt in zip(padded, ids):
            row[width - len(prompt):] = prompt
        return base_rollout.RolloutOutput(text=[self._tokenizer.decode(t.tolist()) for t in tokens], logits=None,
                                          tokens=tokens, left_padded_prompt_tokens=padded, logprobs=logprobs)

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
        """float32 ``[B, C]`` log-probabilities of the completions under the engine's weights and adapter (raw:
        no temperature, as tunix's own rollout): :func:`completion_logps` with the tokenizer's pad id."""
        return self._logps(self.llm.get_params(), jnp.asarray(prompt_tokens, jnp.int32),
                           jnp.asarray(completion_tokens, jnp.int32), pad_id=self.pad_id(), lora=self._lora,
                           lora_scale=self.lora_scale)

    def update_params(self, params: Any, filter_types: Optional[tuple[Any, ...]] = None) -> None:
        """Sync the engine to the trainer's state: its ``nnx.Param`` leaves one jaxllm leaf at a time
        (``update_weights``), its ``nnx.LoRAParam`` leaves (tunix's ``filter_types=(nnx.LoRAParam,)`` for a LoRA
        actor: those only) into the adapter slot at once (``update_lora``); on the devices, no host copy.

        Sets ``last_sync``: ``seconds``, ``num_bytes`` placed (of a LoRA leaf: its bytes as the trainer holds
        it), ``num_leaves``.

        Raises:
          ValueError: a leaf the name map does not know or that does not fit the engine, or a LoRA leaf that is
            not one of the actor's (name and shape, as the rollout was built) (named).
        """
        del filter_types  # the leaves' own types say where each goes
        start = time.perf_counter()
        lora = nnx_param_arrays(params, lora=True)
        for path, leaf in lora.items():
            if self._lora_shapes.get(path) != tuple(leaf.shape):
                raise ValueError(f"LoRA leaf {path!r} of shape {tuple(leaf.shape)} is not one of the actor's the "
                                 "rollout was built with: "
                                 + (f"it has shape {self._lora_shapes[path]}" if path in self._lora_shapes
                                    else f"they are {sorted(self._lora_shapes)}"))
        num_bytes = num_leaves = 0
        for path, leaf in jaxllm_leaves(nnx_param_arrays(params), self._name_map, self.cfg.num_layers):
            if path == "lm_head" and self.cfg.tie_word_embeddings:
                continue
            report = self.llm.update_weights({path: leaf})
            num_bytes += report["num_bytes"]
            num_leaves += report["num_leaves"]
        if lora:
            tree = self._engine_lora(lora)
            self.llm.update_lora(self.lora_request.lora_int_id, tree)
            self._lora = {**self._lora, **tree}
            num_bytes += sum(leaf.nbytes for leaf in lora.values())
            num_leaves += len(lora)
        self.last_sync = {"seconds": time.perf_counter() - start, "num_bytes": num_bytes, "num_leaves": num_leaves}

    def _engine_lora(self, lora: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """The actor's LoRA leaves in the engine's layout, converted where the engine's adapter slots live (moved
        there device to device first, so every sync runs the conversion compiled when the rollout was built)."""
        placed = {path: jax.device_put(leaf, self._lora_sharding) for path, leaf in lora.items()}
        return dict(jaxllm_lora_leaves(placed, self._name_map, self.cfg.num_layers))

    def pad_id(self) -> int:
        """tunix's tokenizer's pad id."""
        return self._tokenizer.pad_id()

    def eos_id(self) -> int:
        """tunix's tokenizer's eos id."""
        return self._tokenizer.eos_id()

    def model(self) -> None:
        """None, as tunix's vLLM rollout: the engine's weights are its own copy in its own layout, not an NNX module.

        tunix syncs the rollout after each step only when this model shares no weights with the trainer's; the
        trainer's actor here would read as shared, leave the engine on the first step's weights and never sync.
        """
        return None
