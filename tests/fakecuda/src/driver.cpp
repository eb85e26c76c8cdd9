#include "driver.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "errors.h"

namespace fakecuda {

// Note [Capture]
// Stream capture is modelled as far as an allocator meets it; a test puts a stream into capture with
// fakecuda_begin_capture (there is no graph). While a stream captures:
// - cuStreamIsCapturing / cuStreamGetCaptureInfo report it (with its capture id);
// - work and event records on it are captured, not run; an event recorded there is "captured": querying or
//   synchronizing it fails with CUDA_ERROR_CAPTURED_EVENT until it is recorded again outside a capture, and a
//   stream that waits on it joins the capture;
// - synchronizing calls (cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize, cuStreamQuery of the
//   capturing stream) fail with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidate the capture, from any
//   thread in CU_STREAM_CAPTURE_MODE_GLOBAL, from the capturing thread in THREAD_LOCAL, never in RELAXED;
// - using the legacy stream while a blocking stream of its device captures fails with
//   CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and invalidates the capture.
// Not modelled: graphs, and which memory calls the real driver refuses during a capture.

Driver& Driver::get() {
  // Note [Immortal driver]: created once, never destroyed (the usual idiom for such a global).
  static Driver& driver = *new Driver;
  return driver;
}

Driver::Driver()
    : memory(config()),
      contexts(static_cast<std::size_t>(config().devices)),
      legacy_(static_cast<std::size_t>(config().devices), nullptr) {
  for (std::size_t i = 0; i < contexts.size(); ++i) contexts[i].device = static_cast<int>(i);
  setup_error = config().error;
  if (const char* spec = std::getenv("FAKECUDA_FAIL")) {
    const std::string error = faults.set(spec);
    if (!error.empty()) {
      std::fprintf(stderr, "fakecuda: FAKECUDA_FAIL=%s is not valid: %s\n", spec, error.c_str());
      setup_error += (setup_error.empty() ? "" : "; ") + std::string("FAKECUDA_FAIL: ") + error;
    }
  }
}

CUresult Driver::result(const char* entry, const Status& s) {
  if (s.ok()) return CUDA_SUCCESS;
  const char* name = error_name(s.code);
  std::string text = std::string(entry) + " -> " + (name ? name : std::to_string(s.code)) + ": " + s.why;
  if (config().log_misuse) std::fprintf(stderr, "fakecuda: %s\n", text.c_str());
  if (misuses_.size() < 10000) misuses_.push_back(std::move(text));
  return s.code;
}

int Driver::context_device(CUcontext ctx) const {
  for (const Context& c : contexts)
    if (reinterpret_cast<CUcontext>(const_cast<Context*>(&c)) == ctx) return c.device;
  return -1;
}

Stream& Driver::create_stream(int device, Stream::Kind kind) {
  const int id = static_cast<int>(streams_.size());
  streams_.push_back(std::make_unique<Stream>(id, device, kind, mu, progress,
                                              [this](Stream& s, const Work& w) { execute(s, w); }));
  Stream& s = *streams_.back();
  // Creating a stream is a host operation: whatever the host has waited for is ordered before its work.
  s.clock.join(race.host());
  if (kind == Stream::Kind::kLegacy) {
    s.name = "legacy stream of device " + std::to_string(device);
  } else {
    s.name = "stream " + hex(reinterpret_cast<std::uintptr_t>(&s)) + " (#" + std::to_string(id) + ")";
    handles_.emplace(reinterpret_cast<CUstream>(&s), &s);
  }
  join_exited_streams();
  return s;
}

Status Driver::resolve(CUstream handle, int current_device, Stream** out) {
  if (handle == nullptr || handle == CU_STREAM_LEGACY) {
    if (current_device < 0)
      return fail(CUDA_ERROR_INVALID_CONTEXT, "the legacy default stream needs a current context");
    Stream*& legacy = legacy_[static_cast<std::size_t>(current_device)];
    if (!legacy) legacy = &create_stream(current_device, Stream::Kind::kLegacy);
    *out = legacy;
    return success();
  }
  if (handle == CU_STREAM_PER_THREAD)
    return fail(CUDA_ERROR_INVALID_HANDLE, "the per-thread default stream (CU_STREAM_PER_THREAD) is not emulated");
  auto it = handles_.find(handle);
  if (it == handles_.end())
    return fail(CUDA_ERROR_INVALID_HANDLE,
                "stream " + hex(reinterpret_cast<std::uintptr_t>(handle)) + " is unknown or destroyed");
  *out = it->second;
  return success();
}

Status Driver::destroy_stream(CUstream handle) {
  auto it = handles_.find(handle);
  if (it == handles_.end())
    return fail(CUDA_ERROR_INVALID_HANDLE, "stream " + hex(reinterpret_cast<std::uintptr_t>(handle)) +
                                               " is unknown or already destroyed (the legacy stream cannot be)");
  // As the real driver: the call returns at once and the work already enqueued still runs.
  it->second->destroyed = true;
  it->second->request_stop();
  handles_.erase(it);
  return success();
}

bool Driver::retired(const Stream& s) const {
  return s.destroyed && s.completed == s.enqueued && race.host().at(static_cast<std::size_t>(s.id)) >= s.enqueued;
}

void Driver::join_exited_streams() {
  // A worker sets exited() under the lock and then takes it no more, so joining it here cannot deadlock.
  for (auto& s : streams_) {
    if (s->exited()) s->join();
    // Its clock adds nothing to the host's any more; free it (clocks grow with the number of streams).
    if (retired(*s)) s->clock = VectorClock{};
  }
}

Event* Driver::find_event(CUevent e) {
  auto it = events_.find(e);
  return it == events_.end() ? nullptr : it->second.get();
}

CUevent Driver::create_event(unsigned flags) {
  auto e = std::make_unique<Event>();
  e->flags = flags;
  const auto handle = reinterpret_cast<CUevent>(e.get());
  events_.emplace(handle, std::move(e));
  return handle;
}

void Driver::destroy_event(CUevent e) { events_.erase(e); }

std::vector<Stream*> Driver::streams_of(int device) {
  std::vector<Stream*> out;
  for (auto& s : streams_)
    if (s->device == device) out.push_back(s.get());
  return out;
}

std::uint64_t Driver::enqueue(Stream& s, Work w) {
  if (s.capture.status == CU_STREAM_CAPTURE_STATUS_ACTIVE) return 0;
  if (s.kind == Stream::Kind::kLegacy) {
    for (Stream* b : streams_of(s.device)) {
      if (b->kind != Stream::Kind::kBlocking || retired(*b)) continue;
      if (b->completed < b->enqueued) w.deps.push_back({b, b->enqueued});
      s.clock.join(b->clock);
    }
  } else if (s.kind == Stream::Kind::kBlocking) {
    if (Stream* legacy = legacy_[static_cast<std::size_t>(s.device)]) {
      if (legacy->completed < legacy->enqueued) w.deps.push_back({legacy, legacy->enqueued});
      s.clock.join(legacy->clock);
    }
  }
  s.clock.join(race.host());
  return s.push(std::move(w));
}

std::uint64_t Driver::enqueue_access(Stream& s, Work w) {
  const Work copy = w;
  const std::uint64_t seq = enqueue(s, std::move(w));
  if (seq == 0) return 0;
  auto remember = [&](std::uintptr_t addr, bool write) {
    Access a{s.id, seq, addr, copy.n, write, memory.allocations_in(addr, copy.n),
             copy.describe() + ", on " + s.name + " as item #" + std::to_string(seq)};
    race.on_access(std::move(a), s.clock);
  };
  switch (copy.kind) {
    case Work::Kind::kFill: remember(copy.dst, true); break;
    case Work::Kind::kCopy:
      remember(copy.src, false);
      remember(copy.dst, true);
      break;
    case Work::Kind::kRead:
    case Work::Kind::kExpect: remember(copy.src, false); break;
    default: break;
  }
  return seq;
}

void Driver::wait_for(std::unique_lock<std::mutex>& lock, const Stream& s, std::uint64_t seq) {
  progress.wait(lock, [&] { return s.completed >= seq; });
}

void Driver::drain(std::unique_lock<std::mutex>& lock) {
  progress.wait(lock, [&] {
    for (auto& s : streams_)
      if (s->completed < s->enqueued) return false;
    return true;
  });
}

void Driver::execute(Stream& s, const Work& w) {
  auto illegal = [&](const Status& why) {
    race.record("illegal-address",
                s.name + " ran item #" + std::to_string(w.seq) + " (" + w.describe() + "): " + why.why +
                    "; a GPU would fault (CUDA_ERROR_ILLEGAL_ADDRESS); the work was skipped",
                false);
  };
  auto* dst = reinterpret_cast<unsigned char*>(w.dst);
  const auto* src = reinterpret_cast<const unsigned char*>(w.src);
  switch (w.kind) {
    case Work::Kind::kFill: {
      Status a = memory.check_access(w.dst, w.n, s.device, true);
      if (!a.ok()) return illegal(a);
      std::memset(dst, w.byte, w.n);
      break;
    }
    case Work::Kind::kCopy: {
      Status a = memory.check_access(w.src, w.n, s.device, false);
      if (a.ok()) a = memory.check_access(w.dst, w.n, s.device, true);
      if (!a.ok()) return illegal(a);
      std::memmove(dst, src, w.n);
      break;
    }
    case Work::Kind::kRead: {
      Status a = memory.check_access(w.src, w.n, s.device, false);
      if (!a.ok()) return illegal(a);
      std::memcpy(w.host, src, w.n);
      break;
    }
    case Work::Kind::kExpect: {
      Status a = memory.check_access(w.src, w.n, s.device, false);
      if (!a.ok()) return illegal(a);
      for (std::size_t i = 0; i < w.n; ++i) {
        if (src[i] == w.byte) continue;
        race.record("data-mismatch",
                    s.name + " item #" + std::to_string(w.seq) + " (" + w.describe() + ") found " + hex(src[i]) +
                        " at " + hex(w.src + i) + " (offset " + std::to_string(i) + ")",
                    false);
        break;
      }
      break;
    }
    case Work::Kind::kMarker:
    case Work::Kind::kWait:
    case Work::Kind::kSleep: break;
  }
}

namespace {

const char* mode_name(CUstreamCaptureMode m) {
  switch (m) {
    case CU_STREAM_CAPTURE_MODE_GLOBAL: return "global";
    case CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: return "thread-local";
    case CU_STREAM_CAPTURE_MODE_RELAXED: return "relaxed";
  }
  return "?";
}

}  // namespace

Status Driver::capture_prohibits(const char* what) {
  for (auto& s : streams_) {
    const Capture& c = s->capture;
    if (c.status != CU_STREAM_CAPTURE_STATUS_ACTIVE) continue;
    const bool prohibited = c.mode == CU_STREAM_CAPTURE_MODE_GLOBAL ||
                            (c.mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL && c.thread == std::this_thread::get_id());
    if (!prohibited) continue;
    const CUstreamCaptureMode mode = c.mode;
    invalidate_capture(c.id);
    return fail(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                std::string(what) + " while " + s->name + " captures (mode " + mode_name(mode) +
                    ") is not permitted; the capture is invalidated");
  }
  return success();
}

Status Driver::legacy_use_during_capture(int device) {
  for (Stream* s : streams_of(device)) {
    if (s->kind != Stream::Kind::kBlocking || s->capture.status != CU_STREAM_CAPTURE_STATUS_ACTIVE) continue;
    invalidate_capture(s->capture.id);
    return fail(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                "the legacy stream of device " + std::to_string(device) + " is used while the blocking " + s->name +
                    " captures; the capture is invalidated");
  }
  return success();
}

Status Driver::refuse_on_capturing(Stream& s, const char* what) {
  if (s.capture.status != CU_STREAM_CAPTURE_STATUS_ACTIVE) return success();
  invalidate_capture(s.capture.id);
  return fail(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
              std::string(what) + " of " + s.name + ", which captures, is not permitted; the capture is invalidated");
}

void Driver::invalidate_capture(std::uint64_t id) {
  for (auto& t : streams_)
    if (t->capture.id == id) t->capture.status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
}

}  // namespace fakecuda
