"""Convert a HF model folder or a GGUF file to a jaxllm orbax checkpoint.

Usage: python scripts/convert_checkpoint.py SOURCE DEST [--dtype float32|bfloat16|float16] [--quantization int8|fp8]
           [--num-layers N]

DEST gets ``params/`` (orbax), ``config.json`` and, from a HF folder, the tokenizer files (a GGUF's tokenizer
is not converted). ``--quantization`` stores the dense projections quantized with float32 per-channel scales.
``--num-layers N`` keeps the first N decoder layers: a layer-skipping draft model for speculative decoding
(Draft & Verify, Zhang et al. 2023).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

# Import this checkout's jaxllm/, not whatever an editable install points at.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxllm.core.build import resolve_dtype  # noqa: E402
from jaxllm.loader import load_model  # noqa: E402
from jaxllm.loader.orbax import save_checkpoint  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def convert(source: Path, dest: Path, dtype: str = "float32", quantization: str | None = None,
            num_layers: Optional[int] = None) -> None:
    """Write ``source``'s parameters (``dtype``, ``quantization``) and config to ``dest``, keeping ``num_layers``.

    Raises:
      ValueError: as ``jaxllm.loader.load_model``, a non-empty ``dest``, or ``num_layers`` out of range.
    """
    cfg, params, hf_config = load_model(source, resolve_dtype(dtype), quantization)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"num_layers={num_layers} must be in [1, {cfg.num_layers}] (the source's layers)")
        params = {**params, "layers": {k: v[:num_layers] for k, v in params["layers"].items()}}
        hf_config = {**hf_config, "num_hidden_layers": num_layers}
        if hf_config.get("layer_types"):
            hf_config["layer_types"] = hf_config["layer_types"][:num_layers]
    save_checkpoint(dest, params, {**hf_config, "torch_dtype": dtype})
    if source.is_dir():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, dest / name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="HF model folder or .gguf file")
    parser.add_argument("dest", type=Path, help="new (or empty) folder for the orbax checkpoint")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default=None, choices=["int8", "fp8"],
                        help="store the dense projections quantized (weight-only, per output channel)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="keep only the first N decoder layers (a draft model for speculative decoding)")
    args = parser.parse_args(argv)
    convert(args.source, args.dest, args.dtype, args.quantization, args.num_layers)
    print(f"wrote {args.dest} ({args.dtype}" + (f", {args.quantization} weights)" if args.quantization else ")"))


if __name__ == "__main__":
    main()
