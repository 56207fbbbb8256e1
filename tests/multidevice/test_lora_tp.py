"""LoRA adapters under tensor parallelism on 8 CPU devices: A and B split as their projection, same tokens as tp=1."""

from __future__ import annotations

import json

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxllm import LLM, LoRARequest
from tests.multidevice.conftest import ENGINE, GREEDY, prompts

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _write_adapter(base, folder, seed: int, rank: int = 4):
    """A random PEFT LoRA folder over all seven projections of the tiny Llama in ``base`` (B non-zero, unlike
    PEFT's initialisation, so the adapter changes the tokens)."""
    from safetensors.numpy import save_file

    cfg = json.loads((base / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0.0, 0.3, (rank, fan_in)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0.0, 0.3, (fan_out, rank)).astype(np.float32)
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
        "lora_dropout": 0.0, "bias": "none"}))


def test_tp_2_mixed_base_and_two_adapters_gives_tp_1_tokens_with_a_and_b_split_as_their_projection(
        kv4_dir, tmp_path):
    requests = []
    for i in (1, 2):
        _write_adapter(kv4_dir, tmp_path / f"adapter{i}", seed=i)
        requests.append(LoRARequest(f"adapter{i}", i, str(tmp_path / f"adapter{i}")))
    # Each prompt under the base model and both adapters, all in one batch.
    batch = [p for p in prompts(2) for _ in range(3)]
    loras = [None, *requests] * 2

    def tokens(tp):
        # One token bucket: each engine compiles one step program (the comparison needs no more).
        llm = LLM(model=kv4_dir, tensor_parallel_size=tp, enable_lora=True, max_loras=2, max_lora_rank=8,
                  **{**ENGINE, "token_buckets": (64,)})
        return llm, [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, lora_request=loras)]

    llm, two = tokens(2)
    leaves = llm.engine.runner.lora.leaves  # [L, max_loras, in, R] and [L, max_loras, R, out]
    # Column-parallel q and gate: B split on its output columns, A whole; row-parallel o and down: A split on its
    # input rows, B whole.
    for key in ("wq", "w_gate"):
        assert leaves[key + "_lora_a"].sharding.spec == P(None, None, None, None)
        assert leaves[key + "_lora_b"].sharding.spec == P(None, None, None, "model")
    for key in ("wo", "w_down"):
        assert leaves[key + "_lora_a"].sharding.spec == P(None, None, "model", None)
        assert leaves[key + "_lora_b"].sharding.spec == P(None, None, None, None)
    del llm
    assert two == tokens(1)[1]
    # The adapters change each prompt's tokens (so the comparison covers their terms).
    assert all(len({tuple(t) for t in two[i:i + 3]}) == 3 for i in (0, 3))
