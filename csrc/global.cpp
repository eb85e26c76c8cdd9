// The global arena registry (see global.h).
#include "global.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>

namespace vmalloc::global {
namespace {

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

// Note [Chunk size at configure]
// configure() and VMALLOC_CONF are checked when given, not at the first CUDA allocation deep inside torch:
// chunk_size="2MB" (2,000,000 bytes, decimal) is refused at once, naming 2MiB, rather than failing the first
// tensor. The backend's granularity is the one expected_granularity() knows without a device.
Config env_config() {
  const char* env = std::getenv("VMALLOC_CONF");
  try {
    Config c = parse_conf(env ? env : "");
    check_chunk_size(c.chunk_size, expected_granularity(c.backend), c.backend);
    return c;
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("VMALLOC_CONF='") + (env ? env : "") + "': " + e.what());
  }
}

Config current(const Registry& r) { return r.configured ? r.config : env_config(); }

}  // namespace

void configure(const Config& config) {
  // The backend is made with the first arena; its granularity is known now (Note [Chunk size at configure]).
  if (const std::size_t g = expected_granularity(config.backend)) check_chunk_size(config.chunk_size, g, config.backend);
  validate(config);
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
  return current(r);
}

void init(int count) {
  const Config c = configuration();
  if (count < 0) throw std::invalid_argument("vmalloc_init: negative device count " + std::to_string(count));
  const int have = device_count(c);
  if (count > have) {
    throw std::invalid_argument("vmalloc_init: torch sees " + std::to_string(count) + " device(s) but the " +
                                c.backend + " backend has " + std::to_string(have) +
                                (c.backend == "cuda" ? "" : ": set devices=" + std::to_string(count) +
                                                                " in VMALLOC_CONF (or configure(devices=...))"));
  }
}

std::shared_ptr<Allocator> arena(int device) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (device >= 0 && device < kMaxDevices && r.owners[device]) return r.owners[device];
  Config c = current(r);
  check_device(c, device);
  c.device = device;
  r.owners[device] = std::make_shared<Allocator>(c);
  r.fast[device].store(r.owners[device].get(), std::memory_order_release);
  return r.owners[device];
}

std::shared_ptr<Allocator> existing(int device) noexcept {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.owners[device];
}

Allocator* fast_existing(int device) noexcept {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return registry().fast[device].load(std::memory_order_acquire);
}

Allocator& fast_arena(int device) {
  if (Allocator* a = fast_existing(device)) return *a;
  return *arena(device);
}

}  // namespace vmalloc::global
