"""Write the flags of an installed vLLM's ``vllm serve`` as JSON: the snapshot ``tests/test_vllm_flags.py`` checks
jaxllm's parser against (``tests/fixtures/vllm_serve_flags.json``).

Run it with a Python where ``vllm`` imports (a virtual environment of its own, since vLLM pins torch and
transformers; ``pip install --no-deps vllm==X`` plus the few modules its argument parser imports is enough):

    python scripts/vllm_serve_flags.py tests/fixtures/vllm_serve_flags.json

Each flag: ``dest``, ``options`` (every spelling), ``form`` (``switch``, ``value``, ``values`` or ``append``),
``default`` (the default as JSON when it is a plain value, else null) and ``engine`` (an ``EngineArgs`` field, so
a ``vllm.LLM`` keyword too); ``keywords``: the ``EngineArgs`` fields without a flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import sys


def main() -> None:
    # Without it vLLM fails to pick a platform on a machine with no GPU; the flags are the same on every platform.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    flags = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        if action.nargs == 0:
            form = "switch"
        elif isinstance(action, argparse._AppendAction):
            form = "append"
        else:
            form = "values" if action.nargs in ("+", "*") else "value"
        default = action.default if isinstance(action.default, (str, int, float, bool, type(None))) else None
        flags.append({"dest": action.dest, "options": list(action.option_strings), "form": form,
                      "default": None if default == argparse.SUPPRESS else default,
                      "engine": action.dest in fields})
    dests = {flag["dest"] for flag in flags}
    snapshot = {"vllm": importlib.metadata.version("vllm"), "flags": flags,
                "keywords": sorted(f for f in fields - dests if not f.startswith("_"))}
    with open(sys.argv[1], "w") as f:
        json.dump(snapshot, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
