"""Models by their Hugging Face Hub id, read offline from a hub cache laid out here (huggingface_hub's layout), and
the served model id: the name the user gave."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from jaxllm.named_models import DEFAULT_MODEL, NAMED_MODELS, resolve_model
from tests.conftest import STORIES_SENTENCE
from tests.server_process import Server, engine_flags

REPO = "jaxllm-test/stories260K"
COMMIT, TAGGED = "0123456789abcdef0123456789abcdef01234567", "89abcdef0123456789abcdef0123456789abcdef"


def lay_out_snapshot(cache: Path, repo: str, files: Path, commit: str, ref: str) -> Path:
    """huggingface_hub's cache layout for ``repo`` at ``commit``: each file of ``files`` in ``blobs/`` (named by
    its sha256), ``snapshots/<commit>/<name>`` a relative link to its blob, ``refs/<ref>`` holding the commit.
    Returns the snapshot folder."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in sorted(files.iterdir()):
        data = file.read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, stories_dir) -> Path:
    """A hub cache holding stories260K as REPO: main at COMMIT, and tag v1 at TAGGED (its generation config
    greedy)."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    lay_out_snapshot(cache, REPO, stories_dir, COMMIT, "main")
    tagged = tmp_path_factory.mktemp("tagged")
    for file in stories_dir.iterdir():
        (tagged / file.name).write_bytes(file.read_bytes())
    generation_config = json.loads((stories_dir / "generation_config.json").read_text())
    (tagged / "generation_config.json").write_text(json.dumps({**generation_config, "temperature": 0.0}))
    lay_out_snapshot(cache, REPO, tagged, TAGGED, "v1")
    return cache


def offline(**env: str) -> dict[str, str]:
    """This environment with the Hub offline and no hub cache of the user's, plus ``env``."""
    kept = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    return {**kept, "HF_HUB_OFFLINE": "1", **env}


def _resolve_in(env: dict[str, str], *calls: str) -> list[str]:
    """``resolve_model(call)`` for each call's arguments, in a process with ``env`` (huggingface_hub reads its
    variables when imported)."""
    code = ("import sys; from jaxllm.named_models import resolve_model; "
            + "; ".join(f"print(resolve_model({call}))" for call in calls))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_a_hub_id_resolves_to_its_snapshot_in_the_hub_cache_offline(hub_cache):
    snapshots = hub_cache / f"models--{REPO.replace('/', '--')}" / "snapshots"
    main, tagged = str(snapshots / COMMIT), str(snapshots / TAGGED)
    calls = (f"{REPO!r}", f"{REPO!r}, revision='v1'", f"{REPO!r}, revision={COMMIT!r}")
    assert _resolve_in(offline(HF_HUB_CACHE=str(hub_cache)), *calls) == [main, tagged, main]
    # HF_HOME's hub folder, and vLLM's download_dir instead of the Hub's cache.
    assert _resolve_in(offline(HF_HOME=str(hub_cache.parent)), calls[0]) == [main]
    assert _resolve_in(offline(HF_HUB_CACHE=str(hub_cache.parent / "elsewhere")),
                       f"{REPO!r}, download_dir={str(hub_cache)!r}") == [main]


def test_a_local_path_and_a_named_model_come_before_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / REPO).mkdir(parents=True)
    assert resolve_model(REPO) == Path(REPO)
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    named = tmp_path / "cache" / NAMED_MODELS["gemma3-270m"].file
    named.parent.mkdir()
    named.write_bytes(b"GGUF")
    assert resolve_model("gemma3-270m") == named


@pytest.mark.parametrize("command", [["jaxllm.generate", "--model"], ["jaxllm.entrypoints.cli", "serve"]])
def test_a_hub_id_missing_offline_is_named_with_how_to_get_it(hub_cache, command):
    proc = subprocess.run([sys.executable, "-m", *command, "jaxllm-test/missing"], capture_output=True, text=True,
                          env=offline(HF_HUB_CACHE=str(hub_cache)), timeout=120)
    assert proc.returncode == 2
    assert "model 'jaxllm-test/missing' is not a local path, a named model (gemma3-270m, smollm2-135m-instruct), " \
           f"nor in the Hugging Face Hub cache {hub_cache}, and HF_HUB_OFFLINE=1 forbids downloading it: download " \
           "it once online with `hf download jaxllm-test/missing`" in proc.stderr, proc.stderr


def test_generate_and_llm_run_a_model_by_its_hub_id(hub_cache, monkeypatch):
    proc = subprocess.run([sys.executable, "-m", "jaxllm.generate", "--model", REPO, "--revision", "v1",
                           "--max-tokens", "40"], capture_output=True, text=True,
                          env=offline(HF_HUB_CACHE=str(hub_cache)), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == STORIES_SENTENCE  # greedy: the v1 snapshot's generation config
    import huggingface_hub.constants
    from jaxllm import LLM, SamplingParams

    # This process imported huggingface_hub before the test could set HF_HUB_OFFLINE: offline mode set as it reads.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    llm = LLM(REPO, download_dir=str(hub_cache), max_model_len=64, num_kv_blocks=16, precompile=False)
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert "Once upon a time" + out[0].outputs[0].text == STORIES_SENTENCE


def test_a_server_started_with_a_hub_id_serves_it_under_that_name(hub_cache, tmp_path):
    server = Server(REPO, *engine_flags(), log=tmp_path / "server.log", env=offline(HF_HUB_CACHE=str(hub_cache)))
    try:
        server.start()
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]] == [REPO]
        body = {"model": REPO, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == REPO
        assert "Once upon a time" + answer.json()["choices"][0]["text"] == STORIES_SENTENCE
        other = httpx.post(f"{server.url}/v1/completions", json={**body, "model": "stories"}, timeout=60)
        assert other.status_code == 404 and REPO in other.json()["error"]["message"]
    finally:
        server.stop()


def test_the_default_model_is_served_under_its_name(smollm2_gguf, tmp_path):
    # The report: the default model was served as its absolute cache path, and model="smollm2-135m-instruct" got a
    # 404.
    server = Server(None, *engine_flags(), log=tmp_path / "server.log")
    try:
        server.start()
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]] == [DEFAULT_MODEL]
        body = {"model": DEFAULT_MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        assert answer.status_code == 200 and answer.json()["model"] == DEFAULT_MODEL, answer.text
    finally:
        server.stop()
