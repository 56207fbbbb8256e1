"""vLLM's prompt forms in LLM, LLMEngine and AsyncLLM: text, token ids, TextPrompt and TokensPrompt dicts (with a
cache_salt and multimodal options left empty); what a text-only decoder cannot serve is refused naming the key, and
a refused prompt leaves nothing queued."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tqdm import tqdm

from jaxllm import (LLM, AsyncEngineArgs, AsyncLLM, EngineArgs, LLMEngine, RequestOutput, RequestOutputKind,
                    SamplingParams, TextPrompt, TokensPrompt)
from jaxllm.frontend.input_processor import IGNORED_PROMPT_KEYS, REFUSED_PROMPT_KEYS
from jaxllm.tokenizer import detect_content_format
from tests.conftest import STORIES

GREEDY = SamplingParams(temperature=0, max_tokens=6)
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, precompile=False)
TEXT = "Once upon a time"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(STORIES, **ENGINE)


@pytest.fixture(scope="module")
def ids(llm) -> list[int]:
    return llm.engine.encode_prompt(TEXT)[1]


@pytest.fixture(scope="module")
def want(llm) -> list[int]:
    return llm.generate(TEXT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_the_reported_tokens_prompt_dict_generates_as_its_ids(llm, ids, want):
    # vLLM's TokensPrompt, the form a vLLM user passes pre-tokenized prompts in, was read as a list of ids before.
    [out] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == want and out.prompt_token_ids == ids and out.prompt is None


def test_every_prompt_form_generates_the_same_tokens(llm, ids, want):
    forms = [TEXT, ids, np.asarray(ids, np.int32), jnp.asarray(ids), [jnp.int32(t) for t in ids],
             TextPrompt(prompt=TEXT),
             TokensPrompt(prompt_token_ids=ids, prompt=TEXT),
             {"prompt": TEXT, "multi_modal_data": None, **{key: None for key in IGNORED_PROMPT_KEYS}},
             {"prompt_token_ids": ids, "multi_modal_data": {}, "mm_processor_kwargs": {"x": 1}}]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want] * len(forms)
    assert [o.prompt_token_ids for o in outs] == [ids] * len(forms)
    # The text reported is the one given, for ids too (TokensPrompt's "prompt").
    assert [o.prompt for o in outs] == [TEXT, None, None, None, None, TEXT, TEXT, TEXT, None]


def test_a_prompt_dicts_cache_salt_keeps_its_prefix_apart(llm, ids):
    long = ids * 3
    salted = {"prompt_token_ids": long, "cache_salt": "a"}
    llm.generate(salted, GREEDY, use_tqdm=False)
    cached = [llm.generate(p, GREEDY, use_tqdm=False)[0].num_cached_tokens
              for p in (salted, {"prompt_token_ids": long, "cache_salt": "b"}, {"prompt_token_ids": long})]
    # The same salt reads the salted prefix's full blocks (16 tokens each); another salt, or none, reads nothing.
    assert cached == [len(long) // 16 * 16, 0, 0]
    assert llm.generate(salted, GREEDY, cache_salt="a", use_tqdm=False)[0].num_cached_tokens == cached[0]
    with pytest.raises(ValueError, match="the prompt's cache_salt 'a' differs from cache_salt='b'"):
        llm.generate(salted, GREEDY, cache_salt="b", use_tqdm=False)


@pytest.mark.parametrize("prompt, match", [
    *[({"prompt": TEXT, key: [1]}, f"prompt key '{key}': ") for key in REFUSED_PROMPT_KEYS],
    ({"prompt": TEXT, "multi_modal_data": {"image": object()}}, r"prompt key 'multi_modal_data' \(image\): the "
                                                                 "models take text and token ids only"),
    ({"cache_salt": "a"}, r"a prompt dict needs 'prompt' .* or 'prompt_token_ids' .*; it has \['cache_salt'\]"),
    ({"prompt": 7}, "prompt key 'prompt' must be a string"),
    ({"prompt_token_ids": [1, 2.5]}, r"prompt token ids must be integers; got 2.5 \(float\)"),
    ([1, True], r"prompt token ids must be integers; got True \(bool\)"),
    ({"prompt_token_ids": "1 2"}, "prompt token ids must be a list of integers; got str"),
    (np.array(5), "prompt token ids must be a 1-D array of integers; got 0-D int64"),
    (np.array([1.0, 2.0]), "prompt token ids must be a 1-D array of integers; got 1-D float64"),
    (jnp.asarray([[1, 2]]), "prompt token ids must be a 1-D array of integers; got 2-D int32"),
    ([np.bool_(True)], r"prompt token ids must be integers; got np.True_"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [1, 600]}, r"outside the vocabulary \[0, 512\)"),
])
def test_a_refused_prompt_names_its_key_and_queues_nothing(llm, prompt, match):
    free = llm.engine.core.num_free_blocks()
    with pytest.raises(ValueError, match=match):
        llm.generate([TEXT, prompt], GREEDY, use_tqdm=False)
    # The good prompt queued before it was aborted with it: nothing is open, no block is held.
    assert not llm.engine.output_processor.requests and not llm.engine.core.requests
    assert llm.engine.core.num_free_blocks() == free


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.integers(-5, 600), st.floats(allow_nan=False), st.booleans(), st.text(max_size=2)),
                max_size=6))
def test_token_ids_are_taken_only_when_all_are_integers_in_the_vocabulary(llm, values):
    ok = bool(values) and all(type(v) is int and 0 <= v < 512 for v in values)
    processor = llm.engine.input_processor
    if ok:
        assert processor.parse_prompt({"prompt_token_ids": values}).token_ids == values
    else:
        with pytest.raises(ValueError):
            processor.parse_prompt({"prompt_token_ids": values})


def test_engine_args_are_checked_when_made_and_build_the_engine_from_engine_args(ids, want):
    args = EngineArgs(model=STORIES, **ENGINE, gpu_memory_utilization=0.5, enforce_eager=True)
    assert (args.model, args.max_num_seqs, args.block_size, args.trust_remote_code) == (
        STORIES, ENGINE["max_num_seqs"], 16, None)
    with pytest.raises(TypeError, match="'bogus'"):
        EngineArgs(model=STORIES, bogus=1)
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        EngineArgs(model=STORIES, max_num_seqs=0)
    # a dataclass, as vLLM's: fields assigned after it is made count, and LLM(**asdict(args)) builds the engine
    args.max_num_seqs = 8
    assert args.engine_kwargs()["max_num_seqs"] == 8
    assert LLM(**dataclasses.asdict(args)).llm_engine.config.max_num_seqs == 8
    assert LLM.from_engine_args(args).llm_engine.config.max_num_seqs == 8
    engine = LLMEngine.from_engine_args(args, usage_context=None)
    engine.add_request("a", {"prompt_token_ids": ids}, GREEDY)
    last = {}
    while engine.has_unfinished_requests():
        last.update((o.request_id, o) for o in engine.step())
    assert last["a"].outputs[0].token_ids == want
    # vLLM's script form: the flags on a parser, parsed, then the arguments
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    argv = ["--model", str(STORIES), "--max-num-seqs", "4", "-tp", "1", "--served-model-name", "s",
            "--enable-log-requests"]
    parsed = AsyncEngineArgs.from_cli_args(parser.parse_args(argv))
    assert (parsed.model, parsed.max_num_seqs, parsed.tensor_parallel_size, parsed.served_model_name,
            parsed.enable_log_requests) == (str(STORIES), 4, 1, "s", True)


def test_async_llm_generate_takes_vllms_prompt_forms_and_arguments(ids, want):
    async def tokens(engine, prompt, request_id, **kwargs):
        outs = [o async for o in engine.generate(prompt, GREEDY, request_id, **kwargs)]
        assert outs[-1].finished
        return outs[-1]

    async def scenario():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=STORIES, enable_log_requests=True, **ENGINE))
        try:
            await engine.check_health()
            text = await tokens(engine, TEXT, "a", trace_headers={"x": "y"}, priority=0, data_parallel_rank=0)
            as_ids = await tokens(engine, {"prompt_token_ids": ids}, "b", prompt_text=TEXT)
            bare = await tokens(engine, TEXT, "c", tokenization_kwargs={"add_special_tokens": False})
            with pytest.raises(ValueError, match=r"tokenization_kwargs keys \['truncation'\] are not supported"):
                await tokens(engine, TEXT, "d", tokenization_kwargs={"truncation": True})
            # Leaving the loop after the first output aborts the request: nothing stays open.
            stream = engine.generate(TEXT, SamplingParams(temperature=0, max_tokens=40), "e")
            async for _ in stream:
                break
            await stream.aclose()
            assert not engine.output_processor.requests
            return text, as_ids, bare
        finally:
            engine.shutdown()  # a plain call, as vLLM's: the cores have exited when it returns
            assert all(core.process.poll() is not None for core in engine.client._cores)

    text, as_ids, bare = asyncio.run(scenario())
    assert text.outputs[0].token_ids == as_ids.outputs[0].token_ids == want
    assert (text.prompt, as_ids.prompt, as_ids.prompt_token_ids) == (TEXT, TEXT, ids)
    # stories260K's tokenizer adds a BOS: without special tokens the prompt is one token shorter.
    assert bare.prompt_token_ids == ids[1:]


def test_enqueue_and_wait_for_completion_give_generates_outputs_in_queue_order(llm, ids, want):
    first = llm.enqueue([TEXT, {"prompt_token_ids": ids}], GREEDY)
    second = llm.enqueue_chat([{"role": "user", "content": "Lily"}], GREEDY, chat_template=TEMPLATE)
    assert llm.engine.output_processor.requests.keys() == set(first + second)  # queued, not yet run
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == first + second
    assert [o.outputs[0].token_ids for o in outs[:2]] == [want, want]
    chat = llm.chat([{"role": "user", "content": "Lily"}], GREEDY, use_tqdm=False, chat_template=TEMPLATE)[0]
    assert outs[2].outputs[0].token_ids == chat.outputs[0].token_ids and outs[2].prompt_token_ids == \
        chat.prompt_token_ids
    # A chat's outputs report the rendered prompt, as vLLM's.
    assert outs[2].prompt == chat.prompt == "user: Lily\nassistant:"
    assert llm.wait_for_completion(RequestOutput, use_tqdm=False) == []
    with pytest.raises(TypeError, match="makes RequestOutput only"):
        llm.wait_for_completion(int)
    # A refused prompt leaves nothing queued, for enqueue as for generate.
    free = llm.engine.core.num_free_blocks()
    with pytest.raises(ValueError, match="must be integers"):
        llm.enqueue([TEXT, {"prompt_token_ids": [1, 2.5]}], GREEDY)
    assert llm._enqueued == [] and not llm.engine.output_processor.requests
    assert llm.engine.core.num_free_blocks() == free


def test_vllms_generate_and_chat_arguments(llm, ids, want):
    bars = []

    def bar(**kwargs):
        bars.append(kwargs)
        return tqdm(disable=True, **kwargs)

    # One priority for all prompts (vLLM's int), a callable use_tqdm, mm_processor_kwargs with nothing to process.
    outs = llm.generate([TEXT, TEXT], GREEDY, priority=0, use_tqdm=bar, mm_processor_kwargs={"num_crops": 4})
    assert [o.outputs[0].token_ids for o in outs] == [want, want] and bars[0]["total"] == 2
    bare = llm.generate(TEXT, GREEDY, tokenization_kwargs={"add_special_tokens": False}, use_tqdm=False)[0]
    assert bare.prompt_token_ids == ids[1:]  # stories260K's BOS left out
    with pytest.raises(ValueError, match="tokenization_kwargs add_special_tokens='false' must be a bool"):
        llm.generate(TEXT, GREEDY, tokenization_kwargs={"add_special_tokens": "false"}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"tokenization_kwargs keys \['max_length'\] are not supported"):
        llm.generate(TEXT, GREEDY, tokenization_kwargs={"max_length": 4}, use_tqdm=False)
    with pytest.raises(ValueError, match="priority=5 .*fcfs"):
        llm.chat([{"role": "user", "content": "Lily"}], GREEDY, priority=5, chat_template=TEMPLATE, use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": "Lily"}], GREEDY, False, None, 0, TEMPLATE, "string",
                    tokenization_kwargs={"add_special_tokens": True})[0]
    assert chat.prompt_token_ids == llm.engine.encode_prompt("user: Lily\nassistant:")[1]  # BOS added
    assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1
    # A bare list of JAX integers is one prompt, as a list of ints is.
    assert llm.generate([jnp.int32(t) for t in ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    # A bare 1-D array is one prompt, whatever its dtype (a float one is refused whole, not read as many prompts).
    assert llm.generate(np.asarray(ids), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="got 1-D float64"):
        llm.generate(np.asarray(ids, np.float64), GREEDY, use_tqdm=False)


# The template that loops over content parts, as multimodal models' templates do, and the one that reads a string.
PARTS_TEMPLATE = ("{% for m in messages %}{{ m.role }}:{% for p in m.content %} [{{ p.text }}]{% endfor %}{{ '\\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.mark.parametrize("content", ["Lily", [{"type": "text", "text": "Li"}, {"type": "text", "text": "ly"}]])
def test_chat_template_content_formats(llm, content):
    message = [{"role": "user", "content": content}]
    tokenizer = llm.get_tokenizer()
    parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
    # "openai" hands the template the text parts, and "auto" does for a template that loops over them; "string"
    # and "auto" (for any other template) one string, parts joined by newlines as vLLM joins them.
    for content_format in ("openai", "auto"):
        assert tokenizer.render_chat(message, chat_template=PARTS_TEMPLATE, content_format=content_format) == \
            "user:" + "".join(f" [{p['text']}]" for p in parts) + "\nassistant:"
    joined = "\n".join(p["text"] for p in parts)
    for content_format in ("string", "auto"):
        assert tokenizer.render_chat(message, chat_template=TEMPLATE, content_format=content_format) == \
            f"user: {joined}\nassistant:"
    # A tool result reaches the template as one string in either format, as vLLM's.
    tool = [{"role": "tool", "content": content, "tool_call_id": "c"}]
    assert tokenizer.render_chat(tool, chat_template=TEMPLATE, content_format="openai") == f"tool: {joined}\nassistant:"
    with pytest.raises(ValueError, match="chat_template_content_format='xml' must be one of"):
        llm.chat(message, GREEDY, chat_template=TEMPLATE, chat_template_content_format="xml", use_tqdm=False)


@pytest.mark.parametrize("template, parts", [
    (PARTS_TEMPLATE, True),
    (TEMPLATE, False),
    ("{% for m in messages %}{% for p in m['content'] | selectattr('type', 'eq', 'text') %}{{ p.text }}{% endfor %}"
     "{% endfor %}", True),
    ("{% set rest = messages[1:] %}{% for message in rest %}{% if message.content is string %}{{ message.content }}"
     "{% else %}{% for part in message.content %}{{ part.text }}{% endfor %}{% endif %}{% endfor %}", True),
    # vLLM does not follow a name set from the content: such a loop reads as "string", as in vLLM
    ("{% for m in messages %}{% set c = m['content'] %}{% for part in c %}{{ part.text }}{% endfor %}{% endfor %}",
     False),
    # vLLM's other shapes: a macro given the content, a namespace field, a slice, a bare `content` loop
    ("{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ show(c=m.content) }}{% endfor %}", True),
    ("{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}{% for p in m.content %}{{ p }}{% endfor %}"
     "{% endfor %}", True),
    ("{% for m in messages %}{% for p in m['content'][1:] %}{{ p }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% for item in content %}{{ item }}{% endfor %}{% endfor %}", True),
    ("{% macro show(content) %}{% for p in content %}{{ p }}{% endfor %}{% endmacro %}{{ messages[0].content }}",
     False),
    ("{% macro show(c) %}{{ c }}{% endmacro %}{% for m in messages %}{{ show(m.content) }}{% for x in c %}{% endfor %}"
     "{% endfor %}", False),
    ("{% for m in messages %}{% if m.content is string %}{% set text = m.content %}{% endif %}{{ text }}{% endfor %}",
     False),
    ("{% for tool in tools %}{% for p in tool.content %}{{ p }}{% endfor %}{% endfor %}{{ messages[0].content }}",
     False),
    ("{% for m in messages %}{% for p in m.content %}", False),  # not valid jinja2: rendering it fails, not this
])
def test_auto_content_format_is_openai_for_templates_that_loop_over_a_messages_content(template, parts):
    """Each case's answer is vLLM 0.34's ``_detect_content_format``'s (run side by side when written)."""
    assert detect_content_format(template) == ("openai" if parts else "string")


def test_auto_renders_a_parts_template_as_transformers_renders_the_parts(llm):
    transformers = pytest.importorskip("transformers")
    template = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
                "{% for p in m.content %}({{ p.text }}){% endfor %}{% endif %}{% endfor %}")
    parts = [{"type": "text", "text": "Li"}, {"type": "text", "text": "ly"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    # What vLLM hands such a template: every message's content as parts, a string one as one part.
    as_parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, messages[1]]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=llm.get_tokenizer().backend)
    want = hf.apply_chat_template(as_parts, chat_template=template, tokenize=False)
    assert llm.get_tokenizer().render_chat(messages, add_generation_prompt=False, chat_template=template) == want
    assert want == "<system>(Be brief.)<user>(Li)(ly)"


def test_reset_prefix_cache_can_start_the_running_requests_over(llm, want):
    stream = llm.generate_stream(TEXT, SamplingParams(temperature=0, max_tokens=6, output_kind=RequestOutputKind.DELTA))
    tokens = list(next(stream).outputs[0].token_ids)
    scheduler = llm.engine.core.scheduler
    assert scheduler.stats.num_running == 1
    assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=False)
    # The running request went back to waiting, to be computed again (a recompute preemption).
    assert (scheduler.stats.num_running, scheduler.stats.num_preempted_waiting) == (0, 1)
    # The request is computed again from its prompt and the tokens it has; greedy, it goes on as before.
    tokens += [t for out in stream for t in out.outputs[0].token_ids]
    assert tokens == want


def test_llm_engines_vllm_calls(llm, ids, want, caplog):
    engine = llm.engine
    assert engine.get_tokenizer() is llm.get_tokenizer()
    engine.add_request("a", ids, GREEDY, prompt_text=TEXT, trace_headers={"traceparent": "x"})
    engine.add_request("b", TEXT, GREEDY)
    assert engine.get_num_unfinished_requests() == 2
    engine.abort_request(request_ids=["b"])
    assert engine.get_num_unfinished_requests() == 1
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert list(done) == ["a"] and done["a"].prompt == TEXT and done["a"].outputs[0].token_ids == want
    caplog.set_level(logging.INFO, logger="jaxllm")
    logging.getLogger("jaxllm").addHandler(caplog.handler)
    try:
        engine.do_log_stats()
    finally:
        logging.getLogger("jaxllm").removeHandler(caplog.handler)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("prompt throughput: ")]


def test_get_metrics_reads_the_series_as_vllms_reader_does(llm, stories_dir):
    def series(name):
        return {type(m).__name__: m for m in llm.get_metrics() if m.name == name}

    before = series("jaxllm:generation_tokens")["Counter"].value
    latency = series("jaxllm:e2e_request_latency_seconds")["Histogram"]
    outs = llm.generate([TEXT, "One day"], GREEDY, use_tqdm=False)
    assert series("jaxllm:generation_tokens")["Counter"].value - before == sum(len(o.outputs[0].token_ids)
                                                                               for o in outs)
    after = series("jaxllm:e2e_request_latency_seconds")["Histogram"]
    assert after.count == latency.count + 2 == after.buckets["+Inf"] and after.sum > latency.sum
    assert list(after.buckets.values()) == sorted(after.buckets.values())  # cumulative, as Prometheus's le buckets
    assert series("jaxllm:num_requests_running")["Gauge"].value == 0
    quiet = LLM(stories_dir, disable_log_stats=True, **ENGINE)
    with pytest.raises(RuntimeError, match="records no stats"):
        quiet.get_metrics()
