"""The real ``jaxllm serve`` as a subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Union

import httpx

STARTUP_SECONDS = 600


# The stories260K engine of the server tests (both servers and the in-process reference) and the core-client
# tests: one step program (16 tokens, 16 rows), built on first use and shared through the session's compilation
# cache; prompts are prefilled in chunks of 16 tokens; max_model_len is the model's 512, so a request can run for
# hundreds of steps.
ENGINE = dict(max_model_len=512, max_num_batched_tokens=16, max_num_seqs=16, token_buckets=(16,), precompile=False)


def engine_flags(**overrides) -> list[str]:
    """``ENGINE`` (with ``overrides``) as ``jaxllm serve`` flags."""
    flags = []
    for name, value in {**ENGINE, **overrides}.items():
        flags.append(f"--{name.replace('_', '-')}")
        flags += [str(v) for v in value] if isinstance(value, tuple) else [str(value).lower()]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m jaxllm.entrypoints.cli serve MODEL --host 127.0.0.1 --port P ARGS`` (in ``env``, by default this
    process's environment; a ``model`` of None: no MODEL, the default model); :meth:`start` waits for /health."""

    def __init__(self, model: Union[Path, str, None], *args: str, log: Optional[Path] = None,
                 env: Optional[dict] = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "jaxllm.entrypoints.cli", "serve", *([] if model is None else [str(model)]),
                     "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log = log
        self.env = env
        self.process: Optional[subprocess.Popen] = None

    def openai_client(self, api_key: str = "none", timeout: float = 300):
        """The official ``openai`` client on this server's ``/v1``, without retries (a retry would hide a failure)."""
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)

    def launch(self) -> "Server":
        """Start the process without waiting (several servers then start side by side)."""
        out = open(self.log, "w") if self.log is not None else subprocess.DEVNULL
        self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_ready(self) -> "Server":
        """Wait until /health answers 200.

        Raises:
          RuntimeError: the process exited first (with its log's tail), or STARTUP_SECONDS passed.
        """
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}: {self.log_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server did not answer /health in {STARTUP_SECONDS} s")

    def start(self) -> "Server":
        """:meth:`launch`, then :meth:`wait_ready`."""
        return self.launch().wait_ready()

    def log_text(self) -> str:
        return self.log.read_text() if self.log is not None and self.log.exists() else ""

    @property
    def core_pids(self) -> list[int]:
        """The engine-core processes (the server's children running ``jaxllm.core.process``)."""
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(c) for c in children if b"jaxllm.core.process" in Path(f"/proc/{c}/cmdline").read_bytes()]

    def metric(self, name: str) -> float:
        """One unlabelled series of ``/metrics``."""
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then wait; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited
