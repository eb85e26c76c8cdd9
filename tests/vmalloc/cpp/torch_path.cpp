// What torch's C++ sees through vmalloc_malloc (the CUDAPluggableAllocator path): errors are C++
// exceptions, std::exception subclasses with vmalloc's message, and out-of-memory is vmalloc::OutOfMemory,
// catchable across the shared-library boundary. Built and run by test_c_api.py with VMALLOC_CONF set to a
// host-backend configuration; prints one line per check.
#include <cstdio>
#include <exception>

#include "allocator.h"
#include "vmalloc_c.h"

int main() {
  void* p = vmalloc_malloc(1 << 20, 0, nullptr);
  std::printf("malloc %s\n", p ? "ok" : "null");
  try {
    vmalloc_malloc(ssize_t{1} << 40, 0, nullptr);
    std::printf("oom none\n");
  } catch (const vmalloc::OutOfMemory& e) {
    std::printf("oom OutOfMemory %s\n", e.what());
  } catch (const std::exception& e) {
    std::printf("oom other %s\n", e.what());
  }
  try {
    vmalloc_malloc(64, 5, nullptr);
    std::printf("device none\n");
  } catch (const std::exception& e) {
    std::printf("device std::exception %s\n", e.what());
  }
  try {
    vmalloc_malloc(-3, 0, nullptr);
    std::printf("negative none\n");
  } catch (const std::invalid_argument& e) {
    std::printf("negative invalid_argument %s\n", e.what());
  }
  vmalloc_free(p, 1 << 20, 0, nullptr);
  return 0;
}
