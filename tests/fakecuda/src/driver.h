// The emulated driver's state: one lock over memory, streams, events, contexts and the race detector.
//
// Note [One lock]
// This is test infrastructure: correctness and clear reports matter, speed does not. One mutex guards all
// state, and stream workers take it to run an item, so an item's memory access and a concurrent unmap are
// strictly ordered one way or the other, never interleaved. Fault counters have their own lock (faults.h).
//
// Note [Immortal driver]
// The Driver is created on first use and never destroyed. An allocator's own static destructors may call
// cuMemUnmap at process exit after this library's destructors ran (libraries are finalized in reverse load
// order, and this one is loaded last); an immortal driver answers them. Stream workers are joined when their
// stream is destroyed; at exit the process ends them.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "faults.h"
#include "memory.h"
#include "race.h"
#include "streams.h"

namespace fakecuda {

struct Context {
  int device = 0;
  int retains = 0;
};

class Driver {
 public:
  static Driver& get();

  std::mutex mu;
  std::condition_variable progress;
  Faults faults;
  bool initialized = false;
  std::string setup_error;  // bad configuration or FAKECUDA_FAIL: cuInit fails

  // --- with `mu` held ---------------------------------------------------------------------------------
  Memory memory;
  RaceDetector race;
  std::vector<Context> contexts;  // the primary context of each device

  // Logs a broken rule (Status with a reason) and returns its code; CUDA_SUCCESS passes through.
  CUresult result(const char* entry, const Status& s);
  std::size_t misuses() const { return misuses_.size(); }
  const std::string& misuse(std::size_t i) const { return misuses_.at(i); }
  void clear_misuses() { misuses_.clear(); }

  // The device of a context handle, or -1.
  int context_device(CUcontext ctx) const;
  // The stream behind a handle for the calling thread (0 and CU_STREAM_LEGACY: the legacy stream of the
  // current context's device).
  Status resolve(CUstream handle, int current_device, Stream** out);
  Stream& create_stream(int device, Stream::Kind kind);
  Status destroy_stream(CUstream handle);
  Event* find_event(CUevent e);
  CUevent create_event(unsigned flags);
  void destroy_event(CUevent e);

  // Enqueues w on s with the legacy stream's implicit dependencies and the host's knowledge (Note [Streams]).
  // Returns the item's sequence number; 0 if s is capturing (the work is captured, not run).
  std::uint64_t enqueue(Stream& s, Work w);
  // Enqueues test work and tells the race detector what it touches.
  std::uint64_t enqueue_access(Stream& s, Work w);
  // Blocks (lock held through `lock`) until s has completed `seq`.
  void wait_for(std::unique_lock<std::mutex>& lock, const Stream& s, std::uint64_t seq);
  // Waits until every stream's queue has run, without telling the race detector anything.
  void drain(std::unique_lock<std::mutex>& lock);
  std::vector<Stream*> streams_of(int device);
  std::size_t live_streams() const { return handles_.size(); }
  std::size_t live_events() const { return events_.size(); }

  // Note [Capture]: the synchronizing call `what` during a capture that prohibits it fails with
  // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates that capture.
  Status capture_prohibits(const char* what);
  // A use of the legacy stream of `device` while one of its blocking streams captures:
  // CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, invalidating that capture.
  Status legacy_use_during_capture(int device);
  // `what` on the capturing stream s: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, invalidating its capture.
  Status refuse_on_capturing(Stream& s, const char* what);
  void invalidate_capture(std::uint64_t id);
  std::uint64_t next_capture_id() { return ++capture_ids_; }

 private:
  Driver();
  void execute(Stream& s, const Work& w);
  void join_exited_streams();
  // Destroyed, drained, and the host is ordered after all its work: it can order nothing any more.
  bool retired(const Stream& s) const;

  std::vector<std::string> misuses_;
  std::vector<std::unique_ptr<Stream>> streams_;       // every stream ever created (ids index this)
  std::unordered_map<CUstream, Stream*> handles_;      // live streams by handle
  std::vector<Stream*> legacy_;                        // by device, created on first use
  std::unordered_map<CUevent, std::unique_ptr<Event>> events_;
  std::uint64_t capture_ids_ = 0;
};

// The calling thread's current context, or nullptr (driver_api.cpp).
CUcontext current_context();

}  // namespace fakecuda
