// Arena options and their text forms: sizes ("512MiB", "1.5GiB", 4096) and VMALLOC_CONF
// ("backend=cuda,chunk_size=2MiB,capacity=16GiB").
#pragma once

#include <cstddef>
#include <string>

namespace vmalloc {

struct Config {
  std::string backend = "cuda";
  std::size_t capacity = 0;  // 0: the backend's default (see Allocator::Allocator)
  std::size_t chunk_size = std::size_t{2} << 20;
  std::size_t small_max = std::size_t{1} << 20;
  int device = 0;
  std::size_t history = 0;  // trace entries kept for snapshot(); 0 records none
  // Note [Reuse before growth]: false (default) reuses cached chunks (reclaim) before creating new ones;
  // true creates new chunks while under capacity first, reclaiming only at the capacity.
  bool eager_growth = false;
};

// Parses "123", "512KiB", "2MiB", "1.5GiB", "1TiB", "10MB" (SI units are decimal). Throws
// std::invalid_argument with the accepted forms on anything else.
std::size_t parse_size(const std::string& text);

// Applies "key=value,key=value" on top of base. Unknown keys and bad values throw std::invalid_argument.
Config parse_conf(const std::string& text, Config base = {});

std::string format_size(std::size_t bytes);

}  // namespace vmalloc
