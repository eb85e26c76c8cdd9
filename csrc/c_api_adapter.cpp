// extern "C" entry points for the torch adapter (csrc/torch/adapter.cpp), with plain C types only.
//
// Note [A C boundary between the core and the torch adapter]
// The adapter is compiled against the installed torch with torch's compiler flags, and older torch wheels
// (2.4's, for one) use the pre-C++11 libstdc++ ABI (_GLIBCXX_USE_CXX11_ABI=0), while this core is built with
// the default one.
// A std::string or std::vector crossing between the two would be laid out differently on each side, so the
// adapter reaches the core only through these functions: integers, pointers and caller-owned buffers, no
// C++ types and no exceptions (each call catches and reports through its return value).
#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "detail/last_error.h"
#include "global.h"

namespace {

void copy_message(const char* text, char* buf, std::size_t cap) {
  if (!buf || cap == 0) return;
  std::strncpy(buf, text, cap - 1);
  buf[cap - 1] = '\0';
}

}  // namespace

extern "C" {

// Allocates `size` bytes on `device`'s global arena. Returns 0 with *out set; 1 when the arena is out of
// memory; 2 on any other error. On 1 and 2 the explanation is copied into err (capacity errcap).
// call_handler=0 skips the OOM handler (see Note [OOM handler and torch's allocator lock] in the adapter).
__attribute__((visibility("default"))) int vmalloc_adapter_malloc(void** out, std::size_t size, int device,
                                                                  void* stream, int call_handler, char* err,
                                                                  std::size_t errcap) {
  try {
    *out = reinterpret_cast<void*>(vmalloc::global::fast_arena(device).malloc(
        size, reinterpret_cast<vmalloc::Stream>(stream), call_handler != 0));
    return 0;
  } catch (const vmalloc::OutOfMemory& e) {
    copy_message(e.what(), err, errcap);
    return 1;
  } catch (const std::exception& e) {
    copy_message(e.what(), err, errcap);
    return 2;
  }
}

// Fills values[i] with the statistic names[i] of `device`'s global arena (0 for a name it does not have).
// Returns how many names were found, or -1 if the arena does not exist yet (values are then zeroed).
__attribute__((visibility("default"))) int vmalloc_adapter_stats(int device, const char* const* names,
                                                                 std::int64_t* values, int n) {
  for (int i = 0; i < n; ++i) values[i] = 0;
  try {
    auto arena = vmalloc::global::existing(device);
    if (!arena) return -1;
    int found = 0;
    for (const auto& [name, value] : arena->stats()) {
      for (int i = 0; i < n; ++i) {
        if (name == names[i]) {
          values[i] = value;
          ++found;
        }
      }
    }
    return found;
  } catch (const std::exception&) {
    return -1;
  }
}

// *fraction = the capacity of `device`'s global arena (made if needed) over the device's memory: what
// torch.cuda.set_per_process_memory_fraction set. 0 on success; 2 with the explanation in err.
__attribute__((visibility("default"))) int vmalloc_adapter_memory_fraction(int device, double* fraction, char* err,
                                                                           std::size_t errcap) {
  try {
    vmalloc::Allocator& arena = vmalloc::global::fast_arena(device);
    const double total = static_cast<double>(arena.backend().total_memory());
    *fraction = total > 0 ? static_cast<double>(arena.capacity()) / total : 1.0;
    return 0;
  } catch (const std::exception& e) {
    copy_message(e.what(), err, errcap);
    return 2;
  }
}

// *largest = the largest request `device`'s global arena can serve now, with at most device_free bytes created
// (Note [Workspace offers]). Returns 0, or -1 if the arena does not exist yet.
__attribute__((visibility("default"))) int vmalloc_adapter_cache_info(int device, std::size_t device_free,
                                                                      std::size_t* largest) {
  try {
    auto arena = vmalloc::global::existing(device);
    if (!arena) return -1;
    *largest = arena->largest_allocatable(device_free);
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}

// Resets the peak statistics of `device`'s global arena, if it exists.
__attribute__((visibility("default"))) void vmalloc_adapter_reset_peak(int device) {
  try {
    if (auto arena = vmalloc::global::existing(device)) arena->reset_peak_stats();
  } catch (const std::exception&) {
  }
}

}  // extern "C"

extern "C" {

// torch's MemPool alloc_fn for torch builds without the adapter: like vmalloc_malloc, but it never calls the
// OOM handler (torch's caching allocator holds its lock here) and reports every failure as null, which torch
// turns into its own torch.cuda.OutOfMemoryError (Note [OOM handler and torch's allocator lock] in
// csrc/torch/adapter.cpp). So that the cause is not lost behind torch's message, it is kept for
// vmalloc_last_error(), and a failure that is not an out-of-memory (a driver error, a bad device) is also
// printed on stderr: torch's message would blame memory for it.
__attribute__((visibility("default"))) void* vmalloc_malloc_no_handler(ssize_t size, int device, void* stream) {
  char err[2048] = {0};
  if (size < 0) {
    std::snprintf(err, sizeof(err), "vmalloc_malloc_no_handler: negative size %zd", size);
    vmalloc::detail::set_last_error(err);
    std::fprintf(stderr, "vmalloc: %s\n", err);
    return nullptr;
  }
  void* out = nullptr;
  const int rc = vmalloc_adapter_malloc(&out, static_cast<std::size_t>(size), device, stream, 0, err, sizeof(err));
  if (rc == 0) return out;
  vmalloc::detail::set_last_error(std::string("vmalloc_malloc_no_handler: ") + err);
  if (rc != 1) std::fprintf(stderr, "vmalloc: allocation failed (not for lack of memory): %s\n", err);
  return nullptr;
}

}  // extern "C"
