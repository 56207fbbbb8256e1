"""vLLM's ``vllm serve`` flags and ``vllm.LLM`` keywords in jaxllm (jaxllm/entrypoints/vllm_flags.py): every one
vLLM 0.34.0 has parses, with its table rule; aliases set their jaxllm settings; refused values name the flag; the
server honours the flags it reads. The snapshot of vLLM's flags: tests/fixtures/vllm_serve_flags.json
(scripts/vllm_serve_flags.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from jaxllm.config import EngineConfig
from jaxllm.entrypoints.engine_args import check_engine_args
from jaxllm.entrypoints.generate import build_parser as generate_parser
from jaxllm.entrypoints.openai.api_server import (add_http_flags, build_app, build_parser, server_flags,
                                                  uvicorn_options)
from jaxllm.entrypoints.vllm_flags import (KEYWORD_ONLY, LLM_RULES, RULES, SWITCH, apply_vllm_flags,
                                           normalize_argv, vllm_engine_kwargs)
from jaxllm.entrypoints.openai.serving import OpenAIServing, ServerOptions
from jaxllm.tokenizer import load_tokenizer
from jaxllm.worker.kv_cache import CPU_DEFAULT_KV_BYTES, default_kv_cache_bytes
from tests.conftest import log_messages
from tests.server_process import Server, engine_flags

SNAPSHOT = json.loads((Path(__file__).parent / "fixtures" / "vllm_serve_flags.json").read_text())
FLAGS = SNAPSHOT["flags"]
PARSER = build_parser()


def parse(*argv: str):
    """``jaxllm serve``'s flags as ``main`` reads them (before the model loads). Raises ValueError as it does."""
    args = PARSER.parse_args(normalize_argv(PARSER, argv))
    args.advisory_flags = apply_vllm_flags(args)
    server_flags(args)
    return args


def native(dest: str) -> bool:
    """A flag jaxllm has under vLLM's name (an EngineConfig field or the server's own)."""
    return dest not in RULES


def test_the_snapshot_is_vllm_0_34_and_every_spelling_of_every_flag_parses():
    assert SNAPSHOT["vllm"] == "0.34.0" and len(FLAGS) == 327
    missing = [o for f in FLAGS for o in f["options"] if o not in PARSER._option_string_actions]
    assert missing == []


def test_every_flag_jaxllm_lacks_has_a_rule_of_its_form_and_kind():
    lacking = [f for f in FLAGS if not native(f["dest"])]
    assert len(lacking) == 278
    for f in lacking:
        rule = RULES[f["dest"]]
        assert (rule.form, rule.engine) == (f["form"], f["engine"]), f["dest"]
    assert set(SNAPSHOT["keywords"]) == set(KEYWORD_ONLY) <= set(RULES)
    # The table names no flag vLLM lacks, and none jaxllm has itself (each of its flags lands where the table reads).
    assert set(RULES) - {f["dest"] for f in FLAGS} == set(KEYWORD_ONLY)
    landed = {name: PARSER._option_string_actions["--" + name.replace("_", "-")].dest
              for name in RULES if name not in KEYWORD_ONLY}
    assert {name: dest for name, dest in landed.items() if dest != name} == {"model": "model_option"}


def vllm_default_argv(f: dict) -> list[str]:
    """The flag set to vLLM's default, as a user copying a vLLM command line would write it."""
    option = f["options"][0]
    if f["form"] == SWITCH:
        return [option] if f["default"] else ["--no-" + option[2:]]
    return [option, f["default"] if isinstance(f["default"], str) else json.dumps(f["default"])]


def test_every_flag_at_vllms_default_is_accepted_and_changes_nothing():
    base = vars(parse())
    given = [f for f in FLAGS if not native(f["dest"]) and f["default"] is not None and f["form"] != "append"]
    assert len(given) > 150
    for f in given:
        args = parse(*vllm_default_argv(f))
        changed = {k for k, v in vars(args).items() if base.get(k) != v} - {f["dest"], "model_option",
                                                                            "advisory_flags"}
        assert changed == set(), (f["dest"], changed)


# One value each rule refuses, and one it accepts (None: it accepts none but its absence, or any).
REFUSED = {
    "runner": ("pooling", "generate"), "convert": ("embed", "none"), "tokenizer_mode": ("mistral", "hf"),
    "config_format": ("mistral", "hf"), "load_format": ("dummy", "safetensors"),
    "worker_cls": ("my.Worker", "auto"),
    **{name: ("x", None) for name in (
        "grpc_port", "hf_overrides", "hf_config_path", "quantization_config", "pooler_config",
        "reasoning_effort_map", "reasoning_config", "watermark_config", "diffusion_config", "kv_transfer_config",
        "ec_transfer_config", "tool_server", "io_processor_plugin", "model_class_overrides", "scheduler_cls",
        "reasoning_parser_plugin", "worker_extension_cls", "tool_parser_plugin", "middleware",
        "kv_cache_dtype_skip_layers", "lora_target_modules", "logits_processors")},
    **{name: (True, False) for name in ("skip_tokenizer_init", "headless", "grpc",
                                        "enable_per_request_metrics", "enable_return_routed_experts",
                                        "return_sampling_mask")},
    "tool_strict_level": ("parameter", "auto"),
    "structured_outputs_config": ('{"backend": "xgrammar", "disable_any_whitespace": true}', '{"backend": "auto"}'),
}


def argv_of(name: str, value) -> list[str]:
    option = "--" + name.replace("_", "-")
    if RULES[name].form == SWITCH:
        return [option if value else "--no-" + option[2:]]
    return [option, value]


def test_the_rules_that_refuse_values_are_the_listed_ones():
    refusing = {name for name, rule in RULES.items() if rule.refuses(True) or rule.refuses("x")}
    assert refusing == set(REFUSED)
    # --help says which values are refused.
    helps = {a.dest: a.help for a in PARSER._actions}
    assert helps["runner"].startswith("vLLM's; accepted as auto, generate (no effect); other values refused: ")
    assert helps["hf_overrides"].startswith("vLLM's; refused when given: ")
    assert helps["grpc"].startswith("vLLM's; refused when on: ")
    assert helps["enforce_eager"].startswith("vLLM's; accepted, no effect: ")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_value_is_an_error_naming_the_flag_and_an_accepted_one_is_not(name):
    bad, good = REFUSED[name]
    option = "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=f"^{option}.* is not supported: {RULES[name].reason[:20]}"):
        parse(*argv_of(name, bad))
    if good is not None:
        parse(*argv_of(name, good))


def test_the_issue_reported_flags_are_taken(caplog):
    # The flags a vLLM command line for a GPU carries, which jaxllm serve refused before ("unrecognized arguments").
    args = parse("--gpu-memory-utilization", "0.85", "--enforce-eager", "--trust-remote-code", "--swa-bounded-replay")
    assert args.gpu_memory_utilization == 0.85
    assert [a.split(" ")[0] for a in args.advisory_flags] == ["--trust-remote-code", "--enforce-eager",
                                                              "--swa-bounded-replay"]
    assert check_engine_args(args) is None and check_engine_args(parse("--gpu-memory-utilization", "1.5")) == \
        "--gpu-memory-utilization 1.5 must be in (0, 1]"


@pytest.mark.parametrize("given, dtype", [("half", "float16"), ("float", "float32"), ("float16", "float16"),
                                          ("bfloat16", "bfloat16"), ("auto", "auto")])
def test_every_dtype_vllm_names_is_taken(given, dtype):
    # vLLM's ModelDType: "half" and "float" were refused before ("--dtype 'half' must be one of ...").
    args = parse("--dtype", given)
    assert check_engine_args(args) is None
    assert EngineConfig(dtype=args.dtype).dtype == dtype
    assert generate_parser().parse_args(["--dtype", given]).dtype == given
    with pytest.raises(ValueError, match=r"dtype='double' must be one of \('auto', .*'half', 'float'\)"):
        EngineConfig(dtype="double")


def test_aliases_set_their_jaxllm_settings():
    args = parse("--model", "m", "--num-gpu-blocks-override", "40", "--max-num-seqs", "16", "--max-num-active-seqs",
                 "8", "--max-num-scheduled-tokens", "64", "--spec-method", "ngram", "--spec-tokens", "3")
    assert (args.model, args.num_kv_blocks, args.max_num_seqs, args.max_num_batched_tokens) == ("m", 40, 8, 64)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    # A cap above the value it caps leaves it; the same value twice is no contradiction.
    assert parse("--max-num-active-seqs", "128").max_num_seqs == 64
    assert parse("m", "--model", "m").model == "m"
    assert parse("--device-memory-utilization", "0.5", "-tp", "1", "-q", "int8").gpu_memory_utilization == 0.5
    assert parse("--load-format", "SafeTensors").load_format == "SafeTensors"  # compared as vLLM does, lowercased
    assert (parse("--hf-token").hf_token, parse("--hf-token", "hf_x").hf_token) == (True, "hf_x")


def test_vllms_sizes_optimization_level_and_dotted_flags():
    args = parse("--max-model-len", "1k", "--max-num-batched-tokens", "8K", "--kv-cache-memory-bytes", "1.5g",
                 "--max-num-scheduled-tokens", "4k", "-O3", "--speculative-config.method", "ngram",
                 "--speculative-config.num_speculative_tokens=2", "-cc.mode=3", "--limit-mm-per-prompt.image", "0")
    assert (args.max_model_len, args.max_num_batched_tokens, args.kv_cache_memory_bytes) == (1000, 4000, 1500000000)
    assert args.optimization_level == "3" and json.loads(args.compilation_config) == {"mode": 3}
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 2}
    assert json.loads(args.limit_mm_per_prompt) == {"image": 0}
    assert parse("--max-model-len", "auto").max_model_len is None and parse("--max-model-len", "-1").max_model_len is None
    assert parse("-O", "1").optimization_level == "1" and parse("--max_model_len=2K").max_model_len == 2048
    assert parse("--max-model-len", "AUTO").max_model_len is None
    # Repeated dotted keys merge as vLLM's parser merges them: objects key by key, lists joined.
    merged = parse("-cc.a.b", "1", "-cc.a.c=2", "-cc.l+", "x,y", "-cc.l+", "z", "--served-model-name", "my.model")
    assert json.loads(merged.compilation_config) == {"a": {"b": 1, "c": 2}, "l": ["x", "y", "z"]}
    assert merged.served_model_name == ["my.model"] and parse("--seed", "-1").seed == -1
    with pytest.raises(ValueError, match="-cc.a is given both a value and keys of its own"):
        parse("-cc.a", "1", "-cc.a.b", "2")
    with pytest.raises(ValueError, match="--speculative-config.method needs a value"):
        parse("--speculative-config.method")
    with pytest.raises(SystemExit):
        PARSER.parse_args(["--max-model-len", "1.5K"])  # a binary suffix takes a whole number, as in vLLM


@pytest.mark.parametrize("argv, message", [
    (["m", "--model", "n"], "--model 'n' contradicts the positional MODEL 'm'"),
    (["--num-kv-blocks", "30", "--num-gpu-blocks-override", "40"], "--num-gpu-blocks-override 40 contradicts "
                                                                   "--num-kv-blocks 30"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--spec-tokens", "3"],
     "--spec-tokens 3 contradicts --speculative-config's num_speculative_tokens 2"),
    (["--num-gpu-blocks-override", "many"], "--num-gpu-blocks-override 'many' must be an int"),
    (["--max-num-active-seqs", "0"], "--max-num-active-seqs 0 must be >= 1"),
    (["--speculative-config", "{oops", "--spec-tokens", "2"], "--speculative-config '{oops' is not a JSON object"),
    (["--allowed-origins", "*"], "--allowed-origins '\\*' must be a JSON list"),
    (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs '\\[1\\]' must be a JSON dict"),
    # argparse gives a MODEL after several values to the flag; as vLLM, say so rather than serve another model.
    (["--api-key", "k", "Qwen/Qwen3-0.6B"], "--api-key took several values and no MODEL came before it"),
    (["--served-model-name", "a", "./model"], "--served-model-name took several values and no MODEL came before"),
])
def test_contradictions_and_malformed_values_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_on_off_flags_take_vllms_spellings():
    assert parse("--disable-prefix-caching").enable_prefix_caching is False
    assert parse("--no-enable-prefix-caching").enable_prefix_caching is False
    assert parse("--disable-chunked-prefill").enable_chunked_prefill is False
    assert parse("--enable-log-requests").enable_log_requests is True
    assert parse("--disable-log-requests").enable_log_requests is False
    assert parse("--enable-uvicorn-access-log").disable_uvicorn_access_log is False
    assert parse("-ep").enable_expert_parallel is True


def test_underscored_flags_and_a_config_file_as_vllm_reads_them(tmp_path):
    assert parse("--max_num_seqs", "8", "--block_size=32").max_num_seqs == 8
    config = tmp_path / "serve.yaml"
    config.write_text("model: m\nmax_num_seqs: 8\nenable-prefix-caching: false\nenforce_eager: true\n"
                      "allowed_origins: ['http://a.example']\ntoken_buckets: [16, 32]\nseq_buckets: []\n"
                      "speculative_config: {method: ngram, num_speculative_tokens: 2}\n"
                      "disable_log_requests: false\ndisable_chunked_prefill: true\nserved_model_name: [a, b]\n")
    args = parse("--config", str(config), "--max-num-seqs", "4")  # the command line wins
    assert (args.model, args.max_num_seqs, args.enable_prefix_caching, args.token_buckets) == ("m", 4, False, [16, 32])
    assert args.allowed_origins == ["http://a.example"] and args.enforce_eager is True and args.seq_buckets is None
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 2}
    assert (args.enable_log_requests, args.enable_chunked_prefill, args.served_model_name) == (True, False, ["a", "b"])
    assert parse("other", "--config", str(config)).model == "other"  # a MODEL on the command line wins too
    config.write_text("compilation-config.mode: 3\ncompilation-config.level: 1\n")  # dotted keys in the file too
    assert json.loads(parse("--config", str(config)).compilation_config) == {"mode": 3, "level": 1}
    config.write_text("- max_num_seqs\n")
    with pytest.raises(ValueError, match="--config .*serve.yaml: a YAML mapping of flag names to values is needed"):
        parse(f"--config={config}")


def test_chat_template_content_format_reaches_the_servers_renderer(stories_dir):
    # vLLM's flag was refused past "auto"; "string" and "openai" now choose how content reaches the template.
    assert parse("--chat-template-content-format", "openai").chat_template_content_format == "openai"
    assert parse().chat_template_content_format == "auto"
    with pytest.raises(ValueError, match=r"--chat-template-content-format 'xml' must be one of \('auto', "):
        parse("--chat-template-content-format", "xml")
    tokenizer = load_tokenizer(stories_dir)
    engine = types.SimpleNamespace(tokenizer=tokenizer, info=types.SimpleNamespace(max_model_len=64))
    parts = "{% for m in messages %}{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endfor %}"
    tokenizer.set_chat_template(parts)
    message = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    rendered = {fmt: OpenAIServing(engine, "m", {}, options=ServerOptions(chat_template_content_format=fmt))
                .render_chat_text(message, add_generation_prompt=False) for fmt in ("openai", "string", "auto")}
    # A string's characters are not parts: the parts template renders nothing of them. "auto" reads the template.
    assert rendered == {"openai": "<a><b>", "string": "<>" * 3, "auto": "<a><b>"}


def test_server_flags_become_uvicorn_and_http_options():
    args = parse("--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2", "--uds", "/tmp/s",
                 "--root-path", "/api", "--disable-uvicorn-access-log", "--h11-max-incomplete-event-size", "1024")
    assert uvicorn_options(args) == dict(ssl_keyfile="k.pem", ssl_certfile="c.pem", ssl_cert_reqs=2, uds="/tmp/s",
                                         root_path="/api", h11_max_incomplete_event_size=1024, access_log=False)
    assert uvicorn_options(parse()) == {}


def test_cors_request_ids_and_docs_on_the_app():
    serving = types.SimpleNamespace(engine=None)
    app = build_app(serving, docs=False)
    add_http_flags(app, parse("--allowed-origins", '["http://a.example"]', "--enable-request-id-headers"))
    client = TestClient(app)
    response = client.get("/version", headers={"Origin": "http://a.example", "X-Request-Id": "r-1"})
    assert response.headers["access-control-allow-origin"] == "http://a.example"
    assert response.headers["x-request-id"] == "r-1"
    assert len(client.get("/version").headers["x-request-id"]) == 32
    assert "access-control-allow-origin" not in client.get("/version", headers={"Origin": "http://b.example"}).headers
    assert client.get("/docs").status_code == 404 and client.get("/openapi.json").status_code == 404
    plain = TestClient(build_app(serving))
    assert plain.get("/docs").status_code == 200 and "x-request-id" not in plain.get("/version").headers


def test_llm_keywords_map_as_the_flags_do(caplog):
    kwargs = vllm_engine_kwargs({"max_num_seqs": 16, "gpu_memory_utilization": 0.5, "num_gpu_blocks_override": 40,
                                 "max_num_active_seqs": 8, "enforce_eager": True, "trust_remote_code": True,
                                 "generation_config": "auto", "spec_method": "ngram", "spec_tokens": 2})
    assert kwargs == {"max_num_seqs": 8, "gpu_memory_utilization": 0.5, "num_kv_blocks": 40,
                      "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    # A cap with no value to cap caps the default (64), as the flag does.
    assert vllm_engine_kwargs({"max_num_active_seqs": 128}) == {"max_num_seqs": 64}
    assert vllm_engine_kwargs({"max_num_scheduled_tokens": 256.0}) == {"max_num_batched_tokens": 256}
    assert EngineConfig(**kwargs).speculative.num_speculative_tokens == 2
    with pytest.raises(TypeError, match="response_role= is vLLM's --response-role, a flag of the server"):
        vllm_engine_kwargs({"response_role": "bot"})
    with pytest.raises(TypeError, match="swap_space= is neither an EngineConfig field nor a keyword of vLLM 0.34's"):
        vllm_engine_kwargs({"swap_space": 4})  # vLLM's before 0.34
    with pytest.raises(ValueError, match="runner= 'pooling' is not supported"):
        vllm_engine_kwargs({"runner": "pooling"})
    # Every EngineArgs keyword vLLM's LLM takes is an EngineConfig field, a parameter of LLMEngine, or has a rule.
    fields = {f.name for f in dataclasses.fields(EngineConfig)} | {"model", "tokenizer", "served_model_name"}
    assert [f["dest"] for f in FLAGS if f["engine"] and f["dest"] not in fields | set(RULES) | set(LLM_RULES)] == []
    assert vllm_engine_kwargs({"reasoning_parser": "qwen3", "shutdown_timeout": 5, "log_level": "debug"}) == {}


def test_advisory_keywords_are_logged_with_the_reason(capfd):
    vllm_engine_kwargs({"enforce_eager": True, "pipeline_parallel_size": 2})
    [message] = log_messages(capfd.readouterr().err, "INFO", "vllm_flags.py")
    assert message.startswith("vLLM keywords accepted without effect: enforce_eager=True (jaxllm's steps are "
                              "always compiled XLA programs; --token-buckets and --precompile choose them); "
                              "pipeline_parallel_size=2 (a vLLM parallelism")


class FakeDevice:
    def __init__(self, platform, limit=0, in_use=0):
        self.platform, self._stats = platform, {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self._stats


def test_gpu_memory_utilization_sizes_the_default_kv_budget():
    gpu = FakeDevice("gpu", limit=80 * 2**30, in_use=2 * 2**30)
    assert default_kv_cache_bytes(gpu, 0.9) == int(80 * 2**30 * 0.9) - 2 * 2**30
    assert default_kv_cache_bytes(gpu, 0.5) == 38 * 2**30
    assert default_kv_cache_bytes(gpu, 0.02) == 0  # less than the weights: nothing, and sizing then says so
    assert default_kv_cache_bytes(FakeDevice("cpu"), 0.5) == CPU_DEFAULT_KV_BYTES
    for bad in (0, 1.01, -0.5, True, "0.9"):
        with pytest.raises(ValueError, match=f"gpu_memory_utilization={bad!r} must be in"):
            EngineConfig(gpu_memory_utilization=bad)


@pytest.mark.parametrize("bad", [-2, 21, 2.5, True])
def test_max_logprobs_outside_what_jaxllm_computes_is_refused(bad):
    with pytest.raises(ValueError, match=f"max_logprobs={bad!r} must be an int in \\[-1, 20\\]"):
        EngineConfig(max_logprobs=bad)
    # vLLM's -1 (the whole vocabulary) is the most jaxllm computes.
    from jaxllm.frontend.input_processor import InputProcessor

    assert InputProcessor(None, None, max_logprobs=-1).max_logprobs == 20


# ---- the server with vLLM's flags ------------------------------------------------------------------------------

TEMPLATE = ("{{ bos_token }}{{ greeting | default('') }}{% if tools %}[tools]{% endif %}{% for m in messages %}"
            "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
USER = [{"role": "user", "content": "Tell me a story."}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
KEYS = ("key-1", "key-2")


def without_tokenizer(stories_dir: Path, folder: Path) -> Path:
    """stories260K's weights and configs in ``folder``, without its tokenizer."""
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (folder / name).symlink_to(stories_dir / name)
    return folder


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_flags_server")
    (folder / "template.jinja").write_text(TEMPLATE)
    model = without_tokenizer(stories_dir, folder / "model")
    server = Server(model, *engine_flags(), "--tokenizer", str(stories_dir), "--chat-template",
                    str(folder / "template.jinja"), "--served-model-name", "stories", "tales", "--api-key", *KEYS,
                    "--response-role", "narrator", "--enable-force-include-usage", "--return-tokens-as-token-ids",
                    "--default-chat-template-kwargs", '{"greeting": "Hello. "}', "--enable-request-id-headers",
                    "--max-logprobs", "2", "--generation-config", "vllm", "--override-generation-config",
                    '{"temperature": 0.0, "max_new_tokens": 2}', "--exclude-tools-when-tool-choice-none",
                    "--disable-fastapi-docs", "--enable-log-requests", "--enforce-eager", "--trust-remote-code",
                    "--gpu-memory-utilization", "0.8", log=folder / "server.log")
    try:
        yield server.start()
    finally:
        server.stop()


def post(server, path, body, key=KEYS[1]):
    return httpx.post(f"{server.url}{path}", json=body, timeout=300, headers={"Authorization": f"Bearer {key}"})


def test_the_server_honours_vllms_chat_flags(server):
    reply = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 4})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "narrator"
    assert len(reply.headers["x-request-id"]) == 32
    # Without the generation prompt the role is the last message's, as vLLM's.
    continued = post(server, "/v1/chat/completions", {"messages": USER + [{"role": "assistant", "content": "Once"}],
                                                      "add_generation_prompt": False, "max_tokens": 2})
    assert continued.json()["choices"][0]["message"]["role"] == "assistant"
    rendered = post(server, "/v1/chat/completions/render", {"messages": USER}).json()
    text = post(server, "/detokenize", {"tokens": rendered["token_ids"]}).json()["prompt"]
    assert text.startswith("Hello. user: Tell me a story.")
    assert post(server, "/tokenize", {"messages": USER}).json()["tokens"] == rendered["token_ids"]
    # A request's own value wins, but None and "auto" leave the default, as vLLM's renderer merges them.
    for value, greeting in (("Hi. ", "Hi. "), (None, "Hello. "), ("auto", "Hello. ")):
        ids = post(server, "/tokenize", {"messages": USER, "chat_template_kwargs": {"greeting": value}}).json()["tokens"]
        assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"].startswith(greeting + "user:")
    # --override-generation-config's temperature over --generation-config vllm's none.
    assert rendered["sampling_params"]["temperature"] == 0.0
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=300, headers={"Authorization": "Bearer key-2"},
                      json={"messages": USER, "max_tokens": 3, "stream": True}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"]["role"] == "narrator"
    # No stream_options: --enable-force-include-usage puts usage on every chunk and a last usage chunk, as vLLM.
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["choices"] == []
    assert all(c["usage"] is not None for c in chunks)
    # No max_tokens: the generation config's max_new_tokens (--override-generation-config).
    assert post(server, "/v1/chat/completions", {"messages": USER}).json()["usage"]["completion_tokens"] == 2


def test_the_server_reads_with_the_tokenizer_given_and_serves_every_name_and_key(server):
    # The model folder has no tokenizer: --tokenizer's renders the chat, and the engine core's grammar reads it.
    choice = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8,
                                               "structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.status_code == 200 and choice.json()["choices"][0]["text"] in ("yes", "no")
    assert [m["id"] for m in httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer key-1"}).json()[
        "data"]] == ["stories", "tales"]
    assert post(server, "/v1/completions", {"model": "tales", "prompt": "Once", "max_tokens": 1},
                key="key-1").json()["model"] == "tales"
    assert post(server, "/v1/completions", {"prompt": "Once", "max_tokens": 1}, key="key-3").status_code == 401
    with_tools = {"messages": USER, "tools": TOOLS}
    rendered = {choice: post(server, "/v1/chat/completions/render", {**with_tools, "tool_choice": choice}).json()
                for choice in ("none", "required")}
    texts = {k: post(server, "/detokenize", {"tokens": v["token_ids"]}).json()["prompt"] for k, v in rendered.items()}
    assert "[tools]" in texts["required"] and "[tools]" not in texts["none"]


def test_the_server_honours_vllms_logprob_flags_and_logs(server):
    def tokens(**body):
        reply = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3, **body}).json()
        return reply["choices"][0]["logprobs"]["tokens"]

    assert len(tokens(logprobs=2)) == 3 and all(t.startswith("token_id:") and t[9:].isdigit()
                                                  for t in tokens(logprobs=0))
    # The request's own false wins over the server's default.
    assert not any(t.startswith("token_id:") for t in tokens(logprobs=1, return_tokens_as_token_ids=False))
    for path, body, param in (("/v1/completions", {"prompt": "Once upon a time", "logprobs": 3}, "logprobs"),
                              ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 3},
                               "top_logprobs"),
                              ("/v1/completions", {"prompt": "Once", "prompt_logprobs": 3}, "prompt_logprobs")):
        refused = post(server, path, {**body, "max_tokens": 3})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
        assert refused.json()["error"]["message"].startswith(f"{param}=3 is more than max_logprobs=2")
    assert httpx.get(f"{server.url}/docs").status_code == 404
    infos = log_messages(server.log_text(), "INFO")
    [accepted] = [m for m in infos if m.startswith("vLLM flags accepted without effect: ")]
    assert "--trust-remote-code (jaxllm runs its own model code" in accepted and "--enforce-eager" in accepted
    assert any(m.startswith("request cmpl-") and ": 5 prompt tokens, SamplingParams(" in m for m in infos)


def test_llm_takes_vllms_keywords(stories_dir, tmp_path):
    from jaxllm import LLM, SamplingParams
    from scheduler import StructuredOutputsParams
    from tests.server_process import ENGINE

    model = without_tokenizer(stories_dir, tmp_path / "model")
    with pytest.raises(ValueError, match="tokenizer='/nowhere': no such file or folder: '/nowhere'"):
        LLM(model, tokenizer="/nowhere")
    with pytest.raises(ValueError, match=f"tokenizer='{model}': no tokenizer in '{model}'"):
        LLM(model, tokenizer=str(model))
    llm = LLM(model, **ENGINE, max_logprobs=1, num_gpu_blocks_override=40, enforce_eager=True,
              trust_remote_code=True, served_model_name="stories", tokenizer=str(stories_dir),
              override_generation_config={"temperature": 0.0, "max_new_tokens": 3},
              chat_template="Story:{% for m in messages %} {{ m['content'] }}{% endfor %}")
    # chat_template: chat()'s template when a call gives none, as vLLM's LLM.
    [chat] = llm.chat([{"role": "user", "content": "Lily"}], use_tqdm=False)
    assert llm.get_tokenizer().decode(chat.prompt_token_ids).endswith("Story: Lily")
    # The engine core reads grammars with the tokenizer given (the model folder has none).
    yes_no = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.generate("Once upon a time", yes_no, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    assert llm.engine.client.infos[0].num_blocks == 40 and llm.engine.metrics.model_name == "stories"
    [out] = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=3, logprobs=1), use_tqdm=False)
    assert len(out.outputs[0].logprobs) == 3
    # No SamplingParams: the generation config's defaults (the override's here), as vLLM's LLM.
    assert (llm.get_default_sampling_params().temperature, llm.get_default_sampling_params().max_tokens) == (0.0, 3)
    [default] = llm.generate("Once upon a time", use_tqdm=False)
    assert default.outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt_logprobs=2 is more than max_logprobs=1, the most this engine serves"):
        llm.generate("Once upon a time", SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)


def test_sampling_defaults_follow_vllms_generation_config_option(tmp_path):
    from jaxllm.paths import sampling_defaults

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_k": 20, "max_new_tokens": 9, '
                                                     '"do_sample": true}')
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20, "max_tokens": 9}
    assert sampling_defaults(tmp_path, "vllm") == {}
    assert sampling_defaults(None, str(tmp_path), {"top_k": 5}) == {"temperature": 0.6, "top_k": 5, "max_tokens": 9}
    assert sampling_defaults(tmp_path / "model.gguf") == {}
    # Every key vLLM's get_diff_sampling_param reads.
    assert sampling_defaults(None, "vllm", {"presence_penalty": 0.5, "frequency_penalty": 0.1,
                                            "skip_special_tokens": False, "do_sample": True}) == {
        "presence_penalty": 0.5, "frequency_penalty": 0.1, "skip_special_tokens": False}
    with pytest.raises(ValueError, match="generation_config='nowhere' must be 'auto'"):
        sampling_defaults(tmp_path, "nowhere")
    with pytest.raises(ValueError, match="--generation-config 'nowhere' must be 'auto'"):
        parse("--generation-config", "nowhere")


def test_gpu_memory_utilization_sizes_the_blocks_an_accelerator_gets(stories_dir):
    from jaxllm.loader import load_model
    from jaxllm.worker.kv_cache import bytes_per_block, resolve_num_blocks

    cfg = load_model(stories_dir)[0]
    per_block = bytes_per_block(cfg, 16, np.float32)
    gpu = FakeDevice("gpu", limit=1000 * per_block, in_use=100 * per_block)
    sizes = dict(block_size=16, dtype=np.float32, num_kv_blocks=None, kv_cache_memory_bytes=None, max_num_seqs=1000,
                 max_model_len=512, device=gpu)
    assert resolve_num_blocks(cfg, gpu_memory_utilization=0.5, **sizes) == 400
    assert resolve_num_blocks(cfg, gpu_memory_utilization=0.9, **sizes) == 800
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=\d+ \(gpu_memory_utilization=0.12 of gpu's memory "
                                         r"less what is in use\) holds 20 KV blocks"):
        resolve_num_blocks(cfg, gpu_memory_utilization=0.12, **sizes)
    assert EngineConfig(gpu_memory_utilization=0.5).cache.gpu_memory_utilization == 0.5


def test_disable_sliding_window_caps_the_length_at_the_window(stories_dir):
    from jaxllm.core.build import model_length
    from jaxllm.loader import load_model

    stories = load_model(stories_dir)[0]
    windowed = dataclasses.replace(stories, sliding_windows=(None, 64, 128))
    assert parse("--disable-sliding-window").disable_sliding_window is True
    assert model_length(windowed, EngineConfig(disable_sliding_window=True)) == 64
    assert model_length(windowed, EngineConfig()) == model_length(stories, EngineConfig(disable_sliding_window=True)) \
        == stories.max_position_embeddings == 512  # no window: unchanged, as vLLM ignores the flag
    with pytest.raises(ValueError, match="max_model_len=100 is longer than the model's sliding window, 64 tokens"):
        model_length(windowed, EngineConfig(disable_sliding_window=True, max_model_len=100))


def test_a_setting_the_engine_core_cannot_serve_is_one_line_naming_it(stories_dir):
    # -tp 2 on one CPU device: the core's ValueError, once, with the way to more host devices; no traceback.
    proc = subprocess.run([sys.executable, "-m", "jaxllm.entrypoints.cli", "serve", str(stories_dir), "-tp", "2",
                           *engine_flags(), "--port", "0"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XLA_FLAGS": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: engine core 0 failed to start: data_parallel_size=1 x tensor_parallel_size=2 needs 2 devices; 1 is "
        "available (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=2 makes 2)")
    # The core's traceback is at debug level, for a ValueError that is a bug.
    debug = subprocess.run([*proc.args, "--log-level", "debug"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "XLA_FLAGS": ""})
    assert "engine core 0 failed to build:\nTraceback (most recent call last):" in debug.stderr


def test_chat_template_variables_merge_as_vllms_renderer():
    from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest
    from jaxllm.entrypoints.openai.serving import chat_template_kwargs

    def merged(defaults=None, **body):
        return chat_template_kwargs(ChatCompletionRequest(messages=USER, **body), defaults)

    # The request's top-level reasoning_effort over its chat_template_kwargs, enable_thinking unless they set it.
    assert merged(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}) == {
        "reasoning_effort": "high", "enable_thinking": True}
    assert merged(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == {
        "reasoning_effort": "none", "enable_thinking": True}
    # Server defaults under everything; None and "auto" leave a default, and stand as given without defaults.
    assert merged({"a": 1, "b": 2}, chat_template_kwargs={"a": None, "b": "auto", "c": 3}) == {"a": 1, "b": 2, "c": 3}
    assert merged(chat_template_kwargs={"a": None}) == {"a": None} and merged() is None


def test_beam_search_past_max_logprobs_is_a_400_naming_n(server):
    # --max-logprobs 2: a beam search step of n=2 beams reads the top 4 logprobs.
    body = {"prompt": "Once", "max_tokens": 2, "n": 2, "use_beam_search": True}
    reply = post(server, "/v1/completions", body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n", reply.text
    assert "more than max_logprobs=2 (--max-logprobs)" in reply.json()["error"]["message"]
    assert post(server, "/v1/completions", {**body, "n": 1}).status_code == 200
