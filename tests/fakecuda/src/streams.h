// Streams and events. Each stream is a worker thread that runs its enqueued work in order, so work really
// is asynchronous: a test can free memory while a write to it is still sleeping on a stream.
//
// Note [Streams]
// Every operation on a stream (test work, an event record, a wait on an event) is one Work item with the
// stream's next sequence number. An item may depend on items of other streams (cuStreamWaitEvent, the legacy
// stream's implicit synchronization); the worker waits for them, sleeps the item's delay without holding the
// driver's lock, then runs it under the lock, so that an unmap can never pull memory from under a write that
// is in progress. An event is a position (stream, sequence number) plus the stream's vector clock at that
// point (Note [Happens-before]); it is complete when its stream has completed that position.
//
// The legacy default stream (handle 0 or CU_STREAM_LEGACY, one per device) is a stream like the others, with
// the legacy semantics: its work waits for all work enqueued before it on the device's blocking streams, and
// their work waits for the legacy stream's earlier work; CU_STREAM_NON_BLOCKING streams take no part. The
// per-thread default stream (CU_STREAM_PER_THREAD) is not emulated.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.h"

namespace fakecuda {

class Stream;

struct Dep {
  const Stream* stream;
  std::uint64_t seq;
};

struct Work {
  enum class Kind { kMarker, kWait, kFill, kCopy, kRead, kExpect, kSleep };
  Kind kind = Kind::kMarker;
  std::uint64_t seq = 0;
  std::vector<Dep> deps;
  unsigned delay_us = 0;
  std::uintptr_t dst = 0;  // fill, copy
  std::uintptr_t src = 0;  // copy, read, expect
  std::size_t n = 0;
  unsigned char byte = 0;  // fill, expect
  void* host = nullptr;    // read: the host buffer
  std::string describe() const;
};

struct Capture {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  std::uint64_t id = 0;
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  std::thread::id thread;
};

class Stream {
 public:
  enum class Kind { kLegacy, kBlocking, kNonBlocking };
  // `execute` runs one item with `mu` held; `progress` is notified whenever an item completes.
  using Executor = std::function<void(Stream&, const Work&)>;

  Stream(int id, int device, Kind kind, std::mutex& mu, std::condition_variable& progress, Executor execute);
  ~Stream();  // joins the worker; request_stop() must have been called (without the lock held here)
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // All below: with the driver's lock held.
  std::uint64_t push(Work w);  // gives w the next sequence number
  void request_stop();         // the worker finishes the queue, then exits
  bool exited() const { return exited_; }
  void join();                 // without the lock held

  const int id;
  const int device;
  const Kind kind;
  std::string name;                 // for messages: "stream 0x5581... (#2)" or "legacy stream of device 0"
  std::uint64_t enqueued = 0;       // last sequence number given out
  std::uint64_t completed = 0;      // last sequence number run
  VectorClock clock;
  Capture capture;
  bool destroyed = false;           // cuStreamDestroy'ed: its handle is invalid, its queue still runs

 private:
  void run();
  bool deps_done(const Work& w) const;

  std::mutex& mu_;
  std::condition_variable& progress_;
  Executor execute_;
  std::deque<Work> queue_;
  bool stop_ = false;
  bool exited_ = false;
  std::thread worker_;  // last: started once everything above is ready
};

struct Event {
  unsigned flags = 0;
  const Stream* stream = nullptr;  // nullptr: never recorded (complete, as for the real driver)
  std::uint64_t seq = 0;
  VectorClock clock;
  std::uint64_t capture_id = 0;    // non-zero: last recorded into this capture (Note [Capture])
};

}  // namespace fakecuda
