// A bounded ring of allocator events, in the vocabulary of PyTorch's memory snapshots.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "../backend.h"

namespace vmalloc {

struct TraceEntry {
  enum Action : std::uint8_t { kAlloc, kFreeRequested, kFreeCompleted, kSegmentMap, kSegmentUnmap, kOom };
  Action action;
  std::uintptr_t addr;
  std::size_t size;
  Stream stream;
  std::int64_t time_us;
  std::size_t device_free = 0;  // for kOom: bytes the arena could still obtain (capacity less reserved)
};

const char* action_name(TraceEntry::Action a);

namespace detail {

class TraceRing {
 public:
  explicit TraceRing(std::size_t capacity) : capacity_(capacity) {}
  bool enabled() const { return capacity_ > 0; }
  void set_capacity(std::size_t capacity) {
    capacity_ = capacity;
    entries_.clear();
    next_ = 0;
  }
  void record(TraceEntry::Action action, std::uintptr_t addr, std::size_t size, Stream stream,
              std::size_t device_free = 0) {
    if (!capacity_) return;
    const auto now = std::chrono::duration_cast<std::chrono::microseconds>(
                         std::chrono::system_clock::now().time_since_epoch()).count();
    TraceEntry e{action, addr, size, stream, now, device_free};
    if (entries_.size() < capacity_) {
      entries_.push_back(e);
    } else {
      entries_[next_] = e;
      next_ = (next_ + 1) % capacity_;
    }
  }
  // Oldest first.
  std::vector<TraceEntry> entries() const {
    std::vector<TraceEntry> out(entries_.begin() + static_cast<std::ptrdiff_t>(next_), entries_.end());
    out.insert(out.end(), entries_.begin(), entries_.begin() + static_cast<std::ptrdiff_t>(next_));
    return out;
  }

 private:
  std::size_t capacity_;
  std::vector<TraceEntry> entries_;
  std::size_t next_ = 0;
};

}  // namespace detail
}  // namespace vmalloc
