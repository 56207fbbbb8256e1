"""Decode-only steps run programs of their own, so that no conditional sits in the layer loop (issue 54): the step
programs' jaxprs (Pallas backend, interpret mode) and compiled HLO (the default CPU backend) hold none inside a loop;
greedy tokens are the same with and without the split; no step compiles after warm-up; the count is logged.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams

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
    split = [o.outputs[0].token_ids for o in pallas_llm.generate(prompts, GREEDY)]
    assert runner.compile_stats.num_compilations == before  # none after warm-up
    assert (4, 4, 8, True) in dispatched and (16, 4, 8, False) in dispatched
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


def test_default_cpu_step_programs_have_no_conditional_in_a_loop(stories_dir):
    llm = LLM(model=stories_dir, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              token_buckets=[4, 16], seq_buckets=[4])
    table, programs = llm.engine.buckets, llm.engine.runner.programs
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
