"""OutputText (stop strings, min_tokens, stop-token text, stream hold-back) against a character-by-character reference;
logprob token texts against a decode of the whole context.

Token texts are given directly (a fake detokenizer), so any split of a text
into tokens, including empty pieces (a byte of a split character), and any
grouping of tokens into steps can be tried. The logprob texts use the real
tokenizers: stories260K's SentencePiece and SmolLM2's byte-level BPE.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from jaxllm.core.messages import EngineCoreOutput, EngineCoreRequest, SampleLogprobs
from jaxllm.frontend.output_processor import OutputProcessor, OutputText, TokenTexts, logprob_entry
from jaxllm.outputs import Logprob
from jaxllm.tokenizer import Tokenizer
from scheduler import RequestOutputKind, SamplingParams


class Pieces:
    """A detokenizer whose token ``i`` decodes to ``pieces[i]``."""

    def __init__(self, pieces):
        self.pieces = pieces

    def step(self, token_id):
        return self.pieces[token_id]


def reference(pieces, stop, include, min_tokens, stopped_by_token=False):
    """(final text, stop string, tokens generated): scan character by
    character; the first character at which some stop string ends, in the
    text of a token past the first ``min_tokens``, ends the text (the longest
    such stop string) and the generation (at that token)."""
    num_tokens = len(pieces)
    if stopped_by_token and not include:
        pieces = pieces[:-1]
    text = ""
    for k, piece in enumerate(pieces, 1):
        for ch in piece:
            text += ch
            hits = [s for s in stop if text.endswith(s)] if k > min_tokens else []
            if hits:
                s = max(hits, key=len)
                return (text if include else text[: len(text) - len(s)]), s, k
    return text, None, num_tokens


def stream(pieces, stop, include, min_tokens, steps, stopped_by_token=False):
    """Feed token ids 0.. in steps of the given sizes, as the engine does.

    Returns (OutputText, deltas, held): held is the unstreamed text after each unfinished step."""
    out = OutputText(Pieces(pieces), SamplingParams(stop=stop, include_stop_str_in_output=include,
                                                    min_tokens=min_tokens, max_tokens=None))
    ids, deltas, held, found = list(range(len(pieces))), [], [], None
    while ids and found is None:
        size = steps[len(deltas) % len(steps)]
        chunk, ids = ids[:size], ids[size:]
        found = out.add_tokens(chunk, stopped_by_token and not ids)
        finished = found is not None or not ids
        deltas.append(out.delta(finished))
        if not finished:
            held.append(out.text[len("".join(deltas)):])
    return out, deltas, held, found


texts = st.text(alphabet="ab .", max_size=4)


@settings(max_examples=600, deadline=None)
@given(pieces=st.lists(texts, min_size=1, max_size=14), stop=st.lists(st.text(alphabet="ab .", min_size=1, max_size=5),
                                                                        min_size=1, max_size=3),
       include=st.booleans(), min_tokens=st.integers(0, 6), steps=st.lists(st.integers(1, 3), min_size=1, max_size=4),
       stopped_by_token=st.booleans())
def test_issue11_stream_deltas_equal_final_text_for_any_split(pieces, stop, include, min_tokens, steps,
                                                              stopped_by_token):
    """The kind behind issue 11 items 1-3: whatever the stop strings, the
    token split, the steps, include_stop_str_in_output and min_tokens, the
    deltas add up to the final text, which is the reference's; and only text
    that may still begin a stop string is held back."""
    out, deltas, held, found = stream(pieces, stop, include, min_tokens, steps, stopped_by_token)
    text, expected_stop, _ = reference(pieces, stop, include, min_tokens, stopped_by_token)
    assert (out.text, found) == (text, expected_stop)
    assert "".join(deltas) == out.text
    for tail in held:
        assert tail == "" or (not include and any(len(s) > len(tail) and s.startswith(tail) for s in stop))


def test_issue11_reported_stop_string_is_held_back_until_cut():
    """Item 1's input as token texts (stories260K's greedy tokens): the
    stream never shows "little gir" before the stop string cuts it."""
    pieces = [",", " there", " was", " a", " little", " g", "ir", "l", " named"]
    out, deltas, _, found = stream(pieces, ["little girl"], False, 0, [1])
    assert found == "little girl" and out.text == ", there was a "
    assert deltas == [",", " there", " was", " a", " ", "", "", ""]
    assert "".join(deltas) == out.text


def test_issue11_stop_string_inside_min_tokens_does_not_stop():
    """Item 2's input as token texts: the first token is ","; with
    min_tokens=1 only a "," in a later token stops."""
    pieces = [",", " there", " was", ",", " a"]
    out, deltas, _, found = stream(pieces, [","], False, 1, [1])
    assert found == "," and out.text == ", there was"
    assert out.num_tokens == 4
    out, _, _, found = stream(pieces, [","], False, 0, [1])
    assert found == "," and out.text == ""


def test_a_stop_string_may_begin_in_the_text_of_the_first_min_tokens():
    """vLLM's window: a match must end past the first min_tokens tokens' text, it may begin in it."""
    out, _, _, found = stream(["x a", "b c"], ["ab"], False, 1, [1])
    assert found == "ab" and out.text == "x "


def test_the_first_stop_string_to_end_wins_whatever_the_split():
    for pieces in (["xabc"], ["x", "a", "b", "c"], ["xa", "bc"]):
        out, _, _, found = stream(pieces, ["abc", "b"], False, 0, [1])
        assert (out.text, found) == ("xa", "b")


def test_issue11_stop_token_text_left_out_unless_included():
    """Item 3: the eos / stop_token_ids token that ended the sequence adds no
    text unless include_stop_str_in_output."""
    pieces = [",", " Lily", "."]
    for include, text in ((False, ", Lily"), (True, ", Lily.")):
        out, deltas, _, _ = stream(pieces, [], include, 0, [1], stopped_by_token=True)
        assert out.text == "".join(deltas) == text
        assert out.num_tokens == (3 if include else 2)


def test_a_model_without_tokenizer_has_empty_text():
    out = OutputText(None, SamplingParams(stop=["a"]))
    assert out.add_tokens([1, 2, 3]) is None and out.delta(True) == "" and out.text == ""


def test_logprob_entry_puts_the_chosen_token_first_and_ranks_the_top_1_to_k():
    decode = TokenTexts(None)
    entry = logprob_entry(7, -3.0, 12, np.array([4, 5]), np.array([-0.1, -0.2]), decode)
    assert list(entry) == [7, 4, 5]
    assert entry == {7: Logprob(-3.0, 12, None), 4: Logprob(-0.1, 1, None), 5: Logprob(-0.2, 2, None)}
    among = logprob_entry(5, -0.2, 2, np.array([4, 5]), np.array([-0.1, -0.2]), decode)
    assert list(among) == [5, 4] and among[5] == Logprob(-0.2, 2, None)


# ---- logprob token texts (issue 25, item 3) ---------------------------------------------------------------------


def contribution(tokenizer, context, token_id, skip_special_tokens=True):
    """Reference: the text ``token_id`` adds after all of ``context``: ``decode(context + [id])`` past the text
    of the context up to its last token that did not leave a character split (the tokens after it are not text
    yet: the token completing the character carries them); "" while a character stays split; a special token's
    own text."""
    if token_id in tokenizer.all_special_ids:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    stable = len(context)
    while stable and tokenizer.decode(context[:stable], skip_special_tokens).endswith("\ufffd"):
        stable -= 1
    before = tokenizer.decode(context[:stable], skip_special_tokens)
    after = tokenizer.decode(context + [token_id], skip_special_tokens)
    if after.endswith("\ufffd"):
        return ""
    assert after.startswith(before), (before, after)
    return after[len(before):]


@pytest.fixture(scope="module", params=["stories", "smollm2"])
def tokenizer(request, stories_dir):
    if request.param == "stories":
        return Tokenizer.from_pretrained(stories_dir)
    return Tokenizer.from_gguf(request.getfixturevalue("smollm2_gguf"))


def candidates(tokenizer):
    """Ids to offer at every position: words with and without their word-start mark (SentencePiece's "▁",
    byte-level's "Ġ"), which decode alone to the same text in SentencePiece; lead bytes of split characters
    (byte fallback's "<0xC3>", byte-level's "Ã"); the eos token."""
    pieces = [p for w in ("the", "was", "a", "named") for p in (w, "\u2581" + w, "\u0120" + w)]
    pieces += ["<0xC3>", "<0xF0>", "\u00c3", "\u00f0"]
    ids = [tokenizer.backend.token_to_id(p) for p in pieces]
    return [i for i in ids if i is not None] + [tokenizer.eos_token_id]


def test_issue25_item3_logprob_texts_are_what_each_token_adds_in_context(tokenizer):
    """The kind, for both tokenizer families: each candidate's text at each position, prompt and output, is
    what it adds to the detokenized text after the tokens before it (leading spaces included, split characters
    carried by the token that completes them); the chosen tokens' texts add up to the text; a word with and
    without its word-start mark never shares a text after the text's start."""
    ids = tokenizer.encode("Once upon a time, there was a café named Lily 🤖. The end")
    cut = len(tokenizer.encode("Once upon a time,"))
    prompt, output = ids[:cut], ids[cut:] + [tokenizer.eos_token_id]
    pool = candidates(tokenizer)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(logprobs=len(pool), prompt_logprobs=len(pool), max_tokens=None)
    processor.add_request(EngineCoreRequest("r", prompt, params, [0], [], [], tokenizer.eos_token_id, 0.0), None)

    def row(token_id):
        return SampleLogprobs(token_id, -1.0, 1, pool, [-1.0] * len(pool))

    steps = [output[i: i + 3] for i in range(0, len(output), 3)]  # several tokens a step, as speculation gives
    for k, step in enumerate(steps):
        last = k == len(steps) - 1
        out = EngineCoreOutput("r", 0, step, finish_reason="stop" if last else None,
                               new_logprobs=[row(t) for t in step],
                               new_prompt_logprobs=[row(t) for t in prompt[1:]] if k == 0 else None)
        (final,), _, _ = processor.process_outputs([out])
    completion = final.outputs[0]
    assert final.finished and completion.token_ids == output
    for contexts, entries in ((ids[:cut + p] for p in range(len(output))), completion.logprobs), \
            ((prompt[:j] for j in range(1, len(prompt))), final.prompt_logprobs[1:]):
        for context, entry in zip(contexts, entries):
            assert {t: lp.decoded_token for t, lp in entry.items()} == \
                {t: contribution(tokenizer, context, t) for t in entry}
            if not tokenizer.decode(context):
                continue  # at the text's start SentencePiece drops the mark's space: both add the same
            for w in ("the", "was", "a", "named"):
                bare, *marked = (tokenizer.backend.token_to_id(m + w) for m in ("", "\u2581", "\u0120"))
                for m in marked:
                    if bare is not None and m is not None:
                        assert entry[bare].decoded_token != entry[m].decoded_token
    special = set(tokenizer.all_special_ids)
    texts = [e[t].decoded_token for t, e in zip(output, completion.logprobs) if t not in special]
    assert "".join(texts) == completion.text == " there was a café named Lily 🤖. The end"
    assert "" in texts  # a character split across byte tokens
    prompt_texts = [e[t].decoded_token for t, e in zip(prompt[1:], final.prompt_logprobs[1:]) if t not in special]
    assert tokenizer.decode(prompt[:1]) + "".join(prompt_texts) == tokenizer.decode(prompt)


# ---- the vocabulary is read once (issue 56, gap 1) -------------------------------------------------------------


class _CountingBackend:
    """A ``tokenizers.Tokenizer`` that counts the reads which rebuild the whole vocabulary in tokenizers 0.22."""

    REBUILDING = ("get_vocab_size", "get_vocab", "get_added_tokens_decoder")

    def __init__(self, backend) -> None:
        self._backend, self.calls = backend, {}

    def __getattr__(self, name):
        attr = getattr(self._backend, name)
        if name not in self.REBUILDING:
            return attr

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kwargs)

        return counted


def test_issue56_detokenizing_64_tokens_reads_the_vocabulary_size_once(stories_dir):
    plain = Tokenizer.from_pretrained(stories_dir)
    backend = _CountingBackend(plain.backend)
    tokenizer = Tokenizer(backend, bos_token_id=plain.bos_token_id, eos_token_ids=plain.eos_token_ids,
                          chat_template=None)
    assert backend.calls == {"get_vocab_size": 1, "get_added_tokens_decoder": 1} and tokenizer.vocab_size == 512
    backend.calls.clear()
    ids = tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
                           "park. One day, she saw a big red ball and a small dog. They played all day long in the sun.",
                           add_special_tokens=False)[:64]
    assert len(ids) == 64
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(logprobs=3, prompt_logprobs=3, max_tokens=None)
    processor.add_request(EngineCoreRequest("r", [1], params, [0], [], [], tokenizer.eos_token_id, 0.0), None)
    out = None
    for k, token in enumerate(ids):
        row = SampleLogprobs(token, -1.0, 1, ids[:3], [-1.0] * 3)
        (out,), _, _ = processor.process_outputs([EngineCoreOutput(
            "r", 0, [token], finish_reason="length" if k == len(ids) - 1 else None, new_logprobs=[row])])
    assert out.finished and out.outputs[0].text == tokenizer.decode(ids)
    assert backend.calls == {}


# ---- output_kind: what each step's RequestOutput holds -------------------------------------------------------


@pytest.fixture(scope="module")
def stories_tokenizer(stories_dir):
    return Tokenizer.from_pretrained(stories_dir)


@given(steps=st.lists(st.integers(1, 4), min_size=1, max_size=8), n=st.integers(1, 2),
       stop=st.sampled_from([None, "was", " a"]), with_logprobs=st.booleans(),
       prompt_chunks=st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_output_kinds_hold_the_same_completion_cumulative_as_deltas_or_final_only(
        stories_tokenizer, steps, n, stop, with_logprobs, prompt_chunks):
    """The class: any grouping of tokens into steps (speculation's several a step), ``n`` sequences, stop strings
    (which cut the text and end a sequence before the core does), logprobs and prompt logprobs recorded over
    several prefill steps. Against CUMULATIVE: FINAL_ONLY gives one output, the finished one, equal to
    CUMULATIVE's last; DELTA gives as many outputs, each holding what CUMULATIVE's added, so its texts,
    token ids, logprobs and prompt logprobs concatenate to CUMULATIVE's last."""
    tok = stories_tokenizer
    ids = tok.encode("Once upon a time, there was a girl named Lily. She was a happy girl and she was a good friend")
    prompt, output = ids[:6], ids[6:6 + sum(steps)]
    bounds = np.cumsum([0] + steps).tolist()

    def row(token_id):
        return SampleLogprobs(token_id, -0.5, 1, [token_id, 5], [-0.5, -1.5])

    def core_outputs(k):
        """Step k's outputs: each sequence gets the step's tokens (sequence i shifted by i so they differ)."""
        chunk = np.array_split(np.arange(1, len(prompt)), min(prompt_chunks, len(steps)))
        last = k == len(steps) - 1
        outs = []
        for i in range(n):
            toks = [(t + i) % tok.vocab_size for t in output[bounds[k]: bounds[k + 1]]]
            outs.append(EngineCoreOutput(
                "r", i, toks, finish_reason="length" if last else None,
                new_logprobs=[row(t) for t in toks] if with_logprobs else None,
                new_prompt_logprobs=([row(prompt[j]) for j in chunk[k]] if k < len(chunk) and i == 0
                                     else None) if with_logprobs else None))
        return outs

    runs = {}
    for kind in RequestOutputKind:
        params = SamplingParams(n=n, stop=stop, max_tokens=None, output_kind=kind,
                                logprobs=1 if with_logprobs else None,
                                prompt_logprobs=1 if with_logprobs else None)
        processor = OutputProcessor(tok)
        processor.add_request(EngineCoreRequest("r", prompt, params, list(range(n)), [], [], tok.eos_token_id,
                                                0.0), None)
        got = []
        for k in range(len(steps)):
            if "r" not in processor.requests:
                break
            got += processor.process_outputs(core_outputs(k))[0]
        runs[kind] = got
    cumulative, delta, final = (runs[k] for k in RequestOutputKind)
    last = cumulative[-1]
    assert last.finished and not any(o.finished for o in cumulative[:-1])
    assert len(final) == 1 and final[0].finished
    assert len(delta) == len(cumulative) and delta[-1].finished
    for i, whole in enumerate(last.outputs):
        got = final[0].outputs[i]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason, got.logprobs,
                got.cumulative_logprob) == (whole.text, whole.token_ids, whole.finish_reason,
                                            whole.stop_reason, whole.logprobs, whole.cumulative_logprob)
        # The deltas add up to the whole whatever the kind: FINAL_ONLY's one output holds it all.
        assert (got.delta_text, got.delta_token_ids) == (whole.text, whole.token_ids)
        steps_of = [out.outputs[i] for out in cumulative]
        assert "".join(c.delta_text for c in steps_of) == whole.text
        assert [t for c in steps_of for t in c.delta_token_ids] == whole.token_ids
        parts = [out.outputs[i] for out in delta]
        assert "".join(p.text for p in parts) == whole.text
        assert [t for p in parts for t in p.token_ids] == whole.token_ids
        assert [p.text for p in parts] == [p.delta_text for p in parts]
        assert [p.token_ids for p in parts] == [p.delta_token_ids for p in parts]
        if with_logprobs:
            assert [e for p in parts for e in p.logprobs] == whole.logprobs
            assert parts[-1].cumulative_logprob == whole.cumulative_logprob
    assert final[0].prompt_logprobs == last.prompt_logprobs
    if with_logprobs:
        assert [e for out in delta for e in out.prompt_logprobs] == last.prompt_logprobs
    else:
        assert last.prompt_logprobs is None and all(out.prompt_logprobs is None for out in delta)


def test_output_kind_other_than_a_request_output_kind_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"SamplingParams.output_kind=2 .*RequestOutputKind"):
        SamplingParams(output_kind=2)
