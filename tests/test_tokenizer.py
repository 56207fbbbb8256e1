"""Tokenizer, chat template and incremental detokenizer, checked against transformers."""

import json
import random
import shutil

import gguf
import jinja2
import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from jaxllm.tokenizer import ChatInputError, IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "Once upon a time, there was a little girl named Lily.",
    "a 123 4567 and 3.14159, 1,000,000.00$",
    "  leading and trailing spaces  ",
    "héllo wörld, ß ø ñ Ünïcödé",
    "emoji 🙂🤖 👍🏽 👨‍👩‍👧 done",
    "日本語のテキスト 中文 한국어",
    "def f(x):\n    return x**2\n\n\tprint(f(3))",
    "it's we're I'll they'd",
    "tabs\tand\r\nnewlines\n\n\n",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "日本語で?"}],
]


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def smol_hf(smollm2_gguf):
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def stories(stories_dir):
    return Tokenizer.from_pretrained(stories_dir)


@pytest.fixture(scope="module")
def stories_hf(stories_dir):
    return transformers.AutoTokenizer.from_pretrained(stories_dir)


# ---- Hugging Face folder ------------------------------------------------------------------------

def test_stories_encodes_once_upon_a_time_with_bos(stories):
    assert stories.encode("Once upon a time") == [1, 403, 407, 261, 378]


def test_stories_special_ids_come_from_the_configs(stories):
    assert (stories.bos_token_id, stories.eos_token_id, stories.eos_token_ids) == (1, 2, [2])
    assert stories.vocab_size == 512 and {0, 1, 2} <= set(stories.all_special_ids)


@pytest.mark.parametrize("text", TEXTS)
def test_stories_matches_transformers(stories, stories_hf, text):
    ids = stories.encode(text)
    assert ids == stories_hf.encode(text)
    assert stories.decode(ids) == stories_hf.decode(ids, skip_special_tokens=True)


def test_stories_has_no_chat_template(stories):
    with pytest.raises(ValueError, match="no chat template"):
        stories.apply_chat_template(CHATS[0])


def test_from_pretrained_reads_eos_lists_and_the_template_file(stories_dir, tmp_path):
    shutil.copy(stories_dir / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": "ignored"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}")
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == [2, 0] and tok.eos_token_id == 2
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


def test_from_pretrained_rejects_a_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


# ---- GGUF ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS + ["<|im_start|>user\nhi<|im_end|>\n"])
def test_gguf_encode_matches_transformers(smol, smol_hf, text):
    assert smol.encode(text) == smol_hf.encode(text)


@pytest.mark.parametrize("text", TEXTS + ["<|im_start|>user\nhi<|im_end|>\n"])
@pytest.mark.parametrize("skip", [True, False])
def test_gguf_decode_matches_transformers(smol, smol_hf, text, skip):
    ids = smol_hf.encode(text)
    assert smol.decode(ids, skip_special_tokens=skip) == smol_hf.decode(ids, skip_special_tokens=skip)


def test_gguf_special_ids_match_transformers(smol, smol_hf):
    assert (smol.bos_token_id, smol.eos_token_id) == (smol_hf.bos_token_id, smol_hf.eos_token_id)
    assert smol.vocab_size == len(smol_hf) == 49152
    assert set(smol_hf.all_special_ids) <= set(smol.all_special_ids)
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_matches_transformers(smol, smol_hf, chat, add_generation_prompt):
    expected = smol_hf.apply_chat_template(chat, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
    assert smol.apply_chat_template(chat, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("answer", ["The capital", "The capital  ", "  The capital"])
def test_issue25_continue_final_message_matches_transformers(smol, smol_hf, answer):
    chat = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": answer}]
    expected = smol_hf.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert smol.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True) == expected
    assert expected.endswith(answer)  # nothing after the answer: no end-of-turn token


def test_issue25_continue_final_message_is_refused_where_it_cannot_be_honoured(stories):
    template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    chat = [{"role": "assistant", "content": "once"}]
    with pytest.raises(ValueError, match="cannot both be true"):
        stories.apply_chat_template(chat, continue_final_message=True, chat_template=template)
    with pytest.raises(ValueError, match="does not write the last message's content"):
        stories.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True,
                                    chat_template=template)
    with pytest.raises(ValueError, match="needs a last message with text content"):
        stories.apply_chat_template([{"role": "assistant", "content": " "}], add_generation_prompt=False,
                                    continue_final_message=True, chat_template=template)


def test_issue25_a_chat_template_can_be_given_or_set(stories):
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    chat = [{"role": "user", "content": "hi"}]
    assert stories.apply_chat_template(chat, chat_template=template) == "<s>[user] hi"
    with pytest.raises(ValueError, match="no chat template"):  # given for that call only
        stories.apply_chat_template(chat)
    # With no template there is nothing that failed on the messages: the error says so alone.
    with pytest.raises(ChatInputError, match="^this model has no chat template; format the prompt yourself"):
        stories.render_chat(chat)
    with pytest.raises(ValueError, match="not valid jinja2"):
        stories.apply_chat_template(chat, chat_template="{% for m in messages %}")


def write_sentencepiece_gguf(path, tokenizer_json, with_merges):
    """stories260K's sentencepiece BPE vocabulary as llama.cpp writes one (scores = merge rank)."""
    model = json.loads(tokenizer_json.read_text())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    n_special, n_bytes = 3, 256
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * n_bytes + [1] * (len(tokens) - n_special - n_bytes))
    writer.add_token_scores([0.0] * (n_special + n_bytes)
                            + [-float(i) for i in range(len(tokens) - n_special - n_bytes)])
    if with_merges:
        writer.add_token_merges([" ".join(m) for m in model["merges"]])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("with_merges", [True, False], ids=["merges", "merges-from-scores"])
def test_sentencepiece_gguf_matches_its_tokenizer_json(stories, stories_dir, tmp_path, with_merges):
    path = write_sentencepiece_gguf(tmp_path / "sp.gguf", stories_dir / "tokenizer.json", with_merges)
    tok = Tokenizer.from_gguf(path)
    for text in TEXTS:
        assert tok.encode(text) == stories.encode(text), text
        assert tok.decode(tok.encode(text)) == stories.decode(stories.encode(text)), text


def test_gguf_without_a_known_tokenizer_model_is_named(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "t5.gguf"), "llama")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"t5\.gguf.*'t5'"):
        Tokenizer.from_gguf(tmp_path / "t5.gguf")


# ---- bad input and template helpers -------------------------------------------------------------

def test_encode_rejects_bytes(smol):
    with pytest.raises(ValueError, match="bytes"):
        smol.encode(b"hello")


def test_decode_rejects_an_id_outside_the_vocabulary(smol):
    with pytest.raises(ValueError, match="49152"):
        smol.decode([5, 49152])


def test_chat_template_rejects_non_dict_messages(smol):
    with pytest.raises(ValueError, match="list of dicts"):
        smol.apply_chat_template(["hello"])


def test_chat_template_helpers_behave_as_in_transformers(stories):
    tok = Tokenizer(stories.backend, bos_token_id=1, eos_token_ids=[2], chat_template=(
        "{{ bos_token }}{{ messages | tojson }}{% if messages | length > 1 %}"
        "{{ raise_exception('one message only') }}{% endif %}{{ strftime_now('%Y') | length }}"))
    assert tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}]) == (
        '<s>[{"role": "user", "content": "<b>é</b>"}]4')
    with pytest.raises(jinja2.TemplateError, match="one message only"):
        tok.apply_chat_template(CHATS[1])


# ---- incremental detokenizer --------------------------------------------------------------------

def stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    return detok, [detok.step(i) for i in output_ids]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(smol, text):
    prompt, output = smol.encode("Say it:"), smol.encode(text)
    detok, deltas = stream(smol, prompt, output)
    assert "".join(deltas) == detok.text == smol.decode(output)
    assert detok.token_ids == output


def test_incremental_never_yields_a_partial_character(smol):
    output = smol.encode("🤖👍🏽 日本語 👨‍👩‍👧")
    _, deltas = stream(smol, [], output)
    assert len(output) > 8 and "" in deltas  # some characters span several byte tokens
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_holds_back_a_trailing_split_character(smol):
    output = smol.encode("ok 🤖")
    detok, _ = stream(smol, [], output[:-1])
    assert detok.text == "ok" and smol.decode(output[:-1]).endswith("\ufffd")
    assert detok.step(output[-1]) == " 🤖"


def test_incremental_special_tokens_follow_skip_flag(smol):
    output = smol.encode("Hi<|im_end|>")
    assert stream(smol, [], output, skip_special_tokens=True)[0].text == "Hi"
    assert stream(smol, [], output, skip_special_tokens=False)[0].text == "Hi<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_keeps_sentencepiece_word_spaces(stories, text):
    prompt = stories.encode("Once upon a time")
    output = stories.encode(text, add_special_tokens=False)
    detok, _ = stream(stories, prompt, output)
    full = stories.decode(prompt + output)
    assert detok.text == full[len(stories.decode(prompt)):]
    assert detok.text.lstrip(" ") == stories.decode(output).lstrip(" ")


@pytest.mark.parametrize("name", ["smol", "stories"])
@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_issue25_item3_peek_is_what_step_returns_and_changes_nothing(name, text, request):
    """Logprob texts ask peek of every candidate: it answers what step would return for it, in context (a
    SentencePiece word's space included), and peeking other ids in between changes no later step."""
    tokenizer = request.getfixturevalue(name)
    prompt, output = tokenizer.encode("Once upon a time"), tokenizer.encode(text, add_special_tokens=False)
    detok, deltas = stream(tokenizer, prompt, output)
    peeking = IncrementalDetokenizer(tokenizer, prompt)
    others = output[::-1] + tokenizer.encode(" the a", add_special_tokens=False)
    for token, delta in zip(output, deltas):
        for other in others:
            peeking.peek(other)
        assert peeking.peek(token) == delta
        assert peeking.step(token) == delta
    assert peeking.text == detok.text


# ---- tokenizer_config.json's legacy / add_prefix_space, against transformers (issue 11, item 7) --

SWEEP_PIECES = ["hello", "Hello", "world", "user", "hi", "Once", "upon", "a", "time", ":", ",", ".", "!", "'s",
                "don't", "café", "cafe\u0301", "naïve", "Ünïcödé", "ß", "ñ", "Ångström", "日本", "🙂", "0", "7",
                "123", "4567", "3.14", "1,000", "2024-01-31", " ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\r\n"]


def sweep_texts(specials, n=300, seed=0):
    """Edge cases around special tokens and leading whitespace, then `n` random concatenations of
    special tokens, words, accents (composed and decomposed), digits and whitespace runs."""
    texts = ["", " ", "  ", "\n", "hi", " hi", "  hi", "hi ", "<s>user: hi", "Hello</s> world"]
    for sp in specials:
        texts += [sp, sp + sp, sp + "user", sp + " user", sp + "  user", "user" + sp, "user " + sp + " hi",
                  sp + "\n" + "hi", " " + sp + "hi", sp + "123", sp + "é"]
    rng = random.Random(seed)
    pieces = SWEEP_PIECES + list(specials) * 3
    while len(texts) < n + 10 + 11 * len(specials):
        texts.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 10))))
    return texts


def encode_mismatches(ours, theirs, texts):
    """The texts (with add_special_tokens) that `ours` encodes differently from transformers."""
    return [(text, add, ours.encode(text, add_special_tokens=add), theirs.encode(text, add_special_tokens=add))
            for text in texts for add in (True, False)
            if ours.encode(text, add_special_tokens=add) != theirs.encode(text, add_special_tokens=add)]


def with_tokenizer_config(src, dest, **changes):
    """A copy of the tokenizer folder `src` with tokenizer_config.json keys changed (None: removed)."""
    shutil.copytree(src, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config.update(changes)
    (dest / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return dest


def test_issue11_tokenizer_legacy_false(stories_dir, tmp_path):
    folder = with_tokenizer_config(stories_dir, tmp_path / "m", legacy=False)
    ids = Tokenizer.from_pretrained(folder).encode("<s>user: hi", add_special_tokens=False)
    assert ids[:2] == [1, 425]  # "u", where legacy inserts "▁u" (318)
    assert ids == transformers.AutoTokenizer.from_pretrained(folder).encode("<s>user: hi", add_special_tokens=False)


STORIES_CONFIGS = {
    "as-shipped": {},
    "legacy-false": dict(legacy=False),
    "legacy-true": dict(legacy=True),
    "legacy-null": dict(legacy=None, add_prefix_space=None),
    "no-prefix-space": dict(add_prefix_space=False),
    "prefix-space": dict(add_prefix_space=True),
    "legacy-true-no-prefix-space": dict(legacy=True, add_prefix_space=False),
    "generic-class-legacy-false": dict(tokenizer_class="PreTrainedTokenizerFast", legacy=False),
}


@pytest.mark.parametrize("changes", STORIES_CONFIGS.values(), ids=STORIES_CONFIGS.keys())
@pytest.mark.parametrize("old_normalizer", [False, True], ids=["metaspace", "normalizer-form"])
def test_issue11_sentencepiece_flags_match_transformers(stories_dir, tmp_path, changes, old_normalizer):
    folder = with_tokenizer_config(stories_dir, tmp_path / "m", **changes)
    if old_normalizer:
        # The form older transformers wrote for Llama 2 / Mistral: "▁" added by the normalizer.
        spec = json.loads((folder / "tokenizer.json").read_text())
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
        spec["pre_tokenizer"] = None
        (folder / "tokenizer.json").write_text(json.dumps(spec))
    ours, theirs = Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)
    texts = sweep_texts(["<s>", "</s>", "<unk>"])
    assert encode_mismatches(ours, theirs, texts)[:5] == []
    for text in texts:
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


@pytest.fixture(scope="module")
def smol_hf_smollm_split(smollm2_gguf):
    """transformers' tokenizer of the GGUF with the split SmolLM2's own tokenizer.json and llama.cpp
    (`tokenizer.ggml.pre` "smollm") use: every digit alone, then the GPT-2 regex. transformers'
    GGUF converter ignores `tokenizer.ggml.pre` and keeps only the GPT-2 regex, so "  7" or
    "\r\n0" would split differently from the model's own tokenizer."""
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok


def test_issue11_gguf_tokenizer_matches_transformers_sweep(smol, smol_hf_smollm_split):
    texts = sweep_texts(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    assert encode_mismatches(smol, smol_hf_smollm_split, texts)[:5] == []
    for text in texts:
        ids = smol_hf_smollm_split.encode(text)
        for skip in (True, False):
            assert smol.decode(ids, skip) == smol_hf_smollm_split.decode(ids, skip_special_tokens=skip), text


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def qwen_style_dir(tmp_path_factory):
    """A small Qwen2-style byte-level BPE (NFC, Qwen2's split regex, ByteLevel) trained here."""
    from tokenizers import normalizers, trainers

    from jaxllm.tokenizer import _QWEN2_SPLIT

    backend = _Backend(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    corpus = sweep_texts([], n=2000, seed=1) + TEXTS
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=600, special_tokens=QWEN_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    folder = tmp_path_factory.mktemp("qwen_style")
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 4096}))
    return folder


QWEN_CONFIGS = {
    "as-shipped": {},
    "prefix-space": dict(add_prefix_space=True),
    "no-prefix-space": dict(add_prefix_space=False),
    "generic-class-prefix-space": dict(tokenizer_class="PreTrainedTokenizerFast", add_prefix_space=True),
}


@pytest.mark.parametrize("changes", QWEN_CONFIGS.values(), ids=QWEN_CONFIGS.keys())
def test_issue11_byte_level_flags_match_transformers(qwen_style_dir, tmp_path, changes):
    folder = with_tokenizer_config(qwen_style_dir, tmp_path / "m", **changes)
    ours, theirs = Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)
    texts = sweep_texts(QWEN_SPECIALS)
    assert encode_mismatches(ours, theirs, texts)[:5] == []
    for text in texts:
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_tokenizer_info_is_vllms_body_for_a_folder_and_a_gguf(stories_dir, smollm2_gguf):
    from jaxllm.tokenizer import load_tokenizer

    info = load_tokenizer(stories_dir).info()
    assert info == {**json.loads((stories_dir / "tokenizer_config.json").read_text()), "tokenizer_class": "LlamaTokenizer"}
    gguf = load_tokenizer(smollm2_gguf).info()
    assert (gguf["bos_token"], gguf["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert gguf["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert gguf["chat_template"].startswith("{% for message in messages %}")


def test_tokenizer_info_spells_added_tokens_by_their_content_and_drops_file_paths(stories_dir):
    from jaxllm.tokenizer import Tokenizer, load_tokenizer

    backend = load_tokenizer(stories_dir).backend
    config = {"vocab_file": "/x/tokenizer.model", "merges_file": "m.txt", "unk_token": {"content": "<unk>"},
              "added_tokens_decoder": {"0": {"content": "<unk>", "special": True}}}
    info = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], chat_template="{{ 1 }}", config=config).info()
    assert info == {"unk_token": "<unk>", "added_tokens_decoder": {"0": "<unk>"}, "bos_token": "<s>",
                    "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{{ 1 }}"}
