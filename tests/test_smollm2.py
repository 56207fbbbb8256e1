"""SmolLM2-135M-Instruct (the embedded default model, a real Q4_1 GGUF) against HF transformers."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4,",
    "The three primary colors are red, yellow and",
    "Water boils at",
    "In machine learning, a transformer is a neural network architecture that relies on",
    "Hello",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


def _hf_greedy(model, prompt_ids):
    """HF greedy decoding with its KV cache, never stopping at eos (``generate``
    would stop at the model's eos even with the generation config's removed)."""
    tokens = []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(NEW_TOKENS):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def test_greedy_tokens_equal_hf_generate_for_8_prompts_batched(smollm2_gguf, hf_model):
    llm = LLM(model=smollm2_gguf, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, precompile=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    lengths = {len(o.prompt_token_ids) for o in outs}
    assert len(lengths) >= 6
    for out in outs:
        assert out.outputs[0].token_ids == _hf_greedy(hf_model, out.prompt_token_ids), out.prompt
