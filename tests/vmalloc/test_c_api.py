"""The C entry points torch calls (vmalloc_malloc / vmalloc_free / hooks), driven through ctypes on the
host backend via VMALLOC_CONF, in a fresh process (the global arenas live for the whole process)."""

import subprocess
import sys
import textwrap

import pytest

from tests_support import SANITIZED_RUN


def run(code: str, env_conf: str) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "VMALLOC_CONF": env_conf}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)


def test_entry_points_drive_the_global_arena():
    r = run(
        """
        import ctypes, vmalloc
        lib = ctypes.CDLL(vmalloc._C.library_path())
        lib.vmalloc_malloc.restype = ctypes.c_void_p
        lib.vmalloc_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.vmalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.vmalloc_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.vmalloc_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
        assert vmalloc.stats(0) == {}
        p = lib.vmalloc_malloc(3 << 20, 0, None)
        q = lib.vmalloc_malloc(1000, 0, ctypes.c_void_p(5))
        ctypes.memset(p, 7, 3 << 20)
        lib.vmalloc_record_stream(p, ctypes.c_void_p(9))
        s = vmalloc.stats(0)
        assert s["allocation.all.current"] == 2, s
        assert s["chunk_size"] == 1 << 20 and s["capacity"] == 64 << 20, s
        lib.vmalloc_free(p, 3 << 20, 0, None)
        lib.vmalloc_free(q, 1000, 0, None)
        lib.vmalloc_free(q, 1000, 0, None)   # double free: reported on stderr, nothing breaks
        lib.vmalloc_empty_cache()
        assert vmalloc.stats(0)["reserved_bytes.all.current"] == 0
        snap = vmalloc.snapshot(0)
        assert [e["action"] for e in snap["device_traces"][0]][:2] == ["segment_map", "alloc"]
        vmalloc._C.global_arena(0).check_invariants()
        try:
            vmalloc.configure(chunk_size="4MiB")
        except RuntimeError as e:
            assert "already in use" in str(e)
        else:
            raise AssertionError("configure after first use must fail")
        print("OK")
        """,
        "backend=host,chunk_size=1MiB,capacity=64MiB,history=100",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OK"
    assert "not a live allocation" in r.stderr


def test_bad_vmalloc_conf_is_reported():
    r = run(
        """
        import vmalloc
        try:
            vmalloc._C.global_arena(0)
        except ValueError as e:
            print("ERR", e)
        """,
        "backend=host,chunk_sz=2MiB",
    )
    assert "unknown VMALLOC_CONF key 'chunk_sz'" in r.stdout, r.stdout + r.stderr


def test_configure_overrides_env_key_by_key():
    r = run(
        """
        import vmalloc
        vmalloc.configure(capacity="32MiB")
        c = vmalloc._C.global_configuration()
        assert c["backend"] == "host" and c["chunk_size"] == 1 << 20 and c["capacity"] == 32 << 20, c
        try:
            vmalloc.configure(chunk_sise="1MiB")
        except TypeError as e:
            assert "chunk_sise" in str(e)
        print("OK")
        """,
        "backend=host,chunk_size=1MiB",
    )
    assert r.stdout.strip() == "OK", r.stderr


@pytest.mark.skipif(SANITIZED_RUN, reason="torch is not loaded under the sanitizer run")
def test_allocator_on_a_cpu_torch_says_what_to_do():
    import torch

    import vmalloc

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    if hasattr(torch._C, "_cuda_customAllocator"):
        pytest.skip("this CPU torch still has the pluggable-allocator entry point")
    with pytest.raises(RuntimeError, match="needs a CUDA build of PyTorch"):
        vmalloc.allocator()
