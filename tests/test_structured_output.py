"""Structured output (JSON schema, regex, choice, Lark and GBNF grammars) enforced in the compiled step.

The default model (SmolLM2-135M-Instruct) serves one batch holding every kind of constraint, greedy and sampled
at temperature 1.0 with seeds, plus unconstrained requests whose tokens must equal a run without the others.
stories260K checks that a constrained request's tokens do not depend on preemption or async scheduling, and
that a grammar failing in the core aborts only its request.
"""

from __future__ import annotations

import ast
import json
import re
import time

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams, StructuredOutputsParams
from jaxllm.core.messages import EngineCoreRequest
from jaxllm.core.requests import CoreRequest, CoreSequence
from jaxllm.structured_output import StructuredOutputManager
from jaxllm.tokenizer import load_tokenizer
from scheduler import SchedulerOutput

jsonschema = pytest.importorskip("jsonschema")

SO = StructuredOutputsParams
# A nested object, an enum, an array and integer ranges; strings are short so that outputs are.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 65},
        "role": {"enum": ["engineer", "manager", "designer"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 2},
        "office": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "floor": {"type": "integer", "minimum": 1,
                                                                               "maximum": 20}},
            "required": ["city", "floor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "skills", "office"],
    "additionalProperties": False,
}
NAMES = ["Alice", "Bob", "Carla", "Dmitri", "Emeka", "Fatima", "Goro", "Hana", "Ivan"]
DATE = r"\d{4}-\d{2}-\d{2}"
EMAIL = r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)"
CHOICES = ["positive", "negative", "neutral"]
# Lark (llguidance's dialect): a context-free language, checked below with Python's own parser.
LARK = r"""
start: expr
expr: term | term " + " term | term " * " term
term: NUMBER | "(" NUMBER " - " NUMBER ")"
NUMBER: /[1-9][0-9]?/
"""
GBNF = r"""
root ::= color (", " color)? (", " color)?
color ::= "red" | "green" | "blue"
"""
GREEDY, SAMPLED = dict(temperature=0.0), dict(temperature=1.0)


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    # Async scheduling on: constrained rows fed by the step in flight make the engine apply that step first.
    return LLM(model=smollm2_gguf, max_model_len=192, max_num_seqs=32, max_num_batched_tokens=512,
               precompile=False, async_scheduling=True)


def _chat(llm, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}])


def _requests(llm) -> dict[str, tuple[str, SamplingParams]]:
    """Name -> (prompt, params) of the mixed batch."""
    reqs = {}
    for i in range(18):
        # Compact JSON (no whitespace between tokens) keeps the outputs, and the test, short.
        reqs[f"json{i}"] = (_chat(llm, f"Describe {NAMES[i % 9]}, a colleague, as JSON."), SamplingParams(
            **(GREEDY if i < 9 else SAMPLED), seed=i, max_tokens=64,
            structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True)))
    reqs["json_n2"] = (_chat(llm, "Describe a new colleague as JSON."), SamplingParams(
        n=2, seed=100, max_tokens=64, structured_outputs=SO(json=json.dumps(SCHEMA), disable_any_whitespace=True)))
    reqs["json_cut"] = (_chat(llm, "Describe Alice as JSON."), SamplingParams(
        **GREEDY, max_tokens=5, structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True)))
    for i, params in enumerate([GREEDY, SAMPLED, SAMPLED]):
        reqs[f"choice{i}"] = (_chat(llm, "Is 'I love this phone!' positive, negative or neutral?"),
                              SamplingParams(**params, seed=i, max_tokens=8, structured_outputs=SO(choice=CHOICES)))
    for i, params in enumerate([GREEDY, SAMPLED]):
        reqs[f"date{i}"] = ("The moon landing happened on ", SamplingParams(
            **params, seed=i, max_tokens=16, structured_outputs=SO(regex=DATE)))
        reqs[f"email{i}"] = ("Contact: ", SamplingParams(
            **params, seed=i, max_tokens=24, structured_outputs=SO(regex=EMAIL)))
        reqs[f"lark{i}"] = ("A sum for a child: ", SamplingParams(
            **params, seed=i, max_tokens=16, structured_outputs=SO(grammar=LARK)))
    reqs["gbnf"] = ("My favourite colors: ", SamplingParams(
        **SAMPLED, seed=7, max_tokens=16, structured_outputs=SO(grammar=GBNF)))
    reqs["date_stop"] = ("The moon landing happened on ", SamplingParams(
        **GREEDY, max_tokens=16, stop=["-"], structured_outputs=SO(regex=DATE)))
    for i, params in enumerate([GREEDY, SAMPLED, SAMPLED]):
        reqs[f"free{i}"] = (["The capital of France is", "Once upon a time", "def fibonacci(n):"][i],
                            SamplingParams(**params, seed=i, max_tokens=16))
    return reqs


@pytest.fixture(scope="module")
def mixed(llm):
    reqs = _requests(llm)
    outs = llm.generate([p for p, _ in reqs.values()], [s for _, s in reqs.values()], use_tqdm=False)
    return reqs, dict(zip(reqs, outs))


def _completions(mixed, prefix: str):
    return [c for name, out in mixed[1].items() if name.startswith(prefix) for c in out.outputs]


def test_twenty_json_outputs_greedy_and_sampled_parse_and_validate_against_the_schema(mixed):
    outputs = [c for c in _completions(mixed, "json") if c not in _completions(mixed, "json_cut")]
    assert len(outputs) == 20
    for c in outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    # The sampled ones differ from each other (the grammar constrains, it does not decide).
    assert len({c.text for c in outputs}) > 10


def test_choice_is_always_one_of_the_choices(mixed):
    texts = [c.text for c in _completions(mixed, "choice")]
    assert len(texts) == 3 and all(t in CHOICES for t in texts)


def test_regex_outputs_full_match(mixed):
    for name, pattern in (("date", DATE), ("email", EMAIL)):
        for c in _completions(mixed, name + "0") + _completions(mixed, name + "1"):
            assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), (name, c.text)


def _arithmetic(node) -> bool:
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)) and _arithmetic(node.left) and _arithmetic(node.right)
    return isinstance(node, ast.Constant) and isinstance(node.value, int)


def test_lark_and_gbnf_grammar_outputs_parse(mixed):
    for c in _completions(mixed, "lark"):
        assert c.finish_reason == "stop" and _arithmetic(ast.parse(c.text, mode="eval").body), c.text
    (gbnf,) = _completions(mixed, "gbnf")
    assert re.fullmatch(r"(red|green|blue)(, (red|green|blue)){0,2}", gbnf.text), gbnf.text


def test_stop_string_and_max_tokens_cut_a_constrained_output(mixed):
    (stopped,) = _completions(mixed, "date_stop")
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", "-")
    assert re.fullmatch(r"\d{4}", stopped.text)
    (cut,) = _completions(mixed, "json_cut")
    # A length finish leaves the JSON incomplete: expected, and reported as "length".
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)


def test_unconstrained_requests_in_the_batch_equal_a_run_without_the_constrained_ones(llm, mixed):
    reqs, outs = mixed
    free = [name for name in reqs if name.startswith("free")]
    alone = llm.generate([reqs[n][0] for n in free], [reqs[n][1] for n in free], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [outs[n].outputs[0].token_ids for n in free]


def test_each_constraint_compiles_once_and_the_metrics_saw_the_bitmask(llm, mixed):
    core = llm.engine.core
    # The schema (as a dict and as JSON text: one grammar), the choices, two regexes, two grammars.
    assert core.structured.num_grammars == 6
    registry = llm.engine.metrics.registry
    assert registry.get_sample_value("jaxllm:grammar_bitmask_seconds_count") > 0
    assert registry.get_sample_value("jaxllm:num_requests_waiting_for_grammar") == 0
    assert core.structured.num_sequences == 0
    assert core.scheduler.block_pool.num_free_blocks == core.num_blocks - 1
    # The chat prompts share the template's system prompt: constrained requests read the prefix cache too.
    assert core.scheduler.prefix_cache_hits > 0


@pytest.mark.parametrize("field, value, words", [
    ("json", {"type": "objekt"}, "Invalid type"),
    ("json", {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "does not exist"),
    ("regex", "[a-", "unclosed character class"),
    ("grammar", "start: foo", "unknown name"),
    ("choice", [], "non-empty list"),
])
def test_invalid_constraint_is_a_value_error_naming_the_field_and_nothing_is_queued(llm, field, value, words):
    with pytest.raises(ValueError, match=rf"(?s)structured_outputs\.{field}.*{words}"):
        llm.generate(["Hello", "Hi"], [SamplingParams(max_tokens=4),
                                       SamplingParams(structured_outputs=SO(**{field: value}))], use_tqdm=False)
    assert not llm.engine.scheduler.requests and not llm.engine.output_processor.requests


def test_exactly_one_constraint_is_required():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"):
        SO()
    with pytest.raises(ValueError, match=r"got \['regex', 'choice'\]"):
        SO(regex="a", choice=["a"])


# ------------------------------------------------------- the manager, alone

def _manager(stories_dir, vocab_size):
    return StructuredOutputManager(lambda: load_tokenizer(stories_dir), vocab_size, [2])


def _seq(request_id):
    """A sequence as the engine core makes one (the manager keeps its grammar on it)."""
    return CoreSequence(CoreRequest(request_id), 0, request_id, [1], SamplingParams())


def _row(request, sample_index=0):
    return SchedulerOutput(requests=[request], samples=np.array([True]), sample_index=np.array([sample_index]))


def _allowed(bitmask, row=0):
    return np.flatnonzero(np.unpackbits(bitmask[row].view(np.uint8), bitorder="little"))


def test_padding_ids_of_a_vocabulary_larger_than_the_tokenizers_are_never_allowed(stories_dir):
    manager = _manager(stories_dir, 600)  # stories260K's tokenizer has 512 ids
    request = _seq("r")
    manager.add(request, manager.compile(SO(regex=r"(.|\n)*")))
    bitmask = manager.bitmask(_row(request), num_rows=4)
    assert bitmask.shape == (4, 19) and bitmask.dtype == np.int32
    allowed = _allowed(bitmask)
    assert 2 in allowed and 300 < len(allowed) and allowed.max() < 512
    assert (bitmask[1:] == -1).all()  # padding rows: everything
    assert manager.bitmask_seconds > 0


def test_equal_constraints_share_one_compile_and_each_sequence_its_own_matcher(stories_dir):
    manager = _manager(stories_dir, 512)
    first = manager.compile(SO(choice=["cat", "dog"]))
    assert manager.compile(SO(choice=["cat", "dog"])) is first
    assert manager.compile(SO(choice=["dog", "cat"])) is not first
    assert manager.num_grammars == 2
    vocab = load_tokenizer(stories_dir).backend.token_to_id
    a, b = _seq("a"), _seq("b")
    for request in (a, b):
        manager.add(request, first)
    a.output_token_ids.extend([vocab("c"), vocab("at")])
    manager.advance([a, b])
    assert _allowed(manager.bitmask(_row(a, len(a.output_token_ids)), 1)).tolist() == [2]  # only eos is left
    assert len(_allowed(manager.bitmask(_row(b), 1))) > 1  # b is still at the start


def test_a_token_the_grammar_rejects_or_a_matcher_out_of_step_raises(stories_dir):
    manager = _manager(stories_dir, 512)
    request = _seq("r")
    manager.add(request, manager.compile(SO(regex="[0-9]+")))
    with pytest.raises(RuntimeError, match="has consumed 0 tokens but the step samples output token 3"):
        manager.bitmask(_row(request, 3), 1)
    request.output_token_ids.append(load_tokenizer(stories_dir).backend.token_to_id("x"))
    with pytest.raises(RuntimeError, match="the grammar rejected sampled token"):
        manager.advance([request])


# --------------------------------------------------------------- stories260K

STORIES_CONSTRAINTS = [
    SO(regex=r"[a-z]{2,8}( [a-z]{2,8}){2,5}\."),
    SO(choice=["cat", "dog", "bird", "fish"]),
    SO(json={"type": "object", "properties": {"n": {"type": "integer"}, "w": {"type": "string", "maxLength": 6}},
             "required": ["n", "w"], "additionalProperties": False}, disable_any_whitespace=True),
    SO(grammar='start: ("la" | "lo" | " ")+ "!"'),
]


def _stories_llm(stories_dir, **kw):
    # Two token buckets (decode steps, 32-token prefills): fewer step programs for each engine to build; what is
    # checked here does not depend on the padding.
    return LLM(model=stories_dir, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, block_size=8,
               num_kv_blocks=14, precompile=False, token_buckets=(8, 32), **kw)


def _stories_batch():
    rng = np.random.default_rng(1)
    prompts, params = [], []
    for i in range(8):
        prompts.append(rng.integers(3, 500, size=int(rng.integers(6, 20))).tolist())
        # Constrained requests arrive last, so they are the ones preempted (FCFS preempts the latest).
        constraint = STORIES_CONSTRAINTS[i % 4] if i >= 2 else None
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=40, n=2 if i == 5 else 1,
                                     ignore_eos=constraint is None, structured_outputs=constraint))
    return prompts, params


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


# One engine of each scheduling mode for the stories260K tests below (each new engine compiles its step programs
# again); each test leaves every block free, which it asserts.
@pytest.fixture(scope="module")
def stories_async(stories_dir):
    return _stories_llm(stories_dir, async_scheduling=True)


@pytest.fixture(scope="module")
def stories_sync(stories_dir):
    return _stories_llm(stories_dir, async_scheduling=False)


@pytest.fixture(scope="module")
def batch_async(stories_async):
    """The outputs of _stories_batch() on the async engine."""
    return stories_async.generate(*_stories_batch(), use_tqdm=False)


def test_constrained_tokens_do_not_depend_on_preemption_or_async_scheduling(stories_sync, batch_async):
    prompts, params = _stories_batch()
    sync = stories_sync
    preempted = sync.engine.scheduler.stats.num_preemptions
    together = sync.generate(prompts, params, use_tqdm=False)
    assert sync.engine.scheduler.stats.num_preemptions > preempted
    alone = [sync.generate([p], s, use_tqdm=False)[0] for p, s in zip(prompts, params)]
    assert _tokens(together) == _tokens(alone)
    assert _tokens(batch_async) == _tokens(together)
    assert any(c.finish_reason == "stop" for o in together[2:] for c in o.outputs)


def test_grammar_failing_in_the_core_aborts_only_its_request(stories_async):
    llm = stories_async
    core = llm.engine.core
    # Past the front end's checks (a regex it would refuse), straight into the core.
    core.add_request(EngineCoreRequest("bad", [5, 6, 7], SamplingParams(structured_outputs=SO(regex="[a-")),
                                       [0], [2], [], 2, 0.0))
    outputs = []
    for _ in range(500):
        outputs += core.step().outputs
        if outputs:
            break
        time.sleep(0.01)
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outputs] == [("bad", "abort", [])]
    assert not core.has_unfinished_requests()
    # The failure is cached with the grammar: the same constraint again is aborted at the next step.
    core.add_request(EngineCoreRequest("again", [5, 6], SamplingParams(structured_outputs=SO(regex="[a-")),
                                       [0], [2], [], 2, 0.0))
    assert [(o.request_id, o.finish_reason) for o in core.step().outputs] == [("again", "abort")]
    good = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(good[0].outputs[0].token_ids) == 4
    assert core.scheduler.block_pool.num_free_blocks == core.num_blocks - 1



def test_speculation_skips_constrained_requests_and_changes_no_tokens(stories_dir, batch_async):
    # The same batch with n-gram speculation: unconstrained sequences verify drafts, constrained ones never get any
    # (their bitmask covers one sampled token per step), and every sequence's tokens equal those without it.
    prompts, params = _stories_batch()
    plain = batch_async
    llm = _stories_llm(stories_dir, speculative_config=dict(method="ngram", num_speculative_tokens=3,
                                                            prompt_lookup_min=1, prompt_lookup_max=3))
    scheduler = llm.engine.core.scheduler
    drafted, update = [], scheduler.update_draft_token_ids

    def record(drafts):
        drafted.extend(scheduler.requests[rid].use_structured_output for rid, ids in drafts.items() if ids)
        update(drafts)

    scheduler.update_draft_token_ids = record
    speculative = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(speculative) == _tokens(plain)
    assert drafted and not any(drafted)
    assert llm.engine.core.stats().spec_num_drafts > 0
    assert scheduler.block_pool.num_free_blocks == llm.engine.core.num_blocks - 1


# ------------------------------------- issue 25 item 5: a finished value ends there

EOS = 2  # stories260K's


def _ends_once_at_eos(completion) -> bool:
    ids = completion.token_ids
    return completion.finish_reason == "stop" and ids.count(EOS) == 1 and ids[-1] == EOS


def test_issue25_item5_finished_choice_stops_at_its_eos_under_min_tokens(stories_async):
    # The report: once "yes" or "no" is complete the grammar allows nothing but EOS, and min_tokens=8 kept the
    # request sampling EOS after EOS until it had 8 tokens.
    llm = stories_async
    choice = SO(choice=["yes", "no"])
    plain, under_min = (llm.generate(["Is the sky blue?"], SamplingParams(temperature=0, max_tokens=20, min_tokens=m,
                                                                          structured_outputs=choice),
                                     use_tqdm=False)[0].outputs[0] for m in (0, 8))
    assert under_min.text in ("yes", "no") and _ends_once_at_eos(under_min), under_min.token_ids
    assert under_min.token_ids == plain.token_ids and under_min.stop_reason is None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_issue25_item5_every_completed_constraint_ends_at_its_eos_whatever_min_tokens_or_ignore_eos(
        request, async_scheduling):
    # The class: every kind of constraint (regex, choice, JSON, Lark) whose value completes before min_tokens, in a
    # state where the grammar allows nothing but EOS; greedy and seeded, n=2, in one batch, with and without
    # async scheduling. Each sequence emits what it emits with neither min_tokens nor ignore_eos, then one EOS.
    rng = np.random.default_rng(25)
    prompts = [rng.integers(3, 500, size=int(rng.integers(4, 12))).tolist() for _ in STORIES_CONSTRAINTS]
    def params(constraint, i, **kw):
        return SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, n=2 if i == 2 else 1, max_tokens=40,
                              structured_outputs=constraint, **kw)
    llm = request.getfixturevalue("stories_async" if async_scheduling else "stories_sync")
    plain = llm.generate(prompts, [params(c, i) for i, c in enumerate(STORIES_CONSTRAINTS)], use_tqdm=False)
    completed = [c for o in plain for c in o.outputs if c.finish_reason == "stop"]
    assert len(completed) >= 4 and all(_ends_once_at_eos(c) for c in completed)
    for kw in (dict(min_tokens=40), dict(ignore_eos=True), dict(ignore_eos=True, min_tokens=40)):
        outs = llm.generate(prompts, [params(c, i, **kw) for i, c in enumerate(STORIES_CONSTRAINTS)], use_tqdm=False)
        for before, after in zip(plain, outs):
            for b, a in zip(before.outputs, after.outputs):
                assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), kw
    assert llm.engine.core.scheduler.block_pool.num_free_blocks == llm.engine.core.num_blocks - 1


def test_issue25_item5_ignore_eos_lifts_the_min_tokens_ban_but_not_the_grammars_end(stories_async):
    # [a-z]+ allows EOS after any letter; a logit bias makes the model take it as soon as it may. min_tokens bans
    # EOS while the grammar allows letters too, so the value grows to min_tokens letters first; under ignore_eos
    # EOS is not banned, and taking it ends the grammar, so the request finishes there ("stop") rather than
    # emitting EOS until max_tokens.
    llm = stories_async
    def run(**kw):
        return llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, logit_bias={EOS: 50.0},
                                                        structured_outputs=SO(regex="[a-z]+"), **kw),
                            use_tqdm=False)[0].outputs[0]
    for kw, num_letters in ((dict(), 1), (dict(min_tokens=5), 5), (dict(ignore_eos=True), 1),
                            (dict(ignore_eos=True, min_tokens=5), 1)):
        out = run(**kw)
        assert _ends_once_at_eos(out) and len(out.token_ids) == num_letters + 1, (kw, out.token_ids)
        assert re.fullmatch("[a-z]+", out.text), (kw, out.text)


def test_issue25_item5_the_manager_reports_a_grammar_that_consumed_its_eos(stories_dir):
    manager = _manager(stories_dir, 512)
    vocab = load_tokenizer(stories_dir).backend.token_to_id
    request = _seq("r")
    manager.add(request, manager.compile(SO(choice=["cat", "dog"])))
    request.output_token_ids.extend([vocab("c"), vocab("at")])
    assert manager.advance([request]) == []  # complete, but the EOS that ends it is not sampled yet
    request.output_token_ids.append(EOS)
    assert manager.advance([request]) == [request]
    assert manager.advance([request]) == []  # reported once: nothing new was consumed
