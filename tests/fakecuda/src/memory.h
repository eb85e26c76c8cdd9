// Device memory on the host: the driver's virtual memory management (reserve, create, map, set access, unmap,
// release, free) with the driver's rules checked on every call.
//
// Note [Device memory on the host]
// Physical allocations are extents of one memfd (one file, so thousands of allocations cost no file
// descriptors). A reservation is PROT_NONE address space; cuMemMap mmaps the allocation's extent there
// MAP_SHARED|MAP_FIXED, still PROT_NONE; cuMemSetAccess mprotects it; cuMemUnmap puts PROT_NONE anonymous
// memory back (not munmap, which would open a hole another mmap could take). So an allocation unmapped from
// one address and mapped at another carries its bytes along, a test can read and write "device" memory at
// the CUdeviceptr through ctypes, and touching memory before cuMemSetAccess faults as it would on a GPU.
// Released allocations give their pages back by punching a hole in the file.
//
// Note [Mapping at an offset]
// cuMemMap(ptr, size, offset, handle) maps bytes [offset, offset + size) of the allocation: offset and size
// multiples of the granularity, offset + size at most the allocation's size (cuda.h's "must be less than"
// cannot be meant strictly: it would forbid mapping a whole allocation at offset 0). One allocation may be
// mapped at several places at once, its parts or the same bytes twice (the programming guide's "virtual
// aliasing"); its memory goes when it is released and its last mapping is unmapped. cuda.h's parameter
// note also says "offset: currently must be zero", against its own description: FAKECUDA_MAP_OFFSETS=0
// emulates a driver that keeps that rule, so that the fallback of a caller (vmalloc probes it) is tested.
//
// Every method expects the driver's lock to be held (see driver.h).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common.h"

namespace fakecuda {

class Memory {
 public:
  explicit Memory(const Config& config);
  ~Memory();
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  Status granularity_for(const CUmemAllocationProp* prop, std::size_t* out) const;
  Status reserve(std::size_t size, std::size_t alignment, CUdeviceptr hint, unsigned long long flags,
                 CUdeviceptr* out);
  Status free_reservation(CUdeviceptr ptr, std::size_t size);
  Status create(std::size_t size, const CUmemAllocationProp* prop, unsigned long long flags,
                CUmemGenericAllocationHandle* out);
  // The memory itself goes when its last mapping does (the documented order); `freed` gets its id if now.
  Status release(CUmemGenericAllocationHandle handle, std::vector<std::uint64_t>* freed);
  Status map(CUdeviceptr ptr, std::size_t size, std::size_t offset, CUmemGenericAllocationHandle handle,
             unsigned long long flags);
  // `freed` gets the ids of released allocations whose last mapping this was.
  Status unmap(CUdeviceptr ptr, std::size_t size, std::vector<std::uint64_t>* freed);
  Status set_access(CUdeviceptr ptr, std::size_t size, const CUmemAccessDesc* desc, std::size_t count);
  Status get_access(unsigned long long* flags, const CUmemLocation* location, CUdeviceptr ptr) const;

  // Whether `device` may read (or write) all of [addr, addr + n) now; if not, why.
  Status check_access(std::uintptr_t addr, std::size_t n, int device, bool write) const;
  // Ids of the allocations mapped in [addr, addr + n) (what a work item touches).
  std::vector<std::uint64_t> allocations_in(std::uintptr_t addr, std::size_t n) const;
  // The mapping holding `ptr`: false if none. For cuPointerGetAttribute.
  bool find_mapping(std::uintptr_t ptr, std::uintptr_t* start, std::size_t* size, int* device) const;

  std::size_t used(int device) const { return used_.at(static_cast<std::size_t>(device)); }
  std::size_t total() const { return config_.total_mem; }
  std::size_t live_allocations() const { return allocations_.size(); }
  std::size_t live_mappings() const { return mappings_.size(); }
  std::size_t live_reservations() const { return reservations_.size(); }

 private:
  struct Allocation {
    std::uint64_t id;
    std::size_t size;
    int device;
    off_t offset;  // extent of the memfd
    bool released = false;
    int mappings = 0;
  };
  struct Mapping {
    std::size_t size;
    std::size_t offset;  // into the allocation
    CUmemGenericAllocationHandle handle;
    std::vector<unsigned char> access;  // CUmemAccess_flags per device
  };

  // Extents of the memfd: first fit over freed extents, else the file grows (it is sparse).
  off_t take_extent(std::size_t size);
  void give_extent(off_t offset, std::size_t size);
  void destroy(CUmemGenericAllocationHandle handle, std::vector<std::uint64_t>* freed);
  // The mappings that exactly tile [ptr, ptr + size), or why they do not.
  Status whole_mappings(std::uintptr_t ptr, std::size_t size, std::vector<std::uintptr_t>* starts) const;

  const Config& config_;
  int fd_ = -1;
  off_t file_end_ = 0;
  std::map<off_t, std::size_t> free_extents_;
  std::map<std::uintptr_t, std::size_t> reservations_;  // base -> size
  std::map<std::uintptr_t, Mapping> mappings_;          // start -> mapping
  std::unordered_map<CUmemGenericAllocationHandle, Allocation> allocations_;
  std::unordered_set<CUmemGenericAllocationHandle> dead_handles_;  // to tell "released twice" from "unknown"
  CUmemGenericAllocationHandle next_handle_ = 0x100001;
  std::uint64_t next_id_ = 1;
  std::vector<std::size_t> used_;
};

}  // namespace fakecuda
