// Sim backend: addresses and handles without memory, so paper-scale traces (100+ GB) replay on a laptop
// through exactly the allocator logic that runs on a GPU.
#include <string>

#include "backend.h"

namespace vmalloc {
namespace {

class SimBackend final : public Backend {
 public:
  explicit SimBackend(std::size_t granularity) : granularity_(granularity) {}

  const char* name() const override { return "sim"; }
  std::size_t granularity() const override { return granularity_; }
  // The default capacity of a simulated device: an 80 GiB accelerator (pass capacity= to model another).
  std::size_t total_memory() const override { return std::size_t{80} << 30; }

  std::uintptr_t reserve(std::size_t bytes) override {
    // Bump-allocate addresses far from anything real; leave a gap so ranges never touch across reservations.
    if (bytes > kEndVa - next_va_ || round_up(bytes) + granularity_ > kEndVa - next_va_)
      throw BackendError("reserve", "vmalloc sim backend: reserve failed: the simulated address space (2^44 to 2^60) "
                                    "cannot hold another " + std::to_string(bytes) + " bytes");
    const std::uintptr_t base = next_va_;
    next_va_ += round_up(bytes) + granularity_;
    return base;
  }
  void release_reservation(std::uintptr_t, std::size_t) override {}
  ChunkHandle create_chunk(std::size_t) override { return ++next_chunk_; }
  void release_chunk(ChunkHandle, std::size_t) override {}
  void map(std::uintptr_t, std::size_t, ChunkHandle, std::size_t) override {}
  void unmap(std::uintptr_t, std::size_t) override {}
  void set_access(std::uintptr_t, std::size_t) override {}

 private:
  std::size_t round_up(std::size_t n) const { return (n + granularity_ - 1) / granularity_ * granularity_; }

  static constexpr std::uintptr_t kEndVa = std::uintptr_t{1} << 60;
  std::size_t granularity_;
  std::uintptr_t next_va_ = std::uintptr_t{1} << 44;
  ChunkHandle next_chunk_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_sim_backend(std::size_t granularity) {
  return std::make_unique<SimBackend>(granularity);
}

}  // namespace vmalloc
