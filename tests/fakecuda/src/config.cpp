// Configuration from the environment, and text helpers.
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "common.h"

namespace fakecuda {

std::string hex(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string range_text(std::uintptr_t addr, std::size_t n) {
  return "[" + hex(addr) + ", " + hex(addr + n) + ") (" + std::to_string(n) + " bytes)";
}

bool parse_size(const std::string& text, std::size_t& out) {
  std::size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  if (i == 0 || i > 19) return false;
  const unsigned long long number = std::strtoull(text.substr(0, i).c_str(), nullptr, 10);
  std::string unit = text.substr(i);
  if (unit.size() == 3 && unit.substr(1) == "iB") unit = unit.substr(0, 1);
  int shift = 0;
  if (unit.empty() || unit == "B") shift = 0;
  else if (unit == "K") shift = 10;
  else if (unit == "M") shift = 20;
  else if (unit == "G") shift = 30;
  else if (unit == "T") shift = 40;
  else return false;
  if (number > (std::numeric_limits<std::size_t>::max() >> shift)) return false;
  out = static_cast<std::size_t>(number) << shift;
  return true;
}

namespace {

Config read_config() {
  Config c;
  auto problem = [&](const std::string& what) {
    c.error += (c.error.empty() ? "" : "; ") + what;
  };
  if (const char* v = std::getenv("FAKECUDA_DEVICES")) {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*v == '\0' || *end != '\0' || n < 1 || n > 64)
      problem(std::string("FAKECUDA_DEVICES=") + v + " is not a device count from 1 to 64");
    else c.devices = static_cast<int>(n);
  }
  if (const char* v = std::getenv("FAKECUDA_TOTAL_MEM")) {
    if (!parse_size(v, c.total_mem) || c.total_mem == 0)
      problem(std::string("FAKECUDA_TOTAL_MEM=") + v + " is not a size such as 8GiB or 536870912");
  }
  if (const char* v = std::getenv("FAKECUDA_GRANULARITY")) {
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    std::size_t g = 0;
    if (!parse_size(v, g) || g < page || (g & (g - 1)) != 0)
      problem(std::string("FAKECUDA_GRANULARITY=") + v + " is not a power of two of at least the page size (" +
              std::to_string(page) + "), such as 2MiB");
    else c.granularity = g;
  }
  if (const char* v = std::getenv("FAKECUDA_LOG")) c.log_misuse = std::string(v) == "1";
  if (const char* v = std::getenv("FAKECUDA_MAP_OFFSETS")) {
    if (std::string(v) != "0" && std::string(v) != "1")
      problem(std::string("FAKECUDA_MAP_OFFSETS=") + v + " is not 0 (offsets refused) or 1 (allowed, the default)");
    else c.map_offsets = std::string(v) == "1";
  }
  if (!c.error.empty()) std::fprintf(stderr, "fakecuda: bad configuration: %s\n", c.error.c_str());
  return c;
}

}  // namespace

const Config& config() {
  static const Config c = read_config();
  return c;
}

}  // namespace fakecuda
