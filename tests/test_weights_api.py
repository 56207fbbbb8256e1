"""The JAX research API (issue 26, items 1-3): an engine over weights in memory (``LLM(params=...)``,
``get_params``), weight updates in place (``update_weights``, ``update_weights_from_path``) and sleep / wake, on
stories260K in float32 (greedy tokens compared exactly, weights bit for bit).

The invariant "after a weight update, no KV computed with the old weights is ever read" is
``test_a_prompt_sent_again_after_an_update_reads_no_kv_of_the_old_weights`` (prefix cache) and
``test_a_request_in_flight_recomputes_its_tokens_with_the_new_weights`` (its own KV).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.core.messages import flatten, unflatten
from jaxllm.frontend.front_end import EngineSleepingError
from jaxllm.loader import load_model
from jaxllm.models import param_layout
from kernels_pallas import ops
from kernels_pallas.ops import HEAD_PANELS
from tests.conftest import STORIES, STORIES_SENTENCE

# One step program (16 tokens, 4 rows), built on first use: once a test has stepped, the count of programs is
# fixed, so any compilation an update or a wake-up caused would show.
ENGINE = dict(max_model_len=128, num_kv_blocks=48, block_size=8, max_num_seqs=4, max_num_batched_tokens=16,
              token_buckets=(16,), precompile=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = ["Once upon a time", "The little dog", STORIES_SENTENCE]


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def _perturbed(host):
    """Weights whose greedy tokens differ from stories260K's: every MLP output projection scaled up."""
    return {**host, "layers": {**host["layers"], "w_down": host["layers"]["w_down"] * 8.0}}


@pytest.fixture(scope="module")
def host():
    """stories260K's weights as host numpy (the loader's tree)."""
    return load_model(STORIES)[1]


@pytest.fixture(scope="module")
def llm():
    return LLM(STORIES, enable_sleep_mode=True, **ENGINE)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy tokens of the folder's weights, before any test updates them."""
    return _tokens(llm)


@pytest.fixture(scope="module")
def perturbed_llm(host):
    """A fresh engine over the perturbed weights: what an updated engine must match."""
    return LLM(STORIES, params=_perturbed(host), **ENGINE)


@pytest.fixture()
def restored(llm, host):
    """The shared engine, put back on the folder's weights after the test (whatever it did)."""
    yield llm
    if llm.is_sleeping():
        llm.engine.abort_request(list(llm.engine.output_processor.requests))
        llm.update_weights(host)
        llm.wake_up()
    llm.update_weights(host)


def _assert_trees_equal(got, want):
    got, want = flatten(jax.device_get(got)), flatten(want)
    assert list(sorted(got)) == list(sorted(want))
    for path in want:
        assert got[path].dtype == want[path].dtype, path
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)


# ----------------------------------------------------------------------------- 1. an engine over weights in memory

def test_an_engine_over_params_in_memory_gives_the_folders_greedy_tokens(perturbed_llm, host, reference):
    # The perturbed engine was built from a tree; given the folder's own tree back, it serves the folder's tokens.
    in_memory = LLM(STORIES, params=host, **ENGINE)
    assert _tokens(in_memory) == reference
    assert _tokens(perturbed_llm) != reference


def test_get_params_gives_the_documented_layout_and_round_trips(llm, host):
    params = llm.get_params()
    layout = param_layout(llm.engine.model_config)
    flat = flatten(params)
    assert {p: (tuple(a.shape), a.dtype) for p, a in flat.items()} == layout
    assert all(isinstance(a, jax.Array) and a.sharding is not None for a in flat.values())
    _assert_trees_equal(params, host)
    # Round trip: an engine built from get_params() runs, and gives back, the same arrays.
    again = LLM(STORIES, params=params, **ENGINE)
    _assert_trees_equal(again.get_params(), host)


def test_params_are_cast_to_the_engine_dtype_as_the_folder_is(host):
    import ml_dtypes

    from_folder = LLM(STORIES, dtype="bfloat16", **ENGINE)
    from_tree = LLM(STORIES, params=host, dtype="bfloat16", **ENGINE)
    assert {a.dtype for a in jax.tree_util.tree_leaves(from_tree.get_params())} == {np.dtype(ml_dtypes.bfloat16)}
    _assert_trees_equal(from_tree.get_params(), jax.device_get(from_folder.get_params()))
    assert _tokens(from_tree) == _tokens(from_folder)
    # On CPU the layer leaves are held as uint16 bits (float_bits_storage): an update converts them on the way in
    # and get_params back, with no step program built.
    assert from_tree.engine.runner.weights.float_bits_storage
    compiled, tokens = from_tree.engine.runner.compile_stats.num_compilations, _tokens(from_tree)
    from_tree.update_weights(_perturbed(host))
    assert _tokens(from_tree) != tokens
    from_tree.update_weights(host)
    assert _tokens(from_tree) == tokens
    _assert_trees_equal(from_tree.get_params(), jax.device_get(from_folder.get_params()))
    assert from_tree.engine.runner.compile_stats.num_compilations == compiled


def test_params_are_quantized_on_the_way_in_as_the_folder_is(host):
    from_folder = LLM(STORIES, quantization="int8", **ENGINE)
    from_tree = LLM(STORIES, params=_perturbed(host), quantization="int8", **ENGINE)
    got = flatten(from_tree.get_params())
    assert got["layers/wq"].dtype == np.int8 and got["layers/wq_scale"].shape == (5, 64)
    assert set(got) == set(param_layout(from_tree.engine.model_config, quantization="int8"))
    # A float update of a quantized engine is quantized on the way in too.
    from_tree.update_weights(host)
    _assert_trees_equal(from_tree.get_params(), jax.device_get(from_folder.get_params()))
    assert _tokens(from_tree) == _tokens(from_folder)
    with pytest.raises(ValueError, match="'layers/wq_scale' is given too"):
        from_tree.update_weights({"layers": {"wq": host["layers"]["wq"], "wq_scale": got["layers/wq_scale"]}})


def test_an_engine_over_a_model_config_alone_takes_token_id_prompts(llm, host, reference):
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    bare = LLM(llm.engine.model_config, params=host, **ENGINE)
    assert bare.get_tokenizer() is None
    assert _tokens(bare, ids) == reference


def test_a_model_config_needs_params_and_one_replica_in_this_process(llm, host):
    cfg = llm.engine.model_config
    with pytest.raises(ValueError, match="pass its weights as params="):
        LLM(cfg, **ENGINE)
    with pytest.raises(ValueError, match="not a ModelConfig"):
        LLM(cfg, params=host, data_parallel_size=2, **ENGINE)


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: {k: v for k, v in t.items() if k != "final_norm"}, "missing leaf 'final_norm' (shape (64,)"),
    (lambda t: {**t, "layers": {**t["layers"], "wq": t["layers"]["wq"][:, :, :32]}},
     "'layers/wq' has shape (5, 64, 32) and dtype float32; the engine expects shape (5, 64, 64)"),
    (lambda t: {**t, "embed": t["embed"].astype(np.int32)}, "'embed' has shape (512, 64) and dtype int32"),
    (lambda t: {**t, "layers": {**t["layers"], "q_norm": t["final_norm"]}}, "'layers/q_norm' is not a parameter"),
])
def test_a_bad_params_tree_is_refused_at_start_up_naming_the_leaf(host, change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(STORIES, params=change(host), **ENGINE)


# ----------------------------------------------------------------------------- 2. weight updates in place

def test_update_weights_changes_outputs_and_updating_back_restores_them_exactly(restored, host, reference,
                                                                                 perturbed_llm):
    compiled = restored.engine.runner.compile_stats.num_compilations
    report = restored.update_weights({"layers": {"w_down": _perturbed(host)["layers"]["w_down"]}})
    assert report["num_leaves"] == 1 and report["num_bytes"] == host["layers"]["w_down"].nbytes
    assert _tokens(restored) == _tokens(perturbed_llm) != reference
    restored.update_weights(host)
    assert _tokens(restored) == reference
    _assert_trees_equal(restored.get_params(), host)
    assert restored.engine.runner.compile_stats.num_compilations == compiled


def _live_bytes():
    """Bytes of the live device buffers, each counted once (arrays may share one)."""
    import gc

    gc.collect()
    return sum({s.data.unsafe_buffer_pointer(): s.data.nbytes
                for a in jax.live_arrays() for s in a.addressable_shards}.values())


def test_an_update_holds_at_most_one_leaf_more_and_lets_the_old_weights_go(restored, host, monkeypatch):
    runner = restored.engine.runner
    largest = max(a.nbytes for a in flatten(host).values())
    seen, set_param = [], runner.weights.set_param

    def watched(path, leaf):  # the new leaf is placed, the old one not yet let go: the peak of the update
        seen.append(_live_bytes())
        set_param(path, leaf)

    monkeypatch.setattr(runner.weights, "set_param", watched)
    before = _live_bytes()
    restored.update_weights(_perturbed(host))
    assert len(seen) == len(flatten(host)) and max(seen) <= before + largest
    assert _live_bytes() == before


@pytest.mark.skipif(not ops.native_kernels(), reason="the lm_head's panels are for the native kernels")
def test_an_update_of_the_tied_embedding_packs_the_lm_heads_panels_again(restored, host, reference):
    runner = restored.engine.runner
    pack = ops.pack_lm_head_panels
    # stories260K ties its [512, 64] float32 embedding: the engine holds it packed for the lm_head too.
    np.testing.assert_array_equal(np.asarray(runner.weights.params[HEAD_PANELS]), np.asarray(pack(host["embed"])))
    compiled = runner.compile_stats.num_compilations
    embed = host["embed"][::-1].copy()  # every token's row moved: the logits move with it
    restored.update_weights({"embed": embed})
    np.testing.assert_array_equal(np.asarray(runner.weights.params[HEAD_PANELS]), np.asarray(pack(embed)))
    assert HEAD_PANELS not in restored.get_params()
    # The greedy tokens of an engine started on that embedding: stale panels would keep the old head's.
    fresh = LLM(STORIES, params={**host, "embed": embed}, **ENGINE)
    assert _tokens(restored) == _tokens(fresh) != reference
    restored.update_weights({"embed": host["embed"]})
    assert _tokens(restored) == reference and runner.compile_stats.num_compilations == compiled


def test_update_weights_takes_device_arrays_and_flat_paths(restored, host, reference, perturbed_llm):
    compiled = restored.engine.runner.compile_stats.num_compilations
    device = jax.device_put(_perturbed(host)["layers"]["w_down"])
    restored.update_weights({"layers/w_down": device})
    assert _tokens(restored) == _tokens(perturbed_llm)
    # Any float dtype is cast to the engine's (float32 here).
    restored.update_weights({"layers/w_down": host["layers"]["w_down"].astype(np.float64)})
    assert _tokens(restored) == reference
    assert restored.engine.runner.compile_stats.num_compilations == compiled


def test_a_prompt_sent_again_after_an_update_reads_no_kv_of_the_old_weights(restored, host, perturbed_llm):
    before = restored.generate([STORIES_SENTENCE], GREEDY, use_tqdm=False)[0]
    cached = restored.generate([STORIES_SENTENCE], GREEDY, use_tqdm=False)[0]
    assert cached.num_cached_tokens > 0 and cached.outputs[0].token_ids == before.outputs[0].token_ids
    restored.update_weights(_perturbed(host))
    after = restored.generate([STORIES_SENTENCE], GREEDY, use_tqdm=False)[0]
    fresh = perturbed_llm.generate([STORIES_SENTENCE], GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == fresh.outputs[0].token_ids != before.outputs[0].token_ids
    assert restored.engine.core.num_free_blocks() == restored.engine.num_blocks - 1


def _step_until(engine, rid, num_tokens):
    tokens = []
    while len(tokens) < num_tokens:
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.outputs[0].delta_token_ids]
    return tokens


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_in_flight_recomputes_its_tokens_with_the_new_weights(host, perturbed_llm, async_scheduling):
    """vLLM's pause: the step in flight finishes with the old weights, the update happens between steps, and the
    request resumes; its tokens after the update are the new weights' continuation of everything before it."""
    llm = LLM(STORIES, params=host, async_scheduling=async_scheduling, **ENGINE)
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=16)
    old = _tokens(llm, [STORIES_SENTENCE], params)[0]
    engine.add_request("r", STORIES_SENTENCE, params)
    reported = _step_until(engine, "r", 5)
    compiled = engine.runner.compile_stats.num_compilations
    assert engine.update_weights(_perturbed(host))["num_preempted"] == 1
    assert engine.runner.compile_stats.num_compilations == compiled
    seq = engine.core.requests["r"].seqs[0]
    num_old = seq.num_output_tokens  # tokens of steps launched before the update, the one in flight included
    assert num_old >= len(reported) and engine.core.num_free_blocks() == engine.num_blocks - 1
    tokens = reported + _step_until(engine, "r", 16 - len(reported))
    assert tokens[:num_old] == old[:num_old]
    prompt = llm.get_tokenizer().encode(STORIES_SENTENCE) + tokens[:num_old]
    continuation = _tokens(perturbed_llm, [prompt], SamplingParams(temperature=0.0, max_tokens=16 - num_old))[0]
    assert tokens[num_old:] == continuation
    assert engine.runner.compile_stats.num_compilations == compiled


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: {"layers": {"wq": t["layers"]["wq"].T}}, "'layers/wq' has shape (64, 64, 5) and dtype float32; "
                                                        "the engine expects shape (5, 64, 64) and dtype float32"),
    (lambda t: {"layers": {"wk": t["layers"]["wk"].astype(np.int8)}}, "'layers/wk' has shape (5, 64, 32) and "
                                                                      "dtype int8"),
    (lambda t: {"lm_head": t["embed"].T}, "'lm_head' is not a parameter of this engine"),
    (lambda t: {"layers": {"wq": t["layers"]["wq"], "w_up": t["layers"]["w_up"][:1]}}, "'layers/w_up' has shape "
                                                                                       "(1, 64, 172)"),
    (lambda t: [t["embed"]], "params must be a dict of arrays"),
])
def test_a_bad_update_is_refused_naming_the_leaf_and_the_old_weights_are_kept(restored, host, reference, change,
                                                                              message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        restored.update_weights(change(_perturbed(host)))
    _assert_trees_equal(restored.get_params(), host)
    assert _tokens(restored) == reference


def test_update_weights_from_path_reads_the_checkpoint(restored, host, reference, tmp_path):
    restored.update_weights(_perturbed(host))
    assert _tokens(restored) != reference
    restored.update_weights_from_path(STORIES)
    assert _tokens(restored) == reference
    with pytest.raises(ValueError, match="config.json"):
        restored.update_weights_from_path(tmp_path)


# ----------------------------------------------------------------------------- 3. sleep and wake

def test_sleep_level_1_frees_the_kv_cache_and_wakes_with_identical_outputs_and_no_compilation(restored, reference):
    runner, core = restored.engine.runner, restored.engine.core
    compiled = runner.compile_stats.num_compilations
    kv_bytes = sum(c.nbytes for c in runner.cache_engine.kv_cache)
    param_bytes = core.param_bytes["total"]
    report = restored.sleep(level=1)[0]
    assert report["level"] == 1 and report["freed_bytes"] == kv_bytes + param_bytes
    assert restored.is_sleeping() and runner.weights.state == "offloaded"
    assert not any(isinstance(c, jax.Array) for c in runner.cache_engine.kv_cache)
    with pytest.raises(EngineSleepingError, match="wake_up"):
        restored.generate(PROMPTS, GREEDY, use_tqdm=False)
    restored.wake_up()
    assert not restored.is_sleeping()
    assert _tokens(restored) == reference
    assert runner.compile_stats.num_compilations == compiled


@pytest.fixture()
def compile_events():
    """Backend compilations in this process while a test runs (JAX's monitoring events)."""
    events: list[str] = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield events
    jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device-arrays"])
@pytest.mark.parametrize("level", [1, 2])
def test_an_update_while_asleep_stays_on_the_host_and_wake_up_places_it_compiling_nothing(
        restored, host, reference, perturbed_llm, compile_events, level, on_device):
    """Issue 56 gap 5: asleep, an update replaces the weights where they live (the host), moving nothing to a
    device (even explicitly: ``disallow_explicit``), and ``get_params`` gives them; ``wake_up`` places them."""
    runner = restored.engine.runner
    # Level 1 keeps a host copy, so a subset will do; level 2 kept nothing, so every leaf is given.
    new = {"layers": {"w_down": _perturbed(host)["layers"]["w_down"]}} if level == 1 else _perturbed(host)
    if on_device:
        new = jax.device_put(new)
    restored.sleep(level=level)
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        report = restored.update_weights(new)
        params = restored.get_params()
    assert report["num_bytes"] == sum(leaf.nbytes for leaf in flatten(new).values())
    assert restored.is_sleeping() and runner.weights.state == "offloaded"
    assert all(isinstance(leaf, np.ndarray) for leaf in flatten(params).values())
    _assert_trees_equal(params, _perturbed(host))
    compiled = runner.compile_stats.num_compilations
    restored.wake_up()
    assert compile_events == [] and runner.compile_stats.num_compilations == compiled
    assert _tokens(restored) == _tokens(perturbed_llm) != reference
    _assert_trees_equal(restored.get_params(), _perturbed(host))


@pytest.mark.parametrize("stored", [dict(dtype="bfloat16"), dict(quantization="int8")], ids=["bf16-bits", "int8"])
def test_an_update_while_asleep_is_held_in_the_stored_form_and_wakes_as_an_update_awake_would(host, stored):
    """bfloat16 held as uint16 bits on CPU, int8 quantized on the way in: an update while asleep ends with the same
    weights and tokens as the same update awake."""
    llm = LLM(STORIES, enable_sleep_mode=True, **stored, **ENGINE)
    llm.update_weights(_perturbed(host))
    awake_params, awake_tokens = jax.device_get(llm.get_params()), _tokens(llm)
    llm.update_weights(host)
    llm.sleep(level=1)
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        llm.update_weights(_perturbed(host))
        _assert_trees_equal(llm.get_params(), awake_params)
    llm.wake_up()
    _assert_trees_equal(llm.get_params(), awake_params)
    assert _tokens(llm) == awake_tokens


def test_an_embedding_given_while_asleep_is_packed_for_the_lm_head_at_wake_up(restored, host, reference):
    embed = host["embed"][::-1].copy()
    restored.update_weights({"embed": embed})
    awake = _tokens(restored)
    restored.update_weights({"embed": host["embed"]})
    restored.sleep(level=1)
    restored.update_weights({"embed": embed})
    restored.wake_up()
    assert _tokens(restored) == awake != reference


def test_get_params_while_asleep_gives_the_host_copy_read_only_and_refuses_when_discarded(restored, host):
    restored.sleep(level=1)
    params = restored.get_params()
    _assert_trees_equal(params, host)
    with pytest.raises(ValueError, match="read-only"):
        params["embed"][0, 0] = 1.0
    restored.sleep(level=2)
    with pytest.raises(RuntimeError, match="discarded"):
        restored.get_params()


def test_sleep_level_2_discards_the_weights_until_an_update_restores_them(restored, host, reference):
    runner = restored.engine.runner
    compiled = runner.compile_stats.num_compilations
    restored.sleep(level=2)
    assert runner.weights.state == "discarded"
    with pytest.raises(ValueError, match="missing leaf 'embed'"):
        restored.update_weights({"layers": host["layers"]})
    # Updated while asleep, then woken: the weights first, then the KV cache.
    restored.update_weights(host)
    assert restored.wake_up(tags=["weights"]) is False and restored.is_sleeping()
    assert restored.wake_up(tags=["kv_cache"]) is True
    assert not restored.is_sleeping() and _tokens(restored) == reference
    # vLLM's order: wake the weights (zeros until updated), update them, then wake the KV cache.
    restored.sleep(level=2)
    restored.wake_up(tags=["weights"])
    with pytest.raises(RuntimeError, match="leaves are zeros"):
        restored.get_params()
    restored.update_weights(host)
    restored.wake_up(tags=["kv_cache"])
    assert _tokens(restored) == reference
    assert runner.compile_stats.num_compilations == compiled


def test_vllms_level_2_order_keeps_an_int8_kv_caches_scales_and_refuses_params_until_every_leaf_is_given(host):
    """The scales calibrated for an int8 KV cache are the engine's, not a trainer's: a level-2 sleep keeps them,
    so an update of the model's own leaves restores the same tokens in either order of calls."""
    llm = LLM(STORIES, enable_sleep_mode=True, kv_cache_dtype="int8", **ENGINE)
    want = _tokens(llm)
    trainer = host  # the loader's tree: no KV scales
    llm.sleep(level=2)
    assert llm.wake_up(tags=["weights"]) is False
    llm.update_weights({"embed": host["embed"]})
    with pytest.raises(RuntimeError, match="leaves are zeros since sleep\\(level=2\\)"):
        llm.get_params()
    llm.update_weights(trainer)
    assert "k_scale" in llm.get_params()["layers"]
    assert llm.wake_up(tags=["kv_cache"]) is True and _tokens(llm) == want
    llm.sleep(level=2)
    llm.update_weights(trainer)  # jaxllm's order: updated while asleep, then woken
    llm.wake_up()
    assert _tokens(llm) == want


def test_sleep_level_2_after_level_1_discards_the_host_copy(restored, host, reference):
    restored.sleep(level=1)
    restored.sleep(level=2)
    assert restored.engine.runner.weights.state == "discarded"
    restored.update_weights(host)
    restored.wake_up()
    assert _tokens(restored) == reference


def _finish(engine):
    """Step ``engine`` until nothing is unfinished; each request's last output."""
    last = {}
    while engine.has_unfinished_requests():
        last.update((out.request_id, out) for out in engine.step())
    return last


@pytest.mark.parametrize("level", [0, 1, 2])
def test_sleep_modes_abort_or_keep_a_queued_request_and_wait_is_refused_with_one(restored, host, reference, level):
    """vLLM's sleep(level, mode) in-process: "abort" finishes it with finish_reason "abort" after the wake-up,
    "keep" runs it after the wake-up to the tokens it would have had, "wait" is refused while one is queued."""
    engine = restored.engine
    engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        restored.sleep(level=level, mode="wait")
    restored.sleep(level=level, mode="keep")
    with pytest.raises(RuntimeError, match="no step runs while the engine is sleeping"):
        engine.step()
    if level == 2:
        restored.update_weights(host)
    assert restored.wake_up() is True and not restored.is_sleeping()
    assert _finish(engine)["busy"].outputs[0].token_ids == reference[0]
    engine.add_request("busy", PROMPTS[0], GREEDY)
    restored.sleep(level=level)
    if level == 2:
        restored.update_weights(host)
    restored.wake_up()
    aborted = _finish(engine)["busy"]
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort" and aborted.outputs[0].token_ids == []
    assert restored.kv_cache_report(block_map=False)["num_used_blocks"] == 1  # the null block alone


def test_release_kv_cache_memory_after_a_level_0_sleep_keeps_the_weights_and_the_kept_request_recomputes(
        restored, reference):
    engine = restored.engine
    with pytest.raises(RuntimeError, match="sleep\\(level=0\\) first"):
        restored.release_kv_cache_memory()
    engine.add_request("busy", PROMPTS[0], GREEDY)
    engine.step()
    restored.sleep(level=0, mode="keep")
    assert restored.release_kv_cache_memory()[0] > 0 and engine.runner.weights.state == "device"
    assert restored.wake_up(tags=["kv_cache"]) is True
    assert _finish(engine)["busy"].outputs[0].token_ids == reference[0]


def test_sleep_refuses_a_bad_level_mode_or_tag(restored):
    with pytest.raises(ValueError, match="level must be 0"):
        restored.sleep(level=3)
    with pytest.raises(ValueError, match="mode='drain'"):
        restored.sleep(mode="drain")
    with pytest.raises(ValueError, match="unknown tags"):
        restored.wake_up(tags=["weigths"])
    assert not restored.is_sleeping()


def test_wake_up_resumes_once_the_memory_is_back_and_scheduling_alone_ends_a_level_0_sleep(restored, reference):
    restored.sleep(level=0)
    assert restored.is_sleeping() and restored.wake_up(tags=["scheduling"]) is True
    restored.sleep(level=1)
    assert restored.wake_up(tags=["scheduling"]) is False and restored.wake_up(tags=["weights"]) is False
    assert restored.wake_up(tags=["kv_cache"]) is True and _tokens(restored) == reference


def test_sleep_resets_the_prefix_cache(restored):
    restored.generate([STORIES_SENTENCE], GREEDY, use_tqdm=False)
    restored.sleep()
    restored.wake_up()
    assert restored.generate([STORIES_SENTENCE], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_trees_cross_the_process_boundary_unchanged(host):
    import ml_dtypes
    import msgspec

    from jaxllm.core.messages import decode_params, encode_params

    tree = {**host, "bf16": host["embed"].astype(ml_dtypes.bfloat16)}
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(encode_params(tree)))
    _assert_trees_equal(unflatten(decode_params(wire)), tree)


def test_sleep_needs_enable_sleep_mode(perturbed_llm):
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        perturbed_llm.sleep()


def test_the_core_process_takes_params_updates_and_sleeps_through_utility_calls(host, reference, perturbed_llm):
    """AsyncLLM's core runs in its own process (MPClient): params are sent at spawn, updates as encoded host
    arrays; get_params comes back as host numpy."""
    import asyncio

    from jaxllm.frontend.async_llm import AsyncLLM

    ids = [perturbed_llm.get_tokenizer().encode(p) for p in PROMPTS]

    async def generate(engine, tag):
        outs = []
        for i, prompt in enumerate(ids):
            async for out in engine.add_request(f"{tag}-{i}", prompt, GREEDY):
                pass
            outs.append(out.outputs[0].token_ids)
        return outs

    async def scenario():
        engine = AsyncLLM(STORIES, params=_perturbed(host), enable_sleep_mode=True, **ENGINE)
        try:
            assert await generate(engine, "a") == _tokens(perturbed_llm)
            _assert_trees_equal(await engine.get_params(), _perturbed(host))
            with pytest.raises(ValueError, match="'layers/wq' has shape"):
                await engine.update_weights({"layers": {"wq": host["layers"]["wq"][:1]}})
            report = await engine.update_weights(jax.device_put(host))
            assert report["num_leaves"] == len(flatten(host))
            assert await generate(engine, "b") == reference
            assert (await engine.sleep(level=2))[0]["freed_bytes"] > 0 and await engine.is_sleeping()
            with pytest.raises(EngineSleepingError):
                engine.add_request("c", ids[0], GREEDY)
            await engine.update_weights_from_path(STORIES)
            await engine.wake_up()
            assert await generate(engine, "d") == reference
        finally:
            engine.shutdown()

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- the scheduler's side of the invariant

@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("reset_at_step", [1, 3, 6])
def test_after_a_prefix_cache_reset_no_kv_written_before_it_is_read(preemption_mode, reset_at_step):
    """The fake runner samples from the KV it reads back; the reset (with the running requests) comes with the
    old KV overwritten by garbage on the device and in the host pool, as new weights make it: any block read from
    before the reset (a prefix hit, a swap-in, a running request's own) would change the tokens."""
    from scheduler import Scheduler, SchedulerConfig
    from tests._scheduler_harness import (FakeRunner, check_block_invariants, make_request, reference_output,
                                          run_until_done, step)

    config = SchedulerConfig(num_blocks=14, block_size=4, max_num_seqs=3, max_num_batched_tokens=12, max_model_len=64,
                             preemption_mode=preemption_mode, num_host_blocks=16 if preemption_mode == "swap" else 0,
                             graceful_degradation=False)
    sched, runner = Scheduler(config), FakeRunner(config)
    prefix = list(range(1, 10))
    requests = [make_request(f"r{i}", prefix + [10 + i], max_tokens=12) for i in range(5)]
    for req in requests:
        sched.add_request(req)
    for _ in range(reset_at_step):
        step(sched, runner)
    preempted = sched.reset_prefix_cache(reset_running_requests=True)
    assert {r.request_id for r in preempted} <= {r.request_id for r in requests} and not sched.running
    assert sched.block_pool.cached == {} and sched.block_pool.num_free_blocks == config.num_blocks - 1
    runner.kv[:], runner.host[:] = -7, -7
    run_until_done(sched, runner, check=check_block_invariants)
    for req in requests:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, req.sampling_params, None, 64)
    assert sched.block_pool.num_free_blocks == config.num_blocks - 1


def test_a_prefix_cache_reset_waits_for_the_step_in_flight():
    from scheduler import Scheduler, SchedulerConfig
    from tests._scheduler_harness import make_request

    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=32))
    sched.add_request(make_request("r", [1, 2, 3]))
    sched.schedule()
    with pytest.raises(RuntimeError, match="has not been applied"):
        sched.reset_prefix_cache()


# ----------------------------------------------------------------------------- checking a tree, by classes of input

def _expected_layout():
    from jaxllm.loader import read_model_config
    from jaxllm.models.config import ModelConfig
    from jaxllm.worker.weights import layout_of

    cfg: ModelConfig = read_model_config(STORIES)[0]
    return layout_of(param_layout(cfg))


_MUTATIONS = ["keep", "drop", "float64", "bfloat16", "int32", "shape", "scalar"]


@pytest.mark.parametrize("partial", [True, False])
def test_prepare_params_refuses_exactly_the_trees_with_a_bad_leaf_and_names_one_of_them(partial):
    from hypothesis import given, settings, strategies as st

    from jaxllm.worker.weights import prepare_params

    expected = _expected_layout()
    paths = list(expected)

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.sampled_from(_MUTATIONS), min_size=len(paths), max_size=len(paths)))
    def check(mutations):
        tree, bad = {}, set()
        for path, mutation in zip(paths, mutations):
            want = expected[path]
            zeros = np.zeros(want.shape, np.float32)
            if mutation == "drop":
                bad |= set() if partial else {path}
                continue
            tree[path] = {"keep": zeros, "float64": zeros.astype(np.float64), "scalar": np.float32(0),
                          "bfloat16": jax.numpy.zeros(want.shape, jax.numpy.bfloat16), "int32": zeros.astype(np.int32),
                          "shape": np.zeros(want.shape[:-1] + (want.shape[-1] + 1,), np.float32)}[mutation]
            bad |= {path} if mutation in ("int32", "shape", "scalar") else set()
        if not bad:
            out = prepare_params(tree, expected, partial=partial)
            assert list(out) == [p for p in paths if p in tree]
            assert all(out[p].shape == expected[p].shape and out[p].dtype == expected[p].dtype for p in out)
            return
        with pytest.raises(ValueError) as refused:
            prepare_params(tree, expected, partial=partial)
        assert any(f"{p!r}" in str(refused.value) for p in bad), (str(refused.value), bad)

    check()


# ----------------------------------------------------------------------------- with a draft model, a quantized KV cache

def test_an_update_of_the_target_keeps_the_draft_model_and_greedy_tokens_exact(host, perturbed_llm):
    """Only the target's weights change; greedy verification keeps the target's tokens whatever the drafts."""
    spec = {"method": "draft_model", "model": str(STORIES), "num_speculative_tokens": 2}
    llm = LLM(STORIES, params=host, speculative_config=spec, enable_sleep_mode=True, **ENGINE)
    draft = flatten(llm.engine.core.drafter.weights.params)
    llm.update_weights(_perturbed(host))
    assert _tokens(llm) == _tokens(perturbed_llm)
    assert all(a is draft[p] for p, a in flatten(llm.engine.core.drafter.weights.params).items())
    llm.sleep(level=1)
    llm.wake_up()
    assert _tokens(llm) == _tokens(perturbed_llm)


def test_an_engine_with_a_quantized_kv_cache_calibrates_given_params_and_keeps_its_scales(host):
    from_folder = LLM(STORIES, kv_cache_dtype="int8", **ENGINE)
    from_tree = LLM(STORIES, params=host, kv_cache_dtype="int8", **ENGINE)
    _assert_trees_equal(from_tree.get_params(), jax.device_get(from_folder.get_params()))
    assert _tokens(from_tree) == _tokens(from_folder)
    scales = jax.device_get(from_tree.get_params()["layers"]["k_scale"])
    from_tree.update_weights(_perturbed(host))
    np.testing.assert_array_equal(jax.device_get(from_tree.get_params()["layers"]["k_scale"]), scales)


def test_data_parallel_cores_each_take_the_params_and_every_update(host, reference, perturbed_llm):
    llm = LLM(STORIES, params=_perturbed(host), data_parallel_size=2, enable_sleep_mode=True, **ENGINE)
    try:
        assert _tokens(llm, PROMPTS * 2) == _tokens(perturbed_llm) * 2
        with pytest.raises(ValueError, match="'embed' has shape"):
            llm.update_weights({"embed": host["embed"][:10]})
        llm.update_weights(host)
        assert _tokens(llm, PROMPTS * 2) == reference * 2
        _assert_trees_equal(llm.get_params(), host)
        assert [r["level"] for r in llm.sleep(level=2)] == [2, 2]
        llm.update_weights_from_path(STORIES)
        llm.wake_up()
        assert not llm.is_sleeping() and _tokens(llm, PROMPTS * 2) == reference * 2
    finally:
        llm.engine.shutdown()
