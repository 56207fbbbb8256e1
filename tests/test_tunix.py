"""tunix's GRPOLearner with jaxllm as its rollout engine (jaxllm.rl.tunix), on stories260K.

tunix's pins (``google-tunix==0.1.7``: transformers 5.12, tokenizers 0.22.2, safetensors < 0.8, huggingface-hub 1.x)
sit below the main test environment's, so tunix is the ``[tunix]`` extra, not in ``[test]``: these tests run in an
environment with ``pip install -e ".[tunix,test]"`` (tests/test_tunix_env.py makes one and runs them there) and are
skipped where tunix is not importable.

Per GRPO step (``scripts/tunix_grpo.py``'s recorder): the engine's logprobs are within ATOL of tunix's recomputation
from the trainer's weights (``compute_per_token_logps``, the logits divided by T=0.9 in the processed mode, as the
engine's sampler does before its float32 log_softmax), the engine's weights equal the trainer's after each sync,
nothing compiles after the first step, and the reward rises.
"""

from __future__ import annotations

import pytest

pytest.importorskip("tunix", reason="tunix is the [tunix] extra (its pins conflict with [test])")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from scripts.tunix_grpo import PROMPTS, run  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from jaxllm.loader.nnx_names import LLAMA3, jaxllm_lora_leaves  # noqa: E402

# The processed mode at T=0.9 (tunix's default) runs STEPS; the raw mode RAW_STEPS, enough for two syncs: the
# first may build the sync's programs, the second must build none, and the logprobs are checked after each.
STEPS = 4
RAW_STEPS = 3
GROUP = 4
# Two token buckets per engine (16 decode rows, 64-token chunks of the prompts) instead of the default ladder's seven:
# each of the three engines here compiles its own programs (their logprobs modes and LoRA differ).
TOKEN_BUCKETS = (16, 64)
# Not 1e-5: that is below float32's own error on these logprobs. Against a float64 forward of the same weights over a
# GRPO step's 384 completion tokens, the engine's paged forward, tunix's recomputation and jaxllm's dense_forward
# are each up to 1.5e-5 off at a step's worst token (RMS 2.3e-6 to 2.4e-6 each, no bias), most of it from q and k
# held in float32 (attention scores reach 65 here); tunix's alone is over 1e-5 on most steps, so even an exact engine
# would miss 1e-5 against it. Two float32 forwards may differ by the sum, 3e-5; the engine and tunix differ by 1.1e-5
# to 1.5e-5.
ATOL = 3e-5


@pytest.fixture(scope="module", params=[("raw_logprobs", RAW_STEPS), ("processed_logprobs", STEPS)],
                ids=["raw_logprobs", "processed_logprobs"])
def grpo(request):
    """(per-step records, the rollout) of GRPO steps on jaxllm with the engine in ``request.param``'s mode, as many
    as ``request.param`` says."""
    mode, steps = request.param
    return run("jaxllm", steps, check=True, atol=ATOL, logprobs_mode=mode, temperature=0.9,
               num_generations=GROUP, token_buckets=TOKEN_BUCKETS)


def test_grpo_on_jaxllm_learns_syncs_exactly_and_compiles_nothing_after_the_first_step(grpo):
    steps, rollout = grpo
    assert len(steps) == (RAW_STEPS if rollout.logprobs_mode == "raw_logprobs" else STEPS)
    assert all(s["logprob_max_abs_diff"] <= ATOL for s in steps), [s["logprob_max_abs_diff"] for s in steps]
    # tunix syncs the engine after every step: each later step's rollout follows a sync whose weights were checked.
    assert all(s.get("sync_weights_equal") for s in steps[1:]), [sorted(s) for s in steps]
    assert all(s["sync_bytes"] > 0 for s in steps[1:])
    assert all(s["rollout_compilations"] == 0 for s in steps[1:]), [s["rollout_compilations"] for s in steps]
    assert all(s["sync_compilations"] == 0 for s in steps[2:]), [s["sync_compilations"] for s in steps]
    rewards = [s["reward"] for s in steps]
    assert rewards[-1] > rewards[0], rewards


def test_a_group_of_repeats_under_one_seed_gets_distinct_reproducible_seeds(grpo):
    """tunix passes one seed for a batch that repeats each prompt G times: the adapter gives each row its own seed
    (jaxllm.rl.tunix.row_seeds), so a group's rows differ, and the same batch and seed give the same seeds."""
    _, rollout = grpo
    config = base_rollout.RolloutConfig(max_tokens_to_generate=16, max_prompt_length=16, temperature=0.9, seed=7)
    first = [p.seed for p in rollout.sampling_params(config, GROUP)]
    assert len(set(first)) == GROUP and None not in first, first
    assert [p.seed for p in rollout.sampling_params(config, GROUP)] == first
    other = base_rollout.RolloutConfig(max_tokens_to_generate=16, max_prompt_length=16, temperature=0.9, seed=8)
    assert [p.seed for p in rollout.sampling_params(other, GROUP)] != first


LORA_STEPS = 3
LORA_RANK = 4


@pytest.fixture(scope="module")
def grpo_lora():
    """(per-step records, the rollout) of LORA_STEPS GRPO steps with a rank-LORA_RANK qwix LoRA actor on jaxllm
    (processed logprobs at T=0.9); the recorder checks each sync's adapter against the trainer's LoRA leaves."""
    return run("jaxllm", LORA_STEPS, check=True, atol=2e-5, logprobs_mode="processed_logprobs", temperature=0.9,
               num_generations=GROUP, lora_rank=LORA_RANK, token_buckets=TOKEN_BUCKETS)


def test_a_lora_actor_syncs_only_its_lora_leaves_into_one_adapter_slot_with_no_compilation(grpo_lora):
    steps, rollout = grpo_lora
    assert len(steps) == LORA_STEPS
    assert [(r.lora_name, r.lora_int_id) for r in rollout.llm.list_loras()] == [("tunix-actor", 1)]
    # Sampled under the adapter: within the full-weight tests' tolerance of tunix's recomputation with qwix's LoRA.
    assert all(s["logprob_max_diff"] <= 2e-5 for s in steps), [s["logprob_max_diff"] for s in steps]
    # After each sync: base weights, the engine's held A/B and its device slot (B times alpha / rank) exact.
    assert all(s.get("sync_weights_equal") for s in steps[1:]), [sorted(s) for s in steps]
    assert rollout.lora_scale == 16.0 / LORA_RANK
    assert all(s["rollout_compilations"] == 0 for s in steps[1:]), [s["rollout_compilations"] for s in steps]
    assert all(s["sync_compilations"] == 0 for s in steps[2:]), [s["sync_compilations"] for s in steps]
    # Only the LoRA leaves travel: 7 projections x 5 layers x (A + B), float32.
    lora_bytes = sum(int(np.prod(shape)) * 4 for shape in rollout._lora_shapes.values())
    full_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(rollout.llm.get_params()))
    assert len(rollout._lora_shapes) == 7 * 5 * 2
    assert all(s["sync_bytes"] == lora_bytes for s in steps[1:]), ([s["sync_bytes"] for s in steps], lora_bytes)
    print(f"LoRA sync {lora_bytes} bytes a step, a full sync {full_bytes} bytes")


def test_a_lora_rollouts_per_token_logps_match_its_sampled_logprobs(grpo_lora):
    """get_per_token_logps runs dense_forward under the synced adapter: at T=1 it gives the engine's sampled
    logprobs of the same completions (the trained adapter is nonzero, so a missing adapter would differ)."""
    _, rollout = grpo_lora
    config = base_rollout.RolloutConfig(max_tokens_to_generate=8, max_prompt_length=16, temperature=1.0, seed=3,
                                        return_logprobs=True)
    # The class's generate: the script's recorder wraps the instance's, checking logprobs at its own temperature.
    out = type(rollout).generate(rollout, PROMPTS, config)
    width = max(len(t) for t in out.tokens)
    completions = np.full((len(out.tokens), width), rollout.pad_id(), np.int32)
    for row, t in zip(completions, out.tokens):
        row[:len(t)] = t
    got = np.asarray(rollout.get_per_token_logps(out.left_padded_prompt_tokens, completions))
    for i, lp in enumerate(out.logprobs):
        np.testing.assert_allclose(got[i, :len(lp)], lp, rtol=0, atol=ATOL)
    base = np.asarray(rollout._logps(rollout.llm.get_params(), jnp.asarray(out.left_padded_prompt_tokens),
                                     jnp.asarray(completions), pad_id=rollout.pad_id()))
    assert max(float(np.abs(base[i, :len(lp)] - lp).max()) for i, lp in enumerate(out.logprobs)) > 1e-3


def test_a_lora_sync_names_a_leaf_that_is_not_the_actors(grpo_lora):
    _, rollout = grpo_lora
    held = rollout.llm.engine.core.lora.weights
    before = {k: tuple(map(np.asarray, pair)) for k, pair in held(rollout.lora_request.lora_int_id).tensors.items()}
    misshapen = nnx.State.from_flat_path(
        {("layers", 0, "attn", "q_proj", "w_lora_a"): nnx.LoRAParam(jnp.zeros((64, LORA_RANK + 1)))})
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.q_proj\.w_lora_a' of shape \(64, 5\).*\(64, 4\)"):
        rollout.update_params(misshapen, (nnx.LoRAParam,))
    unknown = nnx.State.from_flat_path({("lm_head", "w_lora_a"): nnx.LoRAParam(jnp.zeros((64, LORA_RANK)))})
    with pytest.raises(ValueError, match=r"'lm_head\.w_lora_a'"):
        rollout.update_params(unknown, (nnx.LoRAParam,))
    with pytest.raises(ValueError, match=r"'lm_head\.w_lora_a' is not the LoRA pair of a layer kernel"):
        dict(jaxllm_lora_leaves({"lm_head.w_lora_a": jnp.zeros((64, LORA_RANK))}, LLAMA3, 5))
    after = held(rollout.lora_request.lora_int_id).tensors
    assert all(np.array_equal(np.asarray(after[k][i]), before[k][i]) for k in before for i in (0, 1))
