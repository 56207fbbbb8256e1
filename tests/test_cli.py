"""The CLI, run as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib

import pytest

from jaxllm.generate import FALLBACK_SAMPLING, build_parser, sampling_params
from tests.conftest import ROOT, STORIES_SENTENCE, log_messages


def _cli(*args, timeout=600, module="jaxllm.generate", python_flags=()):
    return subprocess.run([sys.executable, *python_flags, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout)


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from ``python -X importtime`` output."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_cli_stories260k_prints_the_reference_sentence(stories_dir):
    proc = _cli("--model", str(stories_dir), "--prompt", "Once upon a time", "--max-tokens", "40",
                "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == STORIES_SENTENCE


def test_cli_stdout_holds_only_the_generated_text_and_the_start_up_log_is_asked_for(stories_dir):
    # The report: "The capital of France is[jaxllm] building ...", start-up lines amid the generated text.
    args = ("--model", str(stories_dir), "--max-tokens", "40", "--temperature", "0")
    quiet, told = _cli(*args), _cli(*args, "--log-level", "info")
    assert quiet.returncode == 0 and told.returncode == 0, quiet.stderr + told.stderr
    assert quiet.stdout == told.stdout == STORIES_SENTENCE + "\n"
    assert log_messages(quiet.stderr, "INFO") == [] and "[jaxllm]" not in quiet.stderr  # warnings only by default
    assert f"loading {stories_dir}" in log_messages(told.stderr, "INFO")


def test_cli_default_model_names_paris(smollm2_gguf):
    proc = _cli("--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is")
    assert "Paris" in proc.stdout


def test_cli_missing_model_exits_with_a_clear_error(tmp_path):
    proc = _cli("--model", str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr


def test_cli_bad_max_tokens_exits_with_a_clear_error(stories_dir):
    proc = _cli("--model", str(stories_dir), "--max-tokens", "0")
    assert proc.returncode == 2
    assert "--max-tokens 0 is out of range" in proc.stderr


# ---- the CLI as a new user tries it (issue 11, item 9) ------------------------------------------

BAD_FLAGS = [
    (["--prompt", ""], "--prompt number 1 is empty"),
    (["--prompt", "ok", "--prompt", ""], "--prompt number 2 is empty"),
    (["--max-model-len", "0"], "--max-model-len 0 must be a positive int"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--quantization", "int4"], "argument --quantization: invalid choice: 'int4'"),
    (["--kv-cache-dtype", "fp8_e5m2"], "argument --kv-cache-dtype: invalid choice: 'fp8_e5m2'"),
    (["--n", "0"], "--n 0 is out of range"),
    (["--temperature", "-1"], "--temperature -1.0 is out of range"),
    (["--top-p", "1.5"], "--top-p 1.5 is out of range"),
    (["--top-k", "-3"], "--top-k -3 is out of range"),
    (["--min-p", "2"], "--min-p 2.0 is out of range"),
    (["--max-num-seqs", "0"], "--max-num-seqs 0 is out of range: must be an int >= 1"),
    (["--logprobs", "-1"], "--logprobs -1 is out of range"),
    (["--stop", ""], "--stop [''] is out of range"),
    (["--max-tokens", "0"], "--max-tokens 0 is out of range"),
    (["--max-tokens", "four"], "argument --max-tokens: invalid int value"),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_issue11_cli_flags_are_checked_before_loading(stories_dir, flags, message):
    proc = _cli("--model", str(stories_dir), *flags, python_flags=("-X", "importtime"))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "loading" not in proc.stderr and "jax" not in imported_modules(proc.stderr)


def test_issue11_cli_no_abbreviations(stories_dir):
    proc = _cli("--model", str(stories_dir), "--max-token", "4", python_flags=("-X", "importtime"))
    assert proc.returncode == 2 and "unrecognized arguments: --max-token 4" in proc.stderr
    assert "jax" not in imported_modules(proc.stderr)


@pytest.mark.parametrize("kind", ["text-file", "gguf-named-text", "folder-without-config", "missing"])
def test_issue11_cli_model_that_is_not_a_model_is_named(tmp_path, kind):
    path, message = {
        "text-file": (ROOT / "README.md", "is a file but not a GGUF model"),
        "gguf-named-text": (tmp_path / "model.gguf", "is a file but not a GGUF model"),
        "folder-without-config": (tmp_path, "has no config.json"),
        "missing": (tmp_path / "missing", "does not exist"),
    }[kind]
    (tmp_path / "model.gguf").write_text("not a model")
    proc = _cli("--model", str(path), python_flags=("-X", "importtime"))
    assert proc.returncode == 2 and message in proc.stderr and str(path) in proc.stderr
    assert "jax" not in imported_modules(proc.stderr)


def test_issue11_cli_prompt_beyond_max_model_len(stories_dir):
    proc = _cli("--model", str(stories_dir), "--max-model-len", "12", "--max-tokens", "20", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    # 5 prompt tokens leave 7 under max_model_len=12: said on stderr (a warning, logged by default), then generated.
    assert "prompt 0 has 5 tokens, so under max_model_len=12 (--max-model-len) its output stops after 7 of the 20 " \
           "--max-tokens" in log_messages(proc.stderr, "WARNING")
    assert proc.stdout.strip() == "Once upon a time, there was a little gir"
    longer = _cli("--model", str(stories_dir), "--max-model-len", "4")
    assert longer.returncode == 2 and "prompt 0 has 5 tokens, more than max_model_len=4" in longer.stderr
    assert "loading" not in longer.stderr  # refused before any weight is read


@pytest.mark.parametrize("delay", [0.0, 1.0, 3.0])
def test_issue11_cli_ctrl_c_exits_quietly_with_130(stories_dir, delay):
    # A background job may inherit SIGINT ignored, and Python then installs no handler; in a
    # terminal Ctrl-C meets Python's default handler, so the child installs it first.
    argv = ["jaxllm.generate", "--model", str(stories_dir), "--precompile", "--max-tokens", "500",
            "--prompt", "Once upon a time", "--prompt", "One day", "--log-level", "info"]  # info: the "loading" line
    child = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             f"sys.argv = {argv!r}; runpy.run_module('jaxllm.generate', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "loading" in line:
            break
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.rstrip().endswith("[jaxllm] interrupted")


def test_issue11_cli_n_stop_logprobs_min_p_max_num_seqs(stories_dir):
    proc = _cli("--model", str(stories_dir), "--temperature", "0", "--max-tokens", "40", "--n", "2", "--stop", "Lily",
                "--stop", "zebra", "--logprobs", "1", "--min-p", "0.05", "--max-num-seqs", "4")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("--- [")]
    assert [lines[i] for i in heads] == [f"--- [0.{j}] Once upon a time, there was a little girl named " for j in (0, 1)]
    # One line per generated token (", there was a little girl named Lily": 10 tokens), greedy: the top token.
    for start in heads:
        rows = [line.split("\t") for line in lines[start + 1:start + 11]]
        assert [r[0] for r in rows] == ["  ','", "  'there'", "  'was'", "  'a'", "  'little'", "  'g'", "  'ir'",
                                        "  'l'", "  'named'", "  'Lily'"]
        assert all(-20 < float(r[1]) <= 0 and r[2].startswith(f"top: {r[0].strip()} ") for r in rows)
    assert len(lines) == 22


def test_issue11_cli_version_help_and_dtype_choices():
    assert _cli("--version").stdout.strip() == "jaxllm 0.1.0"
    assert _cli("--version", module="jaxllm.entrypoints.cli").stdout.strip() == "jaxllm 0.1.0"
    helps = [_cli("--help", python_flags=("-X", "importtime")),
             _cli("generate", "--help", module="jaxllm.entrypoints.cli", python_flags=("-X", "importtime"))]
    for proc in helps:
        assert proc.returncode == 0
        assert "--dtype {auto,float32,bfloat16,float16,half,float}" in proc.stdout
        for flag in ("--n", "--stop", "--logprobs", "--min-p", "--max-num-seqs", "--version"):
            assert re.search(rf"^  {flag} ", proc.stdout, re.M), flag
        assert "jax" not in imported_modules(proc.stderr)  # --help is instant: JAX is not imported
    assert helps[1].stdout.startswith("usage: jaxllm generate ")


def _args(*argv):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("generation_config, flags, expected", [
    ({}, [], dict(FALLBACK_SAMPLING, top_k=0, min_p=0.0, max_tokens=64)),
    ({"do_sample": True, "eos_token_id": 2}, [], dict(FALLBACK_SAMPLING, max_tokens=64)),
    ({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
      "max_new_tokens": 100}, [], dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                                       max_tokens=100)),
    # Keys it does not set take SamplingParams' defaults, as vLLM's generation_config="auto".
    ({"temperature": 0.6}, [], dict(temperature=0.6, top_p=1.0, max_tokens=64)),
    ({"temperature": 0.6, "top_p": 0.9}, ["--temperature", "0", "--max-tokens", "5"],
     dict(temperature=0.0, top_p=0.9, max_tokens=5)),
])
def test_issue11_cli_default_sampling_from_generation_config(generation_config, flags, expected):
    params = sampling_params(_args(*flags), generation_config)
    assert {k: getattr(params, k) for k in expected} == expected


def test_issue11_cli_uses_the_models_generation_config(stories_dir, tmp_path):
    model = tmp_path / "greedy"
    shutil.copytree(stories_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.0}))
    proc = _cli("--model", str(model), "--max-tokens", "40", "--log-level", "info")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == STORIES_SENTENCE  # greedy, from generation_config.json
    assert "(defaults from the model's generation_config.json)" in proc.stderr


def test_issue11_cli_jaxllm_generate_subcommand(stories_dir):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"jaxllm": "jaxllm.entrypoints.cli:main", "jaxllm-generate": "jaxllm.generate:main"}
    proc = _cli("generate", "--model", str(stories_dir), "--max-tokens", "40", "--temperature", "0",
                module="jaxllm.entrypoints.cli")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == STORIES_SENTENCE
    typo = _cli("generate", "--model", str(stories_dir), "--max-token", "4", module="jaxllm.entrypoints.cli")
    assert typo.returncode == 2 and "unrecognized arguments: --max-token 4" in typo.stderr


def test_serve_help_has_a_flag_for_every_engine_config_field_and_bad_flags_exit_2(stories_dir):
    import dataclasses

    from jaxllm.config import EngineConfig

    helped = _cli("serve", "--help", module="jaxllm.entrypoints.cli")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: jaxllm serve ")
    for flag in ["--host", "--port", "--api-key", "--served-model-name", "--max-waiting-requests",
                 "--shutdown-timeout"] + [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(EngineConfig)]:
        assert re.search(rf"^  {flag}\b", helped.stdout, re.M), flag
    bad = _cli("serve", str(stories_dir), "--max-num-seqs", "0", module="jaxllm.entrypoints.cli")
    assert bad.returncode == 2 and "error: --max-num-seqs 0 is out of range: must be an int >= 1" in bad.stderr
    missing = _cli("serve", str(stories_dir / "missing"), module="jaxllm.entrypoints.cli")
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def _printed(text: str) -> str:
    """``text`` without whitespace, so a description argparse wrapped over lines is found whole."""
    return "".join(text.split())


def test_generate_and_serve_help_print_each_engine_fields_description():
    from jaxllm.config import EngineConfig, field_docs

    docs = {d.name: d for d in field_docs(EngineConfig)}
    assert all(len(d.description) > 20 for d in docs.values()), [n for n, d in docs.items() if len(d.description) <= 20]
    serve = _cli("serve", "--help", module="jaxllm.entrypoints.cli")
    generate = _cli("--help")
    assert serve.returncode == 0 and generate.returncode == 0
    assert "EngineConfig.block_size" not in serve.stdout
    for doc in docs.values():
        assert _printed(f"{doc.description} (default: {doc.default})") in _printed(serve.stdout), doc.name
    for name in ("max_model_len", "kv_cache_memory_bytes", "max_num_seqs", "dtype", "quantization", "kv_cache_dtype"):
        assert _printed(docs[name].description) in _printed(generate.stdout), name
    assert _printed("Tokens per KV block, a power of two. (default: 16)") in _printed(serve.stdout)


# ---- issue 25 item 9: the sampling line says what is used ------------------------------------------

def test_issue25_item9_cli_sampling_line_under_temperature_0_has_no_unused_top_p(stories_dir):
    # The report: --temperature 0 printed "temperature=0.0 top_p=0.95 top_k=0 min_p=0.0 ..." (top_p the CLI's
    # unused default).
    proc = _cli("--model", str(stories_dir), "--max-tokens", "4", "--temperature", "0", "--log-level", "info")
    assert proc.returncode == 0, proc.stderr
    line = next(s for s in log_messages(proc.stderr, "INFO") if "sampling:" in s)
    assert line == "sampling: greedy (temperature=0.0) max_tokens=4 (defaults from the CLI)"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("top_k", [0, 1, 20])
@pytest.mark.parametrize("top_p, min_p, repetition_penalty", [(1.0, 0.0, 1.0), (0.95, 0.05, 1.1), (0.9, 0.0, 1.0)])
def test_issue25_item9_the_sampling_line_names_exactly_the_controls_in_use(temperature, top_k, top_p, min_p,
                                                                           repetition_penalty):
    from jaxllm.generate import describe_sampling
    from scheduler import SamplingParams

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty, max_tokens=7)
    named = dict(word.split("=", 1) for word in describe_sampling(params).replace("(", "").replace(")", "").split()
                 if "=" in word)
    greedy = temperature == 0 or top_k == 1
    assert describe_sampling(params).startswith("greedy (") == greedy
    used = {"max_tokens": "7"}
    if repetition_penalty != 1.0:
        used["repetition_penalty"] = str(repetition_penalty)
    if greedy:
        used |= {"top_k": "1"} if top_k == 1 else {"temperature": str(temperature)}
    else:
        used |= {"temperature": str(temperature)} | ({"top_k": str(top_k)} if top_k else {})
        used |= ({"top_p": str(top_p)} if top_p < 1 else {}) | ({"min_p": str(min_p)} if min_p else {})
    assert named == used


STORY_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


def test_chat_template_flag_lets_generate_chat_with_a_model_without_one(stories_dir, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(STORY_TEMPLATE)
    proc = _cli("--model", str(stories_dir), "--chat", "--chat-template", str(template), "--prompt", "Tell me a story.",
                "--max-tokens", "12", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    from jaxllm import LLM, SamplingParams

    want = LLM(model=stories_dir, precompile=False, max_model_len=128).chat(
        [{"role": "user", "content": "Tell me a story."}], SamplingParams(temperature=0, max_tokens=12),
        chat_template=STORY_TEMPLATE, use_tqdm=False)[0].outputs[0].text
    assert want and proc.stdout.strip() == want.strip()


@pytest.mark.parametrize("flags, message", [
    (["--chat-template", "{{ messages }}"], "--chat-template applies to --chat prompts: add --chat"),
    (["--chat", "--chat-template", "no-such-template.jinja"], "--chat-template no-such-template.jinja: no such file"),
    (["--chat", "--chat-template", "{% for %}"], "error: the chat template is not valid jinja2"),
])
def test_a_chat_template_flag_that_cannot_be_used_exits_2_before_the_model_loads(stories_dir, flags, message):
    proc = _cli("--model", str(stories_dir), *flags, python_flags=("-X", "importtime"))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "jax" not in imported_modules(proc.stderr)
