"""Step programs (issue 54). Decode-only steps run programs of their own, so that no conditional sits in the layer
loop: the step programs' jaxprs (Pallas backend, interpret mode) and compiled HLO (the default CPU backend) hold none
inside a loop; greedy tokens are the same with and without the split; no step compiles after warm-up; the count is
logged. A step's host inputs travel as one packed int32 buffer (``StepInputs``), plus the grammar bitmask only when a
row is constrained: transfers counted per dispatch, every field unpacked bit for bit, tokens unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams, StructuredOutputsParams
from jaxllm.sample.sampler import MAX_BANNED_IDS, SamplingArrays
from jaxllm.worker.step_batch import StepBatch, StepInputs
from tests.helpers import counted_dispatches

# Tiny ladders: one decode-only program (T=4) beside the mixed ones (T=4, 16).
PALLAS = dict(attention_backend="pallas", interpret=True, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=64, block_size=8, token_buckets=[4, 16], seq_buckets=[4])
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            jaxpr = getattr(item, "jaxpr", item)
            if hasattr(jaxpr, "eqns"):
                yield jaxpr


def _conds_in_loops(jaxpr, in_loop=False):
    """Names of the ``cond`` equations inside a scan or while body of ``jaxpr``, Pallas kernels' bodies not entered
    (a kernel's branches are the kernel's own, compiled into it)."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "cond" and in_loop:
            found.append(str(eqn)[:200])
        if name == "pallas_call":
            continue
        for sub in _subjaxprs(eqn):
            found += _conds_in_loops(sub, in_loop or name in ("scan", "while"))
    return found


def _pallas_kernels(jaxpr):
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(str(eqn.params.get("name_and_src_info", eqn.params.get("name", ""))))
        for sub in _subjaxprs(eqn):
            names += _pallas_kernels(sub)
    return names


@pytest.fixture(scope="module")
def pallas_llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, precompile=True, **PALLAS)


def test_every_pallas_step_program_has_no_conditional_in_a_loop(pallas_llm):
    programs = pallas_llm.engine.runner.programs
    table = pallas_llm.engine.buckets
    assert table.all_programs() == [(4, 4, 8, False), (4, 4, 8, True), (16, 4, 8, False)]
    for program in table.all_programs():
        jaxpr = programs.trace(program).jaxpr.jaxpr
        assert _conds_in_loops(jaxpr) == [], program
        assert _conds_in_loops(jaxpr, in_loop=True)  # the walk sees the sampler's conds, outside the loop
        kernels = " ".join(_pallas_kernels(jaxpr))
        # The decode-only program attends with the decode kernel alone, the mixed ones with the ragged kernel alone.
        assert ("ragged" in kernels) != program[3], (program, kernels)


def test_decode_only_programs_give_the_mixed_programs_greedy_tokens(pallas_llm, tiny_llama_dir, monkeypatch):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (1, 5, 9, 3)]
    runner = pallas_llm.engine.runner
    dispatched = []
    step_program = runner.programs.step_program
    monkeypatch.setattr(runner.programs, "step_program", lambda p: dispatched.append(p) or step_program(p))
    before = runner.compile_stats.num_compilations
    with counted_dispatches(runner) as records:
        split = [o.outputs[0].token_ids for o in pallas_llm.generate(prompts, GREEDY)]
    assert runner.compile_stats.num_compilations == before  # none after warm-up
    assert (4, 4, 8, True) in dispatched and (16, 4, 8, False) in dispatched
    # Decode-only and mixed programs alike: the packed inputs in one transfer.
    assert {(4, 4, 8, True), (16, 4, 8, False)} <= {program for program, *_ in records}
    assert {puts for *_, puts in records} == {1}
    monkeypatch.undo()

    # The same engine with no decode-only programs: every decode step through the mixed (ragged) program.
    from jaxllm.core import build
    monkeypatch.setattr(build, "step_buckets", lambda ladders, ops: build.BucketTable(*ladders))
    unsplit_llm = LLM(model=tiny_llama_dir, precompile=False, **PALLAS)
    assert unsplit_llm.engine.buckets.decode_token_buckets == ()
    unsplit = [o.outputs[0].token_ids for o in unsplit_llm.generate(prompts, GREEDY)]
    assert split == unsplit


def test_start_up_logs_the_bounded_program_count(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="jaxllm")
    logging.getLogger("jaxllm").addHandler(caplog.handler)
    try:
        llm = LLM(model=tiny_llama_dir, precompile=False, **PALLAS)
    finally:
        logging.getLogger("jaxllm").removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "step programs" in r.getMessage()]
    assert any(re.match(r"3 step programs \(tokens \[4, 16\], .*; 1 of them for decode-only steps, tokens \[4\]\)",
                        line) for line in lines), lines
    assert len(llm.engine.buckets) == 3


@pytest.fixture(scope="module")
def stories_llm(stories_dir):
    """Mixed steps (T=16) and decode-only steps (T=4, through the mixed programs) of up to four rows."""
    llm = LLM(model=stories_dir, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              token_buckets=[4, 16], seq_buckets=[4])
    llm.engine.runner.programs.wait_for_warmup()
    return llm


def test_default_cpu_step_programs_have_no_conditional_in_a_loop(stories_llm):
    table, programs = stories_llm.engine.buckets, stories_llm.engine.runner.programs
    # The C++ kernel takes every row alike here: no decode-only programs.
    assert table.decode_token_buckets == () and len(table) == 2
    for program in table.all_programs():
        hlo = programs.compile_step(program).as_text()
        assert _hlo_loop_conditionals(hlo) == [], program


def _hlo_loop_conditionals(hlo: str) -> list[str]:
    """Computations reached from a ``while`` op's body (calls followed) that hold a ``conditional``."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    called = re.compile(r"(?:body|condition|calls|to_apply|branch_computations|true_computation|"
                        r"false_computation)=\{?%?([\w.\-]+(?:, %?[\w.\-]+)*)\}?")

    def callees(comp):
        for line in bodies.get(comp, ()):
            for group in called.findall(line):
                yield from (c.strip().lstrip("%") for c in group.split(","))

    loop_bodies = [c for comp in bodies for line in bodies[comp] if " while(" in line
                   for c in re.findall(r"body=%?([\w.\-]+)", line)]
    seen, stack, bad = set(), list(loop_bodies), []
    while stack:
        comp = stack.pop()
        if comp in seen:
            continue
        seen.add(comp)
        if any(" conditional(" in line for line in bodies.get(comp, ())):
            bad.append(comp)
        stack.extend(callees(comp))
    assert loop_bodies, "no while loop found: the HLO parse is off"
    return bad


def _random_inputs(rng, shape, num_rows):
    """A StepBatch and SamplingArrays of bucket ``shape`` filled with random values over each dtype's whole range
    (negative ints, float specials, uint32 words above 2**31, both bools)."""
    t, s, w = shape
    sizes = {"T": t, "S": s, "W": w, "S+1": s + 1}
    info = np.iinfo(np.int32)
    batch = StepBatch(**{f.name: rng.integers(info.min, info.max, tuple(sizes[d] for d in f.metadata["dims"]),
                                              dtype=np.int32, endpoint=True)
                         for f in dataclasses.fields(StepBatch)})
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, 3.4e38], np.float32)

    def fill(v):
        if v.dtype == np.float32:
            return np.where(rng.random(v.shape) < 0.3, rng.choice(specials, v.shape),
                            rng.standard_normal(v.shape) * 1e3).astype(np.float32)
        if v.dtype == np.uint32:
            return rng.integers(0, 1 << 32, v.shape, dtype=np.uint32)
        if v.dtype == np.bool_:
            return rng.random(v.shape) < 0.5
        return rng.integers(info.min, info.max, v.shape, dtype=np.int32, endpoint=True)

    return batch, jax.tree_util.tree_map(fill, SamplingArrays.empty(num_rows))


@pytest.mark.parametrize("shape, num_positions", [((16, 4, 8), 1), ((64, 8, 3), 3), ((1, 1, 1), 1)])
def test_every_field_comes_out_of_the_program_as_it_went_in(shape, num_positions):
    rng = np.random.default_rng(sum(shape) + num_positions)
    t, s, w = shape
    num_rows = s * num_positions
    batch, sampling = _random_inputs(rng, shape, num_rows)
    packed = StepInputs.pack(batch, sampling)
    assert packed.words.dtype == np.int32
    assert packed.words.shape == (5 * t + s * (w + 5) + 2 + num_rows * (15 + MAX_BANNED_IDS),)
    abstract = StepInputs.abstract(shape, num_rows, None)
    assert (abstract.words.shape, abstract.shape, abstract.num_sampling_rows) == (packed.words.shape, shape, num_rows)
    # Unpacked inside a compiled program, as the step does.
    out_batch, out_sampling = jax.jit(StepInputs.unpack)(jax.device_put(packed))
    for want, got in [(batch, out_batch), (sampling, out_sampling)]:
        for f in dataclasses.fields(want):
            a, b = np.asarray(getattr(want, f.name)), np.asarray(getattr(got, f.name))
            assert (a.dtype, a.shape) == (b.dtype, b.shape), f.name
            # Bit for bit: -0.0 and every float special too.
            assert np.array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8)), f.name


def test_a_field_of_another_bucket_is_refused():
    batch, sampling = _random_inputs(np.random.default_rng(0), (16, 4, 8), 4)
    with pytest.raises(ValueError, match=r"seq_lens has shape \(3,\); a step of bucket \(16, 4, 8\)"):
        StepInputs.pack(dataclasses.replace(batch, seq_lens=batch.seq_lens[:3]), sampling)
    with pytest.raises(ValueError, match=r"banned has shape \(4, 3\)"):
        StepInputs.pack(batch, dataclasses.replace(sampling, banned=sampling.banned[:, :3]))


def test_each_dispatch_sends_one_buffer_and_the_bitmask_only_when_a_row_is_constrained(stories_llm):
    runner = stories_llm.engine.runner
    prompts = ["Once upon a time", "The little dog ran to the park and saw a big red ball near the tree"]
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    targets = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    constrained = SamplingParams(temperature=0.0, max_tokens=4,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    before = runner.compile_stats.num_compilations
    with counted_dispatches(runner) as records:
        stories_llm.generate([prompts[0]], plain)
        stories_llm.generate([prompts[1]], targets)
        stories_llm.generate(prompts + [prompts[0]], [plain, plain, constrained])
    assert runner.compile_stats.num_compilations == before
    # (T, has bitmask, has prompt targets): decode-only (T=4) and mixed (T=16) steps, with and without either.
    seen = {(program[0], bitmask, has_targets) for program, bitmask, has_targets, _, _ in records}
    assert {(4, False, False), (16, False, False), (16, False, True), (16, True, False), (4, True, False)} <= seen
    for program, bitmask, _, _, puts in records:
        assert puts == 1 + bitmask, (program, bitmask, puts)


# Regression values: these requests' greedy and seeded tokens, which no change to how a step's inputs travel may alter.
PROMPT_LENGTHS = (3, 21, 9, 1, 14, 30)
GREEDY_TOKENS = [[269, 261, 416, 288, 412, 421, 419, 426], [426, 410, 13, 434, 260, 416, 432, 358],
                 [426, 13, 434, 260, 416, 432, 265, 262], [269, 336, 432, 313, 442, 439, 423, 262],
                 [426, 13, 434, 260, 416, 432, 265, 263], [426, 466, 13, 434, 260, 416, 432, 265]]
SEEDED_TOKENS = [[421, 422, 426, 359, 413, 286, 261, 416], [329, 429, 412, 425, 372, 421, 422, 419],
                 [426, 13, 437, 260, 416, 432, 265, 262], [269, 349, 295, 413, 266, 267, 272, 411],
                 [426, 338, 286, 384, 344, 444, 429, 275], [261, 378, 432, 358, 263, 377, 267, 311]]
SEEDED_LOGPROBS = [-9.4265, -9.80857, -10.00819, -8.65841, -8.12409, -14.83574]


def test_mixed_batches_give_the_tokens_of_unpacked_inputs(stories_llm):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in PROMPT_LENGTHS]
    runner = stories_llm.engine.runner
    before = runner.compile_stats.num_compilations
    greedy = stories_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == GREEDY_TOKENS
    # Every sampling control off its default, and seeds above 2**62: the float, uint32 and bool fields' bits.
    seeded = stories_llm.generate(prompts, [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.02, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.2, seed=(1 << 62) + 12345 + i, max_tokens=8, ignore_eos=True, logprobs=2,
                       min_tokens=4) for i in range(len(prompts))])
    assert [o.outputs[0].token_ids for o in seeded] == SEEDED_TOKENS
    np.testing.assert_allclose([o.outputs[0].cumulative_logprob for o in seeded], SEEDED_LOGPROBS, atol=1e-4)
    assert runner.compile_stats.num_compilations == before
