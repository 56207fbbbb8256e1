"""glibc's malloc settings for host steps (jaxllm.worker.host_malloc): when they are given, that they keep a freed
large buffer's pages for the next allocation (no page faults where glibc's defaults fault every page), and when
they are left alone."""

import os
import subprocess
import sys
import textwrap

import pytest

from jaxllm.worker.host_malloc import _reason_to_skip

# In a fresh process: optionally start JAX's CPU client, then tune (or not), then allocate, touch and free a
# 64 MiB buffer twice and print the start-up line and the page faults of the second round. 64 MiB is past glibc's
# 32 MB ceiling on its mmap threshold, so by default every round maps fresh pages.
_PROBE = textwrap.dedent("""
    import ctypes, resource, sys
    if sys.argv[1] == "jax-first":
        import jax
        jax.numpy.ones(2).block_until_ready()
    from jaxllm.worker.host_malloc import tune_host_malloc
    line = tune_host_malloc()
    assert tune_host_malloc() is line  # once per process
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def round_trip():  # as XLA's buffers: malloc, written, freed (numpy would ask for huge pages)
        buf = libc.malloc(64 << 20)
        ctypes.memset(buf, 1, 64 << 20)
        libc.free(buf)
    round_trip()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    round_trip()
    print(line)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")
PAGES = (64 << 20) // 4096


def _probe(order: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES", "JAXLLM_TUNE_MALLOC")}
    out = subprocess.run([sys.executable, "-c", _PROBE, order], env={**clean, **env}, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_malloc_reuses_a_freed_large_buffer_without_page_faults():
    line, faults = _probe("tune-first")
    assert line.startswith("host malloc: one arena, no mmap or trim below 1 GiB (glibc ")
    assert "refused" not in line and "started first" not in line
    assert faults < PAGES // 16, faults  # the second round finds the first round's pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_switched_off_malloc_keeps_glibc_defaults_and_faults_every_page():
    line, faults = _probe("tune-first", JAXLLM_TUNE_MALLOC="0")
    assert line == "host malloc: the C library's defaults (JAXLLM_TUNE_MALLOC=0)"
    assert faults >= PAGES * 9 // 10, faults


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuning_after_jax_started_says_its_threads_keep_their_arenas():
    line, faults = _probe("jax-first")
    assert line.endswith("; JAX's CPU client started first, so its threads keep their own arenas (build the engine "
                         "before other JAX work to include them)")
    assert faults < PAGES // 16, faults  # this (main) thread's arena is tuned all the same


@pytest.mark.parametrize("env, reason", [
    ({"JAXLLM_TUNE_MALLOC": "0"}, "JAXLLM_TUNE_MALLOC=0"),
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, "tcmalloc is preloaded (LD_PRELOAD)"),
    ({"LD_PRELOAD": "/opt/a.so:/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc is preloaded (LD_PRELOAD)"),
    ({"LD_PRELOAD": "libmimalloc.so"}, "mimalloc is preloaded (LD_PRELOAD)"),
    ({"MALLOC_ARENA_MAX": "2"}, "malloc is set from the environment (MALLOC_ARENA_MAX)"),
    ({"MALLOC_TRIM_THRESHOLD_": "1", "MALLOC_MMAP_THRESHOLD_": "1"},
     "malloc is set from the environment (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_)"),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "malloc is set from the environment (GLIBC_TUNABLES)"),
])
def test_an_allocator_chosen_by_the_environment_is_left_alone(env, reason):
    assert _reason_to_skip(env) == reason


def test_unrelated_environment_is_tuned():
    expected = None if sys.platform.startswith("linux") else "not Linux"
    assert _reason_to_skip({"JAXLLM_TUNE_MALLOC": "1", "LD_PRELOAD": "/usr/lib/libiomp5.so",
                            "GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=1000"}) == expected
