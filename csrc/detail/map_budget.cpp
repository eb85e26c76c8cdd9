#include "map_budget.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "../backend.h"

namespace vmalloc::detail {

MapBudget::MapBudget() {
  std::ifstream f("/proc/sys/vm/max_map_count");
  long v = 0;
  if (f >> v && v > 0) {
    // VMALLOC_MAX_MAP_COUNT may only lower it: tests reach the limit without thousands of mappings.
    if (const char* env = std::getenv("VMALLOC_MAX_MAP_COUNT")) {
      const long lower = std::strtol(env, nullptr, 10);
      if (lower > 0 && lower < v) v = lower;
    }
    limit_ = static_cast<std::size_t>(v);
    // 1/16 of the limit, at least 1024: room for the interpreter, the libraries and other allocators.
    reserve_ = limit_ / 16 > 1024 ? limit_ / 16 : 1024;
    if (reserve_ >= limit_) reserve_ = limit_ / 2;
  }
}

MapBudget::Scan MapBudget::scan(std::uintptr_t addr, std::size_t bytes) {
  Scan s;
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (!f) return s;
  char line[512];
  while (std::fgets(line, sizeof line, f)) {
    ++s.count;
    unsigned long long start = 0, end = 0;
    if (bytes && std::sscanf(line, "%llx-%llx", &start, &end) == 2 && start == addr && end == addr + bytes) s.whole = true;
    // Skip the rest of an overlong line (a long path) so it is not counted twice.
    while (!std::strchr(line, '\n') && std::fgets(line, sizeof line, f)) {
    }
  }
  std::fclose(f);
  return s;
}

bool MapBudget::near_limit() {
  ++ops_since_;
  // Each map or unmap adds at most two mappings: no need to look before the reserve could be reached.
  return limit_ && (!scanned_ || last_count_ + 2 * ops_since_ + 2 > limit_ - reserve_);
}

std::string MapBudget::explain(std::size_t count) const {
  return "the process has " + std::to_string(count) + " memory mappings and the kernel allows " +
         std::to_string(limit_) + " (vm.max_map_count); the host backend leaves the last " + std::to_string(reserve_) +
         " to the rest of the process. Every host chunk that is not next to its neighbours in the chunk file is a "
         "mapping of its own (stitched ranges are): use a larger chunk_size (fewer chunks) or raise the limit "
         "(sysctl -w vm.max_map_count=262144)";
}

void MapBudget::before_map(const char* what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!near_limit()) return;
  const Scan s = scan(0, 0);
  last_count_ = s.count;
  ops_since_ = 0;
  scanned_ = true;
  if (s.count + 2 > limit_ - reserve_)
    throw BackendMappingLimit("mmap", std::string("vmalloc host backend: mmap (") + what + ") refused: " +
                                          explain(s.count));
}

void MapBudget::before_unmap(std::uintptr_t addr, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!near_limit()) return;
  const Scan s = scan(addr, bytes);
  last_count_ = s.count;
  ops_since_ = 0;
  scanned_ = true;
  if (s.count + 2 > limit_ - reserve_ && !s.whole)
    throw BackendError("mmap", "vmalloc host backend: mmap (unmapping a chunk, which would split a mapping) refused: " +
                                   explain(s.count));
}

std::string MapBudget::diagnose() {
  if (!limit_) return "";
  const Scan s = scan(0, 0);
  std::lock_guard<std::mutex> lock(mu_);
  last_count_ = s.count;
  ops_since_ = 0;
  scanned_ = true;
  return s.count + 16 >= limit_ - reserve_ ? "; " + explain(s.count) : "";
}

}  // namespace vmalloc::detail
