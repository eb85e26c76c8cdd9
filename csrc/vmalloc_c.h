/* vmalloc's C entry points (libvmalloc.so).
 *
 * Two families (Note [C entry points] in c_api.cpp):
 *   - torch's hooks (vmalloc_malloc, vmalloc_empty_cache, vmalloc_init, vmalloc_set_memory_fraction,
 *     vmalloc_record_stream) report errors as C++ exceptions (std::exception subclasses; vmalloc::OutOfMemory
 *     for out-of-memory), which torch turns into Python exceptions. Only C++ callers may use them.
 *   - vmalloc_try_* never throw and never end the process: they return NULL / -1 and leave a message for
 *     vmalloc_last_error(). vmalloc_free never throws either (it reports on stderr and in vmalloc_last_error).
 * vmalloc_last_error() is per thread: the message of the last failed call on this thread, "" after a call
 * that succeeded; valid until the next vmalloc call on the thread.
 */
#ifndef VMALLOC_C_H_
#define VMALLOC_C_H_

#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

void* vmalloc_malloc(ssize_t size, int device, void* stream);
void vmalloc_free(void* ptr, size_t size, int device, void* stream);
void vmalloc_empty_cache(void);
void vmalloc_init(int device_count);
void vmalloc_set_memory_fraction(double fraction, int device);
void vmalloc_record_stream(void* ptr, void* stream);

void* vmalloc_try_malloc(ssize_t size, int device, void* stream);
int vmalloc_try_free(void* ptr, int device);
int vmalloc_try_empty_cache(void);
int vmalloc_try_init(int device_count);
int vmalloc_try_set_memory_fraction(double fraction, int device);
int vmalloc_try_record_stream(void* ptr, void* stream);
const char* vmalloc_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* VMALLOC_C_H_ */
