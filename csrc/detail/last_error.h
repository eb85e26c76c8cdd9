// The thread-local message behind vmalloc_last_error() (csrc/c_api.cpp), for the entry points in other files.
#pragma once

#include <string>

namespace vmalloc::detail {

// Keeps `what` for vmalloc_last_error() on this thread. Never throws.
void set_last_error(const std::string& what) noexcept;

}  // namespace vmalloc::detail
