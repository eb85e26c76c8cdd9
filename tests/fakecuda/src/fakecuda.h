// fakecuda's test-only API: functions a test calls (from Python through ctypes, see fakecuda.py) next to the
// driver entry points. The library is test infrastructure and never a vmalloc backend; README.md explains it.
//
// Unless said otherwise a function returns a CUresult: CUDA_SUCCESS, or the error a driver call with the same
// problem would return (invalid stream: CUDA_ERROR_INVALID_HANDLE; before cuInit: CUDA_ERROR_NOT_INITIALIZED).
// Stream 0 (or CU_STREAM_LEGACY) is the legacy stream of the calling thread's current context's device.
// Work is asynchronous: it runs on the stream's worker after everything enqueued before it, after `delay_us`.
#pragma once

#include <cuda.h>
#include <stddef.h>

#define FAKECUDA_API  // exported by exports.map

#ifdef __cplusplus
extern "C" {
#endif

// --- Stream work (each access is checked by the race detector when enqueued and executed) ----------------
// Writes `byte` over [dst, dst + n).
FAKECUDA_API CUresult fakecuda_fill(CUstream stream, CUdeviceptr dst, size_t n, unsigned char byte, unsigned delay_us);
// Copies [src, src + n) to dst (device to device).
FAKECUDA_API CUresult fakecuda_copy(CUstream stream, CUdeviceptr dst, CUdeviceptr src, size_t n, unsigned delay_us);
// Copies [src, src + n) into host memory at `host`, which must stay valid until the work has run.
FAKECUDA_API CUresult fakecuda_read(CUstream stream, void* host, CUdeviceptr src, size_t n, unsigned delay_us);
// Checks that every byte of [src, src + n) is `byte`; a difference is recorded as a data-mismatch violation.
FAKECUDA_API CUresult fakecuda_expect(CUstream stream, CUdeviceptr src, size_t n, unsigned char byte, unsigned delay_us);
// Occupies the stream for delay_us.
FAKECUDA_API CUresult fakecuda_sleep(CUstream stream, unsigned delay_us);
// Waits until every stream has run everything enqueued, WITHOUT ordering the host after it: the race
// detector still treats that work as unsynchronized (to show that a race is found even when it did no harm).
FAKECUDA_API void fakecuda_drain(void);

// --- Race detector (Note [Race detector] in race.h) -----------------------------------------------------
// Call right after an allocator hands [addr, addr + size) to `stream`: records a violation if the range is not
// mapped read/write for the stream's device, or if work on another stream touching it is not ordered before
// work enqueued on `stream` from now on.
FAKECUDA_API CUresult fakecuda_check_reuse(CUstream stream, CUdeviceptr addr, size_t size);
// Violations since the last reset (all of them counted; the first 10000 kept with their text).
FAKECUDA_API size_t fakecuda_violations(void);
// Text / kind ("unmap-pending", "release-pending", "reuse-unordered", "reuse-inaccessible", "stream-race",
// "illegal-address", "data-mismatch") of violation i, or NULL. Valid until the calling thread's next call.
FAKECUDA_API const char* fakecuda_violation_text(size_t i);
FAKECUDA_API const char* fakecuda_violation_kind(size_t i);
// Prints every kept violation to stderr; returns the count.
FAKECUDA_API size_t fakecuda_dump_violations(void);
// Broken driver rules: every call that returned an error because of its arguments or the driver's state, with
// the reason ("cuMemMap -> CUDA_ERROR_INVALID_VALUE: ... overlaps the mapping at ..."). Not violations: a
// test may break a rule on purpose. FAKECUDA_LOG=1 also prints them as they happen.
FAKECUDA_API size_t fakecuda_misuses(void);
FAKECUDA_API const char* fakecuda_misuse_text(size_t i);
// Waits for all stream work, then forgets violations, misuses and remembered accesses. Memory, streams,
// events and fault rules stay.
FAKECUDA_API void fakecuda_reset(void);

// --- Fault injection ----------------------------------------------------------------------------------------
// Replaces the fault rules (FAKECUDA_FAIL syntax: "cuMemCreate:3:CUDA_ERROR_OUT_OF_MEMORY,cuMemMap:5:
// CUDA_ERROR_INVALID_VALUE:once"; "" clears them) and resets every call counter. Bad text changes nothing,
// is printed to stderr and returns CUDA_ERROR_INVALID_VALUE; fakecuda_fault_error() then says why.
FAKECUDA_API CUresult fakecuda_set_faults(const char* spec);
FAKECUDA_API const char* fakecuda_fault_error(void);
// How often an entry point (base name, e.g. "cuMemMap") was called since the counters were reset.
FAKECUDA_API unsigned long long fakecuda_calls(const char* entry);

// --- Stream capture (Note [Capture] in driver.cpp) ----------------------------------------------------------
// mode: CU_STREAM_CAPTURE_MODE_GLOBAL (0), _THREAD_LOCAL (1) or _RELAXED (2).
FAKECUDA_API CUresult fakecuda_begin_capture(CUstream stream, int mode);
// Ends the capture the stream takes part in; CUDA_ERROR_STREAM_CAPTURE_INVALIDATED if it was invalidated.
FAKECUDA_API CUresult fakecuda_end_capture(CUstream stream);

// --- State, for leak checks ---------------------------------------------------------------------------------
FAKECUDA_API size_t fakecuda_live_allocations(void);  // created and not yet freed (released and unmapped)
FAKECUDA_API size_t fakecuda_live_mappings(void);
FAKECUDA_API size_t fakecuda_live_reservations(void);
FAKECUDA_API size_t fakecuda_live_streams(void);      // created and not destroyed (the legacy streams not counted)
FAKECUDA_API size_t fakecuda_live_events(void);
FAKECUDA_API size_t fakecuda_used_bytes(int device);  // physical memory held on the device
FAKECUDA_API int fakecuda_primary_retains(int device);

#ifdef __cplusplus
}
#endif
