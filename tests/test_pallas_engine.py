"""The engine on the Pallas kernels generates what the jnp reference does, in float32 and bfloat16 (interpret
mode on CPU, compiled through Triton on a GPU; ``JAXLLM_PALLAS_INTERPRET`` overrides, see tests/helpers.py).

stories260K cannot serve here: its head_dim 8 is below the kernels' minimum of 16.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from tests.helpers import pallas_interpret


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_backend_gives_the_reference_greedy_tokens(tiny_llama_dir, dtype):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (1, 7, 19, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kwargs = dict(dtype=dtype, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=8,
                  precompile=False)
    reference = LLM(model=tiny_llama_dir, attention_backend="reference", **kwargs).generate(prompts, params)
    pallas_llm = LLM(model=tiny_llama_dir, attention_backend="pallas", interpret=pallas_interpret(), **kwargs)
    pallas = pallas_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in pallas] == [o.outputs[0].token_ids for o in reference]
    assert pallas_llm.engine.buckets.width_buckets == (8,)
