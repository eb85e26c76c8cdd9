// MapBudget: keeps the host backend out of the last memory mappings the kernel allows the process
// (Note [Host mapping limit] in backend_host.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

namespace vmalloc::detail {

class MapBudget {
 public:
  MapBudget();
  // Throws BackendMappingLimit (naming the count, the limit and the ways out) if mapping could take the
  // process into the mappings left to the rest of it.
  void before_map(const char* what);
  // The same for an unmap, which splits a mapping unless the chunk is one whole mapping by itself; whole
  // mappings may always be unmapped (that lowers the count: how an arena at the limit frees its way back).
  void before_unmap(std::uintptr_t addr, std::size_t bytes);
  // The explanation appended to an ENOMEM from the kernel when the limit is the likely cause; "" otherwise.
  std::string diagnose();

 private:
  struct Scan {
    std::size_t count = 0;  // mappings of the process
    bool whole = false;     // [addr, addr + bytes) is exactly one mapping
  };
  static Scan scan(std::uintptr_t addr, std::size_t bytes);
  bool near_limit();  // with mu_ held: whether the last count, plus what ops since may add, nears the reserve
  std::string explain(std::size_t count) const;

  std::size_t limit_ = 0;    // vm.max_map_count (0: unknown, no budget)
  std::size_t reserve_ = 0;  // mappings left to the rest of the process
  std::mutex mu_;
  std::size_t last_count_ = 0;
  std::size_t ops_since_ = 0;
  bool scanned_ = false;
};

}  // namespace vmalloc::detail
