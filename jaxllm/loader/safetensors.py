"""Load a Hugging Face model folder (config.json + ``model.safetensors`` or indexed shards) with no torch."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_hf_config(path: str | os.PathLike) -> dict:
    """Read ``config.json`` from a model folder.

    Raises:
      ValueError: the folder does not exist, or has no config.json.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model path {str(folder)!r} does not exist or is not a folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model folder {str(folder)!r} has no config.json")
    return json.loads(config_file.read_text())


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model folder, in shard order.

    Raises:
      ValueError: no ``model.safetensors`` nor index, or the index names a missing shard.
    """
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{INDEX_FILE} in {str(folder)!r} names missing shards: {missing}")
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise ValueError(f"model folder {str(folder)!r} has no *.safetensors weights (torch .bin files are not read)")


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    """``(hf_name, array)`` of every tensor as stored (bfloat16 as ``ml_dtypes.bfloat16``), one at a time in memory."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class LazyTensor:
    """One tensor of a safetensors file, read a slice at a time; ``read(index)`` returns ``view[index]`` as numpy.

    Args:
      handle: an open ``safe_open`` file (numpy). name: the tensor's name.
      transpose: present a 2-D ``[out, in]`` tensor as ``[in, out]`` without reading it.
      first_rows: ``(start, stop)`` of the stored rows to present (part of a fused tensor), or None.
    """

    def __init__(self, handle: Any, name: str, transpose: bool = False, first_rows: tuple[int, int] | None = None):
        self._handle = handle
        self.name = name
        self.transposed = transpose
        stored = tuple(handle.get_slice(name).get_shape())
        self._rows = first_rows or (0, stored[0])
        shape = (self._rows[1] - self._rows[0],) + stored[1:]
        self.shape = shape[::-1] if transpose else shape

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        stored = index[::-1] if self.transposed else index
        start, stop, step = stored[0].indices(self._rows[1] - self._rows[0])
        stored = (slice(self._rows[0] + start, self._rows[0] + stop, step),) + stored[1:]
        array = np.asarray(self._handle.get_slice(self.name)[stored])
        return array.T if self.transposed else array

    def as_transposed(self) -> "LazyTensor":
        return LazyTensor(self._handle, self.name, not self.transposed, self._rows)

    def rows(self, start: int, stop: int) -> "LazyTensor":
        """Rows ``start:stop`` of the stored (untransposed) tensor, still lazy."""
        return LazyTensor(self._handle, self.name, self.transposed, (self._rows[0] + start, self._rows[0] + stop))


class LazyStack:
    """Lazy tensors of one shape stacked on a new leading (layer) axis; ``read(index)`` reads only what it selects."""

    def __init__(self, tensors: list):
        self.tensors = list(tensors)
        self.shape = (len(self.tensors),) + tuple(self.tensors[0].shape)

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        return np.stack([t.read(index[1:]) for t in self.tensors[index[0]]])


def iter_lazy_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, LazyTensor]]:
    """``(hf_name, LazyTensor)`` of every tensor in the folder; nothing is read until ``read``."""
    for file in safetensors_files(path):
        handle = safe_open(str(file), framework="numpy")
        for name in handle.keys():
            yield name, LazyTensor(handle, name)
