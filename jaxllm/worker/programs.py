"""A runner's program table: the step program per ``(T, S, W, decode_only)`` (``BucketTable.all_programs``), compiled
ahead of time from abstract arguments (so serving never traces), and the warm-up that builds them, in the foreground
or a background thread."""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import gc
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional

import jax
from jax import monitoring

from jaxllm.logger import init_logger
from scheduler import BucketTable

logger = init_logger(__name__)

Shape = tuple[int, int, int]
# (T, S, W, decode_only): a bucket shape and whether the program serves decode-only steps.
Program = tuple[int, int, int, bool]

# A background warm-up starts a program only once the engine has been idle (no step dispatched, counting from the
# end of the start-up warm-up) for IDLE_SECONDS, so a short script, whose calls and exit follow each other closely,
# never shares the CPU with compiles it does not need nor waits at exit for one; an engine busy for
# BUSY_GRACE_SECONDS without a pause is a long job, which the remaining buckets pay for, and then builds them anyway.
IDLE_SECONDS = 1.0
BUSY_GRACE_SECONDS = 15.0

# Persistent-cache hits and XLA compiles seen by the build running on this thread: JAX reports them as
# process-wide events, recorded on the thread that asked for the compilation. A build that sees neither took its
# program from JAX's in-memory caches (``shared_jit``).
_compile_events = threading.local()
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _on_jax_event(event: str, **kwargs: Any) -> None:
    if event == _CACHE_HIT and getattr(_compile_events, "hits", None) is not None:
        _compile_events.hits += 1


def _on_jax_duration(event: str, duration: float, **kwargs: Any) -> None:
    if event == _BACKEND_COMPILE and getattr(_compile_events, "compiles", None) is not None:
        _compile_events.compiles += 1


monitoring.register_event_listener(_on_jax_event)
monitoring.register_event_duration_secs_listener(_on_jax_duration)

# Jitted step functions kept for the process after their engines are gone: a few configurations' worth (each holds
# its bucket programs). Those a live engine uses stay shared whatever the count.
SHARED_JIT_SIZE = 16

# Linux caps a process's memory mappings (vm.max_map_count, 65530 by default), and XLA's CPU backend maps each
# executable's code and data apart (tens to hundreds of mappings per program; figures in docs/design/worker.md),
# so a process that keeps thousands of programs reaches the cap, and XLA's compiler then crashes (segfault or
# abort) instead of failing. Past RELEASE_FRACTION of the cap, a compile first
# releases the programs no live engine holds; past REFUSE_FRACTION after that, it is refused with an error.
RELEASE_FRACTION = 0.5
REFUSE_FRACTION = 0.9
# A release that leaves the count past RELEASE_FRACTION (live engines hold that much) is not repeated before the
# count has grown by this share of the cap, so such a process does not drop JAX's caches at every compile.
RELEASE_STEP = 0.1
# More mappings than one compile is taken to add: since reading /proc/self/maps costs time in proportion to the
# mappings held, the next reading is due when this many per compile could have reached the next threshold.
MAPS_PER_COMPILE_BOUND = 1000


class _Same:
    """``obj`` compared and hashed by identity (a model family holds dicts, so it has no value hash)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


def shared_jit(fn: Callable, donate_argnums: tuple[int, ...] = (), out_shardings: Any = None, traced_from: Any = None,
               **static: Any) -> Any:
    """``jax.jit`` of ``functools.partial(fn, **static)``, one per distinct arguments in this process.

    Runners whose step function and static configuration compare equal (``static`` values hashable and compared by
    value: a ``ModelConfig``, the ``AttentionOps`` of ``core.build.attention_ops``) share it, and with it JAX's
    in-memory caches of traces, lowerings and executables: a second engine of the same shapes builds its programs
    without tracing or compiling them again (as vLLM's torch.compile cache, within one process). ``traced_from``
    (compared by identity, not passed to ``fn``) is what the trace reads besides its arguments: the model family
    resolved for ``cfg.model_type``, so that a family registered again under the same name gets programs of its own.
    One is kept while a runner holds it, and the :data:`SHARED_JIT_SIZE` most recently asked for are kept after that
    until the process nears Linux's cap on memory mappings (``_MapGuard``).

    Raises:
      TypeError: a ``static`` value that cannot be hashed.
    """
    key = (fn, donate_argnums, out_shardings, _Same(traced_from), tuple(sorted(static.items())))
    with _shared_lock:
        jitted = _shared_live.get(key)
        if jitted is None:
            jitted = _shared_live[key] = jax.jit(functools.partial(fn, **static), donate_argnums=donate_argnums,
                                                 out_shardings=out_shardings)
        _shared_recent[key] = jitted
        _shared_recent.move_to_end(key)
        while len(_shared_recent) > SHARED_JIT_SIZE:
            _shared_recent.popitem(last=False)
    return jitted


# Every shared step function some runner still holds (weakly), and the SHARED_JIT_SIZE most recently asked for
# (strongly, so an engine built again after the last one is gone finds its programs).
_shared_live: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()
_shared_recent: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()
_shared_lock = threading.Lock()


def memory_maps() -> Optional[tuple[int, int]]:
    """(memory mappings this process holds, the kernel's per-process cap ``vm.max_map_count``), or None where
    ``/proc`` does not tell (not Linux)."""
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as f:
            cap = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n"), cap
    except (OSError, ValueError):
        return None


def _release_programs(count: int, cap: int) -> int:
    """Drop the kept step functions (freeing those no live runner holds), then, if the process is still past
    RELEASE_FRACTION of the cap, every JAX in-memory cache (live engines keep their compiled programs; other jitted
    functions compile again on their next call). ``count``: the mappings held before. Returns those left."""
    with _shared_lock:
        dropped = len(_shared_recent)
        _shared_recent.clear()
    gc.collect()
    left = (memory_maps() or (count, cap))[0]
    cleared = left >= RELEASE_FRACTION * cap
    if cleared:
        jax.clear_caches()
        gc.collect()
        left = (memory_maps() or (left, cap))[0]
    logger.warning(
        f"this process held {count} memory mappings of Linux's cap of {cap} (vm.max_map_count), which XLA's CPU "
        f"programs fill: dropped the {dropped} step functions kept for engines built again (those no engine holds "
        "are freed)" + (" and JAX's in-memory caches (functions jitted before compile again on their next call)"
                        if cleared else "") + f", {left} mappings left")
    return left


class _MapGuard:
    """Keeps this process's memory mappings under ``vm.max_map_count`` as programs are compiled, reading them only
    as often as a threshold could have been reached (:data:`MAPS_PER_COMPILE_BOUND`).

    Args:
      read: () -> (mappings held, cap), or None where unknown (:func:`memory_maps`).
      release: (mappings held, cap) -> mappings left after releasing what can be (:func:`_release_programs`).
    """

    def __init__(self, read: Callable[[], Optional[tuple[int, int]]] = memory_maps,
                 release: Callable[[int, int], int] = _release_programs) -> None:
        self._read = read
        self._release = release
        self._lock = threading.Lock()
        self._compiles_until_reading = 0
        self._left_by_release = 0  # what the last release left, while that and every reading since are past RELEASE

    def _release_at(self, cap: int) -> float:
        after_last = self._left_by_release + RELEASE_STEP * cap if self._left_by_release else 0
        return min(max(RELEASE_FRACTION * cap, after_last), REFUSE_FRACTION * cap)

    def before_compile(self) -> None:
        """Release programs once the process is past RELEASE_FRACTION of the cap (again only after RELEASE_STEP more
        of it, unless past REFUSE_FRACTION), then refuse the compile if it is still past REFUSE_FRACTION.

        Raises:
          RuntimeError: past REFUSE_FRACTION of the cap after a release, naming the count and the cap.
        """
        with self._lock:
            self._compiles_until_reading -= 1
            if self._compiles_until_reading > 0:
                return
            maps = self._read()
            if maps is None:
                self._compiles_until_reading = 1 << 62
                return
            count, cap = maps
            if count < RELEASE_FRACTION * cap:
                self._left_by_release = 0
            release = count >= self._release_at(cap)
            if release:  # other threads compile without reading until it is done
                self._compiles_until_reading = 1 << 62
        if release:  # outside the lock: the collection runs finalizers
            try:
                count = self._release(count, cap)
            except BaseException:
                with self._lock:
                    self._compiles_until_reading = 0  # the next compile reads again
                raise
        with self._lock:
            if release:
                self._left_by_release = count if count >= RELEASE_FRACTION * cap else 0
            if count >= REFUSE_FRACTION * cap:
                self._compiles_until_reading = 0
                raise RuntimeError(
                    f"this process holds {count} memory mappings, near Linux's per-process cap vm.max_map_count="
                    f"{cap}, and XLA crashes compiling a program past it: drop the engines no longer used (del llm; "
                    f"gc.collect()) or raise the cap (sysctl -w vm.max_map_count={max(262144, 4 * cap)})")
            self._compiles_until_reading = max(1, int(self._release_at(cap) - count) // MAPS_PER_COMPILE_BOUND)


_map_guard = _MapGuard()


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


@dataclasses.dataclass
class CompileStats:
    """Programs one runner built and the time spent, shared by its parts.

    Attributes:
      num_compilations: programs built: compiled, loaded from JAX's persistent cache or taken from this process's
        memory (constant after warm-up).
      num_cache_hits: of those, loaded from the persistent cache; num_reused: taken from memory, built by an
        earlier runner of the same configuration (``shared_jit``).
      compile_seconds, cache_load_seconds, reuse_seconds: wall seconds spent on each kind.
    """

    num_compilations: int = 0
    num_cache_hits: int = 0
    num_reused: int = 0
    compile_seconds: float = 0.0
    cache_load_seconds: float = 0.0
    reuse_seconds: float = 0.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def compile(self, fn: Any, *abstract_args: Any) -> Callable:
        """``fn`` (jitted) lowered with ``abstract_args`` and compiled, counted.

        Raises:
          RuntimeError: the process is near Linux's cap on memory mappings (``_MapGuard``).
        """
        _map_guard.before_compile()
        start = time.perf_counter()
        _compile_events.hits = _compile_events.compiles = 0
        try:
            exe = fn.lower(*abstract_args).compile()
            hit, compiled = _compile_events.hits > 0, _compile_events.compiles > 0
        finally:
            _compile_events.hits = _compile_events.compiles = None
        seconds = time.perf_counter() - start
        with self._lock:
            self.num_compilations += 1
            if hit:
                self.num_cache_hits += 1
                self.cache_load_seconds += seconds
            elif compiled:
                self.compile_seconds += seconds
            else:
                self.num_reused += 1
                self.reuse_seconds += seconds
        return exe


@dataclasses.dataclass(frozen=True)
class Warmup:
    """What a warm-up (``ProgramTable.warmup``) built before it returned: ``seconds`` spent, ``step_programs``
    built, ``other_programs`` built (block copies, sampling slots, swaps, LoRA) and ``background`` step programs
    left to a background thread."""

    seconds: float
    step_programs: int
    other_programs: int
    background: int


class ProgramTable:
    """The step programs of one runner, one per ``buckets.all_programs()``, and their warm-up.

    Args:
      buckets: the (T, S, W) shapes steps are padded to, and the T buckets with decode-only programs.
      step_fn: ``decode_only`` -> the jitted step function of decode-only (True) or other (False) steps.
      step_arguments: bucket shape -> abstract arguments of the step function, read at build time (after a KV
        resize too).
      stats: where builds are counted.
    """

    def __init__(self, buckets: BucketTable, step_fn: Callable[[bool], Any], step_arguments: Callable[[Shape], tuple],
                 stats: CompileStats):
        self.buckets = buckets
        self.stats = stats
        self._step_fn = step_fn
        self._step_arguments = step_arguments
        self._steps: dict[Program, Callable] = {}
        self._lock = threading.Lock()
        # Token buckets whose programs (every width) are built; None: build on first use.
        self._ready_tokens: Optional[set[int]] = None
        self._background: Optional[threading.Thread] = None
        self._stop_background = threading.Event()
        # Monotonic seconds of the last dispatch (or of the end of the start-up warm-up) and of the first dispatch
        # since the engine was last idle (None before any).
        self._last_dispatch = time.monotonic()
        self._busy_since: Optional[float] = None

    @property
    def lazy(self) -> bool:
        """Whether programs are built on first use (no :meth:`warmup` ran)."""
        return self._ready_tokens is None

    def compile_step(self, program: Program, announce: bool = False) -> Callable:
        """Compile (once) and return step program ``program``; ``announce`` logs the wait.

        Raises:
          RuntimeError: the process is near Linux's cap on memory mappings (:meth:`CompileStats.compile`).
        """
        exe = self._steps.get(program)
        if exe is None:
            if announce:
                kind = "decode-only " if program[3] else ""
                logger.info(f"building the {kind}step program for {program[0]} tokens x {program[1]} rows "
                            "(first use)...")
            start = time.perf_counter()
            exe = self._steps[program] = self.stats.compile(self._step_fn(program[3]),
                                                            *self._step_arguments(program[:3]))
            if announce:
                logger.info(f"built it in {time.perf_counter() - start:.1f} s")
        return exe

    def trace(self, program: Program) -> jax.stages.Traced:
        """Step program ``program`` traced (not compiled) from its abstract arguments, for inspecting its jaxpr."""
        return self._step_fn(program[3]).trace(*self._step_arguments(program[:3]))

    def step_program(self, program: Program) -> Callable:
        """Step program ``program`` (``BatchDescriptor.program``) for a dispatch now (built first in lazy mode)."""
        exe = self.compile_step(program, announce=self.lazy)
        self._note_dispatch()
        return exe

    def rebuild_after(self, change: Callable[[], None]) -> int:
        """Wait for a background warm-up, run ``change`` (a KV resize), rebuild every step program
        built so far; returns the programs built, ``change``'s included."""
        self.wait_for_warmup()
        before = self.stats.num_compilations
        change()
        shapes, self._steps = list(self._steps), {}
        for shape in shapes:
            self.compile_step(shape)
        return self.stats.num_compilations - before

    def may_build_in_background(self) -> bool:
        """Whether a background build may start now: idle for ``IDLE_SECONDS``, or busy for
        ``BUSY_GRACE_SECONDS`` without a pause."""
        now = time.monotonic()
        with self._lock:
            last, since = self._last_dispatch, self._busy_since
        return now - last >= IDLE_SECONDS or (since is not None and now - since >= BUSY_GRACE_SECONDS)

    def _note_dispatch(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._busy_since is None or now - self._last_dispatch >= IDLE_SECONDS:
                self._busy_since = now
            self._last_dispatch = now

    def token_bucket_programs(self, tokens: int) -> list[Program]:
        """The programs of token bucket ``tokens`` (one per block-table width, twice with a decode-only program)."""
        return [program for program in self.buckets.all_programs() if program[0] == tokens]

    def _mark_ready(self, tokens: int) -> None:
        with self._lock:
            if self._ready_tokens is not None:
                self._ready_tokens.add(tokens)

    def serving_buckets(self) -> BucketTable:
        """The buckets a step may use now: all, except during a background warm-up, when only the
        token buckets already built (so no step waits on a compile)."""
        with self._lock:
            ready = self._ready_tokens
            if ready is None or len(ready) == len(self.buckets.token_buckets):
                return self.buckets
            return self.buckets.restricted(tuple(sorted(ready)))

    def warmup(self, others: Callable[[], None], progress: bool = True, background: bool = False) -> "Warmup":
        """Build every bucket's step program, then call ``others`` (the runner's other programs).

        Args:
          progress: show a tqdm bar on stderr.
          background: build now only the largest token bucket and the smallest of at least 16 tokens; the others in a
            thread, smallest first, one program at a time while :meth:`may_build_in_background` (see
            :meth:`serving_buckets`, :meth:`wait_for_warmup`); at exit it stops after the program it is building,
            and a build that fails there stops it with a logged error.

        Returns:
          What was built before returning, and the seconds spent (``Warmup``).

        Raises:
          RuntimeError: a build in the foreground found the process near Linux's cap on memory mappings.
        """
        from tqdm import tqdm

        start = time.perf_counter()
        tokens = self.buckets.token_buckets
        first = sorted({tokens[-1], next((t for t in tokens if t >= 16), tokens[0])}, reverse=True) if background \
            else list(tokens)
        with self._lock:
            self._ready_tokens = set()
        now = [(t, self.token_bucket_programs(t)) for t in first]
        with tqdm(total=sum(len(programs) for _, programs in now), desc="building step programs", unit="program",
                  disable=not progress) as bar:
            for t, programs in now:
                for program in programs:
                    self.compile_step(program)
                    bar.update()
                self._mark_ready(t)
        before = self.stats.num_compilations
        others()
        num_others = self.stats.num_compilations - before
        rest = [t for t in tokens if t not in first]
        with self._lock:
            self._last_dispatch = time.monotonic()
        if rest:
            # The thread holds the table only while it builds a program, so a table nobody uses any more is freed
            # and its warm-up ends.
            table = weakref.ref(self)
            self._background = threading.Thread(
                target=_build_in_background, args=(table, [(t, self.token_bucket_programs(t)) for t in rest]),
                name="jaxllm-warmup", daemon=True)
            self._background.start()
            # At interpreter exit, let the thread finish its program: a daemon thread that Python stops inside an
            # XLA compile aborts the process ("FATAL: exception not rethrown").
            atexit.register(lambda: table() is not None and table().stop_warmup())
        return Warmup(time.perf_counter() - start, sum(len(programs) for _, programs in now), num_others,
                      len(self.buckets) - sum(len(programs) for _, programs in now))

    def num_pending_programs(self) -> int:
        """Step programs a background warm-up has still to build (0 when compiling lazily)."""
        with self._lock:
            if self._ready_tokens is None:
                return 0
            return len(self.buckets) - sum(1 for program in self.buckets.all_programs()
                                           if program[0] in self._ready_tokens)

    def wait_for_warmup(self, timeout: Optional[float] = None) -> bool:
        """Wait for a background warm-up to end; True once it has: every program built, or stopped (at shutdown,
        or by a failed build it logged; :meth:`num_pending_programs` counts what is left)."""
        if self._background is not None:
            self._background.join(timeout)
        return self._background is None or not self._background.is_alive()

    def stop_warmup(self) -> None:
        """Stop a background warm-up after the program it is building (at shutdown)."""
        self._stop_background.set()
        self.wait_for_warmup()


def _build_in_background(table_ref: "weakref.ref[ProgramTable]",
                         buckets: Iterable[tuple[int, list[Program]]]) -> None:
    """Build ``buckets``' step programs one by one when allowed, while the table lives and runs; log when all
    are built."""
    start, built = time.perf_counter(), 0
    for tokens, programs in buckets:
        for program in programs:
            if not _wait_for_turn(table_ref):
                return
            table = table_ref()
            if table is None:
                return
            try:
                table.compile_step(program)
            except Exception as e:  # the thread's only report is the log
                logger.error(f"background warm-up stopped: building the step program {program} failed ({e}); steps "
                             f"keep to the token buckets built, {table.num_pending_programs()} programs unbuilt")
                return
            del table
            built += 1
        table = table_ref()
        if table is None:
            return
        table._mark_ready(tokens)
        del table
    logger.info(f"background warm-up done: built the other {built} step programs in "
                f"{time.perf_counter() - start:.1f} s (waiting included); every step now takes its own bucket")


def _wait_for_turn(table_ref: "weakref.ref[ProgramTable]", poll: float = 0.05) -> bool:
    """Wait until the table may build; False once it is stopped or gone (held only while asked)."""
    while True:
        table = table_ref()
        if table is None or table._stop_background.is_set():
            return False
        if table.may_build_in_background():
            return True
        stop = table._stop_background
        del table
        stop.wait(poll)


def enable_persistent_compilation_cache(path: Optional[str]) -> None:
    """Point JAX's persistent compilation cache at ``path``, caching every program, unless
    one is already set."""
    if path is None or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
