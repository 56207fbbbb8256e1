"""``python -m jaxllm.generate``: the ``generate`` command, kept at its old path (the code is
``jaxllm.entrypoints.generate``)."""

import sys

from jaxllm.entrypoints.generate import *  # noqa: F401,F403
from jaxllm.entrypoints.generate import main

if __name__ == "__main__":
    sys.exit(main())
