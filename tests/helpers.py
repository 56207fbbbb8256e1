"""Assertions shared by the end-to-end tests and the benchmark scripts' tests, and :class:`SingleSequence`, which
drives the model step for one sequence."""

from __future__ import annotations

import contextlib
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models import forward
from jaxllm.worker.step_batch import StepBatch
from kernels_pallas.cpu_features import describe_cpu
from kernels_pallas.ops import get_attention_ops

TIE_TOL = 1e-4
# The block size of SingleSequence's cache.
BLOCK_SIZE = 4


def assert_one_host_line(stdout: str) -> str:
    """The one ``host:`` line (scripts/_bench_common.py's ``host_line``) of a benchmark's ``stdout``, checked to name
    this machine's CPU count and instruction sets (``describe_cpu()``); the load average is any one-decimal number.
    Returns the line."""
    pattern = re.compile(rf"host: {os.cpu_count()} CPUs \({re.escape(describe_cpu())}\), 1-minute load average "
                         r"\d+\.\d at the end")
    lines = [line for line in stdout.splitlines() if line.startswith("host:")]
    assert len(lines) == 1 and pattern.fullmatch(lines[0]), f"host lines {lines} in:\n{stdout[-3000:]}"
    return lines[0]


def pallas_interpret() -> bool:
    """Whether the tests run the Pallas kernels in the interpreter rather than compiled through Triton.

    ``JAXLLM_PALLAS_INTERPRET=1`` forces the interpreter; ``=0`` forces the
    compiled kernels (scripts/gpu_check.sh sets it, so a GPU JAX cannot see
    never passes silently in interpret mode); unset, the interpreter runs
    unless JAX's default backend is a GPU.

    Raises:
      RuntimeError: ``JAXLLM_PALLAS_INTERPRET=0`` without a GPU, or a value other than 0 or 1.
    """
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

    blocks = len(token_ids) // 4 + 2
    seq = SingleSequence(llm.engine.model_config, llm.engine.runner.weights.params, num_blocks=blocks)
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


@contextlib.contextmanager
def counted_dispatches(runner):
    """Within the block, record for each ``runner.dispatch`` ``(program, has a bitmask, has prompt targets, has LoRA
    slots, host arrays it put on the device)`` in the yielded list. Each dispatch runs under JAX's transfer guard
    refusing implicit host-to-device transfers, so every array it sends goes through the counted ``jax.device_put``
    (patched within the block)."""
    records, puts = [], []
    device_put, dispatch = jax.device_put, runner.dispatch

    def counting_put(x, *args, **kwargs):
        puts.extend(leaf for leaf in jax.tree_util.tree_leaves(x) if not isinstance(leaf, jax.Array))
        return device_put(x, *args, **kwargs)

    def counted(batch, sampling, prev_tokens=None, prompt_target_ids=None, bitmask=None, lora_slots=None):
        puts.clear()
        with jax.transfer_guard_host_to_device("disallow"):
            out = dispatch(batch, sampling, prev_tokens, prompt_target_ids, bitmask, lora_slots)
        records.append((batch.program, bitmask is not None, prompt_target_ids is not None, lora_slots is not None,
                        len(puts)))
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax, "device_put", counting_put)
        patch.setattr(runner, "dispatch", counted)
        yield records


_forward = jax.jit(forward, static_argnames=("cfg", "ops", "all_logits"))


class SingleSequence:
    """Drives ``forward`` for one sequence laid in blocks 1, 2, ... of a fresh cache."""

    def __init__(self, cfg, params, num_blocks=16, backend="reference", cache_dtype=jnp.float32):
        self.cfg, self.params = cfg, params
        self.ops = get_attention_ops(backend)
        shape = (cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.kv = (jnp.zeros(shape, cache_dtype), jnp.zeros(shape, cache_dtype))
        self.block_table = np.arange(1, num_blocks, dtype=np.int32)[None, :]
        self.num_computed = 0

    def run(self, token_ids):
        n = len(token_ids)
        pos = np.arange(self.num_computed, self.num_computed + n, dtype=np.int32)
        slots = self.block_table[0, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        no_token = jnp.full(n, -1, jnp.int32)
        batch = StepBatch(
            input_ids=jnp.asarray(token_ids, jnp.int32), positions=jnp.asarray(pos),
            slot_mapping=jnp.asarray(slots, jnp.int32), block_tables=jnp.asarray(self.block_table),
            seq_lens=jnp.asarray([self.num_computed + n], jnp.int32),
            query_start_loc=jnp.asarray([0, n], jnp.int32), logits_indices=jnp.asarray([n - 1], jnp.int32),
            prev_token_index=no_token, prompt_target_ids=no_token, num_spec_tokens=jnp.zeros(1, jnp.int32),
            num_seqs=jnp.int32(1),
        )
        logits, self.kv = _forward(self.params, self.kv, batch, cfg=self.cfg, ops=self.ops, all_logits=True)
        self.num_computed += n
        return np.asarray(logits)
