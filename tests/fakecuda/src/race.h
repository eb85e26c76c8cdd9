// The race detector: memory that is unmapped, released or handed out for reuse while stream work that touches
// it is not ordered before the new user, and unordered conflicting accesses from two streams.
//
// Note [Race detector]
// Each memory access enqueued on a stream is remembered with its stream and sequence number until the host
// is known to be ordered after it (Note [Happens-before]). The checks:
//   unmap-pending    cuMemUnmap of a range that a remembered access touches (the host has not waited for it);
//   release-pending  the memory of an allocation is freed (cuMemRelease, or the last unmap after it) while a
//                    remembered access touches the allocation;
//   reuse-unordered  fakecuda_check_reuse(stream, range): an access on another stream touches the range and
//                    is not ordered before work enqueued on `stream` from now on (the allocator handed the
//                    memory to `stream` without making it wait);
//   stream-race      an access is enqueued that conflicts (same bytes, one of them a write) with an access on
//                    another stream that is not ordered before it: this catches reuse without a wait even
//                    when a test does not call fakecuda_check_reuse.
// The executing side records two more kinds: illegal-address (work touched memory that was not mapped with
// access for its device when it ran; the work is skipped) and data-mismatch (fakecuda_expect saw other bytes).
// Every violation names what, where, which streams and which work item; those found in a driver call carry a
// backtrace of that call.
//
// Simplification: all host threads share one clock. The allocator orders its threads with its own mutex,
// which the driver cannot see, so per-thread clocks would report races that cannot happen.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "common.h"

namespace fakecuda {

struct Access {
  int stream;
  std::uint64_t seq;
  std::uintptr_t addr;
  std::size_t n;
  bool write;
  std::vector<std::uint64_t> allocations;  // the allocations mapped there when it was enqueued
  std::string what;                        // "fill with 0xab of [..) on stream 0x.. (#2), item #5"
};

struct Violation {
  std::string kind;
  std::string text;
};

// "    #0 libfoo.so(bar+0x12) [0x7f...]" lines of the calling thread's stack, demangled where possible.
std::string backtrace_text(int skip);

class RaceDetector {
 public:
  const VectorClock& host() const { return host_; }
  // The host has waited for everything in `clock`.
  void host_observed(const VectorClock& clock);
  // A new access, already enqueued; `clock` is its stream's clock including it.
  void on_access(Access a, const VectorClock& clock);
  void check_unmap(std::uintptr_t addr, std::size_t n, const std::string& call);
  void check_release(const std::vector<std::uint64_t>& allocations, const std::string& call);
  void check_reuse(int stream, const VectorClock& clock, std::uintptr_t addr, std::size_t n,
                   const std::string& call);
  // Forgets every remembered access (fakecuda_reset, once all work has run).
  void forget_accesses();

  void record(const std::string& kind, std::string text, bool with_backtrace);
  std::size_t count() const { return count_; }
  std::size_t stored() const { return violations_.size(); }
  const Violation& at(std::size_t i) const { return violations_.at(i); }
  void clear_violations();

 private:
  std::deque<Access>& of(int stream);
  template <class F>
  void for_unordered(const VectorClock& clock, int skip_stream, F&& f) const;

  VectorClock host_;
  std::vector<std::deque<Access>> pending_;  // by stream id, in sequence order
  std::vector<Violation> violations_;        // the first kMaxStored
  std::size_t count_ = 0;
  bool warned_history_ = false;
};

}  // namespace fakecuda
