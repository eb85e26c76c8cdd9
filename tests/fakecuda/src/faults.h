// Fault injection: make the n-th call of a driver entry point (and every later one, or just that one) fail
// with a chosen CUresult, and count every entry point's calls so a test can fail each call in turn.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace fakecuda {

struct FaultRule {
  std::string entry;  // base name, e.g. "cuMemCreate"
  std::uint64_t nth;  // the first failing call, counting from 1 since the counters were last reset
  CUresult result;
  bool once;          // fail only call `nth`, not the ones after it
};

// Parses "cuMemCreate:3:CUDA_ERROR_OUT_OF_MEMORY,cuMemMap:5:CUDA_ERROR_INVALID_VALUE:once" (the result may
// also be a number). Returns "" and fills `out`, or returns what is wrong and what to write instead.
std::string parse_fault_spec(const std::string& spec, std::vector<FaultRule>& out);

class Faults {
 public:
  // Counts one call of `entry`; returns the injected CUresult, or CUDA_SUCCESS to let the call run.
  CUresult on_call(const char* entry);
  // Replaces the rules and resets every call counter. On bad text nothing changes and the reason is returned.
  std::string set(const std::string& spec);
  std::uint64_t calls(const std::string& entry) const;

 private:
  mutable std::mutex mu_;  // its own lock: counting must not wait for the driver's lock
  std::vector<FaultRule> rules_;
  std::unordered_map<std::string, std::uint64_t> calls_;
};

}  // namespace fakecuda
