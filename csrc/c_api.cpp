// extern "C" entry points for torch.cuda.memory.CUDAPluggableAllocator, and the global arena registry.
//
// Note [C entry points]
// torch stores {size, device, allocation stream} per pointer and passes them back to free; the C++ type of
// free has `device`, although torch's docstring omits it. torch does not check malloc's result for null,
// so an out-of-memory failure is thrown as a C++ exception (torch reports it as a RuntimeError carrying our
// message), the way RMM's torch allocator does. free must not throw (it runs in destructors): errors there
// are printed.
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "global.h"

namespace vmalloc::global {
namespace {

constexpr int kMaxDevices = 64;

struct Registry {
  std::mutex mu;
  bool configured = false;
  Config config;
  std::array<std::shared_ptr<Allocator>, kMaxDevices> owners;
  std::array<std::atomic<Allocator*>, kMaxDevices> fast{};  // lock-free lookup on the hot path
};

// Note [Global arenas are immortal]
// The registry is never destroyed: torch may free tensors during interpreter shutdown, after static
// destructors would have run, and the driver tears memory down at process exit anyway.
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

Config env_config() {
  const char* env = std::getenv("VMALLOC_CONF");
  return parse_conf(env ? env : "");
}

void check_device(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw std::invalid_argument("vmalloc: device index " + std::to_string(device) + " is out of range");
}

}  // namespace

void configure(const Config& config) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto& a : r.owners)
    if (a) throw std::logic_error("vmalloc: the global allocator is already in use; configure it before the first CUDA allocation");
  r.config = config;
  r.configured = true;
}

Config configuration() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.configured ? r.config : env_config();
}

std::shared_ptr<Allocator> arena(int device) {
  check_device(device);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.owners[device]) {
    Config c = r.configured ? r.config : env_config();
    c.device = device;
    r.owners[device] = std::make_shared<Allocator>(c);
    r.fast[device].store(r.owners[device].get(), std::memory_order_release);
  }
  return r.owners[device];
}

std::shared_ptr<Allocator> existing(int device) {
  check_device(device);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.owners[device];
}

Allocator& fast_arena(int device) {
  if (device >= 0 && device < kMaxDevices) {
    if (Allocator* a = registry().fast[device].load(std::memory_order_acquire)) return *a;
  }
  return *arena(device);
}

}  // namespace vmalloc::global

using vmalloc::global::fast_arena;

extern "C" {

__attribute__((visibility("default"))) void* vmalloc_malloc(ssize_t size, int device, void* stream) {
  if (size < 0) throw std::invalid_argument("vmalloc_malloc: negative size");
  return reinterpret_cast<void*>(
      fast_arena(device).malloc(static_cast<std::size_t>(size), reinterpret_cast<vmalloc::Stream>(stream)));
}

__attribute__((visibility("default"))) void vmalloc_free(void* ptr, size_t /*size*/, int device, void* /*stream*/) {
  try {
    fast_arena(device).free(reinterpret_cast<std::uintptr_t>(ptr));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vmalloc_free: %s\n", e.what());
  }
}

// torch's reset_fn: called by torch.cuda.empty_cache().
__attribute__((visibility("default"))) void vmalloc_empty_cache() {
  vmalloc::global::for_each([](vmalloc::Allocator& a) { a.empty_cache(); });
}

// torch's init_fn: makes the device's arena eagerly, so configuration errors show up at startup.
__attribute__((visibility("default"))) void vmalloc_init(int device) { vmalloc::global::arena(device); }

// torch's memory_fraction_fn: torch.cuda.set_per_process_memory_fraction(fraction, device).
__attribute__((visibility("default"))) void vmalloc_set_memory_fraction(double fraction, int device) {
  if (!(fraction > 0.0 && fraction <= 1.0)) throw std::invalid_argument("memory fraction must be in (0, 1]");
  auto& a = fast_arena(device);
  a.set_capacity(static_cast<std::size_t>(fraction * static_cast<double>(a.backend().total_memory())));
}

// torch's record_stream_fn: tensor.record_stream(stream). torch does not say which device, so the arena
// that owns the pointer takes it.
__attribute__((visibility("default"))) void vmalloc_record_stream(void* ptr, void* stream) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  vmalloc::global::for_each([&](vmalloc::Allocator& a) {
    if (a.owns(addr)) a.record_stream(addr, reinterpret_cast<vmalloc::Stream>(stream));
  });
}

}  // extern "C"
