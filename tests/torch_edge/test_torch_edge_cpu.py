"""The torch-facing edge without a GPU: header search, the adapter's build plan and fallback, the C entry
points the adapter and MemPool mode use (on the host backend), and how swap finds vmalloc."""

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import vmalloc
from vmalloc import cuda_paths, torch_adapter

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, env_conf: str = "backend=host,capacity=8MiB,chunk_size=1MiB,small_max=4KiB") -> str:
    """Runs code in a fresh interpreter (the global arenas are process-wide) with VMALLOC_CONF set."""
    import os

    env = dict(os.environ, VMALLOC_CONF=env_conf, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


# -- finding the CUDA headers the adapter compiles against ------------------------------------------------------------


def make_header(d: Path, name: str = "cuda.h") -> Path:
    d.mkdir(parents=True)
    (d / name).write_text("/* test */\n")
    return d


def test_cuda_h_found_in_the_cu13_wheel_layout_before_the_cu12_one(tmp_path, monkeypatch):
    # /usr/local/cuda (tried before the wheels) is moved out of the way, so the wheel layouts decide.
    monkeypatch.setattr(cuda_paths, "SYSTEM_INCLUDE", tmp_path / "no-toolkit" / "include")
    site = tmp_path / "site"
    cu12 = make_header(site / "nvidia" / "cuda_runtime" / "include")
    assert cuda_paths.find_header("cuda.h", env={}, sites=[str(site)]) == cu12
    cu13 = make_header(site / "nvidia" / "cu13" / "include")
    assert cuda_paths.find_header("cuda.h", env={}, sites=[str(site)]) == cu13
    # A second site-packages (purelib, platlib) is searched after the first.
    other = tmp_path / "other"
    assert cuda_paths.find_header("cuda.h", env={}, sites=[str(other), str(site)]) == cu13
    assert cuda_paths.main(["cuda.h", str(site)]) == 0
    assert cuda_paths.main(["no_such_header.h", str(site)]) == 1


def test_cuda_h_found_in_the_cu12_wheel_layout_and_cuda_home_first(tmp_path):
    site = tmp_path / "site"
    cu12 = make_header(site / "nvidia" / "cuda_runtime" / "include")
    home = tmp_path / "toolkit"
    make_header(home / "include")
    dirs = cuda_paths.candidate_dirs(env={"CUDA_HOME": str(home)}, sites=[str(site)])
    assert dirs[0] == home / "include"
    assert cu12 in dirs
    assert cuda_paths.find_header("cuda.h", env={"CUDA_HOME": str(home)}, sites=[str(site)]) == home / "include"
    assert cuda_paths.find_header("no_such_header.h", env={}, sites=[str(site)]) is None


def test_the_makefile_takes_cuda_include_from_the_shared_search(tmp_path):
    # The Makefile runs vmalloc/cuda_paths.py as a script; CUDA_HOME, which it honours first, tells its answer
    # apart from /usr/local/cuda. Without CUDA_HOME (and no cuda.h anywhere) it would print nothing.
    import os
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    home = tmp_path / "toolkit"
    make_header(home / "include")
    env = dict(os.environ, CUDA_HOME=str(home))
    env.pop("CUDA_INCLUDE", None)
    script = subprocess.run([sys.executable, "vmalloc/cuda_paths.py", "cuda.h"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert script.returncode == 0 and script.stdout.strip() == str(home / "include")
    # A dry run of every compile (-B: as if out of date) shows the directory each one is given.
    r = subprocess.run(["make", "-nB", "fakecuda", f"PY={sys.executable}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    compiles = [line for line in r.stdout.splitlines() if " -c tests/fakecuda/src/" in line]
    assert compiles and all(f"-isystem {home / 'include'} " in line for line in compiles), r.stdout[-2000:] + r.stderr


# -- the adapter's build plan and its fallback ---------------------------------------------------------------


def test_extension_name_is_per_torch_version():
    assert torch_adapter.extension_name("2.11.0+cu130") == "vmalloc_torch_2_11_0_cu130"
    assert torch_adapter.extension_name("2.4.0") != torch_adapter.extension_name("2.5.0")


def test_build_arguments_link_the_core_and_torch_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("VMALLOC_CACHE", str(tmp_path / "cache"))
    cuda = make_header(tmp_path / "cuda" / "include", "cuda_runtime_api.h")
    monkeypatch.setenv("CUDA_HOME", str(cuda.parent))
    fake_torch = types.SimpleNamespace(__version__="2.11.0+cu130", __file__=str(tmp_path / "torch" / "__init__.py"))
    src = torch_adapter.source_dir()
    assert src is not None and (src / "adapter.cpp").is_file()
    args = torch_adapter.build_arguments(fake_torch, str(tmp_path / "lib" / "libvmalloc.so"), src)
    assert args["name"] == "vmalloc_torch_2_11_0_cu130"
    assert str(cuda) in args["extra_include_paths"]
    flags = " ".join(args["extra_ldflags"])
    assert "-lvmalloc" in flags and f"-L{tmp_path / 'lib'}" in flags and "-ltorch_cuda" in flags
    assert args["build_directory"].startswith(str(tmp_path / "cache"))
    assert args["with_cuda"] is False


def test_build_arguments_name_a_missing_cuda_runtime_header(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_paths, "find_header", lambda name, *a, **k: None)
    fake_torch = types.SimpleNamespace(__version__="2.11.0", __file__=str(tmp_path / "t" / "__init__.py"))
    with pytest.raises(RuntimeError, match="cuda_runtime_api.h not found"):
        torch_adapter.build_arguments(fake_torch, "/x/libvmalloc.so", torch_adapter.source_dir())


def test_loaded_library_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 123 /opt/x/nvidia/cu13/lib/libcudart.so.13\n"
        "7f02-7f03 rw-p 00000000 00:00 0 \n"
    )
    assert torch_adapter.loaded_library("libcudart.so", str(maps)) == "/opt/x/nvidia/cu13/lib/libcudart.so.13"
    assert torch_adapter.loaded_library("libnccl", str(maps)) is None


def test_adapter_declines_with_a_reason_on_this_torch():
    code = """
        from vmalloc import torch_adapter
        import torch
        print(torch_adapter.load() is None, '|', torch_adapter.reason())
    """
    out = run_python(code)
    if torch.version.cuda:
        pytest.skip("a CUDA build of torch: the adapter may build here")
    assert out.startswith("True |") and "not a CUDA build" in out


def test_adapter_can_be_switched_off():
    out = run_python("""
        import os; os.environ['VMALLOC_TORCH_ADAPTER'] = '0'
        from vmalloc import torch_adapter
        print(torch_adapter.load(), torch_adapter.reason())
    """)
    assert out.strip().startswith("None VMALLOC_TORCH_ADAPTER=0 turns it off")


def test_allocator_on_a_cpu_torch_says_what_is_needed():
    if torch.version.cuda:
        pytest.skip("a CUDA build of torch")
    with pytest.raises(RuntimeError, match="CUDA build of PyTorch"):
        vmalloc.allocator()
    assert vmalloc.installed() is False


# -- no silent fallback: without the adapter, allocator() refuses unless asked -------------------------------

NINJA_MISSING = "ninja, which torch builds it with, is not installed: pip install ninja"


@pytest.fixture
def cuda_torch_without_adapter(monkeypatch):
    """vmalloc's torch layer as on a CUDA torch whose adapter could not be built. A CPU torch cannot make torch's
    plain pluggable allocator, so the one made is a stand-in naming its malloc symbol; the list records them."""
    from vmalloc import torch_allocator

    for name in ("_ALLOCATOR", "_POOL_ALLOCATOR", "_ADAPTER"):
        monkeypatch.setattr(torch_allocator, name, None)
    monkeypatch.setattr(torch_allocator, "_require_cuda_torch", lambda: torch)
    monkeypatch.setattr(torch_adapter, "_tried", True)
    monkeypatch.setattr(torch_adapter, "_loaded", None)
    monkeypatch.setattr(torch_adapter, "_reason", NINJA_MISSING)
    made = []

    def plain(symbol):
        made.append(symbol)
        return types.SimpleNamespace(symbol=symbol, allocator=lambda: symbol)

    monkeypatch.setattr(torch_allocator, "_plain_allocator", plain)
    monkeypatch.delenv("VMALLOC_ALLOW_FALLBACK", raising=False)
    return made


WHAT_BREAKS = ("record_stream() is a no-op", "use-after-free", "NCCL", "memory_stats()", "cudnn.benchmark")


def test_allocator_without_the_adapter_refuses_with_the_reason_and_the_fix(cuda_torch_without_adapter):
    for _ in range(2):  # and again: a caught refusal does not leave the fallback installed
        with pytest.raises(RuntimeError) as e:
            vmalloc.allocator()
        text = str(e.value)
        for fragment in (NINJA_MISSING, "python -m vmalloc.torch_adapter", "fallback=True", "VMALLOC_ALLOW_FALLBACK=1",
                         *WHAT_BREAKS):  # fmt: skip
            assert fragment in text, (fragment, text)
    assert cuda_torch_without_adapter == [] and vmalloc.installed() is False


def test_the_fallback_is_entered_only_when_asked_and_warns_what_breaks(cuda_torch_without_adapter):
    with pytest.warns(RuntimeWarning) as record:
        alloc = vmalloc.allocator(fallback=True)
    text = " ".join(str(w.message) for w in record)
    assert all(fragment in text for fragment in (NINJA_MISSING, *WHAT_BREAKS)), text
    assert alloc.symbol == "vmalloc_malloc" and cuda_torch_without_adapter == ["vmalloc_malloc"]
    assert vmalloc.allocator() is alloc  # asked once: the same allocator from then on


def test_the_fallback_by_environment_and_an_explicit_no_wins(cuda_torch_without_adapter, monkeypatch):
    monkeypatch.setenv("VMALLOC_ALLOW_FALLBACK", "1")
    with pytest.raises(RuntimeError, match="not available"):
        vmalloc.allocator(fallback=False)
    with pytest.warns(RuntimeWarning, match="record_stream"):
        assert vmalloc.allocator().symbol == "vmalloc_malloc"


def test_mem_pool_without_the_adapter_warns_that_graphs_belong_outside_the_scope(cuda_torch_without_adapter,
                                                                                 monkeypatch):  # fmt: skip
    monkeypatch.setattr(torch.cuda, "MemPool", lambda raw: ("pool", raw), raising=False)
    with pytest.warns(RuntimeWarning, match="capture graphs outside the scope"):
        assert vmalloc.mem_pool() == ("pool", "vmalloc_malloc_no_handler")
    with pytest.raises(RuntimeError, match="not available"):  # the pool's consent is not the global allocator's
        vmalloc.allocator()


def test_ninja_is_found_in_its_package_when_not_on_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "ninja").write_text("#!/bin/sh\n")
    which = torch_adapter.shutil.which
    monkeypatch.setattr(torch_adapter.shutil, "which", lambda name, *a, **k: None if name == "ninja" else which(name))
    monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR=str(bin_dir)))
    assert torch_adapter.ninja_dir() == str(bin_dir)
    path = torch_adapter.os.environ["PATH"]
    with torch_adapter._ninja_on_path(str(bin_dir)):
        assert torch_adapter.os.environ["PATH"].split(":")[0] == str(bin_dir)
    assert torch_adapter.os.environ["PATH"] == path
    cuda_torch = types.SimpleNamespace(version=types.SimpleNamespace(cuda="13.0"), __version__="2.11.0+cu130",
                                       _C=types.SimpleNamespace(_cuda_changeCurrentAllocator=None))  # fmt: skip
    monkeypatch.setenv("CXX", sys.executable)  # a compiler that exists, so ninja is what is checked
    assert torch_adapter._why_not(cuda_torch) is None
    monkeypatch.setitem(sys.modules, "ninja", None)  # `import ninja` fails: neither on PATH nor installed
    assert torch_adapter._why_not(cuda_torch) == NINJA_MISSING + " (a dependency of vmalloc-swap)"
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    assert "no C++ compiler" in torch_adapter._why_not(cuda_torch)


# -- the C entry points (host backend through ctypes) -------------------------------------------------------


def test_out_of_memory_error_is_a_runtime_and_a_memory_error():
    assert issubclass(vmalloc.OutOfMemoryError, RuntimeError)
    assert issubclass(vmalloc.OutOfMemoryError, MemoryError)


def test_adapter_entry_points_respect_call_handler_and_report_stats():
    out = run_python("""
        import ctypes, vmalloc
        from vmalloc import _C
        lib = ctypes.CDLL(_C.library_path())
        calls = []
        vmalloc.set_oom_handler(lambda n: calls.append(n) or False)
        m = lib.vmalloc_adapter_malloc
        m.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                      ctypes.c_char_p, ctypes.c_size_t]
        out, err = ctypes.c_void_p(), ctypes.create_string_buffer(1024)
        assert m(ctypes.byref(out), 3 << 20, 0, None, 1, err, 1024) == 0 and out.value
        # 3 + 6 MiB > the 8 MiB capacity: out of memory (1) with the explanation; the handler runs only when
        # asked.
        assert m(ctypes.byref(ctypes.c_void_p()), 6 << 20, 0, None, 0, err, 1024) == 1
        assert calls == [] and b"out of memory" in err.value, err.value
        assert m(ctypes.byref(ctypes.c_void_p()), 6 << 20, 0, None, 1, err, 1024) == 1
        assert calls == [6 << 20]
        # MemPool's malloc: null on out of memory, never the handler.
        nh = lib.vmalloc_malloc_no_handler
        nh.restype, nh.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        assert nh(6 << 20, 0, None) is None and calls == [6 << 20]
        assert nh(4096, 0, None)
        # Statistics by name, as the adapter's getDeviceStats reads them.
        names = [b"allocated_bytes.all.current", b"num_ooms", b"no.such.stat"]
        arr = (ctypes.c_char_p * 3)(*names)
        vals = (ctypes.c_int64 * 3)()
        st = lib.vmalloc_adapter_stats
        st.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        assert st(0, arr, vals, 3) == 2
        s = vmalloc.stats(0)
        assert vals[0] == s["allocated_bytes.all.current"] and vals[1] == s["num_ooms"] == 3 and vals[2] == 0
        assert st(5, arr, vals, 3) == -1 and list(vals) == [0, 0, 0]   # no arena on device 5
        peak = s["allocated_bytes.all.peak"]
        lib.vmalloc_free(ctypes.c_void_p(out.value), 0, 0, None)
        lib.vmalloc_adapter_reset_peak(0)
        assert vmalloc.stats(0)["allocated_bytes.all.peak"] < peak
        print("ok")
    """)
    assert out.strip() == "ok"


def test_mem_pool_malloc_keeps_the_cause_of_a_null_and_prints_what_is_not_out_of_memory():
    # torch turns any null from a pool's alloc_fn into its own out-of-memory message: the cause must survive.
    code = """
        import ctypes, os, vmalloc
        from vmalloc import _C
        lib = ctypes.CDLL(_C.library_path())
        lib.vmalloc_last_error.restype = ctypes.c_char_p
        nh = lib.vmalloc_malloc_no_handler
        nh.restype, nh.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        assert nh(64 << 20, 0, None) is None                       # over the 8 MiB capacity
        assert b"out of memory" in lib.vmalloc_last_error(), lib.vmalloc_last_error()
        assert nh(4096, 7, None) is None                           # no device 7: not a lack of memory
        assert b"device" in lib.vmalloc_last_error(), lib.vmalloc_last_error()
        fr = lib.vmalloc_adapter_memory_fraction
        fr.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, ctypes.c_size_t]
        f, err = ctypes.c_double(), ctypes.create_string_buffer(512)
        assert fr(0, ctypes.byref(f), err, 512) == 0
        arena = vmalloc.global_arena(0)
        total = os.sysconf("SC_PHYS_PAGES") * arena.granularity       # the host backend's "device memory"
        assert abs(f.value - arena.capacity / total) < 1e-12, (f.value, arena.capacity, total)
        lib.vmalloc_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
        lib.vmalloc_set_memory_fraction(0.001, 0)                    # torch's set_per_process_memory_fraction
        assert fr(0, ctypes.byref(f), err, 512) == 0
        assert 0 <= 0.001 - f.value <= arena.chunk_size / total, f.value  # capacity is whole chunks
        assert fr(7, ctypes.byref(f), err, 512) == 2 and b"device" in err.value
        print("ok")
    """
    import os

    env = dict(os.environ, VMALLOC_CONF="backend=host,capacity=8MiB,chunk_size=1MiB,small_max=4KiB",
               PYTHONPATH=str(ROOT))  # fmt: skip
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    printed = [line for line in r.stderr.splitlines() if line.startswith("vmalloc:")]
    assert len(printed) == 1 and "not for lack of memory" in printed[0] and "device" in printed[0], r.stderr


# -- swap finds vmalloc before its first allocation ------------------------------------------------------


def test_swap_uses_vmalloc_when_installed_even_before_the_arena_exists():
    out = run_python("""
        import torch, vmalloc
        from vmalloc import _C
        from swap.runtime.machine.memory import vmalloc_arena
        assert _C.existing_global_arena(0) is None
        assert vmalloc_arena(torch.device("cuda", 0)) is None      # not torch's allocator: torch's stats
        vmalloc.installed = lambda: True                          # as after change_current_allocator(...)
        arena = vmalloc_arena(torch.device("cuda", 0))
        assert arena is not None and arena.backend == "host" and _C.existing_global_arena(0) is not None
        assert vmalloc_arena(torch.device("cpu")) is None
        print("ok")
    """)
    assert out.strip() == "ok"
