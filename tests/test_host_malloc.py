"""glibc's malloc settings for host steps (jaxllm.worker.host_malloc): when they are given, that they keep a freed
large buffer's pages for the next allocation (no page faults where glibc's defaults fault every page), and when
they are left alone."""

import os
import resource
import shutil
import subprocess
import sys
import textwrap

import pytest

from jaxllm.worker.host_malloc import _reason_to_skip

# In a fresh process: optionally start JAX's CPU client, then tune (or not), then in the main thread and in a new
# one allocate, touch and free a 64 MiB buffer twice, and print the start-up line and each thread's page faults in
# its second round. 64 MiB is past the 32 MiB that glibc's mmap threshold adapts to, and past what a thread's own
# arena heap holds, so with glibc's defaults every round maps fresh pages; transparent huge pages are turned off
# for the process so that faults count pages whatever the host's setting.
_PROBE = textwrap.dedent("""
    import ctypes, resource, sys, threading
    libc = ctypes.CDLL(None)
    libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
    if sys.argv[1] == "jax-first":
        import jax
        jax.numpy.ones(2).block_until_ready()
    from jaxllm.worker.host_malloc import tune_host_malloc
    line = tune_host_malloc()
    assert tune_host_malloc() is line  # once per process
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def round_trip():  # as XLA's buffers: malloc, written, freed (numpy would ask for huge pages)
        buf = libc.malloc(64 << 20)
        ctypes.memset(buf, 1, 64 << 20)
        libc.free(buf)
    def second_round_faults(out):
        round_trip()
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        round_trip()
        out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    faults = []
    second_round_faults(faults)
    thread = threading.Thread(target=second_round_faults, args=(faults,))
    thread.start()
    thread.join()
    print(line)
    print(*faults)
""")
PAGES = (64 << 20) // resource.getpagesize()
TUNED = ("host malloc: arena_max 1, mmap_threshold 1024 MiB, trim_threshold 1024 MiB, top_pad 64 MiB (glibc ")


def _probe(order: str, **env: str) -> tuple[str, int, int]:
    """(the start-up line, the main thread's and a new thread's page faults in their second round)."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES", "JAXLLM_TUNE_MALLOC")}
    out = subprocess.run([sys.executable, "-c", _PROBE, order], env={**clean, **env}, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    main, thread = map(int, out[1].split())
    return out[0], main, thread


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


@linux_only
def test_tuned_malloc_reuses_a_freed_large_buffer_in_every_thread_without_page_faults():
    line, main, thread = _probe("tune-first")
    assert line.startswith(TUNED) and "started first" not in line, line
    # The new thread shares the one arena (its own would have had to map the buffer afresh).
    assert main < PAGES // 16 and thread < PAGES // 16, (main, thread)


@linux_only
def test_switched_off_malloc_keeps_glibc_defaults_and_faults_every_page():
    line, main, thread = _probe("tune-first", JAXLLM_TUNE_MALLOC="0")
    assert line == "host malloc: the C library's defaults (JAXLLM_TUNE_MALLOC=0)"
    assert main >= PAGES * 9 // 10 and thread >= PAGES * 9 // 10, (main, thread)


@linux_only
def test_tuning_after_jax_started_says_its_threads_keep_their_arenas():
    line, main, _ = _probe("jax-first")
    assert line.startswith(TUNED) and line.endswith(
        "; JAX's CPU client started first, so its threads keep their own arenas (build the engine before other JAX "
        "work to include them)"), line
    assert main < PAGES // 16, main  # the main thread's arena is tuned all the same


@pytest.mark.parametrize("env, reason", [
    ({"JAXLLM_TUNE_MALLOC": "0"}, "JAXLLM_TUNE_MALLOC=0"),
    ({"MALLOC_ARENA_MAX": "2"}, "malloc is set from the environment (MALLOC_ARENA_MAX)"),
    ({"MALLOC_TRIM_THRESHOLD_": "1", "MALLOC_MMAP_THRESHOLD_": "1"},
     "malloc is set from the environment (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_)"),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
     "malloc is set from the environment (GLIBC_TUNABLES glibc.malloc)"),
])
def test_an_allocator_chosen_by_the_environment_is_left_alone(env, reason):
    assert _reason_to_skip(env) == reason


def test_unrelated_environment_is_tuned():
    expected = None if sys.platform.startswith("linux") else "not Linux"
    assert _reason_to_skip({"JAXLLM_TUNE_MALLOC": "1", "LD_PRELOAD": "/usr/lib/libiomp5.so",
                            "GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=1000"}) == expected


def test_an_installed_accelerator_plugin_is_left_alone_unless_jax_platforms_puts_the_cpu_first(tmp_path,
                                                                                                  monkeypatch):
    # jax_plugins is the namespace JAX discovers PJRT plugins in (jax-cuda12-plugin installs jax_plugins.xla_cuda12).
    (tmp_path / "jax_plugins" / "xla_cuda12").mkdir(parents=True)
    (tmp_path / "jax_plugins" / "xla_cuda12" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_plugins", raising=False)
    expected = "steps run on the accelerator of xla_cuda12" if sys.platform.startswith("linux") else "not Linux"
    assert _reason_to_skip({}) == expected
    assert _reason_to_skip({"JAX_PLATFORMS": "cuda,cpu"}) == expected
    assert _reason_to_skip({"JAX_PLATFORMS": "cpu"}) == (None if sys.platform.startswith("linux") else "not Linux")


@linux_only
def test_a_preloaded_allocator_is_left_alone(tmp_path):
    # A stand-in for tcmalloc or jemalloc: its own malloc symbols, ahead of glibc's.
    source = tmp_path / "shim.c"
    source.write_text(textwrap.dedent("""
        #include <stddef.h>
        extern void *__libc_malloc(size_t); extern void __libc_free(void *);
        extern void *__libc_calloc(size_t, size_t); extern void *__libc_realloc(void *, size_t);
        void *malloc(size_t n) { return __libc_malloc(n); }
        void free(void *p) { __libc_free(p); }
        void *calloc(size_t a, size_t b) { return __libc_calloc(a, b); }
        void *realloc(void *p, size_t n) { return __libc_realloc(p, n); }
    """))
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("no C compiler")
    shim = tmp_path / "libshim.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(shim), str(source)], check=True)
    line, main, _ = _probe("tune-first", LD_PRELOAD=str(shim))
    assert line == "host malloc: the C library's defaults (malloc is not glibc's (another allocator is loaded))"
    assert main >= PAGES * 9 // 10, main
