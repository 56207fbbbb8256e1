"""Assertions shared by the end-to-end tests."""

from __future__ import annotations

import os

import numpy as np

TIE_TOL = 1e-4


def pallas_interpret() -> bool:
    """Whether the tests run the Pallas kernels in the interpreter rather than compiled through Triton.

    ``JAXLLM_PALLAS_INTERPRET=1`` forces the interpreter; ``=0`` forces the
    compiled kernels (scripts/gpu_check.sh sets it, so a GPU JAX cannot see
    never passes silently in interpret mode); unset, the interpreter runs
    unless JAX's default backend is a GPU.

    Raises:
      RuntimeError: ``JAXLLM_PALLAS_INTERPRET=0`` without a GPU, or a value other than 0 or 1.
    """
    import jax

    flag = os.environ.get("JAXLLM_PALLAS_INTERPRET")
    backend = jax.default_backend()
    if flag is None:
        return backend != "gpu"
    if flag not in ("0", "1"):
        raise RuntimeError(f"JAXLLM_PALLAS_INTERPRET={flag!r}: use 1 (interpreter) or 0 (compiled, needs a GPU)")
    if flag == "0" and backend != "gpu":
        raise RuntimeError(f"JAXLLM_PALLAS_INTERPRET=0 asks for compiled kernels, but JAX's backend is {backend!r}")
    return flag == "1"


def top2_gap(llm, token_ids) -> float:
    """Gap between the two largest next-token logits after ``token_ids``
    (one fresh prefill of the model's forward pass, float32)."""
    from tests.test_model_parity import SingleSequence

    blocks = len(token_ids) // 4 + 2
    seq = SingleSequence(llm.engine.model_config, llm.engine.runner.params, num_blocks=blocks)
    logits = seq.run(np.asarray(token_ids))[-1]
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def assert_same_or_near_tie(llm, prompt, expected, got) -> None:
    """``got == expected``, or they first differ at a step whose top-two logits
    differ by less than ``TIE_TOL`` (a float32 near-tie that summation order
    may flip), which is checked."""
    if got == expected:
        return
    step = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    gap = top2_gap(llm, list(prompt) + list(expected[:step]))
    assert gap < TIE_TOL, f"outputs diverge at step {step} with a top-2 logit gap of {gap}: {expected} vs {got}"
