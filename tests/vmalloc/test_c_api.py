"""The C entry points torch calls (vmalloc_malloc / vmalloc_free / hooks) and their non-throwing twins for C
callers (vmalloc_try_*, vmalloc_last_error), driven through ctypes on the host backend via VMALLOC_CONF, in a
fresh process (the global arenas live for the whole process)."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests_support import SANITIZED_RUN

CSRC = Path(__file__).resolve().parents[2] / "csrc"

PRELUDE = """
import ctypes, vmalloc
lib = ctypes.CDLL(vmalloc._C.library_path())
signatures = {
    "vmalloc_malloc": (ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]),
    "vmalloc_try_malloc": (ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]),
    "vmalloc_free": (None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
    "vmalloc_try_free": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
    "vmalloc_init": (None, [ctypes.c_int]),
    "vmalloc_try_init": (ctypes.c_int, [ctypes.c_int]),
    "vmalloc_try_set_memory_fraction": (ctypes.c_int, [ctypes.c_double, ctypes.c_int]),
    "vmalloc_try_record_stream": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p]),
    "vmalloc_last_error": (ctypes.c_char_p, []),
}
for name, (restype, argtypes) in signatures.items():
    if hasattr(lib, name):  # (an older library lacks the try-API; its own tests then fail where they use it)
        getattr(lib, name).restype = restype
        getattr(lib, name).argtypes = argtypes
def last_error():
    return lib.vmalloc_last_error().decode()
"""


def run(code: str, env_conf: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "VMALLOC_CONF": env_conf, **env}
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True, text=True,
                          env=full, timeout=120)


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
        vmalloc.configure(capacity="32MiB", block_size="4MiB")
        c = vmalloc._C.global_configuration()
        assert c["backend"] == "host" and c["chunk_size"] == 1 << 20 and c["capacity"] == 32 << 20, c
        assert c["block_size"] == 4 << 20 and vmalloc.global_arena(0).stats()["block_size"] == 4 << 20, c
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


@pytest.mark.parametrize(
    "conf, size, device, message",
    [
        ("backend=host,chunk_sz=2MiB", 1024, 0, "unknown VMALLOC_CONF key 'chunk_sz'"),
        ("backend=host,eager_growth=yes please", 1024, 0, "write true or false"),
        ("backend=host,capacity=64MiB", -5, 0, "negative size -5"),
        ("backend=host,capacity=64MiB", 1 << 40, 0, "vmalloc out of memory: tried to allocate 1.00 TiB"),
        ("backend=host,capacity=64MiB", 1024, 64, "device 64 does not exist: the host backend presents 1 device"),
        ("backend=host,capacity=64MiB", 1024, -1, "device -1 does not exist"),
        ("backend=host,capacity=64MiB,devices=2", 1024, 2, "presents 2 device"),
    ],
)
def test_try_malloc_returns_null_and_a_message_instead_of_ending_the_process(conf, size, device, message):
    r = run(
        f"""
        p = lib.vmalloc_try_malloc({size}, {device}, None)
        print("NULL" if p is None else "PTR")
        print(last_error())
        """,
        conf,
    )
    assert r.returncode == 0, r.stderr  # was: terminate called after throwing ...
    out = r.stdout.splitlines()
    assert out[0] == "NULL" and "vmalloc_try_malloc: " in out[1] and message in out[1], r.stdout


def test_cuda_backend_without_a_driver_is_an_error_naming_the_library():
    r = run(
        """
        assert lib.vmalloc_try_malloc(1024, 0, None) is None
        print(last_error())
        assert lib.vmalloc_try_init(1) == -1
        print(last_error())
        """,
        "backend=cuda",
        VMALLOC_LIBCUDA="/nonexistent/libcuda.so.1",
    )
    assert r.returncode == 0, r.stderr
    for line in r.stdout.splitlines():
        assert "cannot load /nonexistent/libcuda.so.1 (named by VMALLOC_LIBCUDA)" in line


def test_last_error_is_cleared_by_a_successful_call_and_try_variants_report():
    r = run(
        """
        assert lib.vmalloc_try_malloc(-1, 0, None) is None and last_error()
        p = lib.vmalloc_try_malloc(4096, 0, None)
        assert p is not None and last_error() == ""
        assert lib.vmalloc_try_free(p + 512, 0) == -1 and "not a live allocation" in last_error()
        assert lib.vmalloc_try_free(p, 0) == 0 and last_error() == ""
        assert lib.vmalloc_try_set_memory_fraction(1.5, 0) == -1 and "(0, 1]" in last_error()
        assert lib.vmalloc_try_record_stream(12345, None) == -1 and "no vmalloc arena allocated" in last_error()
        assert lib.vmalloc_try_empty_cache() == 0
        print("OK")
        """,
        "backend=host,capacity=64MiB",
    )
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr


def test_free_never_creates_an_arena_and_never_throws():
    r = run(
        """
        lib.vmalloc_free(ctypes.c_void_p(4096), 64, 7, None)    # device 7: no arena, none made
        lib.vmalloc_free(ctypes.c_void_p(4096), 64, 0, None)    # device 0 has no arena yet either
        lib.vmalloc_free(ctypes.c_void_p(4096), 64, -1, None)
        assert all(vmalloc._C.existing_global_arena(d) is None for d in range(8))
        print("OK")
        """,
        "backend=host,capacity=64MiB",
    )
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr
    assert r.stderr.count("which has no vmalloc arena") == 3


def test_init_hook_takes_the_device_count_and_makes_no_arena():
    """torch calls init_fn(device_count); on a one-device view, device 1 must not be tried."""
    r = run(
        """
        lib.vmalloc_init(1)              # torch: one device
        assert vmalloc._C.existing_global_arena(0) is None and vmalloc._C.existing_global_arena(1) is None
        assert lib.vmalloc_try_init(2) == -1
        print(last_error())
        assert lib.vmalloc_try_init(0) == 0
        print("OK")
        """,
        "backend=host,capacity=64MiB",
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert "torch sees 2 device(s) but the host backend has 1: set devices=2" in out[0]
    assert out[-1] == "OK"


def test_init_hook_reports_a_bad_configuration():
    r = run(
        """
        assert lib.vmalloc_try_init(1) == -1
        print(last_error())
        """,
        "backend=bogus",
    )
    assert r.returncode == 0, r.stderr
    assert "unknown backend 'bogus': choose 'cuda', 'host' or 'sim'" in r.stdout


def test_configure_checks_at_once():
    r = run(
        """
        for bad, msg in [({"backend": "bogus"}, "choose 'cuda', 'host' or 'sim'"),
                         ({"capacity": "9000000TB"}, "more than vmalloc supports"),
                         ({"eager_growth": "yes"}, "True or False"),
                         ({"devices": 0}, "between 1 and 64"),
                         ({"block_size": "3MiB"}, "not a multiple of chunk_size")]:
            try:
                vmalloc.configure(**bad)
            except (ValueError, TypeError) as e:
                assert msg in str(e), (bad, str(e))
            else:
                raise AssertionError(f"configure({bad}) was accepted")
        print("OK")
        """,
        "backend=host",
    )
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr


def test_configure_refuses_a_chunk_size_off_the_granularity_naming_the_nearest():
    # "2MB" is 2,000,000 bytes: it used to be accepted, and the first CUDA allocation failed deep inside torch.
    r = run(
        """
        for backend, size, names in [("cuda", "2MB", ["2MiB"]), ("sim", "5MB", ["4MiB", "6MiB"]),
                                     ("host", 6000, ["4KiB", "8KiB"])]:
            try:
                vmalloc.configure(backend=backend, chunk_size=size)
            except ValueError as e:
                assert "not a multiple of the " + backend + " backend's granularity" in str(e), str(e)
                assert all(n in str(e) for n in names), str(e)
            else:
                raise AssertionError(f"configure(backend={backend!r}, chunk_size={size!r}) was accepted")
        vmalloc.configure(backend="cuda", chunk_size="4MiB")
        print("OK")
        """,
        "",
    )
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr


def test_vmalloc_conf_with_a_chunk_size_off_the_granularity_fails_when_read():
    r = run(
        """
        try:
            vmalloc.stats(0), vmalloc._C.global_configuration()
        except ValueError as e:
            print(e)
        """,
        "backend=sim,chunk_size=3MB",
    )
    assert r.returncode == 0, r.stderr
    assert "VMALLOC_CONF='backend=sim,chunk_size=3MB'" in r.stdout and "2MiB and 4MiB" in r.stdout, r.stdout


@pytest.mark.skipif(SANITIZED_RUN or shutil.which("c++") is None, reason="needs a C++ compiler and the plain build")
def test_torch_path_throws_cxx_exceptions_torch_can_catch(tmp_path):
    import vmalloc

    lib = Path(vmalloc._C.library_path())
    exe = tmp_path / "torch_path"
    subprocess.run(["c++", "-std=c++17", f"-I{CSRC}", str(Path(__file__).parent / "cpp" / "torch_path.cpp"),
                    str(lib), f"-Wl,-rpath,{lib.parent}", "-o", str(exe)], check=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "VMALLOC_CONF": "backend=host,capacity=64MiB"})
    assert r.returncode == 0, r.stderr
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert out["malloc"] == "ok"
    assert out["oom"].startswith("OutOfMemory vmalloc out of memory")
    assert out["device"].startswith("std::exception vmalloc: device 5 does not exist")
    assert out["negative"].startswith("invalid_argument vmalloc_malloc: negative size")
