"""An architecture jaxllm does not ship, registered (``jaxllm.register_model``) and served: the GPT-J-style
model of tests/custom_model_gptj.py, loaded from safetensors in GPT-J's names, against its plain dense-attention
reference (float32 logits within 1e-4, greedy tokens identical) through the model step, ``LLM`` (chunked
prefill, prefix-cache hits, preemption, logprobs, structured output) and ``jaxllm serve`` (registered by an entry-point
plugin in the server's processes); and the registration's errors.
"""

from __future__ import annotations

import dataclasses
import json
import os

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxllm import LLM, SamplingParams, StructuredOutputsParams, registry
from jaxllm.config import EngineConfig
from jaxllm.core.client import MPClient
from jaxllm.loader import load_model, read_model_config
from jaxllm.models import Family, family, register_model
from jaxllm.models.config import ModelConfig
from jaxllm.worker.sharding import ModelSharding, make_mesh
from tests import custom_model_gptj as gptj
from tests.conftest import ROOT
from tests.helpers import BLOCK_SIZE, SingleSequence
from tests.server_process import Server, engine_flags

TOL = 1e-4
# Engine of the LLM and server tests: prompts prefill in chunks of 16 tokens over 16-token blocks.
ENGINE = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=(16,), precompile=False)
MAX_TOKENS = 8
# Token-id prompts: two sharing a 34-token prefix (two whole blocks hit the prefix cache), one short.
_rng = np.random.default_rng(7)
SHARED = _rng.integers(3, 500, size=34).tolist()
PROMPTS = [SHARED + [11, 12, 13], SHARED + [400, 401], _rng.integers(3, 500, size=5).tolist()]


@pytest.fixture(scope="module")
def gptj_dir(tmp_path_factory, stories_dir):
    register_model(gptj.MODEL_TYPE, gptj.FAMILY, hf_architectures=[gptj.ARCHITECTURE])
    return gptj.write_checkpoint(tmp_path_factory.mktemp("gptj") / "tiny_gptj", stories_dir)


# The reference's sequences are padded to this length: a position's logits under causal attention do not depend
# on the tokens after it, so one program serves every greedy step.
REFERENCE_LEN = 64


@pytest.fixture(scope="module")
def dense(gptj_dir):
    return gptj.dense_forward(gptj_dir)


def greedy_reference(dense, prompt, steps=MAX_TOKENS):
    """(greedy token ids, log-softmax rows [steps, V] they were chosen from) of the dense reference."""
    ids, rows = list(prompt), []
    for _ in range(steps):
        logits = dense(ids + [0] * (REFERENCE_LEN - len(ids)))[len(ids) - 1].astype(np.float64)
        rows.append(logits - logits.max() - np.log(np.exp(logits - logits.max()).sum()))
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], np.stack(rows)


@pytest.fixture(scope="module")
def references(dense):
    return [greedy_reference(dense, p) for p in PROMPTS]


def test_registered_config_json_in_gptj_names_maps_to_a_model_config(gptj_dir):
    cfg = load_model(gptj_dir)[0]
    assert (cfg.architecture, cfg.model_type) == (gptj.ARCHITECTURE, gptj.MODEL_TYPE)
    assert (cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (64, 4, 4, 16, 3)
    assert (cfg.intermediate_size, cfg.rope.partial_rotary_factor, cfg.rms_norm_eps) == (160, 0.5, 1e-5)
    assert (cfg.hidden_act, cfg.tie_word_embeddings, cfg.eos_token_ids) == ("gelu_new", False, (2,))


def test_step_logits_match_the_dense_reference_whole_chunked_and_decoding(gptj_dir, dense):
    cfg, params, _ = load_model(gptj_dir)
    ids = np.random.default_rng(3).integers(3, 500, size=30)
    ref = dense(ids)
    whole = SingleSequence(cfg, params, num_blocks=len(ids) // BLOCK_SIZE + 2, backend="xla").run(ids)
    np.testing.assert_allclose(whole, ref, atol=TOL, rtol=0)
    seq = SingleSequence(cfg, params, num_blocks=len(ids) // BLOCK_SIZE + 2, backend="reference")
    pieces = [seq.run(ids[:7]), seq.run(ids[7:20])] + [seq.run(ids[i:i + 1]) for i in range(20, 30)]
    np.testing.assert_allclose(np.concatenate(pieces), ref, atol=TOL, rtol=0)


def test_training_forward_of_the_registered_family_matches_the_dense_reference(gptj_dir, dense):
    # jaxllm.models.dense.dense_forward runs any family's layers through LayerContext.attend's contract, so a
    # registered architecture can be trained against the pytree the engine serves.
    from jaxllm.models.dense import dense_forward

    cfg, params, _ = load_model(gptj_dir)
    ids = np.random.default_rng(4).integers(3, 500, size=(2, 24))
    got = np.asarray(dense_forward(params, jnp.asarray(ids, jnp.int32), cfg=cfg))
    for row in range(2):
        np.testing.assert_allclose(got[row], dense(ids[row]), atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def llm(gptj_dir):
    return LLM(model=gptj_dir, **ENGINE)


def test_llm_greedy_tokens_and_logprobs_match_the_dense_reference_with_prefix_hits(llm, references):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    first = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    outs = first + llm.generate(PROMPTS[1:], params, use_tqdm=False)
    assert outs[1].num_cached_tokens == 32  # two blocks of the shared prefix, computed by the first request
    for out, (tokens, rows) in zip(outs, references):
        assert list(out.outputs[0].token_ids) == tokens
        for step, (chosen, row) in enumerate(zip(out.outputs[0].logprobs, rows)):
            got = {token: lp.logprob for token, lp in chosen.items()}
            np.testing.assert_allclose(list(got.values()), row[list(got)], atol=TOL, rtol=0, err_msg=f"step {step}")


def test_preempted_requests_of_the_registered_model_keep_the_dense_reference_tokens(gptj_dir, dense):
    # Three 14-token prompts take a block each; growing past 16 tokens, they need six of the four usable blocks.
    prompts = np.random.default_rng(11).integers(3, 500, size=(3, 14)).tolist()
    llm = LLM(model=gptj_dir, **{**ENGINE, "max_model_len": 32, "num_kv_blocks": 5})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == [greedy_reference(dense, p)[0] for p in prompts]


def test_registered_model_steps_compile_nothing_after_warm_up(gptj_dir):
    llm = LLM(model=gptj_dir, **{**ENGINE, "precompile": True, "compilation_cache": None})
    runner = llm.engine.runner
    compiled = runner.compile_stats.num_compilations
    rng = np.random.default_rng(5)
    prompts = [SHARED + rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(1, 40, size=6)]
    params = [SamplingParams(temperature=float(t), top_k=int(k), seed=i, max_tokens=int(m), logprobs=2)
              for i, (t, k, m) in enumerate(zip(rng.uniform(0, 1.5, 6), rng.integers(0, 50, 6), rng.integers(1, 30, 6)))]
    llm.generate(prompts, params, use_tqdm=False)
    assert compiled > 0 and runner.compile_stats.num_compilations == compiled


def test_llm_structured_output_constrains_the_registered_model(llm):
    choices = ["Once upon a time", "The end"]
    out = llm.generate("x", SamplingParams(temperature=0, max_tokens=20,
                                           structured_outputs=StructuredOutputsParams(choice=choices)),
                       use_tqdm=False)[0]
    assert out.outputs[0].text in choices


def test_family_param_axes_shard_its_own_leaves_and_undeclared_ones_are_replicated(gptj_dir):
    cfg, params, _ = load_model(gptj_dir)
    specs = ModelSharding(cfg, make_mesh(1)).param_specs(params)
    assert specs["layers"]["w_fc"] == P(None, None, "model") and specs["layers"]["w_proj"] == P(None, "model", None)
    assert specs["layers"]["wq"] == P(None, None, "model")  # a shared key keeps PARAM_AXES' rule
    assert specs["layers"]["ln_bias"] == P(None, None) and specs["final_norm_bias"] == P(None)


def test_int8_weight_quantization_covers_the_shared_projection_names_only(gptj_dir):
    _, params, _ = load_model(gptj_dir, quantization="int8")
    layers = params["layers"]
    assert sorted(k for k in layers if k.endswith("_scale")) == ["wk_scale", "wo_scale", "wq_scale", "wv_scale"]
    assert layers["wq"].dtype == np.int8 and layers["w_fc"].dtype == np.float32
    assert "lm_head_scale" in params


@pytest.fixture
def isolated_registry(monkeypatch):
    """The registry as it is, restored after the test."""
    monkeypatch.setattr(registry, "_REGISTERED", dict(registry._REGISTERED))
    monkeypatch.setattr(registry, "_IMPORTED", dict(registry._IMPORTED))


@pytest.mark.parametrize("axes", [("embed",), ("embed", "hidden")])
def test_param_axes_that_do_not_fit_the_leaf_are_named(isolated_registry, gptj_dir, axes):
    register_model("bad_axes", dataclasses.replace(gptj.FAMILY, param_axes={"w_fc": axes}))
    cfg, params, _ = load_model(gptj_dir)
    sharding = ModelSharding(dataclasses.replace(cfg, model_type="bad_axes"), make_mesh(1))
    with pytest.raises(ValueError, match=r"Family.param_axes\['w_fc'\]=.* shape \(64, 160\)"):
        sharding.param_specs(params)


def test_model_type_registered_without_architectures_is_chosen_by_model_type(isolated_registry):
    register_model("plain_named", dataclasses.replace(gptj.FAMILY, hf_config=None))
    hf = {"model_type": "plain_named", "architectures": ["SomethingForCausalLM"], "vocab_size": 32,
          "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2}
    cfg = ModelConfig.from_hf_config(hf)
    assert (cfg.model_type, cfg.architecture, cfg.head_dim) == ("plain_named", "SomethingForCausalLM", 8)


@pytest.mark.parametrize("missing", ["n_embd", "n_layer", "vocab_size"])
def test_registered_config_without_a_required_field_names_it(gptj_dir, missing):
    hf = {k: v for k, v in gptj.HF_CONFIG.items() if k != missing}
    named = {"n_embd": "'hidden_size'", "n_layer": "'num_hidden_layers'",
             "vocab_size": "'vocab_size'"}[missing]
    with pytest.raises(ValueError, match=f"lacks \\[{named}\\]"):
        ModelConfig.from_hf_config(hf)


@pytest.mark.parametrize(("args", "message"), [
    (("llama", gptj.FAMILY), "other than the built-in"),
    (("", gptj.FAMILY), "non-empty string"),
    (("mine", "tests.custom_model_gptj"), "import string 'module:attr'"),
    (("mine", gptj.HF_LAYER_NAMES), "must be a jaxllm.models.Family"),
])
def test_register_model_refuses_bad_arguments(isolated_registry, args, message):
    with pytest.raises(ValueError, match=message):
        register_model(*args)


def test_register_model_refuses_an_architecture_another_model_type_runs(isolated_registry, gptj_dir):
    with pytest.raises(ValueError, match="'LlamaForCausalLM' already runs model_type 'llama'"):
        register_model("mine", gptj.FAMILY, hf_architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=f"'{gptj.ARCHITECTURE}' already runs model_type '{gptj.MODEL_TYPE}'"):
        register_model("mine", gptj.FAMILY, hf_architectures=[gptj.ARCHITECTURE])


def test_import_string_that_does_not_import_or_is_no_family_is_named_on_use(isolated_registry):
    register_model("broken", "tests.no_such_module:FAMILY", hf_architectures=["BrokenForCausalLM"])
    hf = {"architectures": ["BrokenForCausalLM"], "model_type": "broken"}
    with pytest.raises(ValueError, match="registered as 'tests.no_such_module:FAMILY', which does not import"):
        ModelConfig.from_hf_config(hf)
    register_model("not_family", "tests.custom_model_gptj:HF_CONFIG")
    cfg = dataclasses.replace(read_model_config(ROOT / "tests/fixtures/stories260K")[0], model_type="not_family")
    with pytest.raises(ValueError, match="a dict, not a jaxllm.models.Family"):
        family(cfg)


def test_family_object_of_an_importable_module_crosses_to_core_processes_by_its_import_string(gptj_dir):
    sent = json.loads(registry.registrations_json())
    assert [gptj.MODEL_TYPE, gptj.IMPORT_STRING, [gptj.ARCHITECTURE]] in sent


def test_family_object_defined_in_main_is_refused_for_core_processes(isolated_registry):
    def layer(w, x, kv, ctx):
        return x, kv

    layer.__module__ = "__main__"
    register_model("from_main", Family(hf_layer_names={}, layer_keys=lambda cfg: set(), layer=layer))
    with pytest.raises(ValueError, match="register_model\\('from_main', ...\\).*not an attribute of an importable"):
        registry.registrations_json()
    with pytest.raises(ValueError, match="cannot import it"):
        MPClient(ROOT / "tests/fixtures/stories260K", EngineConfig(data_parallel_size=2))


def test_general_plugins_register_once_and_jaxllm_plugins_selects_them(isolated_registry, tmp_path, monkeypatch):
    plugin_dir = write_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(plugin_dir))
    for selected, registered in (("other_plugin", False), ("tiny_gptj", True)):
        registry._REGISTERED.pop(gptj.MODEL_TYPE, None)
        monkeypatch.setattr(registry, "_plugins_loaded", False)
        monkeypatch.setenv(registry.PLUGINS_ENV, selected)
        registry.load_general_plugins()
        assert (registry.registered(gptj.MODEL_TYPE) is not None) == registered
        assert registry.registered(gptj.MODEL_TYPE) is None or registry.registered(
            gptj.MODEL_TYPE).family == gptj.IMPORT_STRING


def write_plugin(folder):
    """A distribution's metadata on ``folder`` whose ``jaxllm.general_plugins`` entry point is
    ``tests.custom_model_gptj:register`` (what ``pip install`` of a plugin package leaves)."""
    info = folder / "jaxllm_tiny_gptj_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: jaxllm-tiny-gptj-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.PLUGIN_GROUP}]\ntiny_gptj = tests.custom_model_gptj:register\n")
    return folder


# A program that registers the family object, then runs the CLI: the registration reaches the core process only
# as the import string the front end sends it.
LAUNCHER = ("import sys, jaxllm; from tests import custom_model_gptj as g; jaxllm.register_model(g.MODEL_TYPE, "
            "g.FAMILY, hf_architectures=[g.ARCHITECTURE]); from jaxllm.entrypoints.cli import main; "
            "sys.exit(main(sys.argv[1:]))")


@pytest.fixture(scope="module", params=["plugin", "registered_by_the_launching_program"])
def server(request, gptj_dir, tmp_path_factory):
    """``jaxllm serve`` of the custom model, whose processes know the architecture only from an entry-point
    plugin, or from a registration in the program that starts the server."""
    plugins = write_plugin(tmp_path_factory.mktemp("plugins"))
    paths = [str(plugins)] if request.param == "plugin" else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [str(ROOT)])}
    env.pop(registry.PLUGINS_ENV, None)
    server = Server(gptj_dir, *engine_flags(**ENGINE), log=tmp_path_factory.mktemp("log") / "server.log", env=env)
    if request.param != "plugin":
        server.argv[1:3] = ["-c", LAUNCHER]
    try:
        yield server.start()
    finally:
        server.stop()


def test_server_completions_of_the_registered_model_match_the_dense_reference(server, gptj_dir, references):
    for prompt, (tokens, rows) in zip(PROMPTS, references):
        body = {"model": str(gptj_dir), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "logprobs": 1, "return_tokens_as_token_ids": True, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        logprobs = reply.json()["choices"][0]["logprobs"]
        got = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
        assert got == tokens
        np.testing.assert_allclose(logprobs["token_logprobs"], rows[np.arange(len(tokens)), tokens], atol=TOL, rtol=0)
