// CUresult names and descriptions.
#pragma once

#include <cuda.h>

namespace fakecuda {

const char* error_name(CUresult code);  // "CUDA_ERROR_OUT_OF_MEMORY", or nullptr for an unknown code
const char* error_text(CUresult code);  // "out of memory", or nullptr
bool error_from_name(const char* name, CUresult& out);

}  // namespace fakecuda
