"""SmolLM2-135M-Instruct (the embedded default model, a real Q4_1 GGUF) against HF transformers, and with a LoRA
adapter made by PEFT against HF transformers + PEFT."""

from __future__ import annotations

import pytest

from jaxllm import LLM, LoRARequest, SamplingParams

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


def _hf_greedy(model, prompt_ids, new_tokens=NEW_TOKENS):
    """HF greedy decoding with its KV cache, never stopping at eos (``generate``
    would stop at the model's eos even with the generation config's removed)."""
    tokens = []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(new_tokens):
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


def test_greedy_tokens_equal_hf_peft_with_a_random_rank_8_adapter(smollm2_gguf, hf_model, tmp_path):
    """A rank-8 adapter on every projection, saved by PEFT: each prompt's greedy tokens under it equal HF + PEFT's,
    and the base rows of the same batch equal HF's."""
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    # init_lora_weights=False keeps nn.Linear's random init for B too (PEFT's default zeroes it: a no-op adapter).
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    reference = peft.get_peft_model(hf_model, config).eval()
    try:
        reference.save_pretrained(tmp_path)
        llm = LLM(model=smollm2_gguf, enable_lora=True, max_loras=1, max_lora_rank=8, dtype="float32",
                  max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, precompile=False)
        prompts, adapter = PROMPTS[:2], LoRARequest("random8", 1, str(tmp_path))
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate(prompts * 2, params, lora_request=[adapter] * 2 + [None] * 2, use_tqdm=False)
        changed = 0
        for tuned, base in zip(outs[:2], outs[2:]):
            ids = tuned.prompt_token_ids
            assert tuned.outputs[0].token_ids == _hf_greedy(reference, ids, 16), tuned.prompt
            with reference.disable_adapter():
                assert base.outputs[0].token_ids == _hf_greedy(reference, ids, 16), base.prompt
            changed += tuned.outputs[0].token_ids != base.outputs[0].token_ids
        assert changed >= 1, "the adapter must change the output"
    finally:
        reference.unload()  # hf_model is the module's: give it back without the LoRA layers
