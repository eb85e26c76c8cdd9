// extern "C" entry points for torch.cuda.memory.CUDAPluggableAllocator, and their non-throwing twins.
//
// Note [C entry points]
// torch stores {size, device, allocation stream} per pointer and passes them back to free; the C++ type of
// free has `device`, although torch's docstring omits it. torch calls these hooks from C++ and does not
// check malloc's result for null, so the hooks report errors as C++ exceptions (std::exception subclasses
// with the whole explanation; vmalloc::OutOfMemory for out-of-memory), which torch turns into Python
// exceptions, the way RMM's torch allocator does. A C caller cannot catch an exception: through these hooks
// it would end the process. C callers use the vmalloc_try_* family (vmalloc_c.h), which catches everything,
// returns NULL / -1 and keeps the message for vmalloc_last_error(). free never throws (torch calls it from
// destructors): errors are printed and kept for vmalloc_last_error(). free only looks arenas up: a free for
// a device without an arena is an error, never a reason to make one.
#include <cstdio>
#include <string>

#include "detail/last_error.h"
#include "global.h"
#include "vmalloc_c.h"

namespace {

using vmalloc::Allocator;
namespace global = vmalloc::global;

thread_local std::string t_last_error;

void set_error(const char* what) noexcept {
  try {
    t_last_error = what;
  } catch (...) {
    t_last_error.clear();
  }
}

// Runs f; on an exception keeps its message for vmalloc_last_error() and returns false.
template <typename F>
bool guarded(const char* entry, F&& f) noexcept {
  try {
    f();
    t_last_error.clear();
    return true;
  } catch (const std::exception& e) {
    try {
      set_error((std::string(entry) + ": " + e.what()).c_str());
    } catch (...) {
      set_error(entry);
    }
  } catch (...) {
    set_error((std::string(entry) + ": unknown exception").c_str());
  }
  return false;
}

void* do_malloc(ssize_t size, int device, void* stream) {
  if (size < 0)
    throw std::invalid_argument("vmalloc_malloc: negative size " + std::to_string(size) + " for device " +
                                std::to_string(device));
  return reinterpret_cast<void*>(
      global::fast_arena(device).malloc(static_cast<std::size_t>(size), reinterpret_cast<vmalloc::Stream>(stream)));
}

void do_free(void* ptr, int device) {
  if (!ptr) return;
  Allocator* a = global::fast_existing(device);
  if (!a) {
    throw std::invalid_argument("free of " + std::to_string(reinterpret_cast<std::uintptr_t>(ptr)) +
                                " on device " + std::to_string(device) +
                                ", which has no vmalloc arena (a pointer from another allocator, or a wrong device)");
  }
  a->free(reinterpret_cast<std::uintptr_t>(ptr));
}

void do_empty_cache() {
  std::string first_error;
  global::for_each([&](Allocator& a) {
    try {
      a.empty_cache();
    } catch (const std::exception& e) {  // the other arenas still empty their caches
      if (first_error.empty()) first_error = e.what();
    }
  });
  if (!first_error.empty()) throw std::runtime_error(first_error);
}

void do_set_memory_fraction(double fraction, int device) {
  if (!(fraction > 0.0 && fraction <= 1.0))
    throw std::invalid_argument("memory fraction must be in (0, 1], not " + std::to_string(fraction));
  Allocator& a = global::fast_arena(device);
  a.set_capacity(static_cast<std::size_t>(fraction * static_cast<double>(a.backend().total_memory())));
}

// torch does not say which device, so the arena that owns the pointer takes it.
void do_record_stream(void* ptr, void* stream) {
  if (!ptr) return;
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  bool found = false;
  global::for_each([&](Allocator& a) {
    if (!found && a.owns(addr)) {
      a.record_stream(addr, reinterpret_cast<vmalloc::Stream>(stream));
      found = true;
    }
  });
  if (!found)
    throw std::invalid_argument("record_stream on " + std::to_string(addr) + ", which no vmalloc arena allocated");
}

}  // namespace

namespace vmalloc::detail {

void set_last_error(const std::string& what) noexcept { set_error(what.c_str()); }

}  // namespace vmalloc::detail

extern "C" {

// ---- torch's hooks: C++ exceptions -------------------------------------------------------------------------

__attribute__((visibility("default"))) void* vmalloc_malloc(ssize_t size, int device, void* stream) {
  return do_malloc(size, device, stream);
}

__attribute__((visibility("default"))) void vmalloc_free(void* ptr, size_t /*size*/, int device, void* /*stream*/) {
  if (!guarded("vmalloc_free", [&] { do_free(ptr, device); })) std::fprintf(stderr, "%s\n", t_last_error.c_str());
}

// torch's reset_fn: called by torch.cuda.empty_cache().
__attribute__((visibility("default"))) void vmalloc_empty_cache() { do_empty_cache(); }

// Note [Init hook]
// torch calls init_fn(device_count) once, at lazy CUDA initialization (CUDAPluggableAllocator::init(int
// device_count)): the argument is a count, not a device. The hook checks the configuration and the count
// and makes no arena: an arena per GPU made eagerly would reserve address space and retain a context on
// every GPU, also those the program never uses. Arenas are made at their device's first allocation.
__attribute__((visibility("default"))) void vmalloc_init(int device_count) { global::init(device_count); }

// torch's memory_fraction_fn: torch.cuda.set_per_process_memory_fraction(fraction, device).
__attribute__((visibility("default"))) void vmalloc_set_memory_fraction(double fraction, int device) {
  do_set_memory_fraction(fraction, device);
}

// torch's record_stream_fn: tensor.record_stream(stream).
__attribute__((visibility("default"))) void vmalloc_record_stream(void* ptr, void* stream) {
  do_record_stream(ptr, stream);
}

// ---- for C callers: never throw --------------------------------------------------------------------------

__attribute__((visibility("default"))) void* vmalloc_try_malloc(ssize_t size, int device, void* stream) {
  void* p = nullptr;
  guarded("vmalloc_try_malloc", [&] { p = do_malloc(size, device, stream); });
  return p;
}

__attribute__((visibility("default"))) int vmalloc_try_free(void* ptr, int device) {
  return guarded("vmalloc_try_free", [&] { do_free(ptr, device); }) ? 0 : -1;
}

__attribute__((visibility("default"))) int vmalloc_try_empty_cache() {
  return guarded("vmalloc_try_empty_cache", [] { do_empty_cache(); }) ? 0 : -1;
}

__attribute__((visibility("default"))) int vmalloc_try_init(int device_count) {
  return guarded("vmalloc_try_init", [&] { global::init(device_count); }) ? 0 : -1;
}

__attribute__((visibility("default"))) int vmalloc_try_set_memory_fraction(double fraction, int device) {
  return guarded("vmalloc_try_set_memory_fraction", [&] { do_set_memory_fraction(fraction, device); }) ? 0 : -1;
}

__attribute__((visibility("default"))) int vmalloc_try_record_stream(void* ptr, void* stream) {
  return guarded("vmalloc_try_record_stream", [&] { do_record_stream(ptr, stream); }) ? 0 : -1;
}

__attribute__((visibility("default"))) const char* vmalloc_last_error() { return t_last_error.c_str(); }

}  // extern "C"
