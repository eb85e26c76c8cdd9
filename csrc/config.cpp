#include "config.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace vmalloc {
namespace {

std::string trim(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

}  // namespace

std::size_t parse_size(const std::string& raw) {
  const std::string text = trim(raw);
  const std::string forms = "expected a byte count such as 4096, \"512KiB\", \"2MiB\", \"1.5GiB\" or \"10MB\"";
  std::size_t pos = 0;
  while (pos < text.size() && (std::isdigit(static_cast<unsigned char>(text[pos])) || text[pos] == '.')) ++pos;
  if (pos == 0) throw std::invalid_argument("invalid size '" + raw + "': " + forms);
  double number = 0;
  try {
    number = std::stod(text.substr(0, pos));
  } catch (const std::exception&) {
    throw std::invalid_argument("invalid size '" + raw + "': " + forms);
  }
  std::string unit = trim(text.substr(pos));
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
  const double bytes = number * scale;
  if (bytes != std::floor(bytes) || bytes > 9.0e18)
    throw std::invalid_argument("invalid size '" + raw + "': not a whole number of bytes");
  return static_cast<std::size_t>(bytes);
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
      throw std::invalid_argument("VMALLOC_CONF item '" + item + "' is not key=value");
    const std::string key = trim(item.substr(0, eq));
    const std::string value = trim(item.substr(eq + 1));
    if (key == "backend") c.backend = value;
    else if (key == "capacity") c.capacity = parse_size(value);
    else if (key == "chunk_size") c.chunk_size = parse_size(value);
    else if (key == "small_max") c.small_max = parse_size(value);
    else if (key == "history") c.history = parse_size(value);
    else if (key == "device") c.device = std::stoi(value);
    else if (key == "eager_growth") c.eager_growth = (value == "1" || value == "true" || value == "True");
    else
      throw std::invalid_argument("unknown VMALLOC_CONF key '" + key +
                                  "': known keys are backend, capacity, chunk_size, small_max, history, device, eager_growth");
  }
  return c;
}

std::string format_size(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[64];
  if (u == 0) std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace vmalloc
