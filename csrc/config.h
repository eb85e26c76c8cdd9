// Arena options and their text forms: sizes ("512MiB", "1.5GiB", 4096) and VMALLOC_CONF
// ("backend=cuda,chunk_size=2MiB,capacity=16GiB").
#pragma once

#include <cstddef>
#include <string>

namespace vmalloc {

// The largest capacity an arena accepts: 1 PiB, beyond any device, so that 4x of it (the first address
// reservation) and every byte count in stats() fit comfortably in 64 bits.
constexpr std::size_t kMaxCapacity = std::size_t{1} << 50;
constexpr int kMaxDevices = 64;
// The largest physical block (one backend allocation of several chunks) by default: Note [Blocks and slices].
constexpr std::size_t kDefaultBlockBytes = std::size_t{32} << 20;
// Note [Reuse before growth]: how far above its high-water mark of chunks in use an arena may grow rather
// than reclaim, by default.
constexpr double kDefaultGrowthSlack = 0;
constexpr double kMaxGrowthSlack = 1024;
constexpr std::size_t kDefaultMidChunks = 0;  // Note [Mid-size blocks]: opt-in
constexpr std::size_t kMaxMidChunks = 64;

struct Config {
  std::string backend = "cuda";
  std::size_t capacity = 0;  // 0: the backend's default (see Allocator::Allocator)
  std::size_t chunk_size = std::size_t{2} << 20;
  std::size_t small_max = std::size_t{1} << 20;
  // Note [Blocks and slices]: the largest physical block, a multiple of chunk_size; chunk_size itself makes
  // one chunk per block; 0: kDefaultBlockBytes.
  std::size_t block_size = 0;
  int device = 0;
  // How many devices the host and sim backends present (the cuda backend asks the driver).
  int devices = 1;
  std::size_t history = 0;  // trace entries kept for snapshot(); 0 records none
  // Note [Reuse before growth]: false (default) creates chunks on a cache miss only while the chunks held
  // stay within (1 + growth_slack) x the most chunks ever in use at once, and reclaims cached ones beyond;
  // true creates new chunks while under capacity first, reclaiming only at the capacity.
  bool eager_growth = false;
  double growth_slack = kDefaultGrowthSlack;
  // Note [Step plan]: learn the repeating step of a training loop and serve it from a planned layout.
  bool step_plan = true;
  // Note [Mid-size blocks]: requests above small_max up to mid_chunks chunks are blocks of slabs of
  // mid_chunks chunks, rounded to a quarter chunk; 0 (the default) rounds them to whole chunks.
  std::size_t mid_chunks = kDefaultMidChunks;
};

// Parses "123", "512KiB", "2MiB", "1.5GiB", "1TiB", "10MB" (SI units are decimal). Throws
// std::invalid_argument with the accepted forms on anything else, and on sizes of 2^63 bytes or more.
std::size_t parse_size(const std::string& text);
// "1/0/true/false/yes/no/on/off" (any case). Throws std::invalid_argument listing them otherwise.
bool parse_bool(const std::string& text, const std::string& what);
// A non-negative decimal integer. Throws std::invalid_argument naming `what` otherwise.
std::size_t parse_count(const std::string& text, const std::string& what);
// A non-negative decimal number such as 0.125 (or 12.5%). Throws std::invalid_argument naming `what` otherwise.
double parse_fraction(const std::string& text, const std::string& what);

// Applies "key=value,key=value" on top of base, then validate()s. Unknown keys and bad values throw
// std::invalid_argument saying what to write instead.
Config parse_conf(const std::string& text, Config base = {});

// Checks what can be checked without a backend: the backend's name, capacity and history bounds,
// small_max <= chunk_size, the device count. Throws std::invalid_argument.
void validate(const Config& config);

std::string format_size(std::size_t bytes);

}  // namespace vmalloc
