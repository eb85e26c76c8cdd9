#include "race.h"

#include <cxxabi.h>
#include <execinfo.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

namespace fakecuda {
namespace {

constexpr std::size_t kMaxStored = 10000;
// Accesses remembered per stream. Beyond it the oldest are forgotten (and said so once): a test that never
// synchronizes would otherwise grow without bound.
constexpr std::size_t kMaxHistory = std::size_t{1} << 16;

std::string demangle_frame(const char* frame) {
  // "module(mangled+0x12) [0x7f...]": demangle the part between '(' and '+'.
  std::string s(frame);
  const auto open = s.find('('), plus = s.find('+', open == std::string::npos ? 0 : open);
  if (open == std::string::npos || plus == std::string::npos || plus == open + 1) return s;
  const std::string mangled = s.substr(open + 1, plus - open - 1);
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status),
                                              std::free);
  if (status != 0 || !name) return s;
  return s.substr(0, open + 1) + name.get() + s.substr(plus);
}

}  // namespace

std::string backtrace_text(int skip) {
  // Enough frames to reach the allocator's caller through the backend; Python's own frames are noise.
  void* frames[24];
  const int n = backtrace(frames, 24);
  std::unique_ptr<char*, void (*)(void*)> symbols(backtrace_symbols(frames, n), std::free);
  std::string out;
  for (int i = skip + 1; i < n; ++i) {
    out += "    #" + std::to_string(i - skip - 1) + " " +
           (symbols ? demangle_frame(symbols.get()[i]) : hex(reinterpret_cast<std::uintptr_t>(frames[i]))) + "\n";
  }
  return out;
}

std::deque<Access>& RaceDetector::of(int stream) {
  if (pending_.size() <= static_cast<std::size_t>(stream)) pending_.resize(static_cast<std::size_t>(stream) + 1);
  return pending_[static_cast<std::size_t>(stream)];
}

// Calls f(access) for each remembered access not ordered before `clock`, except those of `skip_stream`.
template <class F>
void RaceDetector::for_unordered(const VectorClock& clock, int skip_stream, F&& f) const {
  for (std::size_t t = 0; t < pending_.size(); ++t) {
    if (static_cast<int>(t) == skip_stream) continue;
    const auto& q = pending_[t];
    const std::uint64_t known = clock.at(t);
    for (auto it = q.rbegin(); it != q.rend() && it->seq > known; ++it) f(*it);
  }
}

void RaceDetector::host_observed(const VectorClock& clock) {
  host_.join(clock);
  for (std::size_t t = 0; t < pending_.size(); ++t) {
    auto& q = pending_[t];
    while (!q.empty() && q.front().seq <= host_.at(t)) q.pop_front();
  }
}

void RaceDetector::on_access(Access a, const VectorClock& clock) {
  for_unordered(clock, a.stream, [&](const Access& other) {
    if (!overlaps(a.addr, a.n, other.addr, other.n) || !(a.write || other.write)) return;
    record("stream-race",
           "two streams touch the same memory with nothing ordering them (one writes):\n  new:   " + a.what +
               "\n  other: " + other.what +
               "\n  (make the new stream wait for an event recorded after the other work, e.g. at free)",
           true);
  });
  auto& q = of(a.stream);
  q.push_back(std::move(a));
  if (q.size() > kMaxHistory) {
    q.pop_front();
    if (!warned_history_) {
      warned_history_ = true;
      std::fprintf(stderr, "fakecuda: more than %zu accesses on one stream without host synchronization; "
                           "the race detector forgets the oldest\n", kMaxHistory);
    }
  }
}

void RaceDetector::check_unmap(std::uintptr_t addr, std::size_t n, const std::string& call) {
  for_unordered(host_, -1, [&](const Access& a) {
    if (!overlaps(addr, n, a.addr, a.n)) return;
    record("unmap-pending",
           call + " unmaps memory that stream work still touches, and the host has not waited for it:\n  work: " +
               a.what + "\n  (synchronize with an event recorded after that work before unmapping)",
           true);
  });
}

void RaceDetector::check_release(const std::vector<std::uint64_t>& allocations, const std::string& call) {
  if (allocations.empty()) return;
  for_unordered(host_, -1, [&](const Access& a) {
    for (std::uint64_t id : a.allocations) {
      for (std::uint64_t freed : allocations) {
        if (id != freed) continue;
        record("release-pending",
               call + " frees an allocation that stream work still touches, and the host has not waited for it:"
                      "\n  work: " + a.what + "\n  (synchronize with an event recorded after that work first)",
               true);
        return;
      }
    }
  });
}

void RaceDetector::check_reuse(int stream, const VectorClock& clock, std::uintptr_t addr, std::size_t n,
                               const std::string& call) {
  VectorClock next = clock;  // what work enqueued on `stream` from now on is ordered after
  next.join(host_);
  for_unordered(next, stream, [&](const Access& a) {
    if (!overlaps(addr, n, a.addr, a.n)) return;
    record("reuse-unordered",
           call + ": the memory is handed out while work on another stream still touches it, and nothing makes "
                  "the new stream wait for that work:\n  work: " + a.what +
               "\n  (record an event after that work and make the new stream wait for it, or synchronize)",
           true);
  });
}

void RaceDetector::forget_accesses() { pending_.clear(); }

void RaceDetector::record(const std::string& kind, std::string text, bool with_backtrace) {
  ++count_;
  if (violations_.size() >= kMaxStored) return;
  if (with_backtrace) text += "\n  backtrace of the call:\n" + backtrace_text(2);
  violations_.push_back({kind, "[" + kind + "] " + text});
}

void RaceDetector::clear_violations() {
  violations_.clear();
  count_ = 0;
}

}  // namespace fakecuda
