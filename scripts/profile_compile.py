"""Where a pytest run's time goes in JAX: seconds and counts of each ``jax.monitoring`` duration event (tracing,
jaxpr to MLIR, XLA backend compile, compilation-cache reads), summed over the run, in this process.

  python scripts/profile_compile.py [pytest arguments...]
  python scripts/profile_compile.py tests/test_compilation.py        # one file, in this process
  XLA_FLAGS=... python scripts/profile_compile.py -p no:cacheprovider tests/test_compilation.py

The tests run under tests/conftest.py as usual (its XLA flags included; set ``$XLA_FLAGS`` to compare others: a flag
set there keeps its value). Compiles in subprocesses the tests start are not counted. Prints pytest's own wall
time, a table of the events by total seconds and the host line; exits with pytest's status.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as common  # noqa: E402


def main(argv: list[str]) -> int:
    import jax
    import pytest

    seconds: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()

    def listen(event: str, duration: float, **_: object) -> None:
        seconds[event] += duration
        counts[event] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    start = time.perf_counter()
    status = pytest.main(argv)
    wall = time.perf_counter() - start
    print(f"pytest: {wall:.1f} s wall, exit status {int(status)}")
    print(f"{'seconds':>9} {'count':>7}  event")
    for event, total in seconds.most_common():
        print(f"{total:9.2f} {counts[event]:7d}  {event}")
    print(common.host_line(common.host_info()))
    return int(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
