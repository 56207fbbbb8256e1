"""Float32 logits of the jaxllm forward pass against HF transformers.

Tolerance: max abs logit difference <= 1e-4 (issue 2), for a whole-prompt
prefill, a prefill in two chunks over the paged cache, and 16 decode steps,
for a tiny random model of every family (issue 18: Gemma 3, Phi-3, Mixtral,
Qwen3-MoE besides the Llama family).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxllm.loader import load_model  # noqa: E402
from tests.helpers import BLOCK_SIZE, SingleSequence  # noqa: E402,F401  (SingleSequence: other tests import it here)
from tests.hf_models import make_tiny_hf_model  # noqa: E402

TOL = 1e-4
PROMPT_LEN = 13
DECODE_STEPS = 16
# The jnp attention paths: the reference, and the tiled one the engine uses on CPU. The Llama family
# runs both; the other families the engine's.
BACKENDS = ("reference", "xla")
CASES = [(arch, backend) for arch in ("llama", "llama3", "mistral", "qwen2", "qwen3") for backend in BACKENDS] + [
    (arch, "xla") for arch in ("gemma3", "phi3", "phi3_long", "mixtral", "qwen3_moe")]


@pytest.fixture(scope="module")
def hf_tiny_models(tmp_path_factory):
    """Tiny HF models by arch, each built once: (cfg, float32 params, token ids, HF logits of all ids)."""
    built = {}

    def get(arch):
        if arch not in built:
            folder = tmp_path_factory.mktemp(arch)
            hf = make_tiny_hf_model(arch, folder)
            cfg, params, _ = load_model(folder, np.float32)
            ids = np.random.default_rng(1).integers(3, 256, size=PROMPT_LEN + DECODE_STEPS)
            with torch.no_grad():
                ref = hf(torch.tensor(ids[None])).logits[0].numpy()
            built[arch] = (cfg, params, ids, ref)
        return built[arch]

    return get


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def tiny(request, hf_tiny_models):
    arch, backend = request.param
    return hf_tiny_models(arch) + (backend,)


def test_prefill_logits_match_hf(tiny):
    cfg, params, ids, ref, backend = tiny
    got = SingleSequence(cfg, params, backend=backend).run(ids[:PROMPT_LEN])
    np.testing.assert_allclose(got, ref[:PROMPT_LEN], atol=TOL, rtol=0)


def test_chunked_prefill_logits_match_hf(tiny):
    cfg, params, ids, ref, backend = tiny
    seq = SingleSequence(cfg, params, backend=backend)
    first = seq.run(ids[:6])
    second = seq.run(ids[6:PROMPT_LEN])
    np.testing.assert_allclose(np.concatenate([first, second]), ref[:PROMPT_LEN], atol=TOL, rtol=0)


def test_decode_steps_logits_match_hf(tiny):
    cfg, params, ids, ref, backend = tiny
    seq = SingleSequence(cfg, params, backend=backend)
    seq.run(ids[:PROMPT_LEN])
    for i in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
        got = seq.run(ids[i:i + 1])
        np.testing.assert_allclose(got[0], ref[i], atol=TOL, rtol=0, err_msg=f"decode position {i}")
        assert got[0].argmax() == ref[i].argmax(), f"greedy token at decode position {i}"


DENSE_ARCHS = sorted({arch for arch, _ in CASES})


@pytest.mark.parametrize("arch", DENSE_ARCHS)
def test_dense_forward_logits_match_hf_for_whole_and_right_padded_rows(hf_tiny_models, arch):
    # The training-side forward (jaxllm.models.dense_forward) runs the family's own layers with dense attention:
    # row 0 is the whole sequence, row 1 its first PROMPT_LEN tokens right-padded, whose padding changes nothing.
    from jaxllm.models.dense import dense_forward

    cfg, params, ids, ref = hf_tiny_models(arch)
    padded = np.where(np.arange(len(ids)) < PROMPT_LEN, ids, 0)
    got = np.asarray(jax.jit(dense_forward, static_argnames="cfg")(params, jnp.asarray(np.stack([ids, padded]),
                                                                                       jnp.int32), cfg=cfg))
    np.testing.assert_allclose(got[0], ref, atol=TOL, rtol=0)
    np.testing.assert_allclose(got[1, :PROMPT_LEN], ref[:PROMPT_LEN], atol=TOL, rtol=0)
    assert (got[0].argmax(-1) == ref.argmax(-1)).all()


# The bit-casting is one tree_map over every layer leaf, whatever the family: one tiny model
# (compiling six programs per model, the other families' cases would cost ~1 min of suite time).
BF16_CASES = [("llama", backend) for backend in BACKENDS]


@pytest.mark.parametrize("arch, backend", BF16_CASES, ids=["-".join(case) for case in BF16_CASES])
def test_bfloat16_held_as_uint16_bits_gives_the_same_logits(hf_tiny_models, arch, backend):
    # The CPU engine keeps bf16 layer weights and caches as uint16 bit patterns
    # (models.loop_storage): the numbers must not change at all.
    import ml_dtypes

    from jaxllm.models import loop_storage

    cfg, params, ids, _ = hf_tiny_models(arch)
    bf16 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, ml_dtypes.bfloat16), params)
    plain = SingleSequence(cfg, bf16, backend=backend, cache_dtype=jnp.bfloat16)
    bits = SingleSequence(cfg, loop_storage(bf16), backend=backend, cache_dtype=jnp.uint16)
    for chunk in (ids[:9], ids[9:PROMPT_LEN], ids[PROMPT_LEN:PROMPT_LEN + 1]):
        np.testing.assert_array_equal(bits.run(chunk), plain.run(chunk))
    assert bits.params["layers"]["wq"].dtype == jnp.uint16
    np.testing.assert_array_equal(jax.lax.bitcast_convert_type(bits.kv[0], jnp.bfloat16), plain.kv[0])
