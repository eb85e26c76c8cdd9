// Backend: the small contract the allocator core needs from a memory system.
//
// Three implementations share it (see backend_*.cpp): the CUDA driver's virtual memory management, the
// same contract on host memory (memfd chunks mmap'ed into a PROT_NONE reservation), and a bookkeeping-only
// simulator. Everything above this line is identical for all three, so the allocator is tested in full on
// machines without a GPU.
//
// Note [Backend failures]
// Every call that can fail throws BackendError, whose message names the backend, the call (the driver entry
// point or system call) and the system's reason (the CUresult's name and text, or errno's). The allocator
// gives each call a strong guarantee (Note [Failure guarantees] in allocator.cpp), so a call either happened
// or did not: a backend must not half-do one (a failed map leaves nothing mapped, a failed unmap leaves the
// chunk where it was, as far as the system lets the backend know).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

// Exported from libvmalloc.so whatever the including module's default visibility (pybind11 modules and the
// torch adapter build with -fvisibility=hidden), so that exceptions thrown in the core are caught, and
// dynamic_casts succeed, in the modules that use it.
#define VMALLOC_API __attribute__((visibility("default")))

namespace vmalloc {

struct Config;

using Stream = std::uintptr_t;       // a cudaStream_t / CUstream value; 0 is the legacy default stream
using ChunkHandle = std::uint64_t;   // a physical allocation of one or more chunks, a "block" (Note [Blocks
                                     // and slices] in allocator.cpp): CUmemGenericAllocationHandle, memfd
                                     // offset, sim id
using Event = std::uint64_t;         // a recorded stream position; 0 means "nothing to wait for"

// A backend call failed. `call` is the entry point or system call that failed (e.g. "cuMemMap", "mmap").
struct VMALLOC_API BackendError : std::runtime_error {
  BackendError(std::string call_name, const std::string& message)
      : std::runtime_error(message), call(std::move(call_name)) {}
  std::string call;
};

// Thrown by map when the process has no memory mapping left to give (the host backend's vm.max_map_count:
// Note [Host mapping limit] in backend_host.cpp). Unmapping cached ranges makes mappings free again (Note
// [Mappings back before a refusal] in allocator.cpp).
struct VMALLOC_API BackendMappingLimit : BackendError {
  using BackendError::BackendError;
};

// Thrown by create_chunk when the memory system itself has no physical memory left (as opposed to the
// allocator's own capacity, which the core enforces before it asks).
struct VMALLOC_API BackendOutOfMemory : BackendError {
  using BackendError::BackendError;
};

class VMALLOC_API Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* name() const = 0;
  // Chunk sizes and mapping offsets must be multiples of this.
  virtual std::size_t granularity() const = 0;
  // Physical memory the device has in total (for the default capacity).
  virtual std::size_t total_memory() const = 0;
  // Whether addresses returned by the allocator can be dereferenced by this process (host backend only).
  virtual bool host_accessible() const { return false; }

  virtual std::uintptr_t reserve(std::size_t bytes) = 0;
  virtual void release_reservation(std::uintptr_t base, std::size_t bytes) = 0;
  // A physical allocation (a block) of `bytes`, a multiple of the chunk size.
  virtual ChunkHandle create_chunk(std::size_t bytes) = 0;
  virtual void release_chunk(ChunkHandle chunk, std::size_t bytes) = 0;
  // Maps bytes [offset, offset + bytes) of the block at addr (inside a reservation, not mapped): one mapping.
  // A block may be mapped at several places at once. The mapping is not accessible until set_access.
  virtual void map(std::uintptr_t addr, std::size_t bytes, ChunkHandle chunk, std::size_t offset) = 0;
  // Unmaps exactly one whole mapping made by map().
  virtual void unmap(std::uintptr_t addr, std::size_t bytes) = 0;
  // Whether map() accepts a nonzero offset. When not, the allocator makes every block one chunk.
  virtual bool maps_at_offsets() { return true; }
  // Makes [addr, addr + bytes), a run of mapped chunks, readable and writable by the device.
  virtual void set_access(std::uintptr_t addr, std::size_t bytes) = 0;

  // Stream ordering. Backends without asynchronous work return 0 from record_event and ignore the rest.
  virtual Event record_event(Stream) { return 0; }
  virtual bool event_done(Event) { return true; }
  virtual void event_synchronize(Event) {}
  virtual void stream_wait(Stream, Event) {}
  virtual void release_event(Event) noexcept {}
  // Whether work submitted to the stream is being captured into a CUDA graph right now
  // (Note [Graph capture] in allocator.cpp). Backends without graphs never capture.
  virtual bool capturing(Stream) { return false; }
};

std::unique_ptr<Backend> make_cuda_backend(int device);
std::unique_ptr<Backend> make_host_backend();
std::unique_ptr<Backend> make_sim_backend(std::size_t granularity);
// "cuda" | "host" | "sim"; throws std::invalid_argument naming the choices otherwise.
std::unique_ptr<Backend> make_backend(const std::string& name, int device);

// How many devices the backend of `config` has: the driver's count for cuda (cuDeviceGetCount; throws
// std::runtime_error when the driver cannot be loaded), config.devices for host and sim.
int device_count(const Config& config);
int cuda_device_count();
// Throws std::invalid_argument naming the count unless 0 <= device < device_count(config).
void check_device(const Config& config, int device);

}  // namespace vmalloc
