// Small pieces every part of the emulated driver uses: rule-check results, vector clocks, configuration.
#pragma once

#include <cuda.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fakecuda {

// The outcome of checking one of the driver's rules: the CUresult the real driver returns and, on failure,
// which rule was broken. A CUresult alone cannot say that, so the reason goes to the misuse log
// (fakecuda_misuse_text) where a test, or a person reading a failure, can see it.
struct Status {
  CUresult code = CUDA_SUCCESS;
  std::string why;
  bool ok() const { return code == CUDA_SUCCESS; }
};
inline Status success() { return {}; }
inline Status fail(CUresult code, std::string why) { return Status{code, std::move(why)}; }

std::string hex(std::uint64_t v);
// "[0x1000, 0x3000) (8192 bytes)"
std::string range_text(std::uintptr_t addr, std::size_t n);
inline bool overlaps(std::uintptr_t a, std::size_t an, std::uintptr_t b, std::size_t bn) {
  return a < b + bn && b < a + an;
}

// Note [Happens-before]
// Every operation enqueued on a stream gets the next sequence number of that stream. A vector clock says,
// for each stream (by its small integer id), the last sequence number known to be ordered before its owner:
// a stream (what it has waited for), an event (its stream's clock when recorded), or the host (what it has
// synchronized with). Work on stream t with sequence number q is ordered before an owner with clock C iff
// q <= C[t]. Ordering, not completion, is what the race detector checks: work that happened to finish before
// an unmap is still a race if nothing made the host wait for it, because on a real GPU it might not have.
class VectorClock {
 public:
  std::uint64_t at(std::size_t stream) const { return stream < v_.size() ? v_[stream] : 0; }
  void advance(std::size_t stream, std::uint64_t seq) {
    if (stream >= v_.size()) v_.resize(stream + 1, 0);
    v_[stream] = std::max(v_[stream], seq);
  }
  void join(const VectorClock& other) {
    if (other.v_.size() > v_.size()) v_.resize(other.v_.size(), 0);
    for (std::size_t i = 0; i < other.v_.size(); ++i) v_[i] = std::max(v_[i], other.v_[i]);
  }

 private:
  std::vector<std::uint64_t> v_;
};

// Read once from the environment (see README.md): FAKECUDA_DEVICES, FAKECUDA_TOTAL_MEM, FAKECUDA_GRANULARITY.
struct Config {
  int devices = 1;
  std::size_t total_mem = std::size_t{8} << 30;
  std::size_t granularity = std::size_t{2} << 20;
  bool log_misuse = false;  // FAKECUDA_LOG=1: print every rule violation to stderr as it happens
  bool map_offsets = true;  // FAKECUDA_MAP_OFFSETS=0: cuMemMap refuses a nonzero offset (Note [Mapping at an offset])
  std::string error;        // non-empty: a variable was malformed; cuInit fails and says so on stderr
};
const Config& config();

// Parses "8GiB", "512MiB", "64KiB", "4096" (binary multiples; K/M/G/T without "iB" accepted too).
bool parse_size(const std::string& text, std::size_t& out);

// The emulated driver's version (cuDriverGetVersion; cuGetProcAddress refuses newer requests).
constexpr int kDriverVersion = 13000;

}  // namespace fakecuda
