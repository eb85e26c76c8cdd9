// The process-wide arenas behind torch's CUDAPluggableAllocator: one per device, made on first use from the
// configuration set by vmalloc.allocator(**options) or, failing that, the VMALLOC_CONF environment variable.
#pragma once

#include <memory>

#include "allocator.h"

namespace vmalloc::global {

// Sets the configuration for arenas not yet made. Throws std::logic_error once any arena exists.
void configure(const Config& config);
// The configuration arenas are (or will be) made with.
Config configuration();
// The arena of `device`, made now if needed.
std::shared_ptr<Allocator> arena(int device);
// The arena of `device` if it was made, else null.
std::shared_ptr<Allocator> existing(int device);
// Applies f to every arena made so far.
template <typename F>
void for_each(F&& f) {
  for (int d = 0; d < 64; ++d)
    if (auto a = existing(d)) f(*a);
}

}  // namespace vmalloc::global
