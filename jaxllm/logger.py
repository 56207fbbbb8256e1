"""jaxllm's logging (vLLM's ``vllm.logger``): start-up and serving facts go to the ``jaxllm`` logger, one line each
on stderr with its level (``INFO 12-06 07:08:14 [build.py:81] parameters: ...``), so stdout carries only what a
command outputs (the generated text).

The level is ``JAXLLM_LOGGING_LEVEL`` (vLLM's ``VLLM_LOGGING_LEVEL``; a name such as ``WARNING`` or ``debug``),
else INFO; the commands set theirs with ``--log-level`` (:func:`logging_level`): ``jaxllm serve`` logs INFO,
``python -m jaxllm.generate`` WARNING unless asked. The ``jaxllm`` logger does not propagate to the root logger,
so an application's own logging configuration does not print jaxllm's lines twice.
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
    """``level`` upper-cased, a level name of ``LEVELS``.

    Raises:
      ValueError: another name (``source`` says where it came from).
    """
    if level.lower() not in LEVELS:
        raise ValueError(f"{source}={level!r} is not a log level: {', '.join(LEVELS)}")
    return level.upper()


def init_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``__name__``, under ``jaxllm``), the ``jaxllm`` logger configured first."""
    _configure()
    return logging.getLogger(name)


@contextlib.contextmanager
def logging_level(level: Optional[str], default: str) -> Iterator[str]:
    """Set the ``jaxllm`` logger's level for a command's run: ``level`` (its ``--log-level``), else
    ``JAXLLM_LOGGING_LEVEL``, else ``default``. The variable is set to it too, so the engine-core processes the
    command starts log at the same level; both are restored on exit. Yields the level's name.

    Raises:
      ValueError: a name not in ``LEVELS``.
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
