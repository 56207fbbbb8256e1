"""orbax-checkpoint storage of the parameter pytree, restored straight into shardings.

A checkpoint folder (``scripts/convert_checkpoint.py``) holds ``config.json``, ``params/`` (the
``jaxllm.models`` pytree, ``[in, out]`` weights, ``_scale`` leaves when quantized) and tokenizer files.
Each device reads only its own slice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxllm.worker.sharding import ModelSharding
from jaxllm.worker.weights import param_targets

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
    """Restore the parameter pytree into ``sharding``'s parameter shardings (any tensor-parallel degree).

    ``dtype``: of the restored arrays (quantized weights keep theirs, scales float32: ``weights.param_targets``).
    Returns ``jax.Array``s sharded as ``sharding.param_specs``.
    """
    import orbax.checkpoint as ocp

    folder = Path(path).absolute() / PARAMS_DIR
    checkpointer = ocp.StandardCheckpointer()
    metadata = checkpointer.metadata(folder).item_metadata.tree
    return checkpointer.restore(folder, param_targets(sharding, metadata, dtype))
