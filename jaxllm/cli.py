"""``python -m jaxllm.cli`` and the ``jaxllm`` console script: the command dispatcher, kept at its old path (the
code is ``jaxllm.entrypoints.cli``)."""

import sys

from jaxllm.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
