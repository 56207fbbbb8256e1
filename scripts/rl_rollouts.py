"""An RL loop that runs on a laptop: GRPO-style REINFORCE on the stories260K fixture, rollouts by jaxllm.

Each iteration samples ``--n`` seeded completions per prompt through ``LLM.generate``, scores each by how often the
target word appears in it, takes Adam steps with ``jax.grad`` on a dense-attention forward over the same parameter
pytree the engine serves (``jaxllm.models.dense.dense_forward``), and hands the new weights to the running engine
with ``LLM.update_weights`` (no recompilation: the step programs take the weights as an argument). It prints, per
iteration, the mean reward, the rollout output tokens/s, the seconds of the weight update and the programs XLA
compiled during the iteration (the engine's and the training step's; 0 after the first).

    python scripts/rl_rollouts.py --iterations 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring

# Import this checkout's packages, not whatever an installed copy points at.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _bench_common as common  # noqa: E402
from jaxllm import LLM, SamplingParams  # noqa: E402
from jaxllm.loader import load_model  # noqa: E402
from jaxllm.models import dense_forward  # noqa: E402

STORIES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "stories260K"
PROMPTS = ["Once upon a time, there was a", "One day, a little girl named Lily", "The dog saw a",
           "Tom and his mom went to the"]

_compiles = [0]
monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: _compiles.__setitem__(0, _compiles[0] + (event == "/jax/core/compile/backend_compile_duration")))


def rewards(texts: list[str], word: str) -> np.ndarray:
    """How often ``word`` appears in each completion, float32 ``[N]``."""
    return np.asarray([t.lower().count(word) for t in texts], np.float32)


def advantages(reward: np.ndarray, n: int) -> np.ndarray:
    """GRPO's group-relative advantage: each completion's reward against its prompt's ``n``, in their std units."""
    groups = reward.reshape(-1, n)
    return ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)).reshape(-1)


def pack(prompts: list[list[int]], completions: list[list[int]], n: int, length: int) -> tuple[np.ndarray, ...]:
    """Prompt + completion rows, right-padded to ``length``: ids int32 ``[N, length]`` and a float32 mask of the
    positions whose next token is a completion token (the ones the policy chose)."""
    ids = np.zeros((len(completions), length), np.int32)
    mask = np.zeros((len(completions), length), np.float32)
    for i, completion in enumerate(completions):
        prompt = prompts[i // n]
        row = (prompt + completion)[:length]
        ids[i, :len(row)] = row
        mask[i, len(prompt) - 1:len(row) - 1] = 1.0
    return ids, mask


def make_train_step(cfg, lr: float):
    """One jitted Adam step on the REINFORCE loss ``-mean(advantage * log p(completion))``."""

    def loss(params, ids, mask, adv):
        logp = jax.nn.log_softmax(dense_forward(params, ids, cfg=cfg), axis=-1)
        chosen = jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
        per_row = (chosen * mask[:, :-1]).sum(1)
        return -(adv * per_row).mean()

    @jax.jit
    def step(params, m, v, t, ids, mask, adv):
        grads = jax.grad(loss)(params, ids, mask, adv)
        m = jax.tree_util.tree_map(lambda a, g: 0.9 * a + 0.1 * g, m, grads)
        v = jax.tree_util.tree_map(lambda a, g: 0.999 * a + 0.001 * g * g, v, grads)
        scale = lr * jnp.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        params = jax.tree_util.tree_map(lambda p, a, b: p - scale * a / (jnp.sqrt(b) + 1e-8), params, m, v)
        return params, m, v

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--word", default="happy", help="the word the reward counts")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps-per-iteration", type=int, default=2)
    args = p.parse_args()

    cfg, host_params, _ = load_model(STORIES, np.float32)
    # Every program built up front (precompile=True), so that a compilation counted later is a real one; a step
    # holds at most one token per sequence besides the short prompts, so 64 tokens bound the buckets.
    rows = len(PROMPTS) * args.n
    llm = LLM(str(STORIES), params=host_params, precompile=True, max_num_seqs=rows, max_model_len=128,
              max_num_batched_tokens=max(64, rows))
    prompts = [llm.get_tokenizer().encode(text) for text in PROMPTS]
    length = max(map(len, prompts)) + args.max_tokens
    params = jax.tree_util.tree_map(jnp.asarray, host_params)
    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    train_step = make_train_step(cfg, args.lr)
    engine_programs = llm.engine.runner.compile_stats.num_compilations
    print(f"stories260K, {len(PROMPTS)} prompts x {args.n} completions of {args.max_tokens} tokens, reward: "
          f"occurrences of {args.word!r}; Adam lr {args.lr}, {args.steps_per_iteration} steps per iteration")
    print(f"{'iter':>4} {'mean reward':>11} {'rollout tok/s':>13} {'update s':>8} {'compilations':>12} "
          f"{'engine programs':>15}")
    for it in range(1, args.iterations + 1):
        compiles = _compiles[0]
        sampling = [SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=1000 * it + i)
                    for i in range(len(PROMPTS))]
        start = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        rollout_s = time.perf_counter() - start
        completions = [c for out in outs for c in out.outputs]
        reward = rewards([c.text for c in completions], args.word)
        ids, mask = pack(prompts, [list(c.token_ids) for c in completions], args.n, length)
        adv = jnp.asarray(advantages(reward, args.n))
        for k in range(args.steps_per_iteration):
            t = jnp.float32((it - 1) * args.steps_per_iteration + k + 1)
            params, m, v = train_step(params, m, v, t, jnp.asarray(ids), jnp.asarray(mask), adv)
        jax.block_until_ready(params)
        start = time.perf_counter()
        llm.update_weights(params)
        update_s = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for c in completions)
        print(f"{it:>4} {reward.mean():>11.3f} {tokens / rollout_s:>13.1f} {update_s:>8.3f} "
              f"{_compiles[0] - compiles:>12} {llm.engine.runner.compile_stats.num_compilations - engine_programs:>15}", flush=True)
    print(common.host_line(common.host_info()))


if __name__ == "__main__":
    main()
