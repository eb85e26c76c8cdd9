// The process-wide arenas behind torch's CUDAPluggableAllocator: one per device, made on first use from the
// configuration set by vmalloc.allocator(**options) or, failing that, the VMALLOC_CONF environment variable.
#pragma once

#include <memory>

#include "allocator.h"

namespace vmalloc::global {

// Sets the configuration for arenas not yet made, after validate()-ing it (std::invalid_argument naming
// what to change). Throws std::logic_error once any arena exists.
void configure(const Config& config);
// The configuration arenas are (or will be) made with. Throws std::invalid_argument for a bad VMALLOC_CONF.
Config configuration();
// Checks the configuration and that `device_count` devices exist for its backend, without making an arena
// (torch's init hook: Note [Init hook] in c_api.cpp). Throws std::invalid_argument / std::runtime_error.
void init(int device_count);
// The arena of `device`, made now if needed. Throws std::invalid_argument for a device the backend does not
// have (naming the count) or a bad configuration, and what the backend throws when it cannot start.
std::shared_ptr<Allocator> arena(int device);
// The arena of `device` if it was made, else null (also for any index out of range). Never throws.
std::shared_ptr<Allocator> existing(int device) noexcept;
// existing(device).get() without taking the registry's lock (the C entry points' hot path). Never throws.
Allocator* fast_existing(int device) noexcept;
// The arena of `device`, made now if needed, without the registry's lock once it exists (every allocation but
// the first). The registry keeps it alive for the process. Throws what arena() throws.
Allocator& fast_arena(int device);
// Applies f to every arena made so far.
template <typename F>
void for_each(F&& f) {
  for (int d = 0; d < kMaxDevices; ++d)
    if (auto a = existing(d)) f(*a);
}

}  // namespace vmalloc::global
