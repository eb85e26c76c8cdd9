// Host backend: the VMM contract on ordinary memory.
//
// Note [Host backend]
// Physical blocks are slots of one memfd; a run of a block's chunks is "mapped" by mmap'ing that part of its
// slot MAP_SHARED|MAP_FIXED into a PROT_NONE reservation (one mmap per run: one kernel mapping, not one per
// chunk), so a chunk unmapped from one range and mapped into another really carries its bytes along, exactly
// as a cuMemCreate handle mapped at an offset would. set_access is an mprotect, so code that forgets
// it faults here as it would on a GPU. Released chunks give their pages back with a punched hole.
//
// Note [Host mapping limit]
// Every mapped run whose neighbours are not the next offsets of the memfd is a mapping of its own, and the
// kernel caps a process's mappings (vm.max_map_count, 65530 by default). A run of a block's chunks is one
// mmap (Note [Blocks and slices] in allocator_blocks.cpp), but stitching chunks of many blocks into one range
// costs one mapping per run: 4 GiB of 64 KiB chunks each from its own block needs more mappings than the
// default allows, and cannot succeed. What the backend does (detail/map_budget.h):
//   - it never takes the process into the last mappings (1/16 of the limit): a map or a splitting unmap
//     there fails with an error that names the count, the limit and the ways out (a larger chunk_size, a
//     higher vm.max_map_count), so the interpreter and libraries can still mmap after the failure;
//   - unmapping a chunk that is a whole mapping by itself is always allowed (and at the kernel's limit
//     done by munmap first, see unmap): an arena that met the limit frees its way back below it.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "backend.h"
#include "detail/map_budget.h"

namespace vmalloc {
namespace {

const char* errno_name(int e) {
  switch (e) {
    case ENOMEM: return "ENOMEM";
    case EINVAL: return "EINVAL";
    case ENOSPC: return "ENOSPC";
    case EBADF: return "EBADF";
    case EACCES: return "EACCES";
    case EAGAIN: return "EAGAIN";
    case EPERM: return "EPERM";
    case EFAULT: return "EFAULT";
    case EEXIST: return "EEXIST";
    case ENODEV: return "ENODEV";
    case EOVERFLOW: return "EOVERFLOW";
    case EFBIG: return "EFBIG";
    case EOPNOTSUPP: return "EOPNOTSUPP";
    default: return "errno";
  }
}

// Throws BackendError for the system call `call` (doing `what`) that failed with errno `err`; `extra` explains
// an ENOMEM further (the mapping limit).
[[noreturn]] void fail(const char* call, const std::string& what, int err, const std::string& extra = "") {
  throw BackendError(call, std::string("vmalloc host backend: ") + call + " (" + what + ") failed: " +
                               std::strerror(err) + " (" + errno_name(err) + " " + std::to_string(err) + ")" + extra);
}

class HostBackend final : public Backend {
 public:
  HostBackend() {
    fd_ = memfd_create("vmalloc-host-chunks", MFD_CLOEXEC);
    if (fd_ < 0) fail("memfd_create", "the chunk file", errno);
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
    if (p == MAP_FAILED) fail("mmap", "reserving " + std::to_string(bytes) + " bytes of address space", errno);
    return reinterpret_cast<std::uintptr_t>(p);
  }
  void release_reservation(std::uintptr_t base, std::size_t bytes) override {
    // Around any lost hole (see unmap): another mapping lives there now.
    std::uintptr_t from = base;
    const std::uintptr_t end = base + bytes;
    std::vector<std::pair<std::uintptr_t, std::size_t>> lost;
    {
      std::lock_guard<std::mutex> lock(mu_);
      lost.assign(lost_.lower_bound({base, 0}), lost_.lower_bound({end, 0}));
    }
    for (const auto& [addr, size] : lost) {
      if (addr > from && munmap(reinterpret_cast<void*>(from), addr - from) != 0)
        fail("munmap", "releasing a reservation", errno);
      from = addr + size;
    }
    if (end > from && munmap(reinterpret_cast<void*>(from), end - from) != 0)
      fail("munmap", "releasing a reservation", errno);
  }

  ChunkHandle create_chunk(std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slots = free_slots_[bytes];
    if (!slots.empty()) {
      const off_t offset = slots.back();
      slots.pop_back();
      return static_cast<ChunkHandle>(offset);
    }
    const off_t offset = end_;
    if (ftruncate(fd_, end_ + static_cast<off_t>(bytes)) != 0) {
      const int err = errno;
      if (err == ENOSPC || err == ENOMEM || err == EFBIG) {
        throw BackendOutOfMemory("ftruncate", std::string("vmalloc host backend: ftruncate (growing the chunk file) "
                                                          "failed: ") + std::strerror(err) + " (" + errno_name(err) + ")");
      }
      fail("ftruncate", "growing the chunk file", err);
    }
    end_ += static_cast<off_t>(bytes);
    return static_cast<ChunkHandle>(offset);
  }

  void release_chunk(ChunkHandle chunk, std::size_t bytes) override {
    const auto offset = static_cast<off_t>(chunk);
    // Give the pages back now; the slot (file offset) is kept for the next chunk of this size.
    if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, static_cast<off_t>(bytes)) != 0)
      fail("fallocate", "punching a hole for a released chunk", errno);
    std::lock_guard<std::mutex> lock(mu_);
    free_slots_[bytes].push_back(offset);
  }

  void map(std::uintptr_t addr, std::size_t bytes, ChunkHandle chunk, std::size_t offset) override {
    budget_.before_map("mapping a chunk");
    void* p = mmap(reinterpret_cast<void*>(addr), bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, fd_,
                   static_cast<off_t>(chunk + offset));
    if (p == MAP_FAILED) {
      const int err = errno;
      // A failed MAP_FIXED may have dropped the reservation there: put it back, so the range stays ours.
      reserve_at(addr, bytes);
      const std::string limit = err == ENOMEM ? budget_.diagnose() : "";
      if (!limit.empty())  // the kernel's own mapping limit: unmapping elsewhere would make room
        throw BackendMappingLimit("mmap", std::string("vmalloc host backend: mmap (mapping a chunk) failed: ") +
                                              std::strerror(err) + limit);
      fail("mmap", "mapping a chunk", err);
    }
  }

  void unmap(std::uintptr_t addr, std::size_t bytes) override {
    if (is_lost(addr, bytes))
      throw BackendError("mmap", "vmalloc host backend: unmap failed: the address was taken by another mapping "
                                 "after an earlier unmap at the mapping limit; it stays out of use");
    budget_.before_unmap(addr, bytes);
    // Put the PROT_NONE reservation back rather than munmap, which would open a hole another mmap could take.
    if (reserve_at(addr, bytes)) return;
    const int err = errno;
    // At the mapping limit (Note [Host mapping limit]) the kernel refuses any mmap, even one that would
    // merge away mappings; munmap still works when it frees a whole mapping. Unmap, then reserve the hole
    // again without replacing anything: if another thread's mmap took it meanwhile, the address is lost to
    // us (remembered, never touched again) rather than clobbered.
    if (err != ENOMEM || munmap(reinterpret_cast<void*>(addr), bytes) != 0)
      fail("mmap", "unmapping a chunk (PROT_NONE over it)", err, err == ENOMEM ? budget_.diagnose() : "");
    void* p = mmap(reinterpret_cast<void*>(addr), bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == reinterpret_cast<void*>(addr)) return;
    if (p != MAP_FAILED) munmap(p, bytes);  // a kernel without MAP_FIXED_NOREPLACE put it elsewhere
    {
      std::lock_guard<std::mutex> lock(mu_);
      lost_.emplace(addr, bytes);
    }
    throw BackendError("mmap", "vmalloc host backend: unmap at the mapping limit: the chunk is unmapped but its "
                               "address could not be reserved again; it stays out of use");
  }

  void set_access(std::uintptr_t addr, std::size_t bytes) override {
    if (mprotect(reinterpret_cast<void*>(addr), bytes, PROT_READ | PROT_WRITE) != 0) {
      const int err = errno;
      fail("mprotect", "set_access (read/write)", err, err == ENOMEM ? budget_.diagnose() : "");
    }
  }

 private:
  bool is_lost(std::uintptr_t addr, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = lost_.upper_bound({addr + bytes, 0});
    return it != lost_.begin() && std::prev(it)->first + std::prev(it)->second > addr;
  }
  static bool reserve_at(std::uintptr_t addr, std::size_t bytes) {
    return mmap(reinterpret_cast<void*>(addr), bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                -1, 0) != MAP_FAILED;
  }

  int fd_ = -1;
  detail::MapBudget budget_;
  std::mutex mu_;
  off_t end_ = 0;
  std::map<std::size_t, std::vector<off_t>> free_slots_;
  std::set<std::pair<std::uintptr_t, std::size_t>> lost_;  // unmapped addresses another mapping took
};

}  // namespace

std::unique_ptr<Backend> make_host_backend() { return std::make_unique<HostBackend>(); }

}  // namespace vmalloc
