// Backend: the small contract the allocator core needs from a memory system.
//
// Three implementations share it (see backend_*.cpp): the CUDA driver's virtual memory management, the
// same contract on host memory (memfd chunks mmap'ed into a PROT_NONE reservation), and a bookkeeping-only
// simulator. Everything above this line is identical for all three, so the allocator is tested in full on
// machines without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

namespace vmalloc {

using Stream = std::uintptr_t;       // a cudaStream_t / CUstream value; 0 is the legacy default stream
using ChunkHandle = std::uint64_t;   // a physical chunk (CUmemGenericAllocationHandle, memfd slot, sim id)
using Event = std::uint64_t;         // a recorded stream position; 0 means "nothing to wait for"

// Thrown by create_chunk when the memory system itself has no physical memory left (as opposed to the
// allocator's own capacity, which the core enforces before it asks).
struct BackendOutOfMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Backend {
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
  virtual ChunkHandle create_chunk(std::size_t bytes) = 0;
  virtual void release_chunk(ChunkHandle chunk, std::size_t bytes) = 0;
  // Maps one whole chunk at addr (inside a reservation). The mapping is not accessible until set_access.
  virtual void map(std::uintptr_t addr, std::size_t bytes, ChunkHandle chunk) = 0;
  virtual void unmap(std::uintptr_t addr, std::size_t bytes) = 0;
  // Makes [addr, addr + bytes), a run of mapped chunks, readable and writable by the device.
  virtual void set_access(std::uintptr_t addr, std::size_t bytes) = 0;

  // Stream ordering. Backends without asynchronous work return 0 from record_event and ignore the rest.
  virtual Event record_event(Stream) { return 0; }
  virtual bool event_done(Event) { return true; }
  virtual void event_synchronize(Event) {}
  virtual void stream_wait(Stream, Event) {}
  virtual void release_event(Event) {}
};

std::unique_ptr<Backend> make_cuda_backend(int device);
std::unique_ptr<Backend> make_host_backend();
std::unique_ptr<Backend> make_sim_backend(std::size_t granularity);
// "cuda" | "host" | "sim"; throws std::invalid_argument naming the choices otherwise.
std::unique_ptr<Backend> make_backend(const std::string& name, int device);

}  // namespace vmalloc
