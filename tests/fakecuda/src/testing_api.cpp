// The test-only API (fakecuda.h).
#include "fakecuda.h"

#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

#include "driver.h"

using fakecuda::Driver;
using fakecuda::fail;
using fakecuda::Status;
using fakecuda::Stream;
using fakecuda::Work;

namespace {

// Text handed to ctypes: a per-thread copy, valid until the thread's next call.
const char* hand_out(const std::string& s) {
  thread_local std::string buffer;
  buffer = s;
  return buffer.c_str();
}

// Runs f(driver) under the driver's lock.
template <class F>
auto locked(F&& f) {
  Driver& drv = Driver::get();
  std::lock_guard<std::mutex> lock(drv.mu);
  return f(drv);
}

std::mutex g_fault_error_mu;
std::string g_fault_error;

// Resolves `stream` and checks it may take work; on failure logs it and returns its code.
CUresult stream_for_work(Driver& drv, const char* entry, CUstream stream, Stream** out) {
  if (!drv.initialized) return drv.result(entry, fail(CUDA_ERROR_NOT_INITIALIZED, "cuInit has not succeeded"));
  Status s = drv.resolve(stream, drv.context_device(fakecuda::current_context()), out);
  if (s.ok() && (*out)->capture.status == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
    s = fail(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, (*out)->name + "'s capture was invalidated; end it first");
  if (s.ok() && (*out)->kind == Stream::Kind::kLegacy) s = drv.legacy_use_during_capture((*out)->device);
  return drv.result(entry, s);
}

CUresult enqueue(const char* entry, CUstream stream, Work w) {
  Driver& drv = Driver::get();
  std::lock_guard<std::mutex> lock(drv.mu);
  Stream* s = nullptr;
  if (CUresult r = stream_for_work(drv, entry, stream, &s)) return r;
  if (w.kind != Work::Kind::kSleep && w.n == 0) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "n is 0"));
  drv.enqueue_access(*s, std::move(w));
  return CUDA_SUCCESS;
}

}  // namespace

extern "C" {

CUresult fakecuda_fill(CUstream stream, CUdeviceptr dst, size_t n, unsigned char byte, unsigned delay_us) {
  Work w;
  w.kind = Work::Kind::kFill;
  w.dst = dst;
  w.n = n;
  w.byte = byte;
  w.delay_us = delay_us;
  return enqueue("fakecuda_fill", stream, std::move(w));
}

CUresult fakecuda_copy(CUstream stream, CUdeviceptr dst, CUdeviceptr src, size_t n, unsigned delay_us) {
  Work w;
  w.kind = Work::Kind::kCopy;
  w.dst = dst;
  w.src = src;
  w.n = n;
  w.delay_us = delay_us;
  return enqueue("fakecuda_copy", stream, std::move(w));
}

CUresult fakecuda_read(CUstream stream, void* host, CUdeviceptr src, size_t n, unsigned delay_us) {
  if (!host) return CUDA_ERROR_INVALID_VALUE;
  Work w;
  w.kind = Work::Kind::kRead;
  w.host = host;
  w.src = src;
  w.n = n;
  w.delay_us = delay_us;
  return enqueue("fakecuda_read", stream, std::move(w));
}

CUresult fakecuda_expect(CUstream stream, CUdeviceptr src, size_t n, unsigned char byte, unsigned delay_us) {
  Work w;
  w.kind = Work::Kind::kExpect;
  w.src = src;
  w.n = n;
  w.byte = byte;
  w.delay_us = delay_us;
  return enqueue("fakecuda_expect", stream, std::move(w));
}

CUresult fakecuda_sleep(CUstream stream, unsigned delay_us) {
  Work w;
  w.kind = Work::Kind::kSleep;
  w.delay_us = delay_us;
  return enqueue("fakecuda_sleep", stream, std::move(w));
}

void fakecuda_drain(void) {
  Driver& drv = Driver::get();
  std::unique_lock<std::mutex> lock(drv.mu);
  drv.drain(lock);
}

CUresult fakecuda_check_reuse(CUstream stream, CUdeviceptr addr, size_t size) {
  static constexpr const char* entry = "fakecuda_check_reuse";
  Driver& drv = Driver::get();
  std::lock_guard<std::mutex> lock(drv.mu);
  Stream* s = nullptr;
  if (!drv.initialized) return drv.result(entry, fail(CUDA_ERROR_NOT_INITIALIZED, "cuInit has not succeeded"));
  if (CUresult r = drv.result(entry, drv.resolve(stream, drv.context_device(fakecuda::current_context()), &s)))
    return r;
  if (size == 0) return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "size is 0"));
  const std::string call = std::string(entry) + "(" + s->name + ", " + fakecuda::range_text(addr, size) + ")";
  const Status access = drv.memory.check_access(addr, size, s->device, true);
  if (!access.ok())
    drv.race.record("reuse-inaccessible", call + ": the memory handed out is not usable: " + access.why, true);
  drv.race.check_reuse(s->id, s->clock, addr, size, call);
  return CUDA_SUCCESS;
}

size_t fakecuda_violations(void) {
  return locked([](Driver& d) { return d.race.count(); });
}

const char* fakecuda_violation_text(size_t i) {
  return locked([&](Driver& d) { return i < d.race.stored() ? hand_out(d.race.at(i).text) : nullptr; });
}

const char* fakecuda_violation_kind(size_t i) {
  return locked([&](Driver& d) { return i < d.race.stored() ? hand_out(d.race.at(i).kind) : nullptr; });
}

size_t fakecuda_dump_violations(void) {
  Driver& drv = Driver::get();
  std::lock_guard<std::mutex> lock(drv.mu);
  for (std::size_t i = 0; i < drv.race.stored(); ++i)
    std::fprintf(stderr, "fakecuda violation %zu: %s\n", i, drv.race.at(i).text.c_str());
  return drv.race.count();
}

size_t fakecuda_misuses(void) {
  return locked([](Driver& d) { return d.misuses(); });
}

const char* fakecuda_misuse_text(size_t i) {
  return locked([&](Driver& d) { return i < d.misuses() ? hand_out(d.misuse(i)) : nullptr; });
}

void fakecuda_reset(void) {
  Driver& drv = Driver::get();
  std::unique_lock<std::mutex> lock(drv.mu);
  drv.drain(lock);
  drv.race.forget_accesses();
  drv.race.clear_violations();
  drv.clear_misuses();
}

CUresult fakecuda_set_faults(const char* spec) {
  const std::string error = Driver::get().faults.set(spec ? spec : "");
  std::lock_guard<std::mutex> lock(g_fault_error_mu);
  g_fault_error = error;
  if (error.empty()) return CUDA_SUCCESS;
  std::fprintf(stderr, "fakecuda: fakecuda_set_faults(\"%s\"): %s\n", spec ? spec : "", error.c_str());
  return CUDA_ERROR_INVALID_VALUE;
}

const char* fakecuda_fault_error(void) {
  std::lock_guard<std::mutex> lock(g_fault_error_mu);
  return hand_out(g_fault_error);
}

unsigned long long fakecuda_calls(const char* entry) {
  return entry ? Driver::get().faults.calls(entry) : 0;
}

CUresult fakecuda_begin_capture(CUstream stream, int mode) {
  static constexpr const char* entry = "fakecuda_begin_capture";
  Driver& drv = Driver::get();
  std::lock_guard<std::mutex> lock(drv.mu);
  Stream* s = nullptr;
  if (CUresult r = stream_for_work(drv, entry, stream, &s)) return r;
  if (s->kind == Stream::Kind::kLegacy)
    return drv.result(entry, fail(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "the legacy stream cannot be captured"));
  if (mode < CU_STREAM_CAPTURE_MODE_GLOBAL || mode > CU_STREAM_CAPTURE_MODE_RELAXED)
    return drv.result(entry, fail(CUDA_ERROR_INVALID_VALUE, "unknown capture mode " + std::to_string(mode)));
  if (s->capture.status != CU_STREAM_CAPTURE_STATUS_NONE)
    return drv.result(entry, fail(CUDA_ERROR_ILLEGAL_STATE, s->name + " is already capturing"));
  s->capture = {CU_STREAM_CAPTURE_STATUS_ACTIVE, drv.next_capture_id(), static_cast<CUstreamCaptureMode>(mode),
                std::this_thread::get_id()};
  return CUDA_SUCCESS;
}

CUresult fakecuda_end_capture(CUstream stream) {
  static constexpr const char* entry = "fakecuda_end_capture";
  Driver& drv = Driver::get();
  std::lock_guard<std::mutex> lock(drv.mu);
  if (!drv.initialized) return drv.result(entry, fail(CUDA_ERROR_NOT_INITIALIZED, "cuInit has not succeeded"));
  Stream* s = nullptr;
  if (CUresult r = drv.result(entry, drv.resolve(stream, drv.context_device(fakecuda::current_context()), &s)))
    return r;
  if (s->capture.status == CU_STREAM_CAPTURE_STATUS_NONE)
    return drv.result(entry, fail(CUDA_ERROR_ILLEGAL_STATE, s->name + " is not capturing"));
  const std::uint64_t id = s->capture.id;
  const bool invalidated = s->capture.status == CU_STREAM_CAPTURE_STATUS_INVALIDATED;
  for (Stream* t : drv.streams_of(s->device))
    if (t->capture.id == id) t->capture = fakecuda::Capture{};
  return invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
}

size_t fakecuda_live_allocations(void) {
  return locked([](Driver& d) { return d.memory.live_allocations(); });
}

size_t fakecuda_live_mappings(void) {
  return locked([](Driver& d) { return d.memory.live_mappings(); });
}

size_t fakecuda_live_reservations(void) {
  return locked([](Driver& d) { return d.memory.live_reservations(); });
}

size_t fakecuda_live_streams(void) {
  return locked([](Driver& d) { return d.live_streams(); });
}

size_t fakecuda_live_events(void) {
  return locked([](Driver& d) { return d.live_events(); });
}

size_t fakecuda_used_bytes(int device) {
  if (device < 0 || device >= fakecuda::config().devices) return 0;
  return locked([&](Driver& d) { return d.memory.used(device); });
}

int fakecuda_primary_retains(int device) {
  if (device < 0 || device >= fakecuda::config().devices) return -1;
  return locked([&](Driver& d) { return d.contexts[static_cast<std::size_t>(device)].retains; });
}

}  // extern "C"
