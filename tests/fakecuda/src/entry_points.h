// The driver entry points the emulator provides (the table lives in driver_api.cpp, next to them).
#pragma once

#include <string>

namespace fakecuda {

bool is_entry_point(const std::string& name);  // a base name such as "cuMemCreate"
std::string entry_point_list();                // "cuInit, cuDriverGetVersion, ..."

}  // namespace fakecuda
