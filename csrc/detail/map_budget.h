// MapBudget: keeps the host backend out of the last memory mappings the kernel allows the process
// (Note [Host mapping limit] in backend_host.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace vmalloc::detail {

class MapBudget {
 public:
  MapBudget();
  // Throws BackendOutOfMappings (naming the count, the limit and the ways out) if mapping could take the
  // process into the mappings left to the rest of it.
  void before_map(const char* what);
  // The same for an unmap, which splits a mapping unless the chunk is one whole mapping by itself, with half
  // the reserve as its limit; whole mappings may always be unmapped (that lowers the count: how an arena at
  // the limit frees its way back). Throws BackendError.
  void before_unmap(std::uintptr_t addr, std::size_t bytes);
  // The explanation appended to an ENOMEM from the kernel when the limit is the likely cause; "" otherwise.
  std::string diagnose();

 private:
  // With mu_ held: whether an operation may go ahead under `limit` without looking (the last count, plus what
  // the operations allowed since may have added, stays below it); else rescans unless nothing was allowed
  // since the last scan, whose picture is then still true.
  bool clear_of(std::size_t limit);
  void rescan();                                        // with mu_ held
  bool whole(std::uintptr_t addr, std::size_t bytes) const;  // with mu_ held: exactly one mapping at last scan
  std::string explain(std::size_t count) const;

  std::size_t limit_ = 0;    // vm.max_map_count (0: unknown, no budget)
  std::size_t reserve_ = 0;  // mappings left to the rest of the process
  std::mutex mu_;
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> mappings_;  // [start, end) at the last scan, sorted
  std::size_t ops_since_ = 0;  // operations allowed since the last scan
  bool scanned_ = false;
};

}  // namespace vmalloc::detail
