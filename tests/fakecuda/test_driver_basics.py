"""The emulated driver answers cuGetProcAddress for every entry point vmalloc looks up (with the ABI
version asked for), requires cuInit, keeps per-thread context stacks, and takes its configuration from the
environment, refusing bad values."""

import ctypes
import re

import pytest

from fakecuda.api import (
    CUDA_ERROR_INVALID_CONTEXT,
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_FOUND,
    CUDA_SUCCESS,
)
from fakecuda.build import ROOT
from fakecuda.isolated import run_isolated


def proc_address(fc, symbol, version=12000, flags=0):
    fn, status = ctypes.c_void_p(123), ctypes.c_int(-1)
    code = fc.call("cuGetProcAddress_v2", symbol.encode(), ctypes.byref(fn), version, flags, ctypes.byref(status))
    return code, fn.value, status.value


def exported(fc, name):
    return ctypes.cast(getattr(fc.lib, name), ctypes.c_void_p).value


def vmalloc_lookups():
    """The entry points csrc/ looks up through cuGetProcAddress (VMALLOC_CU_LOOKUP(name) lines)."""
    names = set()
    for path in (ROOT / "csrc").rglob("*.cpp"):
        names.update(re.findall(r"^\s*VMALLOC_CU_LOOKUP\((\w+)\)", path.read_text(), re.M))
    return sorted(names)


def test_every_entry_point_vmalloc_looks_up_is_provided(fakecuda):
    names = vmalloc_lookups()
    assert "cuMemMap" in names and "cuStreamWaitEvent" in names, names
    missing = [n for n in names if proc_address(fakecuda, n)[0] != CUDA_SUCCESS]
    assert not missing


def test_lookup_picks_the_abi_of_the_requested_version(fakecuda):
    assert proc_address(fakecuda, "cuDeviceTotalMem")[1] == exported(fakecuda, "cuDeviceTotalMem_v2")
    assert proc_address(fakecuda, "cuStreamGetCaptureInfo", 11000)[1] == exported(fakecuda, "cuStreamGetCaptureInfo")
    assert proc_address(fakecuda, "cuStreamGetCaptureInfo", 12000)[1] == exported(
        fakecuda, "cuStreamGetCaptureInfo_v2")
    assert proc_address(fakecuda, "cuStreamGetCaptureInfo", 12030)[1] == exported(
        fakecuda, "cuStreamGetCaptureInfo_v3")
    assert proc_address(fakecuda, "cuGetProcAddress", 12000)[1] == exported(fakecuda, "cuGetProcAddress_v2")


def test_unknown_symbols_are_not_found(fakecuda):
    assert proc_address(fakecuda, "cuMemAllocAsync") == (CUDA_ERROR_NOT_FOUND, None, 1)  # SYMBOL_NOT_FOUND
    assert "cuMemAllocAsync is not emulated by fakecuda" in fakecuda.misuses()[-1]
    assert proc_address(fakecuda, "cuMemMap", 10000) == (CUDA_ERROR_NOT_FOUND, None, 2)  # VERSION_NOT_SUFFICIENT
    assert proc_address(fakecuda, "cuMemMap", 99000)[0] == CUDA_ERROR_INVALID_VALUE  # newer than the driver
    assert proc_address(fakecuda, "cuStreamWaitEvent", 12000, flags=2)[0] == CUDA_ERROR_NOT_FOUND  # per-thread
    assert proc_address(fakecuda, "cuMemMap", 12000, flags=2)[0] == CUDA_SUCCESS


def test_error_names_and_strings(fakecuda):
    text = ctypes.c_char_p()
    assert fakecuda.call("cuGetErrorString", 2, ctypes.byref(text)) == CUDA_SUCCESS
    assert text.value == b"out of memory"
    assert fakecuda.error_name(906) == "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"
    assert fakecuda.call("cuGetErrorName", 12345, ctypes.byref(text)) == CUDA_ERROR_INVALID_VALUE


def test_devices_and_contexts(fakecuda):
    count, dev, total = ctypes.c_int(), ctypes.c_int(), ctypes.c_size_t()
    assert fakecuda.call("cuDeviceGetCount", ctypes.byref(count)) == CUDA_SUCCESS and count.value == 1
    assert fakecuda.call("cuDeviceGet", ctypes.byref(dev), 1) == CUDA_ERROR_INVALID_DEVICE
    assert fakecuda.call("cuDeviceTotalMem_v2", ctypes.byref(total), 0) == CUDA_SUCCESS
    assert total.value == 8 << 30
    current, popped = ctypes.c_void_p(), ctypes.c_void_p()
    assert fakecuda.call("cuCtxGetCurrent", ctypes.byref(current)) == CUDA_SUCCESS and current.value
    assert fakecuda.call("cuCtxPushCurrent_v2", current) == CUDA_SUCCESS
    assert fakecuda.call("cuCtxPopCurrent_v2", ctypes.byref(popped)) == CUDA_SUCCESS
    assert popped.value == current.value
    assert fakecuda.call("cuCtxPushCurrent_v2", ctypes.c_void_p(0x1234)) == CUDA_ERROR_INVALID_CONTEXT
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    assert fakecuda.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total)) == CUDA_SUCCESS
    assert free.value == total.value - fakecuda.used_bytes()


def test_primary_context_retains_are_counted(fakecuda):
    retains = fakecuda.primary_retains()
    ctx = ctypes.c_void_p()
    assert fakecuda.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0) == CUDA_SUCCESS
    assert fakecuda.primary_retains() == retains + 1
    assert fakecuda.call("cuDevicePrimaryCtxRelease_v2", 0) == CUDA_SUCCESS
    assert fakecuda.primary_retains() == retains


def test_calls_before_cuinit_fail_and_releasing_too_often_is_an_error():
    proc = run_isolated("""
        import ctypes, fakecuda
        fc = fakecuda.FakeCuda()
        ctx = ctypes.c_void_p()
        print(fc.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0))
        fc.init()
        print(fc.call("cuDevicePrimaryCtxRelease_v2", 0))
        print(fc.call("cuCtxPopCurrent_v2", ctypes.byref(ctx)))
        e = ctypes.c_void_p()
        print(fc.call("cuEventCreate", ctypes.byref(e), 0))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3", "201", "201", "201"]  # NOT_INITIALIZED, then INVALID_CONTEXT


def test_configuration_from_the_environment():
    proc = run_isolated("""
        import ctypes, fakecuda
        fc = fakecuda.driver()
        count, total = ctypes.c_int(), ctypes.c_size_t()
        fc.check("cuDeviceGetCount", ctypes.byref(count))
        fc.check("cuDeviceTotalMem_v2", ctypes.byref(total), 1)
        print(count.value, total.value, fc.granularity(1))
        fc.create(1 << 30, device=1)
        try:
            fc.create(64 << 10, device=1)
        except fakecuda.CudaError as e:
            print(e.code)
    """, FAKECUDA_DEVICES="2", FAKECUDA_TOTAL_MEM="1GiB", FAKECUDA_GRANULARITY="64KiB")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2", str(1 << 30), str(64 << 10), "2"]


@pytest.mark.parametrize("var, value, message", [
    ("FAKECUDA_DEVICES", "0", "not a device count from 1 to 64"),
    ("FAKECUDA_TOTAL_MEM", "8 GB", "not a size such as 8GiB"),
    ("FAKECUDA_GRANULARITY", "3MiB", "not a power of two"),
])
def test_bad_configuration_fails_cuinit_and_says_why(var, value, message):
    proc = run_isolated("""
        import fakecuda
        fc = fakecuda.FakeCuda()
        print(fc.call("cuInit", 0))
    """, **{var: value})
    assert proc.returncode == 0, proc.stderr
    assert f"fakecuda: bad configuration: {var}={value} is {message}" in proc.stderr
    assert proc.stdout.strip() == "1"


def test_only_the_driver_api_and_the_test_api_are_exported(fakecuda):
    import subprocess

    nm = subprocess.run(["nm", "-D", "--defined-only", str(fakecuda.path)], capture_output=True, text=True)
    if nm.returncode != 0:
        pytest.skip("nm is not available")
    names = [line.split()[-1] for line in nm.stdout.splitlines()]
    assert names and all(n.startswith(("cu", "fakecuda_")) for n in names), names
