// The core's C entry points that the torch adapter calls (defined in csrc/c_api.cpp and
// csrc/c_api_adapter.cpp, exported by libvmalloc.so). Plain C types only: see
// Note [A C boundary between the core and the torch adapter].
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// 0: *out is the allocation; 1: out of memory; 2: another error. err receives the explanation.
int vmalloc_adapter_malloc(void** out, size_t size, int device, void* stream, int call_handler, char* err,
                           size_t errcap);
// Fills values[i] with statistic names[i]; returns the number found, -1 if the device has no arena yet.
int vmalloc_adapter_stats(int device, const char* const* names, int64_t* values, int n);
void vmalloc_adapter_reset_peak(int device);
// *largest = the largest request the arena can serve now (Note [Workspace offers] in allocator_inspect.cpp);
// -1 if the device has no arena yet.
int vmalloc_adapter_cache_info(int device, size_t device_free, size_t* largest);
// *fraction = the arena's capacity / the device's memory (the arena is made if needed). 0, or 2 with err set.
int vmalloc_adapter_memory_fraction(int device, double* fraction, char* err, size_t errcap);

// torch's CUDAPluggableAllocator hooks (csrc/c_api.cpp). free never throws; the others may throw a
// std::exception, which the adapter turns into a torch error.
void vmalloc_free(void* ptr, size_t size, int device, void* stream);
void vmalloc_empty_cache(void);
void vmalloc_set_memory_fraction(double fraction, int device);
void vmalloc_record_stream(void* ptr, void* stream);

#ifdef __cplusplus
}
#endif
