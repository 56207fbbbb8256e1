"""tunix's GRPOLearner on stories260K or the default model, rollouts by jaxllm or by tunix's sampler, side by side.

Needs tunix (``pip install -e ".[tunix]"``). The actor is tunix's Llama 3 with ``--model``'s config and weights:
``stories260K`` (the test fixture) or ``default`` (SmolLM2-135M-Instruct, its GGUF dequantized to float32 into an HF
folder once); prompts are plain text (no chat template); the reward is how often ``--word`` appears in a completion.
Per step it records the mean reward, rollout tokens/s and CPU seconds, weight sync seconds and bytes, and programs
XLA compiled; for jaxllm it also records, per step, the largest difference between the engine's logprobs
(``--logprobs-mode``) and tunix's recomputation from the trainer's weights, and with ``--check`` asserts it is at
most ``--atol`` times max(1, |logprob|) and that the engine's weights equal the trainer's after each sync.
``--lora-rank R`` makes the actor a qwix LoRA actor (rank R on every projection), whose syncs send its LoRA leaves
only (to the engine's adapter slot). It prints a per-step and a side-by-side table; ``--result-file MACHINE`` writes
them to ``docs/benchmarks/results/<date>-<MACHINE>-tunix-grpo.json`` (a file of the same day keeps its other models'
tables) and renders its Markdown page.

    python scripts/tunix_grpo.py --steps 8 --engines jaxllm,vanilla [--result-file MACHINE]
    python scripts/tunix_grpo.py --model default --steps 5 [--result-file MACHINE]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grain  # noqa: E402
import optax  # noqa: E402
import safetensors.numpy  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.llama3 import model as llama3_lib  # noqa: E402
from tunix.models.llama3 import params as llama3_params  # noqa: E402
from tunix.rl import common as tunix_common  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from jaxllm.loader.gguf import load_gguf  # noqa: E402
from jaxllm.loader.nnx import nnx_param_arrays, params_from_nnx  # noqa: E402
from jaxllm.loader.nnx_names import jaxllm_lora_leaves, name_map_of  # noqa: E402
from jaxllm.named_models import resolve_model  # noqa: E402
from jaxllm.rl.tunix import JaxllmRollout  # noqa: E402
from jaxllm.tokenizer import Tokenizer  # noqa: E402

# The plain-JAX loop's prompts, model and compilation counter (importing it registers the counter).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_rollouts import PROMPTS, STORIES, _compiles  # noqa: E402


# tunix 0.1.7's Llama 3 applies rope with theta 1e6 whatever its config says, so the engine is given the model with
# that theta: a copy of the model whose config says so.
TUNIX_ROPE_THETA = 1_000_000.0


def model_folder(model: str) -> Path:
    """An HF folder (config.json with rope_theta ``TUNIX_ROPE_THETA``, float32 safetensors, tokenizer) of ``model``:
    ``stories260K`` (the fixture copied) or a name or path ``jaxllm.named_models.resolve_model`` takes ("default":
    jaxllm's default model), a llama-architecture GGUF dequantized to float32 by jaxllm's loader. Written once under
    the system temp folder."""
    source = STORIES if model == "stories260K" else resolve_model(None if model == "default" else model)
    folder = Path(tempfile.gettempdir()) / f"jaxllm-{source.stem}-theta1e6"
    if (folder / "config.json").exists():
        return folder
    partial = Path(tempfile.mkdtemp(prefix=folder.name, dir=folder.parent))
    if source.is_dir():
        for f in source.iterdir():
            if f.name != "config.json":
                shutil.copy(f, partial / f.name)
        cfg = json.loads((source / "config.json").read_text())
    else:
        cfg, weights = load_gguf(source)
        if cfg["model_type"] != "llama":
            raise ValueError(f"{source}: tunix's Llama 3 actor needs a llama GGUF, not {cfg['model_type']!r}")
        safetensors.numpy.save_file(weights, str(partial / "model.safetensors"))
        tokenizer = Tokenizer.from_gguf(source)
        tokenizer.backend.save(str(partial / "tokenizer.json"))
        eos = tokenizer.backend.id_to_token(tokenizer.eos_token_id)
        # No bos: the GGUF says add_bos_token false, so neither sampler prepends one to the plain-text prompts.
        (partial / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos}))
        cfg = {**cfg, "torch_dtype": "float32"}
    (partial / "config.json").write_text(json.dumps({**cfg, "rope_theta": TUNIX_ROPE_THETA}))
    try:
        partial.rename(folder)
    except OSError:  # another run wrote it first
        shutil.rmtree(partial)
    return folder


def tunix_actor(folder: Path) -> nnx.Module:
    """tunix's Llama 3 with ``folder``'s config and weights (float32)."""
    cfg = json.loads((folder / "config.json").read_text())
    config = llama3_lib.ModelConfig(
        num_layers=cfg["num_hidden_layers"], vocab_size=cfg["vocab_size"], embed_dim=cfg["hidden_size"],
        hidden_dim=cfg["intermediate_size"], num_heads=cfg["num_attention_heads"], head_dim=cfg["head_dim"],
        num_kv_heads=cfg["num_key_value_heads"], rope_theta=cfg["rope_theta"], norm_eps=cfg["rms_norm_eps"],
        weight_tying=cfg["tie_word_embeddings"])
    return llama3_params.create_model_from_safe_tensors(str(folder), config, dtype=jnp.float32)


class Recorder:
    """Wraps a rollout's generate and update_params: per step timings, compilations and, for jaxllm, the logprob
    difference from tunix's recomputation with the trainer's ``actor`` (asserted with ``check``, as are the
    engine's weights after each sync against ``hf_config``'s conversion of the actor)."""

    def __init__(self, rollout, actor: nnx.Module, hf_config: dict, check: bool, atol: float, temperature: float):
        self.rollout, self.actor, self.check, self.atol, self.temperature = rollout, actor, check, atol, temperature
        self.hf_config = hf_config
        self.steps: list[dict] = []
        self.sync: dict = {}
        generate, update = rollout.generate, rollout.update_params
        rollout.generate = functools.partial(self._generate, generate)
        rollout.update_params = functools.partial(self._update, update)

    def _generate(self, generate, prompts, rollout_config, **kwargs):
        compiles, wall, cpu = _compiles[0], time.perf_counter(), time.process_time()
        out = generate(prompts, rollout_config, **kwargs)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        tokens = sum(len(t) for t in out.tokens)
        step = {"rollout_tok_s": tokens / wall, "rollout_cpu_s": cpu, "rollout_compilations": _compiles[0] - compiles,
                **{f"sync_{k}": v for k, v in self.sync.items()}, "completions": [t.tolist() for t in out.tokens]}
        if isinstance(self.rollout, JaxllmRollout) and out.logprobs is not None:
            step.update(self._logprob_diff(out))
        self.steps.append(step)
        self.sync = {}
        return out

    def _logprob_diff(self, out) -> dict[str, float]:
        """Largest |engine logprob - tunix's recomputation with the trainer's weights| over the completion tokens,
        absolute and over max(1, |logprob|) (the recomputation divides the logits by the temperature in the
        processed modes, as the sampler does)."""
        rollout = self.rollout
        width = max(len(t) for t in out.tokens)
        completions = np.full((len(out.tokens), width), rollout.pad_id(), np.int32)
        for row, t in zip(completions, out.tokens):
            row[:len(t)] = t
        graphdef, state = nnx.split(self.actor)
        temperature = 1.0 if rollout.logprobs_mode.startswith("raw") else self.temperature
        ref = np.asarray(tunix_common.compute_per_token_logps(
            graphdef, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
            completion_tokens=jnp.asarray(completions), pad_id=rollout.pad_id(), eos_id=rollout.eos_id(),
            temperature=temperature))
        diffs = [(np.abs(ref[i, :len(lp)] - lp), np.maximum(1.0, np.abs(lp))) for i, lp in enumerate(out.logprobs)]
        absolute = max(float(d.max()) for d, _ in diffs if d.size)
        # Both sides are float32: their rounding grows with the logprob's size (each is 1e-5 from a float64 forward
        # at |logprob| ~3 on stories260K, as is HF transformers' float32), so the check scales with max(1, |lp|).
        scaled = max(float((d / s).max()) for d, s in diffs if d.size)
        if self.check:
            assert scaled <= self.atol, f"engine logprobs differ from tunix's by {scaled} * max(1, |lp|) > {self.atol}"
        return {"logprob_max_abs_diff": absolute, "logprob_max_diff": scaled}

    def _update(self, update, params, filter_types=None):
        compiles, wall = _compiles[0], time.perf_counter()
        update(params, filter_types)
        self.sync = {"seconds": time.perf_counter() - wall, "compilations": _compiles[0] - compiles}
        if isinstance(self.rollout, JaxllmRollout):
            self.sync["bytes"] = self.rollout.last_sync["num_bytes"]
            if self.check:
                # tunix syncs under transfer guards; the comparison reads both sides on the host.
                with jax.transfer_guard("allow"):
                    self._check_weights()
                self.sync["weights_equal"] = True

    def _check_weights(self) -> None:
        _, want = params_from_nnx(self.actor, self.hf_config)
        got = self.rollout.llm.get_params()
        for path, leaf in jax.tree_util.tree_flatten_with_path(want)[0]:
            have = functools.reduce(lambda t, k: t[k.key], path, got)
            np.testing.assert_array_equal(np.asarray(have), np.asarray(leaf), err_msg=str(path))
        if self.rollout.lora_request is not None:
            self._check_lora()

    def _check_lora(self) -> None:
        """The engine's adapter equals the trainer's LoRA leaves: the values it holds exactly, and its device slot
        as the engine lays it out (rank padded with zeros, B times the scale)."""
        lora = nnx_param_arrays(nnx.state(self.actor, nnx.LoRAParam), lora=True)
        want = dict(jaxllm_lora_leaves(lora, name_map_of(self.actor), self.rollout.cfg.num_layers))
        manager = self.rollout.llm.engine.core.lora
        lora_id = self.rollout.lora_request.lora_int_id
        held = manager.weights(lora_id).tensors
        slot = manager.slot_ids.index(lora_id)
        scale = np.float32(self.rollout.lora_scale)
        for path, leaf in want.items():
            key, _, which = path.removeprefix("layers/").rpartition("_lora_")
            leaf = np.asarray(leaf)
            np.testing.assert_array_equal(np.asarray(held[key]["ab".index(which)]), leaf, err_msg=path)
            in_slot = np.asarray(manager.slots.leaves[f"{key}_lora_{which}"][:, slot])
            rank = leaf.shape[-1] if which == "a" else leaf.shape[1]
            if which == "a":
                np.testing.assert_array_equal(in_slot[..., :rank], leaf, err_msg=path)
                assert not in_slot[..., rank:].any(), path
            else:
                np.testing.assert_array_equal(in_slot[:, :rank], leaf * scale, err_msg=path)
                assert not in_slot[:, rank:].any(), path


def run(engine: str, steps: int, *, model: str = "stories260K", word: str = "the", check: bool = False,
        atol: float = 2e-5, temperature: float = 0.9, logprobs_mode: str = "processed_logprobs",
        num_generations: int = 4, max_tokens: int = 24, learning_rate: float = 3e-3, lora_rank: int = 0,
        lora_alpha: float = 16.0, token_buckets: Optional[tuple[int, ...]] = None) -> tuple[list[dict], Any]:
    """``steps`` GRPO steps with ``engine`` ("jaxllm" or "vanilla") on ``model`` (:func:`model_folder`), Adam at
    ``learning_rate``; one dict per step, and the rollout. ``lora_rank``: train a qwix LoRA actor of that rank and
    ``lora_alpha`` on every projection (0: full weights). ``token_buckets``: the jaxllm engine's
    (``EngineConfig.token_buckets``; None: its default ladder)."""
    folder = model_folder(model)
    hf_config = json.loads((folder / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = 0  # stories260K has no pad token; <unk> (0) never appears in a completion
    actor = tunix_actor(folder)
    lora = {}
    if lora_rank:
        import qwix

        provider = qwix.LoraProvider(module_path=".*(q|k|v|o|gate|up|down)_proj", rank=lora_rank, alpha=lora_alpha)
        actor = qwix.apply_lora_to_model(actor, provider, **actor.get_model_input(), rngs=nnx.Rngs(0))
        lora = {"lora_provider": provider}
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rows = len(PROMPTS) * num_generations
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=max_tokens, max_prompt_length=16, kv_cache_size=128, temperature=temperature,
        seed=0, return_logprobs=engine == "jaxllm", rollout_vllm_logprobs_mode=logprobs_mode)
    rollout_engine = "vanilla" if engine == "vanilla" else functools.partial(
        JaxllmRollout, model=str(folder), max_num_seqs=rows, max_model_len=64, max_num_batched_tokens=64,
        precompile=True, **lora, **({} if token_buckets is None else {"token_buckets": token_buckets}))
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                                                  rl_cluster_lib.Role.ROLLOUT)},
            rollout_engine=rollout_engine, offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adam(learning_rate), eval_every_n_steps=10_000, max_steps=steps),
            rollout_config=rollout_config))
    recorder = Recorder(cluster.rollout, cluster.actor_trainer.model, hf_config, check, atol, temperature)
    rewards: list[float] = []

    def reward(prompts, completions, **kwargs):
        scores = [float(c.lower().count(word)) for c in completions]
        rewards.append(float(np.mean(scores)))
        return scores

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=[reward],
        algo_config=grpo_learner.GRPOConfig(num_generations=num_generations, num_iterations=1, beta=0.0))
    data = grain.MapDataset.source(PROMPTS * steps).batch(len(PROMPTS)).map(lambda x: {"prompts": x})
    learner.train(data)
    for step, r in zip(recorder.steps, rewards):
        step["reward"] = r
    return recorder.steps, cluster.rollout


COLUMNS = ["engine", "step", "reward", "rollout tok/s", "rollout CPU s", "sync s", "sync bytes",
           "rollout compilations", "sync compilations", "logprob max abs diff", "logprob max diff / max(1, abs(lp))"]
KEYS = ["reward", "rollout_tok_s", "rollout_cpu_s", "sync_seconds", "sync_bytes", "rollout_compilations",
        "sync_compilations", "logprob_max_abs_diff", "logprob_max_diff"]


def table_rows(results: dict[str, list[dict]]) -> list[list[str]]:
    """One row of ``COLUMNS`` per engine and step ("" where the engine has no such figure)."""
    return [[engine, str(i)] + [("" if step.get(k) is None else f"{step[k]:.4g}") for k in KEYS]
            for engine, steps in results.items() for i, step in enumerate(steps, 1)]


SUMMARY_COLUMNS = ["model", "engine", "steps", "reward, step 1 → last", "rollout tok/s after step 1 (mean)",
                   "rollout CPU s after step 1 (mean)", "sync ms (mean)", "sync MB", "compilations after step 1",
                   "logprob max diff / max(1, abs(lp))"]
SUMMARY_TITLE = "Side by side"


def summary_rows(model: str, results: dict[str, list[dict]]) -> list[list[str]]:
    """One row of ``SUMMARY_COLUMNS`` per engine: means over steps 2.. (step 1 compiles), syncs over every sync,
    compilations of the rollouts after step 1 and of every sync; "" where the engine has no such figure (tunix's
    own sampler shares the trainer's weights: no sync, no logprobs of its own)."""
    rows = []
    for engine, steps in results.items():
        later, syncs = steps[1:], [s for s in steps if "sync_seconds" in s]
        lp = [s["logprob_max_diff"] for s in steps if s.get("logprob_max_diff") is not None]
        rows.append([
            model, engine, str(len(steps)), f"{steps[0]['reward']:.3g} → {steps[-1]['reward']:.3g}",
            f"{np.mean([s['rollout_tok_s'] for s in later]):.4g}" if later else "",
            f"{np.mean([s['rollout_cpu_s'] for s in later]):.3g}" if later else "",
            f"{1e3 * np.mean([s['sync_seconds'] for s in syncs]):.3g}" if syncs else "",
            f"{syncs[0]['sync_bytes'] / 1e6:.3g}" if syncs and "sync_bytes" in syncs[0] else "",
            str(sum(s["rollout_compilations"] for s in later) + sum(s["sync_compilations"] for s in syncs)),
            f"{max(lp):.3g}" if lp else ""])
    return rows


def write_result_file(machine: str, model: str, command: str, rows: list[list[str]], summary: list[list[str]],
                      notes: list[str], description: str) -> Path:
    """Today's ``docs/benchmarks/results/<date>-<machine>-tunix-grpo.json`` with its Markdown page; its path.

    A file of today's is updated: ``model``'s rows of the side-by-side table and its per-step table replaced,
    other models' kept, so one page holds every model run that day.
    """
    import _bench_common as common
    import render_results

    host = common.host_info()
    host["load_avg_1m"] = round(host["load_avg_1m"], 1)
    date = datetime.date.today().isoformat()
    path = render_results.RESULTS / f"{date}-{machine}-tunix-grpo.json"
    tables = json.loads(path.read_text())["tables"] if path.exists() else []
    side = next((t for t in tables if t["title"] == SUMMARY_TITLE), None)
    kept = [r for r in side["rows"] if r[0] != model] if side else []
    title = f"{model}: per GRPO step"
    per_step = [t for t in tables if t["title"] not in (SUMMARY_TITLE, title)]
    per_step.append({"title": title, "command": command, "columns": COLUMNS, "rows": rows, "notes": notes})
    side = {"title": SUMMARY_TITLE, "command": "; ".join(t["command"] for t in per_step),
            "columns": SUMMARY_COLUMNS, "rows": kept + summary}
    result = {"date": date, "machine": machine, "title": "tunix's GRPOLearner: jaxllm vs tunix's sampler",
              "host": host, "description": description, "tables": [side] + per_step}
    path.write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".md").write_text(render_results.render(result))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="stories260K",
                   help="stories260K (the test fixture), default (jaxllm's default model) or a llama GGUF")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=3e-3, help="the actor's Adam learning rate")
    p.add_argument("--engines", default="jaxllm,vanilla")
    p.add_argument("--word", default="the")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--logprobs-mode", default="processed_logprobs",
                   help="tunix's rollout_vllm_logprobs_mode (the engine's logprobs_mode)")
    p.add_argument("--check", action="store_true", help="assert weights equal after each sync and logprobs close")
    p.add_argument("--atol", type=float, default=2e-5)
    p.add_argument("--lora-rank", type=int, default=0, help="train a qwix LoRA actor of this rank (0: full weights)")
    p.add_argument("--json", help="write the per-step records here")
    p.add_argument("--result-file", metavar="MACHINE", help="write docs/benchmarks/results/<date>-MACHINE-tunix-grpo")
    args = p.parse_args()
    results = {}
    for engine in args.engines.split(","):
        results[engine], _ = run(engine, args.steps, model=args.model, word=args.word, check=args.check,
                                 atol=args.atol, temperature=args.temperature, logprobs_mode=args.logprobs_mode,
                                 learning_rate=args.learning_rate, lora_rank=args.lora_rank)
        if args.json:
            Path(args.json).write_text(json.dumps(results))
    rows = table_rows(results)
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    print("\n".join("| " + " | ".join(r) + " |" for r in rows))
    summary = summary_rows(args.model, results)
    print("| " + " | ".join(SUMMARY_COLUMNS) + " |\n|" + "---|" * len(SUMMARY_COLUMNS))
    print("\n".join("| " + " | ".join(r) + " |" for r in summary))
    if args.result_file:
        command = (f"python scripts/tunix_grpo.py --model {args.model} --steps {args.steps} --engines {args.engines} "
                   f"--learning-rate {args.learning_rate} --logprobs-mode {args.logprobs_mode} "
                   + (f"--check --atol {args.atol} " if args.check else "") + f"--result-file {args.result_file}")
        cfg = json.loads((model_folder(args.model) / "config.json").read_text())
        notes = [f"{args.model}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
                 f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads of {cfg['head_dim']}, "
                 f"vocabulary {cfg['vocab_size']}, float32, rope theta 1e6 on both sides (tunix's Llama 3 uses 1e6 "
                 f"whatever its config says); Adam at {args.learning_rate}."]
        description = (f"tunix {version('google-tunix')}'s GRPOLearner, 4 prompts x 4 generations, up to 24 tokens, "
                       f"T={args.temperature}, plain-text prompts, reward: occurrences of {args.word!r}. Rollouts by "
                       "jaxllm (jaxllm.rl.tunix.JaxllmRollout, logprobs against tunix's recomputation from the "
                       "trainer's weights) or by tunix's own sampler (vanilla, which shares the trainer's weights: "
                       "no sync). Step 1 includes compilation.")
        print("wrote", write_result_file(args.result_file, args.model, command, rows, summary, notes, description))


if __name__ == "__main__":
    main()
