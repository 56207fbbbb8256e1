"""What the engine returns, end to end (issue 11 items 1, 2, 3, 5, 8): streamed text vs final text, stop strings
under min_tokens, the stopping token's text, bad words in both spellings, vLLM-shaped logprobs and
num_cached_tokens.

References: the same request without stop strings (seeded, so its tokens do not depend on the batch), cut by
``tests.test_output_processor.reference`` (character by character); HF transformers' float32 logits for logprobs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.outputs import Logprob
from jaxllm.frontend.input_processor import bad_words_token_ids
from tests.test_output_processor import contribution, reference

PROMPT = "Once upon a time"
_ids = itertools.count()


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(model=stories_dir, precompile=False)


def run(engine, requests):
    """Add (prompt, params) requests and step until all finish; per request, its outputs in order."""
    ids = [f"r{next(_ids)}" for _ in requests]
    for rid, (prompt, params) in zip(ids, requests):
        engine.add_request(rid, prompt, params)
    outs = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return [outs[rid] for rid in ids]


def assert_stream_adds_up(steps):
    """Every completion's deltas add up to its final text and token ids."""
    final = steps[-1]
    assert final.finished and not any(s.finished for s in steps[:-1])
    for i, completion in enumerate(final.outputs):
        assert "".join(s.outputs[i].delta_text for s in steps) == completion.text
        assert sum((s.outputs[i].delta_token_ids for s in steps), []) == completion.token_ids
    assert "".join(s.delta_text for s in steps) == final.outputs[0].text


def token_pieces(steps):
    """Per completion of an unstopped stream: (token ids, the text each token added)."""
    result = []
    for i in range(len(steps[-1].outputs)):
        rows = [s.outputs[i] for s in steps if s.outputs[i].delta_token_ids]
        assert all(len(r.delta_token_ids) == 1 for r in rows)
        result.append(([r.delta_token_ids[0] for r in rows], [r.delta_text for r in rows]))
    return result


def stop_sweep(pieces, every=3, lengths=(1, 2, 4, 7, 11)):
    """Stop strings cut out of a text around its token boundaries (each split
    differently across tokens), and near misses (a real prefix, then a
    character the text lacks) that must be held back and then released."""
    text = "".join(pieces)
    bounds = np.cumsum([len(p) for p in pieces])[:-1]
    stops = []
    for b in bounds[1::every]:
        stops += [text[max(b - n // 2, 0): max(b - n // 2, 0) + n] for n in lengths]
        stops.append(text[max(b - 3, 0): b + 2] + "\u00a7")
    stops = [s for s in dict.fromkeys(stops) if s]
    # Some requests carry several stop strings at once.
    return [[s] for s in stops] + [stops[i: i + 3] for i in range(0, len(stops), 7)]


def check_against_reference(llm, params, make_stop_lists, min_tokens=0):
    """Run ``params`` without stop strings, then once per stop list (made
    from the first completion's token texts) with ``min_tokens``, streamed:
    deltas add up, and each completion is the unstopped one cut where the
    reference says. Returns how many completions a stop string ended."""
    engine = llm.engine
    completions = token_pieces(run(engine, [(PROMPT, params)])[0])
    stop_lists = make_stop_lists(completions[0][1])
    requests = [(PROMPT, SamplingParams(**{**vars(params), "stop": stops, "min_tokens": min_tokens}))
                for stops in stop_lists]
    num_stopped = 0
    for stops, steps in zip(stop_lists, run(engine, requests)):
        assert_stream_adds_up(steps)
        for (ids, pieces), out in zip(completions, steps[-1].outputs):
            text, stop, num_tokens = reference(pieces, stops, params.include_stop_str_in_output, min_tokens)
            assert (out.text, out.stop_reason, out.token_ids) == (text, stop, ids[:num_tokens]), stops
            num_stopped += stop is not None
    return num_stopped


def test_issue11_stream_does_not_leak_start_of_stop_string(llm):
    """The reported input: the stream used to spell ", there was a little gir"."""
    params = SamplingParams(temperature=0, max_tokens=40, stop=["little girl"])
    steps = list(llm.generate_stream(PROMPT, params))
    assert steps[-1].outputs[0].text == ", there was a "
    assert "".join(s.delta_text for s in steps) == ", there was a "
    assert steps[-1].outputs[0].stop_reason == "little girl"
    assert_stream_adds_up(steps)


def test_generate_builds_final_outputs_only_and_leaves_the_callers_params_alone(llm, monkeypatch):
    """``generate`` asks for FINAL_ONLY (vLLM's LLM does): across its steps the output processor builds one
    ``RequestOutput`` per request, the finished one, equal to a cumulative stream's last; the caller's
    ``SamplingParams`` keep their kind; a stream keeps it too (one output a step); None in a list is the defaults."""
    from jaxllm.frontend.output_processor import OutputProcessor
    from scheduler import RequestOutputKind

    made = []
    make = OutputProcessor._make_output

    def counted(self, state, finished):
        made.append(finished)
        return make(self, state, finished)

    monkeypatch.setattr(OutputProcessor, "_make_output", counted)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    final = llm.generate([PROMPT, "One day"], params, use_tqdm=False)
    assert made == [True, True] and params.output_kind is RequestOutputKind.CUMULATIVE
    made.clear()
    steps = [out for out in llm.generate_stream(PROMPT, params) if out.request_id]
    assert len(made) == len(steps) >= 12 and made[-1] and not any(made[:-1])
    assert (final[0].outputs[0].text, final[0].outputs[0].token_ids) == (steps[-1].outputs[0].text,
                                                                         steps[-1].outputs[0].token_ids)
    defaults = llm.generate([PROMPT, PROMPT], [params, None], use_tqdm=False)
    assert defaults[1].finished and 1 <= len(defaults[1].outputs[0].token_ids) <= SamplingParams().max_tokens


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_issue11_stream_deltas_equal_final_text(llm, n, include):
    """Item 1's kind: stop strings of any length, split across tokens anywhere, near misses, several per
    request, include_stop_str_in_output on and off, n = 1 and 3."""
    params = SamplingParams(n=n, temperature=0.9, seed=5, max_tokens=40, include_stop_str_in_output=include)
    assert check_against_reference(llm, params, stop_sweep) > 20


def test_issue11_stop_string_inside_min_tokens_does_not_stop(llm):
    """The reported input: the first token is ","; min_tokens=1 must not let it stop."""
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=[","], min_tokens=1),
                       use_tqdm=False)[0].outputs[0]
    full = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert full.text.startswith(",") and full.text.count(",") == 1
    assert (out.text, out.finish_reason, out.token_ids) == (full.text, "length", full.token_ids)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("min_tokens", [1, 4, 9])
def test_issue11_min_tokens_stop_string_sweep(llm, min_tokens, include):
    """Item 2's kind: stop strings inside, across and after the text of the first min_tokens tokens."""
    params = SamplingParams(temperature=0, max_tokens=40, include_stop_str_in_output=include)

    def stop_lists(pieces):
        early = "".join(pieces[:min_tokens])
        return [[early[i: i + n]] for i in range(len(early)) for n in (1, 3)] + stop_sweep(pieces, every=4)
    assert check_against_reference(llm, params, stop_lists, min_tokens) > 10


def test_issue11_stop_token_text_left_out_unless_included(llm):
    """The reported input: stop_token_ids=[426] ('.') used to leave the '.' in the text."""
    for include, text in ((False, ", there was a little girl named Lily"),
                          (True, ", there was a little girl named Lily.")):
        params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[426],
                                include_stop_str_in_output=include)
        steps = list(llm.generate_stream(PROMPT, params))
        out = steps[-1].outputs[0]
        assert (out.text, out.token_ids[-1], out.stop_reason, out.finish_reason) == (text, 426, 426, "stop")
        assert_stream_adds_up(steps)


@pytest.mark.parametrize("include", [False, True])
def test_issue11_stop_token_sweep(llm, include):
    """Item 3's kind: every distinct token of the greedy output as the stop token, and eos (forced after
    min_tokens, its text shown by skip_special_tokens=False)."""
    greedy = SamplingParams(temperature=0, max_tokens=40)
    [(ids, pieces)] = token_pieces(run(llm.engine, [(PROMPT, greedy)])[0])
    firsts = {t: p for p, t in reversed(list(enumerate(ids[:30])))}
    requests = [(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[t],
                                        include_stop_str_in_output=include)) for t in firsts]
    for (t, p), steps in zip(firsts.items(), run(llm.engine, requests)):
        out = steps[-1].outputs[0]
        assert (out.token_ids, out.stop_reason) == (ids[: p + 1], t)
        assert out.text == "".join(pieces[: p + 1] if include else pieces[:p])
        assert_stream_adds_up(steps)
    eos = llm.engine.eos_token_ids[0]
    forced = SamplingParams(temperature=0, max_tokens=40, min_tokens=3, logit_bias={eos: 100.0},
                            skip_special_tokens=False, include_stop_str_in_output=include)
    steps = run(llm.engine, [(PROMPT, forced)])[0]
    out = steps[-1].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[:3] + [eos], "stop", None)
    assert out.text == "".join(pieces[:3]) + ("</s>" if include else "")
    assert_stream_adds_up(steps)


# ------------------------------------------------------------------ bad words (item 5)

WORDS = ["beautiful", "sunset", "calm", "peaceful", "amazing", "stunning"]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return LLM(model=smollm2_gguf, max_model_len=256, precompile=False)


def contains(seq, sub):
    return any(seq[i: i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_issue11_bad_words_ban_both_variants(smollm2):
    """The reported input: " beautiful" (one token; "beautiful" is two) used to be generated."""
    prompt = "The sunset over the ocean was very"
    spaced = smollm2.tokenizer.encode(" beautiful", add_special_tokens=False)
    plain = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert plain.token_ids[: len(spaced)] == spaced
    out = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=8, bad_words=["beautiful"]),
                           use_tqdm=False)[0].outputs[0]
    assert "beautiful" not in out.text and not contains(out.token_ids, spaced)


@pytest.mark.parametrize("model, num_differing", [("smollm2", 6), ("stories", 1)])
def test_issue11_bad_words_token_ids_have_both_variants(model, num_differing, request):
    """Each word is banned bare and after a space, whatever the two token counts. SmolLM2 (byte-level BPE)
    spells the six WORDS in two tokens bare and one spaced; stories260K's normalizer prepends the "▁" itself,
    so its two spellings coincide (kept once) except for a word that starts with a literal "▁"."""
    tokenizer = request.getfixturevalue("smollm2" if model == "smollm2" else "llm").tokenizer
    words = WORDS + ["x", "!", "Lily", "big red", " ball", "\u2581x"]
    differing = 0
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        assert bad_words_token_ids(tokenizer, [word]) == ([plain, spaced] if spaced != plain else [plain])
        differing += len(plain) != len(spaced)
    assert differing == num_differing


def test_issue11_bad_words_never_generated_in_either_spelling(smollm2):
    """Item 5's kind: prompts that make SmolLM2 repeat a word after a space and at a line start; banned,
    neither spelling (of different token counts) appears in the output tokens."""
    tokenizer = smollm2.tokenizer
    prompts = [p for w in WORDS for p in (" ".join([w] * 6), "\n".join([w] * 5) + "\n")]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    free = smollm2.generate(prompts, greedy, use_tqdm=False)
    banned = smollm2.generate(prompts, [SamplingParams(temperature=0, max_tokens=8, bad_words=[w])
                                        for w in WORDS for _ in range(2)], use_tqdm=False)
    for i, word in enumerate(WORDS):
        plain = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        assert len(plain) != len(spaced)
        # Unbanned, the prompts do make the model write the word in each spelling.
        assert contains(free[2 * i].outputs[0].token_ids, spaced)
        assert contains(free[2 * i + 1].outputs[0].token_ids, plain)
        for out in banned[2 * i: 2 * i + 2]:
            assert not contains(out.outputs[0].token_ids, spaced) and not contains(out.outputs[0].token_ids, plain)


# ------------------------------------------------------------ vLLM-shaped outputs (item 8)


def test_issue11_num_cached_tokens(llm):
    """Prompt tokens read from the prefix cache: none the first time, the full blocks after; as many as the
    scheduler counts as hits; n > 1 reports its prefill's; prompt_logprobs reads no cache."""
    prompt = list(range(3, 43))  # 40 tokens: two full blocks of 16
    scheduler = llm.engine.scheduler
    greedy = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].num_cached_tokens == 0
    hits = scheduler.prefix_cache_hits
    steps = list(llm.generate_stream([prompt], greedy))
    assert [s.num_cached_tokens for s in steps] == [32] * len(steps)
    assert scheduler.prefix_cache_hits - hits == 32
    assert llm.generate([prompt], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=2),
                        use_tqdm=False)[0].num_cached_tokens == 32
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
                        use_tqdm=False)[0].num_cached_tokens == 0


@pytest.fixture(scope="module")
def hf_stories(stories_dir):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()

    def log_softmax(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1).numpy()
    return log_softmax


def assert_entry_matches_hf(entry, token, k, row, tokenizer, context):
    """vLLM's dict: the token first, then the top k with ranks 1..k; logprobs within 1e-4 of HF; the token's
    rank is HF's count of tokens at least as likely (up to near-ties); decoded_token is what the token adds to
    the text after ``context`` (issue 25 item 3; it was ``decode([id])``, which drops SentencePiece's spaces)."""
    top = np.argsort(-row)[:k].tolist()
    assert list(entry)[0] == token and set(entry) == {token, *top}
    for t, lp in entry.items():
        assert isinstance(lp, Logprob)
        assert abs(lp.logprob - row[t]) < 1e-4
        assert lp.decoded_token == contribution(tokenizer, context, t)
    for rank, t in enumerate(top, 1):
        assert entry[t].rank == rank
    if token not in top:
        lp = row[token]
        assert np.sum(row > lp + 1e-4) < entry[token].rank <= np.sum(row >= lp - 1e-4)


def test_issue11_logprobs_are_logprob_objects(llm, hf_stories):
    params = SamplingParams(temperature=2.0, seed=4, max_tokens=16, logprobs=2, ignore_eos=True)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    rows = hf_stories(out.prompt_token_ids + completion.token_ids)[len(out.prompt_token_ids) - 1: -1]
    assert len(completion.logprobs) == len(completion.token_ids) == 16
    ids = out.prompt_token_ids + completion.token_ids
    for p, (entry, token, row) in enumerate(zip(completion.logprobs, completion.token_ids, rows)):
        assert_entry_matches_hf(entry, token, 2, row, llm.tokenizer, ids[:len(out.prompt_token_ids) + p])
    assert any(entry[t].rank > 2 for entry, t in zip(completion.logprobs, completion.token_ids))
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids)), abs=1e-4)


def test_issue11_prompt_logprobs_are_logprob_objects(llm, hf_stories):
    prompt = "Once upon a time, there was a big dog named Tom. He liked to eat"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    rows = hf_stories(ids)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert_entry_matches_hf(out.prompt_logprobs[pos], ids[pos], 3, rows[pos - 1], llm.tokenizer, ids[:pos])
    assert any(out.prompt_logprobs[p][ids[p]].rank > 3 for p in range(1, len(ids)))


def test_issue11_get_tokenizer(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer
    assert tokenizer.encode(PROMPT) == [1, 403, 407, 261, 378]


@pytest.mark.parametrize("model", ["stories", "smollm2"])
def test_issue25_item3_generated_logprob_texts_add_up_to_the_text(model, request):
    """End to end on SentencePiece (stories260K) and byte-level BPE (SmolLM2): every text of every entry, output
    and prompt, is what its token adds in context; the chosen tokens' texts add up to the output text, the
    prompt tokens' to the prompt."""
    engine = request.getfixturevalue("llm" if model == "stories" else "smollm2")
    tokenizer = engine.tokenizer
    prompt = "Once upon a time, a robot 🤖 named"
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=24, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    out = engine.generate(prompt, params, use_tqdm=False)[0]
    completion, prompt_ids = out.outputs[0], out.prompt_token_ids
    ids = prompt_ids + completion.token_ids
    positions = [(len(prompt_ids) + p, e) for p, e in enumerate(completion.logprobs)]
    for end, entry in positions + list(enumerate(out.prompt_logprobs))[1:]:
        assert {t: lp.decoded_token for t, lp in entry.items()} == \
            {t: contribution(tokenizer, ids[:end], t) for t in entry}
    special = set(tokenizer.all_special_ids)
    texts = [e[t].decoded_token for t, e in zip(completion.token_ids, completion.logprobs) if t not in special]
    assert "".join(texts) == completion.text
    prompt_texts = [out.prompt_logprobs[j][t].decoded_token for j, t in enumerate(prompt_ids) if j and t not in special]
    assert tokenizer.decode(prompt_ids[:1]) + "".join(prompt_texts) == prompt


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [21, 1000, -1, 2.5])
def test_issue11_sampling_params_rejects_logprobs_above_limit_when_built(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}={value}.*\[0, 20\]"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_from_0_to_20_are_accepted(field):
    assert getattr(SamplingParams(**{field: 0}), field) == 0
    assert getattr(SamplingParams(**{field: 20}), field) == 20
