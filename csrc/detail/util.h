// Small helpers shared by the allocator's source files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

namespace vmalloc::detail {

constexpr std::size_t kSmallRound = 512;  // small requests round to this, as PyTorch's kMinBlockSize

inline std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

inline std::string hex(std::uintptr_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

}  // namespace vmalloc::detail
