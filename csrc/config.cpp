#include "config.h"

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>

namespace vmalloc {
namespace {

std::string trim(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

// 2^63: every size must fit the int64 counters of stats().
constexpr double kSizeLimit = 9223372036854775808.0;

}  // namespace

std::size_t parse_size(const std::string& raw) {
  const std::string text = trim(raw);
  const std::string forms = "expected a byte count such as 4096, \"512KiB\", \"2MiB\", \"1.5GiB\" or \"10MB\"";
  if (!text.empty() && text[0] == '-')
    throw std::invalid_argument("invalid size '" + raw + "': sizes must not be negative; " + forms);
  // The number: digits, optionally one '.' and more digits ("1..2GiB" and "1.2.3" are rejected).
  std::size_t pos = 0, dots = 0, digits = 0;
  while (pos < text.size() && (std::isdigit(static_cast<unsigned char>(text[pos])) || text[pos] == '.')) {
    if (text[pos] == '.') ++dots;
    else ++digits;
    ++pos;
  }
  const std::string number_text = text.substr(0, pos);
  if (digits == 0 || dots > 1 || number_text.front() == '.' || number_text.back() == '.')
    throw std::invalid_argument("invalid size '" + raw + "': " + forms);
  const std::string unit = trim(text.substr(pos));
  double scale = 1;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "KiB" || unit == "K") scale = 1024.0;
  else if (unit == "MiB" || unit == "M") scale = 1024.0 * 1024;
  else if (unit == "GiB" || unit == "G") scale = 1024.0 * 1024 * 1024;
  else if (unit == "TiB" || unit == "T") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "KB" || unit == "kB") scale = 1e3;
  else if (unit == "MB") scale = 1e6;
  else if (unit == "GB") scale = 1e9;
  else if (unit == "TB") scale = 1e12;
  else throw std::invalid_argument("invalid size unit '" + unit + "' in '" + raw + "': " + forms);
  const std::string too_large = "invalid size '" + raw + "': too large (sizes must be below 2^63 bytes = 8 EiB)";
  if (dots == 0 && scale == 1) {  // plain byte counts exactly, without a detour through double
    if (number_text.size() > 19) throw std::invalid_argument(too_large);
    const unsigned long long v = std::stoull(number_text);
    if (v > static_cast<unsigned long long>(std::numeric_limits<std::int64_t>::max()))
      throw std::invalid_argument(too_large);
    return static_cast<std::size_t>(v);
  }
  const double bytes = std::stod(number_text) * scale;
  if (!(bytes < kSizeLimit)) throw std::invalid_argument(too_large);
  if (bytes != std::floor(bytes))
    throw std::invalid_argument("invalid size '" + raw + "': not a whole number of bytes");
  return static_cast<std::size_t>(bytes);
}

bool parse_bool(const std::string& raw, const std::string& what) {
  const std::string v = lower(trim(raw));
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw std::invalid_argument("invalid " + what + " '" + raw +
                              "': write true or false (also accepted: 1/0, yes/no, on/off)");
}

std::size_t parse_count(const std::string& raw, const std::string& what) {
  const std::string v = trim(raw);
  if (!all_digits(v) || v.size() > 18)
    throw std::invalid_argument("invalid " + what + " '" + raw + "': write a non-negative whole number such as 0 or 1000");
  return static_cast<std::size_t>(std::stoull(v));
}

double parse_fraction(const std::string& raw, const std::string& what) {
  std::string v = trim(raw);
  const bool percent = !v.empty() && v.back() == '%';
  if (percent) v = trim(v.substr(0, v.size() - 1));
  std::size_t dots = 0, digits = 0;
  for (char ch : v) {
    if (ch == '.') ++dots;
    else if (std::isdigit(static_cast<unsigned char>(ch))) ++digits;
    else digits = 0, dots = 2;  // anything else: rejected below
  }
  if (digits == 0 || dots > 1 || v.size() > 24)
    throw std::invalid_argument("invalid " + what + " '" + raw + "': write a non-negative number such as 0.125 or 12.5%");
  return std::stod(v) / (percent ? 100.0 : 1.0);
}

void validate(const Config& c) {
  if (c.backend != "cuda" && c.backend != "host" && c.backend != "sim")
    throw std::invalid_argument("unknown backend '" + c.backend + "': choose 'cuda', 'host' or 'sim'");
  if (c.capacity > kMaxCapacity)
    throw std::invalid_argument("capacity " + format_size(c.capacity) + " (" + std::to_string(c.capacity) +
                                " bytes) is more than vmalloc supports (" + format_size(kMaxCapacity) +
                                "): give the device's memory or less, e.g. \"80GiB\"");
  if (c.chunk_size == 0)
    throw std::invalid_argument("chunk_size must be positive: use a multiple of the backend's granularity, e.g. \"2MiB\"");
  if (c.chunk_size > kMaxCapacity)
    throw std::invalid_argument("chunk_size " + format_size(c.chunk_size) + " is more than vmalloc supports (" +
                                format_size(kMaxCapacity) + ")");
  if (c.small_max > c.chunk_size)
    throw std::invalid_argument("small_max (" + format_size(c.small_max) + ") must not exceed chunk_size (" +
                                format_size(c.chunk_size) + "): small blocks are carved from one chunk");
  if (c.block_size != 0 && (c.block_size < c.chunk_size || c.block_size % c.chunk_size != 0)) {
    const std::size_t below = c.block_size / c.chunk_size * c.chunk_size, above = below + c.chunk_size;
    throw std::invalid_argument("block_size " + format_size(c.block_size) + " is not a multiple of chunk_size (" +
                                format_size(c.chunk_size) + "): use a multiple of it (the nearest: " +
                                (below ? format_size(below) + " or " : "") + format_size(above) +
                                "), chunk_size itself for one chunk per block, or 0 for the default (" +
                                format_size(kDefaultBlockBytes) + ")");
  }
  if (c.block_size > kMaxCapacity)
    throw std::invalid_argument("block_size " + format_size(c.block_size) + " is more than vmalloc supports (" +
                                format_size(kMaxCapacity) + ")");
  if (!(c.growth_slack >= 0 && c.growth_slack <= kMaxGrowthSlack))
    throw std::invalid_argument("growth_slack " + std::to_string(c.growth_slack) + " is out of range: a fraction from 0 "
                                "(never grow past the high-water mark of chunks in use) to " +
                                std::to_string(static_cast<int>(kMaxGrowthSlack)) + " (or eager_growth=true)");
  if (c.mid_chunks > kMaxMidChunks)
    throw std::invalid_argument("mid_chunks " + std::to_string(c.mid_chunks) + " is more than " +
                                std::to_string(kMaxMidChunks) + ": mid-size slabs are that many chunks, and one block in "
                                "use holds them all (0 rounds mid-size requests to whole chunks)");
  if (c.devices < 1 || c.devices > kMaxDevices)
    throw std::invalid_argument("devices must be between 1 and " + std::to_string(kMaxDevices) + ", not " +
                                std::to_string(c.devices));
  if (c.device < 0 || c.device >= kMaxDevices)
    throw std::invalid_argument("device " + std::to_string(c.device) + " is out of range: device indices are 0 to " +
                                std::to_string(kMaxDevices - 1));
}

Config parse_conf(const std::string& text, Config c) {
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    const std::string item = trim(text.substr(start, end - start));
    start = end + 1;
    if (item.empty()) continue;
    const std::size_t eq = item.find('=');
    if (eq == std::string::npos)
      throw std::invalid_argument("VMALLOC_CONF item '" + item + "' is not key=value (e.g. capacity=16GiB)");
    const std::string key = trim(item.substr(0, eq));
    const std::string value = trim(item.substr(eq + 1));
    auto small_int = [&](const std::string& what) {
      const std::size_t v = parse_count(value, "VMALLOC_CONF " + what);
      if (v > static_cast<std::size_t>(kMaxDevices))
        throw std::invalid_argument("invalid VMALLOC_CONF " + what + " '" + value + "': at most " +
                                    std::to_string(kMaxDevices));
      return static_cast<int>(v);
    };
    if (key == "backend") c.backend = value;
    else if (key == "capacity") c.capacity = parse_size(value);
    else if (key == "chunk_size") c.chunk_size = parse_size(value);
    else if (key == "small_max") c.small_max = parse_size(value);
    else if (key == "block_size") c.block_size = parse_size(value);
    else if (key == "history") c.history = parse_count(value, "VMALLOC_CONF history (trace entries)");
    else if (key == "device") c.device = small_int("device");
    else if (key == "devices") c.devices = small_int("devices");
    else if (key == "eager_growth") c.eager_growth = parse_bool(value, "VMALLOC_CONF eager_growth");
    else if (key == "step_plan") c.step_plan = parse_bool(value, "VMALLOC_CONF step_plan");
    else if (key == "growth_slack") c.growth_slack = parse_fraction(value, "VMALLOC_CONF growth_slack");
    else if (key == "mid_chunks") c.mid_chunks = parse_count(value, "VMALLOC_CONF mid_chunks");
    else
      throw std::invalid_argument("unknown VMALLOC_CONF key '" + key +
                                  "': known keys are backend, capacity, chunk_size, small_max, block_size, history, "
                                  "device, devices, eager_growth, growth_slack, mid_chunks, step_plan");
  }
  validate(c);
  return c;
}

std::string format_size(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  char buf[64];
  if (u == 0) std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace vmalloc
