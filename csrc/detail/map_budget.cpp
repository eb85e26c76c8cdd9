#include "map_budget.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "../backend.h"

namespace vmalloc::detail {

MapBudget::MapBudget() {
  std::ifstream f("/proc/sys/vm/max_map_count");
  long v = 0;
  if (f >> v && v > 0) {
    limit_ = static_cast<std::size_t>(v);
    // 1/16 of the limit, at least 1024: room for the interpreter, the libraries and other allocators.
    reserve_ = limit_ / 16 > 1024 ? limit_ / 16 : 1024;
    if (reserve_ >= limit_) reserve_ = limit_ / 2;
  }
}

void MapBudget::rescan() {
  mappings_.clear();
  scanned_ = true;
  ops_since_ = 0;
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (!f) return;
  char line[512];
  while (std::fgets(line, sizeof line, f)) {
    unsigned long long start = 0, end = 0;
    if (std::sscanf(line, "%llx-%llx", &start, &end) == 2) mappings_.emplace_back(start, end);
    // Skip the rest of an overlong line (a long path) so it is not counted twice.
    while (!std::strchr(line, '\n') && std::fgets(line, sizeof line, f)) {
    }
  }
  std::fclose(f);
}

bool MapBudget::whole(std::uintptr_t addr, std::size_t bytes) const {
  auto it = std::lower_bound(mappings_.begin(), mappings_.end(), std::make_pair(addr, std::uintptr_t{0}));
  return it != mappings_.end() && it->first == addr && it->second == addr + bytes;
}

bool MapBudget::clear_of(std::size_t limit) {
  // Each map or unmap adds at most two mappings: no need to look before `limit` could be reached. Scanning
  // /proc/self/maps costs milliseconds at tens of thousands of mappings, so near the limit an operation
  // rescans only if another was allowed since the last scan: a run of refusals (an arena unmapping its way
  // back, one refused split after another) costs one scan, not one each.
  if (scanned_ && mappings_.size() + 2 * ops_since_ + 2 <= limit) return true;
  if (!scanned_ || ops_since_ > 0) rescan();
  return false;
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
  if (!limit_) return;
  if (!clear_of(limit_ - reserve_) && mappings_.size() + 2 > limit_ - reserve_)
    throw BackendOutOfMappings("mmap", std::string("vmalloc host backend: mmap (") + what + ") refused: " +
                                           explain(mappings_.size()));
  ++ops_since_;
}

void MapBudget::before_unmap(std::uintptr_t addr, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!limit_) return;
  const std::size_t limit = limit_ - reserve_ / 2;
  if (!clear_of(limit) && mappings_.size() + 2 > limit && !whole(addr, bytes))
    throw BackendError("mmap", "vmalloc host backend: mmap (unmapping a chunk, which would split a mapping) refused: " +
                                   explain(mappings_.size()));
  ++ops_since_;
}

std::string MapBudget::diagnose() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!limit_) return "";
  rescan();
  return mappings_.size() + 16 >= limit_ - reserve_ ? "; " + explain(mappings_.size()) : "";
}

}  // namespace vmalloc::detail
