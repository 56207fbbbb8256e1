"""orbax-checkpoint storage of the parameter pytree, restored straight into shardings.

Layout of a jaxllm orbax checkpoint folder (written by
``scripts/convert_checkpoint.py``)::

    <dir>/config.json        the HF-style model config (what ModelConfig reads)
    <dir>/params/            orbax StandardCheckpointer tree: the pytree of
                             ``jaxllm.models`` (``[in, out]`` weights; int8 or
                             float8 ones with their ``_scale`` leaves when
                             converted with ``--quantization``)
    <dir>/tokenizer*.json    the tokenizer, when the source had one

Restoring hands orbax a target of ``jax.ShapeDtypeStruct``s carrying each
parameter's ``NamedSharding``, so every device reads only its own slice from
storage (orbax/TensorStore chunked reads); no array is assembled on the host.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from jaxllm.worker.quantization import leaf_dtype
from jaxllm.worker.sharding import ModelSharding

if TYPE_CHECKING:
    from jaxllm.models.common import Params

PARAMS_DIR = "params"
_METADATA_FILE = "_CHECKPOINT_METADATA"


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """True for a folder holding ``config.json`` and an orbax ``params/`` tree."""
    p = Path(path)
    return (p / "config.json").is_file() and (p / PARAMS_DIR / _METADATA_FILE).is_file()


def save_checkpoint(path: str | os.PathLike, params: Params, hf_config: dict) -> None:
    """Write ``params`` (numpy or jax arrays) and ``hf_config`` as a jaxllm orbax checkpoint.

    Raises:
      ValueError: ``path`` exists and is not empty (nothing is overwritten).
    """
    import orbax.checkpoint as ocp

    folder = Path(path).absolute()
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"checkpoint folder {str(folder)!r} exists and is not empty")
    folder.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(folder / PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2, default=str))


def restore_params(path: str | os.PathLike, sharding: ModelSharding, dtype: Any) -> Params:
    """Restore the parameter pytree into ``sharding``'s parameter shardings.

    Args:
      path: a folder :func:`is_orbax_checkpoint` accepts.
      sharding: the target layout (any tensor-parallel degree, whatever the
        checkpoint was written from).
      dtype: dtype of the restored arrays (orbax casts while reading);
        quantized weights keep their stored dtype and scales are float32
        (``jaxllm.worker.quantization.leaf_dtype``).

    Returns:
      The pytree of ``jax.Array``s, each sharded as ``sharding.param_specs``.
    """
    import orbax.checkpoint as ocp

    folder = Path(path).absolute() / PARAMS_DIR
    checkpointer = ocp.StandardCheckpointer()
    metadata = checkpointer.metadata(folder).item_metadata.tree
    shardings = sharding.param_shardings(metadata)
    target = jax.tree_util.tree_map_with_path(
        lambda path, m, s: jax.ShapeDtypeStruct(m.shape, leaf_dtype(path[-1].key, m.dtype, dtype), sharding=s),
        metadata, shardings)
    return checkpointer.restore(folder, target)
