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

from scripts.tunix_grpo import run  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

STEPS = 4
GROUP = 4
# Not 1e-5: that is below float32's own error on these logits (|logit| up to 24, float32 spacing 1.9e-6 there). The
# engine's paged forward, tunix's dense one and jaxllm's dense_forward are each 1.1e-5 to 1.6e-5 from a float64
# forward of the same weights over a GRPO step's 384 tokens (the log_softmax's share is 1e-6), so two of them may
# differ by the sum, 3.2e-5; they differ by 1.3e-5 to 1.4e-5.
ATOL = 3e-5


@pytest.fixture(scope="module", params=["raw_logprobs", "processed_logprobs"])
def grpo(request):
    """(per-step records, the rollout) of STEPS GRPO steps on jaxllm with the engine in ``request.param``'s mode."""
    return run("jaxllm", STEPS, check=True, atol=ATOL, logprobs_mode=request.param, temperature=0.9,
               num_generations=GROUP)


def test_grpo_on_jaxllm_learns_syncs_exactly_and_compiles_nothing_after_the_first_step(grpo):
    steps, rollout = grpo
    assert len(steps) == STEPS
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
