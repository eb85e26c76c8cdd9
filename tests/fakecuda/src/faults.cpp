#include "faults.h"

#include <cctype>
#include <cstdlib>

#include "entry_points.h"
#include "errors.h"

namespace fakecuda {
namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  parts.push_back(cur);
  return parts;
}

std::string trim(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

bool all_digits(const std::string& s) {
  if (s.empty() || s.size() > 18) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

const char* kSyntax = "write ENTRY:N:RESULT[:once] items separated by commas, e.g. "
                      "cuMemCreate:3:CUDA_ERROR_OUT_OF_MEMORY,cuMemMap:5:CUDA_ERROR_INVALID_VALUE:once";

}  // namespace

std::string parse_fault_spec(const std::string& spec, std::vector<FaultRule>& out) {
  std::vector<FaultRule> rules;
  if (trim(spec).empty()) {
    out.clear();
    return "";
  }
  for (const std::string& raw : split(spec, ',')) {
    const std::string item = trim(raw);
    const std::string where = "fault item '" + item + "': ";
    const std::vector<std::string> f = split(item, ':');
    if (f.size() != 3 && f.size() != 4) return where + "expected 3 or 4 fields separated by ':'; " + kSyntax;
    FaultRule r;
    r.entry = trim(f[0]);
    if (!is_entry_point(r.entry))
      return where + "'" + r.entry + "' is not an entry point of the emulated driver; use one of: " +
             entry_point_list();
    const std::string n = trim(f[1]);
    if (!all_digits(n) || std::strtoull(n.c_str(), nullptr, 10) == 0)
      return where + "the call number '" + n + "' must be a whole number from 1 (the first call)";
    r.nth = std::strtoull(n.c_str(), nullptr, 10);
    const std::string result = trim(f[2]);
    if (all_digits(result)) {
      r.result = static_cast<CUresult>(std::strtol(result.c_str(), nullptr, 10));
    } else if (!error_from_name(result.c_str(), r.result)) {
      return where + "'" + result + "' is not a CUresult name such as CUDA_ERROR_OUT_OF_MEMORY (or a number)";
    }
    if (r.result == CUDA_SUCCESS) return where + "injecting CUDA_SUCCESS is not a fault; name an error";
    r.once = false;
    if (f.size() == 4) {
      if (trim(f[3]) != "once") return where + "the 4th field may only be 'once', not '" + trim(f[3]) + "'";
      r.once = true;
    }
    rules.push_back(r);
  }
  out = std::move(rules);
  return "";
}

CUresult Faults::on_call(const char* entry) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::uint64_t n = ++calls_[entry];
  for (const FaultRule& r : rules_) {
    if (r.entry != entry) continue;
    if (r.once ? n == r.nth : n >= r.nth) return r.result;
  }
  return CUDA_SUCCESS;
}

std::string Faults::set(const std::string& spec) {
  std::vector<FaultRule> rules;
  std::string error = parse_fault_spec(spec, rules);
  if (!error.empty()) return error;
  std::lock_guard<std::mutex> lock(mu_);
  rules_ = std::move(rules);
  calls_.clear();
  return "";
}

std::uint64_t Faults::calls(const std::string& entry) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(entry);
  return it == calls_.end() ? 0 : it->second;
}

}  // namespace fakecuda
