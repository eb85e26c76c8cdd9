// Host backend: the VMM contract on ordinary memory.
//
// Note [Host backend]
// Physical chunks are slots of one memfd; a chunk is "mapped" by mmap'ing its slot MAP_SHARED|MAP_FIXED
// into a PROT_NONE reservation, so a chunk unmapped from one range and mapped into another really carries
// its bytes along, exactly as a cuMemCreate handle would. set_access is an mprotect, so code that forgets
// it faults here as it would on a GPU. Released chunks give their pages back with a punched hole.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "backend.h"

namespace vmalloc {
namespace {

[[noreturn]] void fail(const char* what) {
  throw std::runtime_error(std::string("vmalloc host backend: ") + what + ": " + std::strerror(errno));
}

class HostBackend final : public Backend {
 public:
  HostBackend() {
    fd_ = memfd_create("vmalloc-host-chunks", MFD_CLOEXEC);
    if (fd_ < 0) fail("memfd_create");
  }
  ~HostBackend() override { ::close(fd_); }

  const char* name() const override { return "host"; }
  std::size_t granularity() const override { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }
  std::size_t total_memory() const override {
    return static_cast<std::size_t>(sysconf(_SC_PHYS_PAGES)) * granularity();
  }
  bool host_accessible() const override { return true; }

  std::uintptr_t reserve(std::size_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fail("reserving address space");
    return reinterpret_cast<std::uintptr_t>(p);
  }
  void release_reservation(std::uintptr_t base, std::size_t bytes) override {
    munmap(reinterpret_cast<void*>(base), bytes);
  }

  ChunkHandle create_chunk(std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slots = free_slots_[bytes];
    off_t offset;
    if (!slots.empty()) {
      offset = slots.back();
      slots.pop_back();
    } else {
      offset = end_;
      if (ftruncate(fd_, end_ + static_cast<off_t>(bytes)) != 0) {
        if (errno == ENOSPC || errno == ENOMEM) throw BackendOutOfMemory("host backend: memfd is full");
        fail("growing the chunk file");
      }
      end_ += static_cast<off_t>(bytes);
    }
    return static_cast<ChunkHandle>(offset);
  }

  void release_chunk(ChunkHandle chunk, std::size_t bytes) override {
    const auto offset = static_cast<off_t>(chunk);
    // Give the pages back now; the slot (file offset) is kept for the next chunk of this size.
    if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, static_cast<off_t>(bytes)) != 0)
      fail("punching a hole for a released chunk");
    std::lock_guard<std::mutex> lock(mu_);
    free_slots_[bytes].push_back(offset);
  }

  void map(std::uintptr_t addr, std::size_t bytes, ChunkHandle chunk) override {
    void* p = mmap(reinterpret_cast<void*>(addr), bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, fd_,
                   static_cast<off_t>(chunk));
    if (p == MAP_FAILED) fail("mapping a chunk");
  }

  void unmap(std::uintptr_t addr, std::size_t bytes) override {
    // Put the PROT_NONE reservation back rather than munmap, which would open a hole another mmap could take.
    void* p = mmap(reinterpret_cast<void*>(addr), bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fail("unmapping a chunk");
  }

  void set_access(std::uintptr_t addr, std::size_t bytes) override {
    if (mprotect(reinterpret_cast<void*>(addr), bytes, PROT_READ | PROT_WRITE) != 0) fail("set_access");
  }

 private:
  int fd_ = -1;
  std::mutex mu_;
  off_t end_ = 0;
  std::map<std::size_t, std::vector<off_t>> free_slots_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend() { return std::make_unique<HostBackend>(); }

}  // namespace vmalloc
