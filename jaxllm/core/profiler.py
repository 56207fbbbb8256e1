"""An engine core's ``start_profile`` / ``stop_profile``: a ``jax.profiler`` trace over a range of its steps.

vLLM's worker profiler, with JAX's profiler: a session starts ``delay_iterations`` steps after ``start_profile``,
and ends at ``stop_profile`` or after ``max_iterations`` traced steps. Each traced step is a
``jax.profiler.StepTraceAnnotation`` named :data:`STEP_NAME` with its ``step_num``, so TensorBoard's and XProf's
step views split the trace by engine step. A step is counted when ``EngineCore.step`` begins; idle time is not.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from jaxllm.config import OPTION_KWARGS, ProfilerConfig, check_profile_request
from jaxllm.logger import init_logger

logger = init_logger(__name__)

# The name of each traced step's annotation.
STEP_NAME = "jaxllm_step"


class StepProfiler:
    """One engine core's profile sessions (``EngineCore.start_profile``). Not thread-safe: the core's loop drives it.

    Args:
      config: the engine's ``ProfilerConfig``; None or without a profiler, every start raises.
      core_index: the core's data-parallel rank, in the trace folder's name.
    """

    def __init__(self, config: Optional[ProfilerConfig], core_index: int) -> None:
        self.config, self.core_index = config, core_index
        self.folder: Optional[str] = None  # the session's trace folder, while one is pending or running
        self.running = False
        self._skip = self._limit = self._step = 0
        self._kwargs: dict[str, Any] = {}

    @property
    def active(self) -> bool:
        """Whether a session is pending (delayed) or running."""
        return self.folder is not None

    def start(self, prefix: Optional[str] = None, delay_iterations: Optional[int] = None,
              max_iterations: Optional[int] = None, profiler_kwargs: Optional[dict[str, Any]] = None) -> str:
        """Begin a session; the trace starts now, or after the delay (``None``: the config's). With the config's
        schedule (``ProfilerConfig.scheduled``) the trace skips wait + warmup steps more and records the active
        ones (``max_iterations`` unused). Returns its folder.

        Raises:
          RuntimeError: profiling is off (no ``--profiler-config`` profiler), a session is active, or JAX's
            profiler would not start (another trace runs in this process).
          ValueError: a bad override (``jaxllm.config.check_profile_request``).
        """
        config = self.config
        if config is None or config.profiler is None:
            raise RuntimeError("profiling is off: start the engine with a profiler_config, e.g. --profiler-config "
                               "'{\"profiler\": \"jax\", \"torch_profiler_dir\": \"/tmp/traces\"}'")
        kwargs = check_profile_request(prefix, delay_iterations, max_iterations, profiler_kwargs)
        if self.active:
            raise RuntimeError(f"a profile is already being recorded into {self.folder}; stop_profile() first")
        self._kwargs = kwargs
        delay = config.delay_iterations if delay_iterations is None else delay_iterations
        limit = config.max_iterations if max_iterations is None else max_iterations
        if config.scheduled:
            delay, limit = delay + config.wait_iterations + config.warmup_iterations, config.active_iterations
        name = f"{prefix}_dp{self.core_index}" if prefix else f"dp{self.core_index}"
        folder = os.path.join(config.torch_profiler_dir, name)
        if "://" not in folder:  # a folder that cannot be made fails here, not when the trace is written
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as e:
                raise RuntimeError(f"start_profile: cannot make the trace folder {folder} ({e.strerror})") from None
        self.folder = folder
        self._skip, self._limit, self._step = delay, limit, 0
        if delay == 0:
            self._begin()
        return self.folder

    def stop(self) -> Optional[str]:
        """End the session, writing its trace; the folder, or None when no session was active.
        Raises RuntimeError: JAX's profiler could not write the trace (the session has ended all the same)."""
        folder, running = self.folder, self.running
        self.folder, self.running = None, False
        if running:
            import jax  # here, not at the top: front ends check requests with this module and never load JAX

            try:
                jax.profiler.stop_trace()
            except Exception as e:
                _forget_failed_session()
                raise RuntimeError(f"stop_profile: the trace could not be written to {folder} ({e})") from None
            logger.info("profile written to %s", folder)
        return folder

    def stop_quietly(self) -> None:
        """:meth:`stop`, a failure logged, not raised: where the engine must go on (a session's last step) or shut
        down."""
        try:
            self.stop()
        except RuntimeError as e:
            logger.warning("%s", e)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Run one engine step in this: a delayed trace starts when its delay has passed (a failure to start is
        logged and ends the session: the step runs on), a traced step is annotated, and the trace stops after
        its ``max_iterations``-th step."""
        if self.active and not self.running:
            if self._skip > 0:
                self._skip -= 1
            else:
                try:
                    self._begin()
                except RuntimeError as e:
                    logger.warning("%s", e)
        if not self.running:
            yield
            return
        import jax

        self._step += 1
        with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=self._step):
            yield
        if self._limit and self._step >= self._limit:
            self.stop_quietly()

    def _begin(self) -> None:
        import jax

        options = jax.profiler.ProfileOptions()
        for name in OPTION_KWARGS:
            if name in self._kwargs:
                setattr(options, name, self._kwargs[name])
        try:
            jax.profiler.start_trace(self.folder, profiler_options=options,
                                     create_perfetto_trace=self._kwargs.get("create_perfetto_trace", False))
        except RuntimeError as e:
            self.folder = None
            raise RuntimeError(f"start_profile: JAX's profiler did not start ({e})") from None
        self.running = True
        logger.info("profiling into %s", self.folder)


def _forget_failed_session() -> None:
    """Let JAX start traces again after a failed ``stop_trace``, which leaves its session set (JAX 0.10-0.11)."""
    import jax._src.profiler as jax_profiler

    state = getattr(jax_profiler, "_profile_state", None)
    if state is not None:
        with state.lock:
            state.reset()
