"""The manual: README.md and the MkDocs site in docs/.

The site builds with ``mkdocs build --strict`` (a broken link, a missing anchor or a page left out of the nav
fails), the README's examples run as written (the offline one on the default model, the serving ones against a
stories260K server, with only the client's base_url pointed at it), the structured-output example prints what it
generated, and the reference pages name every environment variable the code reads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_process import Server, engine_flags

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
EXAMPLE_SECONDS = 600
# What the serving examples of the manual connect to; the test points it at its own server.
EXAMPLE_BASE_URL = 'base_url="http://localhost:8000/v1"'
# stories260K has no chat template: the test server renders a chat as BOS and the messages' text.
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def code_blocks(page: Path, language: str) -> list[str]:
    """The fenced code blocks of ``page`` in ``language``, in order, without their fences."""
    return re.findall(rf"^```{language}\n(.*?)^```$", page.read_text(), flags=re.DOTALL | re.MULTILINE)


def run_example(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python (this environment, so the session's model cache) and return the result."""
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                            timeout=EXAMPLE_SECONDS, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_mkdocs_build_strict_passes(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                             "-d", str(site)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-5000:]
    assert (site / "index.html").is_file()
    assert (site / "reference" / "configuration" / "index.html").is_file()
    assert (site / "operations" / "grafana.json").is_file() and (site / "operations" / "alert_rules.yml").is_file()


def test_readme_is_a_short_page_whose_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert "docs/index.md" in local
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    bash = [block.strip() for block in code_blocks(README, "bash")]
    assert ci in bash
    assert ("python -m pip install -q -e . && python -m jaxllm.generate --prompt \"The capital of France is\" "
            "--max-tokens 8 --temperature 0") in bash


def test_environment_page_names_every_jaxllm_variable():
    # The two JAXLLM_ names that are no environment variables: a shell flag of gpu_check.sh and a test's constant.
    not_variables = {"JAXLLM_OK", "JAXLLM_RUN_FIELDS"}
    sources = [p for d in ("jaxllm", "scheduler", "kernels_pallas", "scripts", "tests") for p in (ROOT / d).rglob("*")
               if p.suffix in (".py", ".sh", ".cc", ".h") and p != Path(__file__)]
    used = {name for p in sources for name in re.findall(r"\bJAXLLM_[A-Z0-9_]+", p.read_text())} - not_variables
    page = (DOCS / "reference" / "environment.md").read_text()
    assert "JAXLLM_DEQUANT_CACHE_GB" in used
    assert sorted(name for name in used if f"`{name}`" not in page) == []


def test_every_python_example_of_the_manual_compiles():
    pages = [README, *sorted(DOCS.rglob("*.md"))]
    blocks = [(page, block) for page in pages for block in code_blocks(page, "python")]
    assert len(blocks) >= 10
    for page, block in blocks:
        compile(block, str(page), "exec")


def test_benchmark_results_are_rendered_from_their_json_and_linked():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import render_results
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert render_results.main(["--check"]) == 0
    results = sorted((DOCS / "benchmarks" / "results").glob("*.json"))
    assert results
    index = (DOCS / "benchmarks" / "index.md").read_text()
    for path in results:
        payload = json.loads(path.read_text())
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", payload["date"]) and path.name.startswith(payload["date"])
        assert f"results/{path.stem}.md" in index


def test_readme_offline_example_runs_as_written(smollm2_gguf, tmp_path):
    [example] = [block for block in code_blocks(README, "python") if "from jaxllm import LLM" in block]
    out = run_example(example, tmp_path).stdout.splitlines()
    lines = [line for line in out if line.strip()]
    assert "Paris" in lines[0]
    assert len(lines) >= 2


def test_structured_output_example_prints_constrained_results(smollm2_gguf, tmp_path):
    [example] = code_blocks(DOCS / "serving" / "structured-output.md", "python")
    out = dict(line.split(": ", 1) for line in run_example(example, tmp_path).stdout.splitlines() if ": " in line)
    person = json.loads(out["json"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", out["regex"])
    assert out["choice"] in {"positive", "negative", "neutral"}
    assert re.fullmatch(r"[0-9]+ \+ [0-9]+", out["grammar"])


def test_research_example_updates_sleeps_and_generates():
    [example] = [block for block in code_blocks(DOCS / "research.md", "python") if "update_weights" in block]
    out = run_example(example, ROOT).stdout.splitlines()
    assert out[0] == out[1] == "{'num_leaves': 11, 'num_bytes': 1040128, 'num_preempted': 0}"
    assert out[2].strip()


@pytest.fixture(scope="module")
def example_server(stories_dir, tmp_path_factory):
    server = Server(stories_dir, *engine_flags(), "--chat-template", CHAT_TEMPLATE,
                    log=tmp_path_factory.mktemp("server") / "server.log").start()
    yield server
    assert server.stop() == 0


@pytest.mark.parametrize("page, marker", [(README, "chat.completions"),
                                          (DOCS / "serving" / "openai.md", "completions.create"),
                                          (DOCS / "serving" / "tools.md", "tool_calls")],
                         ids=["readme", "serving-openai", "serving-tools"])
def test_serving_examples_run_against_a_server(example_server, page, marker, tmp_path):
    [example] = [block for block in code_blocks(page, "python") if marker in block]
    assert EXAMPLE_BASE_URL in example
    code = example.replace(EXAMPLE_BASE_URL, f'base_url="{example_server.url}/v1"')
    out = run_example(code, tmp_path).stdout
    assert out.strip()
    if "tool_calls" in example:
        name, arguments = out.splitlines()[0].split(" ", 1)
        assert name == "get_weather" and "city" in json.loads(arguments)
