// The exported driver entry points, and cuGetProcAddress's table of them. Only they and fakecuda.h's
// functions leave the library (exports.map).
//
// Every entry point first counts the call and applies injected faults (faults.h), then, under the driver's
// lock, requires cuInit (as the real driver does), checks its arguments against the driver's rules and does
// the work. A broken rule returns the CUresult the real driver returns and logs why (Driver::result).
#include <cuda.h>

#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "driver.h"
#include "entry_points.h"
#include "errors.h"

// Older ABI versions that cuGetProcAddress hands out for old `cudaVersion`s; cuda.h names the newest.
#undef cuGetProcAddress
#undef cuStreamGetCaptureInfo
extern "C" {
CUresult cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags);
CUresult cuStreamGetCaptureInfo(CUstream hStream, CUstreamCaptureStatus* captureStatus_out, cuuint64_t* id_out);
CUresult cuStreamGetCaptureInfo_v2(CUstream hStream, CUstreamCaptureStatus* captureStatus_out, cuuint64_t* id_out,
                                   CUgraph* graph_out, const CUgraphNode** dependencies_out,
                                   size_t* numDependencies_out);
}

using fakecuda::Driver;
using fakecuda::fail;
using fakecuda::Status;
using fakecuda::Stream;
using fakecuda::success;

namespace fakecuda {
namespace {
thread_local std::vector<CUcontext> t_context_stack;
}  // namespace

CUcontext current_context() { return t_context_stack.empty() ? nullptr : t_context_stack.back(); }

}  // namespace fakecuda

namespace {

int current_device(Driver& drv) { return drv.context_device(fakecuda::current_context()); }

Status need_context(Driver& drv, int* device) {
  *device = current_device(drv);
  if (*device < 0) return fail(CUDA_ERROR_INVALID_CONTEXT, "no current context (retain a primary context and push it)");
  return success();
}

Status valid_device(CUdevice dev) {
  if (dev < 0 || dev >= fakecuda::config().devices)
    return fail(CUDA_ERROR_INVALID_DEVICE, "device " + std::to_string(dev) + " does not exist (" +
                                               std::to_string(fakecuda::config().devices) + " device(s))");
  return success();
}

// A stream may take new work unless its capture was invalidated (until the capture ends, as on a GPU), and
// the legacy stream not while a blocking stream of its device captures.
Status stream_takes_work(Driver& drv, Stream& s) {
  if (s.capture.status == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
    return fail(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, s.name + "'s capture was invalidated; end it first");
  if (s.kind == Stream::Kind::kLegacy) return drv.legacy_use_during_capture(s.device);
  return success();
}

std::string call_text(const char* entry, CUdeviceptr ptr, std::size_t size) {
  return std::string(entry) + "(" + fakecuda::hex(ptr) + ", " + std::to_string(size) + ")";
}

}  // namespace

// Counts the call, applies faults, takes the lock and requires cuInit. Defines `drv`, `lock` and `entry`.
#define FAKECUDA_ENTRY_NOINIT(name)                                      \
  static constexpr const char* entry = #name;                            \
  Driver& drv = Driver::get();                                           \
  if (const CUresult injected = drv.faults.on_call(entry)) return injected; \
  std::unique_lock<std::mutex> lock(drv.mu)
#define FAKECUDA_ENTRY(name)  \
  FAKECUDA_ENTRY_NOINIT(name); \
  if (!drv.initialized) return drv.result(entry, fail(CUDA_ERROR_NOT_INITIALIZED, "cuInit has not succeeded"))
#define FAKECUDA_CHECK(expr)                                \
  do {                                                      \
    const Status check_ = (expr);                           \
    if (!check_.ok()) return drv.result(entry, check_);     \
  } while (0)

extern "C" {

// ---------------------------------------------------------------------------------------------------------
// Initialization, errors, devices

CUresult cuInit(unsigned int flags) {
  FAKECUDA_ENTRY_NOINIT(cuInit);
  if (flags != 0) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "flags must be 0"));
  if (!drv.setup_error.empty())
    return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "fakecuda is misconfigured: " + drv.setup_error));
  drv.initialized = true;
  return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int* version) {
  FAKECUDA_ENTRY_NOINIT(cuDriverGetVersion);
  if (!version) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null version"));
  *version = fakecuda::kDriverVersion;
  return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char** str) {
  FAKECUDA_ENTRY_NOINIT(cuGetErrorString);
  if (!str) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null str"));
  *str = fakecuda::error_text(error);
  return *str ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult error, const char** str) {
  FAKECUDA_ENTRY_NOINIT(cuGetErrorName);
  if (!str) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null str"));
  *str = fakecuda::error_name(error);
  return *str ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  FAKECUDA_ENTRY(cuDeviceGet);
  if (!device) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null device"));
  FAKECUDA_CHECK(valid_device(ordinal));
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int* count) {
  FAKECUDA_ENTRY(cuDeviceGetCount);
  if (!count) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null count"));
  *count = fakecuda::config().devices;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
  FAKECUDA_ENTRY(cuDeviceGetName);
  if (!name || len <= 0) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null name or len <= 0"));
  FAKECUDA_CHECK(valid_device(dev));
  std::snprintf(name, static_cast<std::size_t>(len), "fakecuda device %d", dev);
  return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem(size_t* bytes, CUdevice dev) {
  FAKECUDA_ENTRY(cuDeviceTotalMem);
  if (!bytes) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null bytes"));
  FAKECUDA_CHECK(valid_device(dev));
  *bytes = drv.memory.total();
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------------------------------------
// Contexts: one primary context per device, and a context stack per host thread.

CUresult cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  FAKECUDA_ENTRY(cuDevicePrimaryCtxRetain);
  if (!pctx) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null pctx"));
  FAKECUDA_CHECK(valid_device(dev));
  fakecuda::Context& c = drv.contexts[static_cast<std::size_t>(dev)];
  ++c.retains;
  *pctx = reinterpret_cast<CUcontext>(&c);
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
  FAKECUDA_ENTRY(cuDevicePrimaryCtxRelease);
  FAKECUDA_CHECK(valid_device(dev));
  fakecuda::Context& c = drv.contexts[static_cast<std::size_t>(dev)];
  if (c.retains == 0)
    return drv.result(entry, fail(CUDA_ERROR_INVALID_CONTEXT, "the primary context of device " + std::to_string(dev) +
                                                                 " is released more often than it was retained"));
  --c.retains;
  return CUDA_SUCCESS;
}

namespace {
Status usable_context(Driver& drv, CUcontext ctx) {
  const int dev = drv.context_device(ctx);
  if (dev < 0) return fail(CUDA_ERROR_INVALID_CONTEXT, "unknown context " + fakecuda::hex(reinterpret_cast<std::uintptr_t>(ctx)));
  if (drv.contexts[static_cast<std::size_t>(dev)].retains == 0)
    return fail(CUDA_ERROR_INVALID_CONTEXT, "the primary context of device " + std::to_string(dev) + " is not retained");
  return success();
}
}  // namespace

CUresult cuCtxGetCurrent(CUcontext* pctx) {
  FAKECUDA_ENTRY(cuCtxGetCurrent);
  if (!pctx) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null pctx"));
  *pctx = fakecuda::current_context();
  return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  FAKECUDA_ENTRY(cuCtxSetCurrent);
  auto& stack = fakecuda::t_context_stack;
  if (!ctx) {
    if (!stack.empty()) stack.pop_back();
    return CUDA_SUCCESS;
  }
  FAKECUDA_CHECK(usable_context(drv, ctx));
  if (stack.empty()) stack.push_back(ctx);
  else stack.back() = ctx;
  return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent(CUcontext ctx) {
  FAKECUDA_ENTRY(cuCtxPushCurrent);
  FAKECUDA_CHECK(usable_context(drv, ctx));
  fakecuda::t_context_stack.push_back(ctx);
  return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent(CUcontext* pctx) {
  FAKECUDA_ENTRY(cuCtxPopCurrent);
  auto& stack = fakecuda::t_context_stack;
  if (stack.empty()) return drv.result(entry, fail(CUDA_ERROR_INVALID_CONTEXT, "this thread has no current context"));
  if (pctx) *pctx = stack.back();
  stack.pop_back();
  return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice* device) {
  FAKECUDA_ENTRY(cuCtxGetDevice);
  if (!device) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null device"));
  int dev = -1;
  FAKECUDA_CHECK(need_context(drv, &dev));
  *device = dev;
  return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
  FAKECUDA_ENTRY(cuCtxSynchronize);
  int dev = -1;
  FAKECUDA_CHECK(need_context(drv, &dev));
  FAKECUDA_CHECK(drv.capture_prohibits(entry));
  fakecuda::VectorClock seen;
  for (Stream* s : drv.streams_of(dev)) {
    seen.join(s->clock);
    drv.wait_for(lock, *s, s->enqueued);
  }
  drv.race.host_observed(seen);
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------------------------------------
// Virtual memory management (memory.h has the rules)

CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                       CUmemAllocationGranularity_flags option) {
  FAKECUDA_ENTRY(cuMemGetAllocationGranularity);
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "unknown granularity option " + std::to_string(option)));
  return drv.result(entry, drv.memory.granularity_for(prop, granularity));
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  FAKECUDA_ENTRY(cuMemAddressReserve);
  return drv.result(entry, drv.memory.reserve(size, alignment, addr, flags, ptr));
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  FAKECUDA_ENTRY(cuMemAddressFree);
  return drv.result(entry, drv.memory.free_reservation(ptr, size));
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                     unsigned long long flags) {
  FAKECUDA_ENTRY(cuMemCreate);
  return drv.result(entry, drv.memory.create(size, prop, flags, handle));
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  FAKECUDA_ENTRY(cuMemRelease);
  std::vector<std::uint64_t> freed;
  FAKECUDA_CHECK(drv.memory.release(handle, &freed));
  drv.race.check_release(freed, "cuMemRelease(" + fakecuda::hex(handle) + ")");
  return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  FAKECUDA_ENTRY(cuMemMap);
  return drv.result(entry, drv.memory.map(ptr, size, offset, handle, flags));
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  FAKECUDA_ENTRY(cuMemUnmap);
  std::vector<std::uint64_t> freed;
  FAKECUDA_CHECK(drv.memory.unmap(ptr, size, &freed));
  drv.race.check_unmap(static_cast<std::uintptr_t>(ptr), size, call_text(entry, ptr, size));
  drv.race.check_release(freed, call_text(entry, ptr, size) + " (the last mapping of a released allocation)");
  return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  FAKECUDA_ENTRY(cuMemSetAccess);
  return drv.result(entry, drv.memory.set_access(ptr, size, desc, count));
}

CUresult cuMemGetAccess(unsigned long long* flags, const CUmemLocation* location, CUdeviceptr ptr) {
  FAKECUDA_ENTRY(cuMemGetAccess);
  return drv.result(entry, drv.memory.get_access(flags, location, ptr));
}

CUresult cuMemGetInfo(size_t* free, size_t* total) {
  FAKECUDA_ENTRY(cuMemGetInfo);
  if (!free || !total) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null free or total"));
  int dev = -1;
  FAKECUDA_CHECK(need_context(drv, &dev));
  *total = drv.memory.total();
  *free = drv.memory.total() - drv.memory.used(dev);
  return CUDA_SUCCESS;
}

CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  FAKECUDA_ENTRY(cuPointerGetAttribute);
  if (!data) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null data"));
  std::uintptr_t start = 0;
  std::size_t size = 0;
  int device = -1;
  if (!drv.memory.find_mapping(static_cast<std::uintptr_t>(ptr), &start, &size, &device))
    return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, fakecuda::hex(ptr) + " is not mapped device memory"));
  switch (attribute) {
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *static_cast<int*>(data) = device; break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *static_cast<unsigned int*>(data) = CU_MEMORYTYPE_DEVICE; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *static_cast<CUdeviceptr*>(data) = ptr; break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *static_cast<CUdeviceptr*>(data) = start; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *static_cast<size_t*>(data) = size; break;
    default:
      return drv.result(entry, fail(CUDA_ERROR_NOT_SUPPORTED,
                                    "pointer attribute " + std::to_string(attribute) + " is not emulated"));
  }
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------------------------------------
// Events

CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  FAKECUDA_ENTRY(cuEventCreate);
  if (!event) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null event"));
  int dev = -1;
  FAKECUDA_CHECK(need_context(drv, &dev));
  if (flags & ~0x7u) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "unknown flags " + fakecuda::hex(flags)));
  if ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING))
    return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "CU_EVENT_INTERPROCESS needs CU_EVENT_DISABLE_TIMING"));
  *event = drv.create_event(flags);
  return CUDA_SUCCESS;
}

CUresult cuEventDestroy(CUevent event) {
  FAKECUDA_ENTRY(cuEventDestroy);
  if (!drv.find_event(event))
    return drv.result(entry, fail(CUDA_ERROR_INVALID_HANDLE, "unknown or destroyed event"));
  drv.destroy_event(event);  // as on a GPU, a pending record still completes; nothing waits on the object
  return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent event, CUstream stream) {
  FAKECUDA_ENTRY(cuEventRecord);
  fakecuda::Event* e = drv.find_event(event);
  if (!e) return drv.result(entry, fail(CUDA_ERROR_INVALID_HANDLE, "unknown or destroyed event"));
  Stream* s = nullptr;
  FAKECUDA_CHECK(drv.resolve(stream, current_device(drv), &s));
  FAKECUDA_CHECK(stream_takes_work(drv, *s));
  if (s->capture.status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
    e->capture_id = s->capture.id;
    return CUDA_SUCCESS;
  }
  fakecuda::Work w;
  w.kind = fakecuda::Work::Kind::kMarker;
  e->seq = drv.enqueue(*s, std::move(w));
  e->stream = s;
  e->clock = s->clock;
  e->capture_id = 0;
  return CUDA_SUCCESS;
}

CUresult cuEventQuery(CUevent event) {
  FAKECUDA_ENTRY(cuEventQuery);
  fakecuda::Event* e = drv.find_event(event);
  if (!e) return drv.result(entry, fail(CUDA_ERROR_INVALID_HANDLE, "unknown or destroyed event"));
  if (e->capture_id)
    return drv.result(entry, fail(CUDA_ERROR_CAPTURED_EVENT, "the event was last recorded in a stream capture"));
  if (e->stream && e->stream->completed < e->seq) return CUDA_ERROR_NOT_READY;
  drv.race.host_observed(e->clock);
  return CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent event) {
  FAKECUDA_ENTRY(cuEventSynchronize);
  fakecuda::Event* e = drv.find_event(event);
  if (!e) return drv.result(entry, fail(CUDA_ERROR_INVALID_HANDLE, "unknown or destroyed event"));
  if (e->capture_id)
    return drv.result(entry, fail(CUDA_ERROR_CAPTURED_EVENT, "the event was last recorded in a stream capture"));
  FAKECUDA_CHECK(drv.capture_prohibits(entry));
  // Copies: the event may be re-recorded or destroyed by another thread while this one waits.
  const fakecuda::VectorClock clock = e->clock;
  if (const Stream* s = e->stream) drv.wait_for(lock, *s, e->seq);
  drv.race.host_observed(clock);
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------------------------------------
// Streams

CUresult cuStreamCreate(CUstream* stream, unsigned int flags) {
  FAKECUDA_ENTRY(cuStreamCreate);
  if (!stream) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null stream"));
  int dev = -1;
  FAKECUDA_CHECK(need_context(drv, &dev));
  if (flags & ~static_cast<unsigned>(CU_STREAM_NON_BLOCKING))
    return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "unknown flags " + fakecuda::hex(flags)));
  Stream& s = drv.create_stream(dev, (flags & CU_STREAM_NON_BLOCKING) ? Stream::Kind::kNonBlocking
                                                                       : Stream::Kind::kBlocking);
  *stream = reinterpret_cast<CUstream>(&s);
  return CUDA_SUCCESS;
}

CUresult cuStreamDestroy(CUstream stream) {
  FAKECUDA_ENTRY(cuStreamDestroy);
  return drv.result(entry, drv.destroy_stream(stream));
}

CUresult cuStreamSynchronize(CUstream stream) {
  FAKECUDA_ENTRY(cuStreamSynchronize);
  Stream* s = nullptr;
  FAKECUDA_CHECK(drv.resolve(stream, current_device(drv), &s));
  if (s->kind == Stream::Kind::kLegacy) FAKECUDA_CHECK(drv.legacy_use_during_capture(s->device));
  FAKECUDA_CHECK(drv.refuse_on_capturing(*s, entry));
  FAKECUDA_CHECK(drv.capture_prohibits(entry));
  if (s->capture.status == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
    return drv.result(entry, fail(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, s->name + "'s capture was invalidated"));
  const fakecuda::VectorClock clock = s->clock;
  drv.wait_for(lock, *s, s->enqueued);
  drv.race.host_observed(clock);
  return CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream stream) {
  FAKECUDA_ENTRY(cuStreamQuery);
  Stream* s = nullptr;
  FAKECUDA_CHECK(drv.resolve(stream, current_device(drv), &s));
  if (s->kind == Stream::Kind::kLegacy) FAKECUDA_CHECK(drv.legacy_use_during_capture(s->device));
  FAKECUDA_CHECK(drv.refuse_on_capturing(*s, entry));
  if (s->completed < s->enqueued) return CUDA_ERROR_NOT_READY;
  drv.race.host_observed(s->clock);
  return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
  FAKECUDA_ENTRY(cuStreamWaitEvent);
  if (flags != 0) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "flags must be 0"));
  Stream* s = nullptr;
  FAKECUDA_CHECK(drv.resolve(stream, current_device(drv), &s));
  fakecuda::Event* e = drv.find_event(event);
  if (!e) return drv.result(entry, fail(CUDA_ERROR_INVALID_HANDLE, "unknown or destroyed event"));
  FAKECUDA_CHECK(stream_takes_work(drv, *s));
  if (e->capture_id) {
    // Waiting on an event of a live capture forks the capture into this stream (Note [Capture]).
    for (Stream* t : drv.streams_of(s->device)) {
      if (t->capture.id != e->capture_id || t->capture.status != CU_STREAM_CAPTURE_STATUS_ACTIVE) continue;
      s->capture = t->capture;
      return CUDA_SUCCESS;
    }
    return drv.result(entry, fail(CUDA_ERROR_CAPTURED_EVENT, "the event was recorded in a capture that has ended"));
  }
  if (!e->stream) return CUDA_SUCCESS;  // never recorded: nothing to wait for
  fakecuda::Work w;
  w.kind = fakecuda::Work::Kind::kWait;
  w.deps.push_back({e->stream, e->seq});
  if (s->capture.status != CU_STREAM_CAPTURE_STATUS_ACTIVE) s->clock.join(e->clock);
  drv.enqueue(*s, std::move(w));
  return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus* status) {
  FAKECUDA_ENTRY(cuStreamIsCapturing);
  if (!status) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null status"));
  Stream* s = nullptr;
  FAKECUDA_CHECK(drv.resolve(stream, current_device(drv), &s));
  if (s->kind == Stream::Kind::kLegacy) {
    for (Stream* t : drv.streams_of(s->device)) {
      if (t->kind == Stream::Kind::kBlocking && t->capture.status == CU_STREAM_CAPTURE_STATUS_ACTIVE)
        return drv.result(entry, fail(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                                      "asked about the legacy stream while the blocking " + t->name + " captures"));
    }
  }
  *status = s->capture.status;
  return CUDA_SUCCESS;
}

namespace {
CUresult capture_info(const char* entry, CUstream stream, CUstreamCaptureStatus* status, cuuint64_t* id) {
  Driver& drv = Driver::get();
  if (const CUresult injected = drv.faults.on_call(entry)) return injected;
  std::unique_lock<std::mutex> lock(drv.mu);
  if (!drv.initialized) return drv.result(entry, fail(CUDA_ERROR_NOT_INITIALIZED, "cuInit has not succeeded"));
  if (!status) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null captureStatus_out"));
  Stream* s = nullptr;
  FAKECUDA_CHECK(drv.resolve(stream, current_device(drv), &s));
  *status = s->capture.status;
  if (id && s->capture.status != CU_STREAM_CAPTURE_STATUS_NONE) *id = s->capture.id;
  return CUDA_SUCCESS;
}
}  // namespace

CUresult cuStreamGetCaptureInfo(CUstream stream, CUstreamCaptureStatus* status, cuuint64_t* id) {
  return capture_info("cuStreamGetCaptureInfo", stream, status, id);
}

CUresult cuStreamGetCaptureInfo_v2(CUstream stream, CUstreamCaptureStatus* status, cuuint64_t* id, CUgraph* graph,
                                   const CUgraphNode** deps, size_t* num_deps) {
  // No graph is built; a capturing stream reports an empty dependency set.
  if (graph) *graph = nullptr;
  if (deps) *deps = nullptr;
  if (num_deps) *num_deps = 0;
  return capture_info("cuStreamGetCaptureInfo", stream, status, id);
}

#if CUDA_VERSION >= 12030
CUresult cuStreamGetCaptureInfo_v3(CUstream stream, CUstreamCaptureStatus* status, cuuint64_t* id, CUgraph* graph,
                                   const CUgraphNode** deps, const CUgraphEdgeData** edges, size_t* num_deps) {
  if (edges) *edges = nullptr;
  return cuStreamGetCaptureInfo_v2(stream, status, id, graph, deps, num_deps);
}
#endif

}  // extern "C"

// ---------------------------------------------------------------------------------------------------------
// cuGetProcAddress

namespace {

struct EntryPoint {
  const char* name;  // base name, as cuGetProcAddress is asked for it
  int since;         // the CUDA version whose ABI this function has
  bool takes_stream; // has a per-thread-default-stream variant on a real driver
  void* fn;
};

#define FAKECUDA_EP(name, since, stream) {#name, since, stream, reinterpret_cast<void*>(&name)}
const EntryPoint kEntryPoints[] = {
    FAKECUDA_EP(cuInit, 2000, false),
    FAKECUDA_EP(cuDriverGetVersion, 2020, false),
    FAKECUDA_EP(cuGetErrorString, 6000, false),
    FAKECUDA_EP(cuGetErrorName, 6000, false),
    FAKECUDA_EP(cuDeviceGet, 2000, false),
    FAKECUDA_EP(cuDeviceGetCount, 2000, false),
    FAKECUDA_EP(cuDeviceGetName, 2000, false),
    FAKECUDA_EP(cuDeviceTotalMem, 3020, false),
    FAKECUDA_EP(cuDevicePrimaryCtxRetain, 7000, false),
    FAKECUDA_EP(cuDevicePrimaryCtxRelease, 7000, false),
    FAKECUDA_EP(cuCtxGetCurrent, 4000, false),
    FAKECUDA_EP(cuCtxSetCurrent, 4000, false),
    FAKECUDA_EP(cuCtxPushCurrent, 4000, false),
    FAKECUDA_EP(cuCtxPopCurrent, 4000, false),
    FAKECUDA_EP(cuCtxGetDevice, 2000, false),
    FAKECUDA_EP(cuCtxSynchronize, 2000, false),
    FAKECUDA_EP(cuMemGetAllocationGranularity, 10020, false),
    FAKECUDA_EP(cuMemAddressReserve, 10020, false),
    FAKECUDA_EP(cuMemAddressFree, 10020, false),
    FAKECUDA_EP(cuMemCreate, 10020, false),
    FAKECUDA_EP(cuMemRelease, 10020, false),
    FAKECUDA_EP(cuMemMap, 10020, false),
    FAKECUDA_EP(cuMemUnmap, 10020, false),
    FAKECUDA_EP(cuMemSetAccess, 10020, false),
    FAKECUDA_EP(cuMemGetAccess, 10020, false),
    FAKECUDA_EP(cuMemGetInfo, 3020, false),
    FAKECUDA_EP(cuPointerGetAttribute, 4000, false),
    FAKECUDA_EP(cuEventCreate, 2000, false),
    FAKECUDA_EP(cuEventDestroy, 4000, false),
    FAKECUDA_EP(cuEventRecord, 2000, true),
    FAKECUDA_EP(cuEventQuery, 2000, false),
    FAKECUDA_EP(cuEventSynchronize, 2000, false),
    FAKECUDA_EP(cuStreamCreate, 2000, false),
    FAKECUDA_EP(cuStreamDestroy, 4000, false),
    FAKECUDA_EP(cuStreamSynchronize, 2000, true),
    FAKECUDA_EP(cuStreamQuery, 2000, true),
    FAKECUDA_EP(cuStreamWaitEvent, 3020, true),
    FAKECUDA_EP(cuStreamIsCapturing, 10000, true),
    {"cuStreamGetCaptureInfo", 10010, true, reinterpret_cast<void*>(&cuStreamGetCaptureInfo)},
    {"cuStreamGetCaptureInfo", 11030, true, reinterpret_cast<void*>(&cuStreamGetCaptureInfo_v2)},
#if CUDA_VERSION >= 12030
    {"cuStreamGetCaptureInfo", 12030, true, reinterpret_cast<void*>(&cuStreamGetCaptureInfo_v3)},
#endif
    {"cuGetProcAddress", 11030, false, reinterpret_cast<void*>(&cuGetProcAddress)},
    {"cuGetProcAddress", 12000, false, reinterpret_cast<void*>(&cuGetProcAddress_v2)},
};
#undef FAKECUDA_EP

// Note [cuGetProcAddress]
// A symbol is a base name; the entry with the newest ABI not newer than `cudaVersion` is returned (so
// "cuStreamGetCaptureInfo" at 12000 is the _v2 signature and at 12030 the _v3 one, as on a real driver).
// An unknown name, or one whose every ABI is newer than asked, returns CUDA_ERROR_NOT_FOUND with a null
// pointer and the matching symbolStatus; the documentation says CUDA_SUCCESS with a null pointer, drivers
// answer CUDA_ERROR_NOT_FOUND, and callers must handle both. The per-thread-default-stream variants are not
// emulated: asking for them (CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) for a stream function fails.
CUresult lookup(const char* entry, const char* symbol, void** pfn, int version, cuuint64_t flags,
                CUdriverProcAddressQueryResult* status) {
  Driver& drv = Driver::get();
  if (const CUresult injected = drv.faults.on_call(entry)) return injected;
  std::unique_lock<std::mutex> lock(drv.mu);
  if (!symbol || !pfn) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "null symbol or pfn"));
  *pfn = nullptr;
  if (version > fakecuda::kDriverVersion)
    return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "cudaVersion " + std::to_string(version) +
                                                               " is newer than the driver's " +
                                                               std::to_string(fakecuda::kDriverVersion)));
  if (flags > CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
    return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "unknown flags " + fakecuda::hex(flags)));
  const EntryPoint* best = nullptr;
  bool known = false;
  for (const EntryPoint& ep : kEntryPoints) {
    if (std::strcmp(ep.name, symbol) != 0) continue;
    known = true;
    if (ep.since <= version && (!best || ep.since > best->since)) best = &ep;
  }
  if (best && best->takes_stream && (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)) best = nullptr;
  if (!best) {
    if (status) *status = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return drv.result(entry, fail(CUDA_ERROR_NOT_FOUND,
                                  std::string(symbol) + (known ? " is not provided for cudaVersion " +
                                                                     std::to_string(version) + " and these flags"
                                                               : " is not emulated by fakecuda")));
  }
  if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
  *pfn = best->fn;
  return CUDA_SUCCESS;
}

}  // namespace

extern "C" {

CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult* symbolStatus) {
  return lookup("cuGetProcAddress", symbol, pfn, cudaVersion, flags, symbolStatus);
}

CUresult cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags) {
  return lookup("cuGetProcAddress", symbol, pfn, cudaVersion, flags, nullptr);
}

}  // extern "C"

namespace fakecuda {

bool is_entry_point(const std::string& name) {
  for (const EntryPoint& ep : kEntryPoints)
    if (name == ep.name) return true;
  return false;
}

std::string entry_point_list() {
  std::string out;
  const char* last = "";
  for (const EntryPoint& ep : kEntryPoints) {
    if (std::strcmp(ep.name, last) == 0) continue;
    out += (out.empty() ? "" : ", ") + std::string(ep.name);
    last = ep.name;
  }
  return out;
}

}  // namespace fakecuda
