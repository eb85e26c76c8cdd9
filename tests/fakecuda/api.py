"""ctypes wrappers for the emulated driver: the driver entry points a test needs, and the test-only API
(``src/fakecuda.h``). One library instance per process; ``driver()`` returns it ready to use."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_ubyte, c_uint, c_ulonglong, c_void_p
from pathlib import Path
from typing import Any, Optional

from .build import ensure_built

MiB = 1 << 20

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906
CUDA_ERROR_CAPTURED_EVENT = 907

CU_STREAM_LEGACY = 1
CU_STREAM_NON_BLOCKING = 1
CU_EVENT_DISABLE_TIMING = 2
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_STREAM_CAPTURE_STATUS_NONE = 0
CU_STREAM_CAPTURE_STATUS_ACTIVE = 1
CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2
CU_STREAM_CAPTURE_MODE_GLOBAL = 0
CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
CU_STREAM_CAPTURE_MODE_RELAXED = 2


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", c_ubyte), ("gpuDirectRDMACapable", c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", c_void_p), ("allocFlags", _AllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", c_int)]


def device_prop(device: int = 0) -> CUmemAllocationProp:
    """Pinned device memory on `device`, as vmalloc asks for it."""
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device)
    return prop


def access_desc(device: int = 0, flags: int = CU_MEM_ACCESS_FLAGS_PROT_READWRITE) -> CUmemAccessDesc:
    return CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device), flags)


class CudaError(RuntimeError):
    """A driver call returned an error; `reason` is the emulator's explanation (its misuse log), if any."""

    def __init__(self, call: str, code: int, name: str, reason: str = "") -> None:
        super().__init__(f"{call} returned {name} ({code})" + (f": {reason}" if reason else ""))
        self.call = call
        self.code = code


_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    # test API
    "fakecuda_fill": (c_int, [c_void_p, c_ulonglong, c_size_t, c_ubyte, c_uint]),
    "fakecuda_copy": (c_int, [c_void_p, c_ulonglong, c_ulonglong, c_size_t, c_uint]),
    "fakecuda_read": (c_int, [c_void_p, c_void_p, c_ulonglong, c_size_t, c_uint]),
    "fakecuda_expect": (c_int, [c_void_p, c_ulonglong, c_size_t, c_ubyte, c_uint]),
    "fakecuda_sleep": (c_int, [c_void_p, c_uint]),
    "fakecuda_drain": (None, []),
    "fakecuda_check_reuse": (c_int, [c_void_p, c_ulonglong, c_size_t]),
    "fakecuda_violations": (c_size_t, []),
    "fakecuda_violation_text": (c_char_p, [c_size_t]),
    "fakecuda_violation_kind": (c_char_p, [c_size_t]),
    "fakecuda_dump_violations": (c_size_t, []),
    "fakecuda_misuses": (c_size_t, []),
    "fakecuda_misuse_text": (c_char_p, [c_size_t]),
    "fakecuda_reset": (None, []),
    "fakecuda_set_faults": (c_int, [c_char_p]),
    "fakecuda_fault_error": (c_char_p, []),
    "fakecuda_calls": (c_ulonglong, [c_char_p]),
    "fakecuda_begin_capture": (c_int, [c_void_p, c_int]),
    "fakecuda_end_capture": (c_int, [c_void_p]),
    "fakecuda_live_allocations": (c_size_t, []),
    "fakecuda_live_mappings": (c_size_t, []),
    "fakecuda_live_reservations": (c_size_t, []),
    "fakecuda_live_streams": (c_size_t, []),
    "fakecuda_live_events": (c_size_t, []),
    "fakecuda_used_bytes": (c_size_t, [c_int]),
    "fakecuda_primary_retains": (c_int, [c_int]),
    # driver entry points (exported names; cuda.h maps some base names to _v2)
    "cuInit": (c_int, [c_uint]),
    "cuDriverGetVersion": (c_int, [POINTER(c_int)]),
    "cuGetErrorName": (c_int, [c_int, POINTER(c_char_p)]),
    "cuGetErrorString": (c_int, [c_int, POINTER(c_char_p)]),
    "cuGetProcAddress": (c_int, [c_char_p, POINTER(c_void_p), c_int, c_ulonglong]),
    "cuGetProcAddress_v2": (c_int, [c_char_p, POINTER(c_void_p), c_int, c_ulonglong, POINTER(c_int)]),
    "cuDeviceGet": (c_int, [POINTER(c_int), c_int]),
    "cuDeviceGetCount": (c_int, [POINTER(c_int)]),
    "cuDeviceGetName": (c_int, [c_char_p, c_int, c_int]),
    "cuDeviceTotalMem_v2": (c_int, [POINTER(c_size_t), c_int]),
    "cuDevicePrimaryCtxRetain": (c_int, [POINTER(c_void_p), c_int]),
    "cuDevicePrimaryCtxRelease_v2": (c_int, [c_int]),
    "cuCtxGetCurrent": (c_int, [POINTER(c_void_p)]),
    "cuCtxSetCurrent": (c_int, [c_void_p]),
    "cuCtxPushCurrent_v2": (c_int, [c_void_p]),
    "cuCtxPopCurrent_v2": (c_int, [POINTER(c_void_p)]),
    "cuCtxGetDevice": (c_int, [POINTER(c_int)]),
    "cuCtxSynchronize": (c_int, []),
    "cuMemGetAllocationGranularity": (c_int, [POINTER(c_size_t), POINTER(CUmemAllocationProp), c_int]),
    "cuMemAddressReserve": (c_int, [POINTER(c_ulonglong), c_size_t, c_size_t, c_ulonglong, c_ulonglong]),
    "cuMemAddressFree": (c_int, [c_ulonglong, c_size_t]),
    "cuMemCreate": (c_int, [POINTER(c_ulonglong), c_size_t, POINTER(CUmemAllocationProp), c_ulonglong]),
    "cuMemRelease": (c_int, [c_ulonglong]),
    "cuMemMap": (c_int, [c_ulonglong, c_size_t, c_size_t, c_ulonglong, c_ulonglong]),
    "cuMemUnmap": (c_int, [c_ulonglong, c_size_t]),
    "cuMemSetAccess": (c_int, [c_ulonglong, c_size_t, POINTER(CUmemAccessDesc), c_size_t]),
    "cuMemGetAccess": (c_int, [POINTER(c_ulonglong), POINTER(CUmemLocation), c_ulonglong]),
    "cuMemGetInfo_v2": (c_int, [POINTER(c_size_t), POINTER(c_size_t)]),
    "cuPointerGetAttribute": (c_int, [c_void_p, c_int, c_ulonglong]),
    "cuEventCreate": (c_int, [POINTER(c_void_p), c_uint]),
    "cuEventDestroy_v2": (c_int, [c_void_p]),
    "cuEventRecord": (c_int, [c_void_p, c_void_p]),
    "cuEventQuery": (c_int, [c_void_p]),
    "cuEventSynchronize": (c_int, [c_void_p]),
    "cuStreamCreate": (c_int, [POINTER(c_void_p), c_uint]),
    "cuStreamDestroy_v2": (c_int, [c_void_p]),
    "cuStreamSynchronize": (c_int, [c_void_p]),
    "cuStreamQuery": (c_int, [c_void_p]),
    "cuStreamWaitEvent": (c_int, [c_void_p, c_void_p, c_uint]),
    "cuStreamIsCapturing": (c_int, [c_void_p, POINTER(c_int)]),
    "cuStreamGetCaptureInfo": (c_int, [c_void_p, POINTER(c_int), POINTER(c_ulonglong)]),
    "cuStreamGetCaptureInfo_v2": (c_int, [c_void_p, POINTER(c_int), POINTER(c_ulonglong), c_void_p, c_void_p,
                                          c_void_p]),
}


class FakeCuda:
    """The emulated driver in this process. Methods named after driver calls raise CudaError on failure;
    ``call`` returns the raw CUresult for tests that expect one."""

    def __init__(self, path: Optional[Path] = None) -> None:
        self.path = Path(path) if path else ensure_built()
        self.lib = ctypes.CDLL(str(self.path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.restype = restype
            fn.argtypes = argtypes

    # --- raw calls and errors ---------------------------------------------------------------------------
    def call(self, name: str, *args: Any) -> int:
        """Calls an exported function and returns its result unchecked. Only functions with a declared
        signature (_SIGNATURES) may be called: ctypes would otherwise truncate 64-bit arguments silently."""
        if name not in _SIGNATURES:
            raise KeyError(f"{name} has no signature in fakecuda/api.py's _SIGNATURES; add it there")
        return getattr(self.lib, name)(*args)

    def check(self, name: str, *args: Any) -> None:
        before = self.lib.fakecuda_misuses()
        code = self.call(name, *args)
        if code != CUDA_SUCCESS:
            after = self.lib.fakecuda_misuses()
            reason = self.lib.fakecuda_misuse_text(after - 1).decode() if after > before else ""
            raise CudaError(name, code, self.error_name(code), reason)

    def error_name(self, code: int) -> str:
        out = c_char_p()
        if self.lib.cuGetErrorName(code, byref(out)) != CUDA_SUCCESS or not out.value:
            return f"CUresult {code}"
        return out.value.decode()

    # --- devices and contexts -----------------------------------------------------------------------------
    def init(self) -> None:
        self.check("cuInit", 0)

    def make_current(self, device: int = 0) -> int:
        """Retains `device`'s primary context and makes it current on the calling thread."""
        ctx = c_void_p()
        self.check("cuDevicePrimaryCtxRetain", byref(ctx), device)
        self.check("cuCtxSetCurrent", ctx)
        return ctx.value or 0

    def granularity(self, device: int = 0) -> int:
        g = c_size_t()
        self.check("cuMemGetAllocationGranularity", byref(g), byref(device_prop(device)), 0)
        return g.value

    def ctx_synchronize(self) -> None:
        self.check("cuCtxSynchronize")

    # --- memory ---------------------------------------------------------------------------------------
    def reserve(self, size: int, alignment: int = 0) -> int:
        ptr = c_ulonglong()
        self.check("cuMemAddressReserve", byref(ptr), size, alignment, 0, 0)
        return ptr.value

    def free_reservation(self, ptr: int, size: int) -> None:
        self.check("cuMemAddressFree", ptr, size)

    def create(self, size: int, device: int = 0) -> int:
        handle = c_ulonglong()
        self.check("cuMemCreate", byref(handle), size, byref(device_prop(device)), 0)
        return handle.value

    def release(self, handle: int) -> None:
        self.check("cuMemRelease", handle)

    def map(self, ptr: int, size: int, handle: int, offset: int = 0) -> None:
        self.check("cuMemMap", ptr, size, offset, handle, 0)

    def unmap(self, ptr: int, size: int) -> None:
        self.check("cuMemUnmap", ptr, size)

    def set_access(self, ptr: int, size: int, device: int = 0,
                   flags: int = CU_MEM_ACCESS_FLAGS_PROT_READWRITE) -> None:
        self.check("cuMemSetAccess", ptr, size, byref(access_desc(device, flags)), 1)

    def access_flags(self, ptr: int, device: int = 0) -> int:
        """The CUmemAccess_flags `device` has on the mapping holding `ptr`."""
        flags = c_ulonglong()
        self.check("cuMemGetAccess", byref(flags), byref(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device)), ptr)
        return flags.value

    def map_new(self, size: int, device: int = 0) -> tuple[int, int]:
        """Reserves, creates, maps and grants read/write access to `size` bytes: (address, handle)."""
        ptr = self.reserve(size)
        handle = self.create(size, device)
        self.map(ptr, size, handle)
        self.set_access(ptr, size, device)
        return ptr, handle

    def unmap_free(self, ptr: int, size: int, handle: int) -> None:
        """Undoes map_new."""
        self.unmap(ptr, size)
        self.release(handle)
        self.free_reservation(ptr, size)

    @staticmethod
    def peek(addr: int, n: int) -> bytes:
        """Reads "device" memory from the host (it is mapped in this process)."""
        return ctypes.string_at(addr, n)

    @staticmethod
    def poke(addr: int, data: bytes) -> None:
        ctypes.memmove(addr, data, len(data))

    # --- streams and events -------------------------------------------------------------------------------
    def stream(self, nonblocking: bool = False) -> int:
        s = c_void_p()
        self.check("cuStreamCreate", byref(s), CU_STREAM_NON_BLOCKING if nonblocking else 0)
        return s.value or 0

    def destroy_stream(self, stream: int) -> None:
        self.check("cuStreamDestroy_v2", stream)

    def synchronize(self, stream: int) -> None:
        self.check("cuStreamSynchronize", stream)

    def _query(self, name: str, handle: int) -> bool:
        """True when the work is done, False while it is pending (CUDA_ERROR_NOT_READY); raises otherwise."""
        code = self.call(name, handle)
        if code not in (CUDA_SUCCESS, CUDA_ERROR_NOT_READY):
            raise CudaError(name, code, self.error_name(code))
        return code == CUDA_SUCCESS

    def stream_done(self, stream: int) -> bool:
        return self._query("cuStreamQuery", stream)

    def event(self) -> int:
        e = c_void_p()
        self.check("cuEventCreate", byref(e), CU_EVENT_DISABLE_TIMING)
        return e.value or 0

    def destroy_event(self, event: int) -> None:
        self.check("cuEventDestroy_v2", event)

    def record(self, event: int, stream: int) -> None:
        self.check("cuEventRecord", event, stream)

    def event_done(self, event: int) -> bool:
        return self._query("cuEventQuery", event)

    def event_synchronize(self, event: int) -> None:
        self.check("cuEventSynchronize", event)

    def wait_event(self, stream: int, event: int) -> None:
        self.check("cuStreamWaitEvent", stream, event, 0)

    def capture_status(self, stream: int) -> int:
        status = c_int()
        self.check("cuStreamIsCapturing", stream, byref(status))
        return status.value

    def begin_capture(self, stream: int, mode: int = CU_STREAM_CAPTURE_MODE_GLOBAL) -> None:
        self.check("fakecuda_begin_capture", stream, mode)

    def end_capture(self, stream: int) -> int:
        """Ends the capture; returns CUDA_SUCCESS, or CUDA_ERROR_STREAM_CAPTURE_INVALIDATED."""
        return self.call("fakecuda_end_capture", stream)

    # --- stream work ----------------------------------------------------------------------------------
    def fill(self, stream: int, addr: int, n: int, byte: int, delay_us: int = 0) -> None:
        self.check("fakecuda_fill", stream, addr, n, byte, delay_us)

    def copy(self, stream: int, dst: int, src: int, n: int, delay_us: int = 0) -> None:
        self.check("fakecuda_copy", stream, dst, src, n, delay_us)

    def read(self, stream: int, addr: int, n: int, delay_us: int = 0) -> ctypes.Array:
        """Enqueues a copy of [addr, addr + n) to a new host buffer, returned; valid once the work has run."""
        buf = ctypes.create_string_buffer(n)
        self.check("fakecuda_read", stream, buf, addr, n, delay_us)
        return buf

    def expect(self, stream: int, addr: int, n: int, byte: int, delay_us: int = 0) -> None:
        self.check("fakecuda_expect", stream, addr, n, byte, delay_us)

    def sleep(self, stream: int, delay_us: int) -> None:
        self.check("fakecuda_sleep", stream, delay_us)

    def drain(self) -> None:
        """Waits for all stream work without ordering the host after it (see fakecuda.h)."""
        self.lib.fakecuda_drain()

    def check_reuse(self, stream: int, addr: int, n: int) -> None:
        self.check("fakecuda_check_reuse", stream, addr, n)

    # --- the race detector and the misuse log -------------------------------------------------------------
    def violations(self) -> list[str]:
        n = min(self.lib.fakecuda_violations(), 10000)
        return [(self.lib.fakecuda_violation_text(i) or b"").decode() for i in range(n)]

    def violation_kinds(self) -> list[str]:
        n = min(self.lib.fakecuda_violations(), 10000)
        return [(self.lib.fakecuda_violation_kind(i) or b"").decode() for i in range(n)]

    def take_violations(self) -> list[str]:
        """Waits for all work, returns the kinds of the violations found and forgets them (reset)."""
        self.drain()
        kinds = self.violation_kinds()
        self.reset()
        return kinds

    def misuses(self) -> list[str]:
        return [(self.lib.fakecuda_misuse_text(i) or b"").decode() for i in range(self.lib.fakecuda_misuses())]

    def reset(self) -> None:
        self.lib.fakecuda_reset()

    def assert_no_violations(self) -> None:
        self.drain()
        found = self.violations()
        assert not found, f"fakecuda recorded {len(found)} violation(s):\n\n" + "\n\n".join(found)

    # --- fault injection ------------------------------------------------------------------------------
    def set_faults(self, spec: str) -> None:
        """Replaces the fault rules (FAKECUDA_FAIL syntax) and resets the call counters."""
        if self.lib.fakecuda_set_faults(spec.encode()) != CUDA_SUCCESS:
            raise ValueError(self.lib.fakecuda_fault_error().decode())

    def calls(self, entry: str) -> int:
        return self.lib.fakecuda_calls(entry.encode())

    # --- state ------------------------------------------------------------------------------------------
    def live(self) -> dict[str, int]:
        """What exists now: allocations, mappings, reservations, streams, events (for leak checks)."""
        return {k: getattr(self.lib, f"fakecuda_live_{k}")()
                for k in ("allocations", "mappings", "reservations", "streams", "events")}

    def used_bytes(self, device: int = 0) -> int:
        return self.lib.fakecuda_used_bytes(device)

    def primary_retains(self, device: int = 0) -> int:
        return self.lib.fakecuda_primary_retains(device)


_driver: Optional[FakeCuda] = None


def driver() -> FakeCuda:
    """This process's emulated driver, initialized, with device 0's primary context current on this thread.

    Other threads call ``make_current()`` themselves: the current context is per thread, as on CUDA.
    """
    global _driver
    if _driver is None:
        d = FakeCuda()
        d.init()
        d.make_current(0)
        _driver = d
    return _driver
