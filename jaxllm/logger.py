"""jaxllm's logging (vLLM's ``vllm.logger``): the ``jaxllm`` logger writes one line per fact to stderr (stdout
carries only a command's output) and does not propagate to the root logger. Level: ``--log-level``
(:func:`logging_level`), else ``JAXLLM_LOGGING_LEVEL`` (vLLM's ``VLLM_LOGGING_LEVEL``), else INFO.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator, Optional

LOGGER_NAME = "jaxllm"
LOGGING_LEVEL_ENV = "JAXLLM_LOGGING_LEVEL"
LEVELS = ("debug", "info", "warning", "error", "critical")
_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record comes (a test's capture or a redirect may replace it after
    the handler is made)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def _configure() -> logging.Logger:
    root = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
        root.addHandler(handler)
        root.propagate = False
        env = os.environ.get(LOGGING_LEVEL_ENV, "info")
        root.setLevel(env.upper() if env.lower() in LEVELS else logging.INFO)
        if env.lower() not in LEVELS:
            root.warning("%s=%r is not a log level (%s): logging INFO", LOGGING_LEVEL_ENV, env, ", ".join(LEVELS))
    return root


def check_level(level: str, source: str = "--log-level") -> str:
    """``level`` upper-cased, a name of ``LEVELS``. Raises ValueError: another name (``source`` says whence)."""
    if level.lower() not in LEVELS:
        raise ValueError(f"{source}={level!r} is not a log level: {', '.join(LEVELS)}")
    return level.upper()


def init_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``__name__``, under ``jaxllm``), the ``jaxllm`` logger configured first."""
    _configure()
    return logging.getLogger(name)


@contextlib.contextmanager
def logging_level(level: Optional[str], default: str) -> Iterator[str]:
    """Set the ``jaxllm`` logger's level (and ``JAXLLM_LOGGING_LEVEL``, for the command's core processes) for a
    command's run: ``level``, else the variable, else ``default``; both restored on exit. Yields the level's name.
    Raises ValueError: a name not in ``LEVELS``.
    """
    env = os.environ.get(LOGGING_LEVEL_ENV)
    name = (check_level(level) if level is not None else
            check_level(env, LOGGING_LEVEL_ENV) if env is not None else check_level(default))
    root = _configure()
    previous = root.level
    root.setLevel(name)
    os.environ[LOGGING_LEVEL_ENV] = name
    try:
        yield name
    finally:
        root.setLevel(previous)
        if env is None:
            del os.environ[LOGGING_LEVEL_ENV]
        else:
            os.environ[LOGGING_LEVEL_ENV] = env
