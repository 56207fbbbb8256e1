"""The ``jaxllm`` command: ``jaxllm COMMAND [ARGS]`` (``generate``, ``serve``, ``diag``), one module per
subcommand, imported only when it runs and parsing its own arguments. Add one by naming its module in
``COMMANDS``; the module provides ``main(argv, prog) -> exit status``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from jaxllm import __version__

# name -> (module with main(argv, prog), one-line help)
COMMANDS = {
    "generate": ("jaxllm.entrypoints.generate", "generate text from prompts, streamed to stdout"),
    "serve": ("jaxllm.entrypoints.openai.api_server", "serve a model over an OpenAI-compatible HTTP API"),
    "diag": ("jaxllm.entrypoints.diag", "KV cache diagnostics of a running server (text, JSON, or a PNG)"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to its subcommand; returns its exit status."""
    parser = argparse.ArgumentParser(prog="jaxllm", allow_abbrev=False,
                                     description="jaxllm: a JAX/XLA-compiled LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"jaxllm {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, summary) in COMMANDS.items():
        commands.add_parser(name, help=summary, description=summary, add_help=False, allow_abbrev=False)
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    return module.main(rest, prog=f"jaxllm {args.command}")


if __name__ == "__main__":
    sys.exit(main())
