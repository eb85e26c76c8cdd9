#include "memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace fakecuda {
namespace {

bool multiple(std::size_t v, std::size_t g) { return v % g == 0; }

int host_prot(unsigned char flags) {
  if (flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) return PROT_READ | PROT_WRITE;
  if (flags == CU_MEM_ACCESS_FLAGS_PROT_READ) return PROT_READ;
  return PROT_NONE;
}

Status check_device_location(const CUmemLocation& loc, int devices, const char* what) {
  if (loc.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return fail(CUDA_ERROR_INVALID_VALUE,
                std::string(what) + " location type " + std::to_string(loc.type) +
                    " is not CU_MEM_LOCATION_TYPE_DEVICE (only device memory is emulated)");
  if (loc.id < 0 || loc.id >= devices)
    return fail(CUDA_ERROR_INVALID_DEVICE, std::string(what) + " device " + std::to_string(loc.id) +
                                               " does not exist (" + std::to_string(devices) + " device(s))");
  return success();
}

}  // namespace

Memory::Memory(const Config& config) : config_(config), used_(static_cast<std::size_t>(config.devices), 0) {
  fd_ = memfd_create("fakecuda-device-memory", MFD_CLOEXEC);
  if (fd_ < 0) {
    // Without it nothing can be emulated; say so loudly rather than fail later in a confusing way.
    std::fprintf(stderr, "fakecuda: memfd_create failed: %s\n", std::strerror(errno));
    std::abort();
  }
}

Memory::~Memory() {
  for (const auto& [base, size] : reservations_) munmap(reinterpret_cast<void*>(base), size);
  ::close(fd_);
}

Status Memory::granularity_for(const CUmemAllocationProp* prop, std::size_t* out) const {
  if (!prop || !out) return fail(CUDA_ERROR_INVALID_VALUE, "null prop or granularity pointer");
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
    return fail(CUDA_ERROR_INVALID_VALUE, "prop->type is not CU_MEM_ALLOCATION_TYPE_PINNED");
  Status s = check_device_location(prop->location, config_.devices, "prop->location");
  if (!s.ok()) return s;
  *out = config_.granularity;
  return success();
}

Status Memory::reserve(std::size_t size, std::size_t alignment, CUdeviceptr hint, unsigned long long flags,
                       CUdeviceptr* out) {
  const std::size_t g = config_.granularity;
  if (!out) return fail(CUDA_ERROR_INVALID_VALUE, "null ptr");
  if (flags != 0) return fail(CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  // The documentation asks for a multiple of the host page size; a reservation that is not a multiple of
  // the granularity cannot be mapped in full, so the stricter rule catches a real allocator bug earlier.
  if (size == 0 || !multiple(size, g))
    return fail(CUDA_ERROR_INVALID_VALUE,
                "size " + std::to_string(size) + " is not a positive multiple of the granularity " + std::to_string(g));
  if (alignment & (alignment - 1))
    return fail(CUDA_ERROR_INVALID_VALUE, "alignment " + std::to_string(alignment) + " is not a power of two or 0");
  const std::size_t align = std::max(alignment, g);
  // Over-reserve by the alignment, then trim both ends, so the base is aligned as a device address would be.
  const std::size_t span = size + align;
  void* p = mmap(reinterpret_cast<void*>(hint), span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return fail(CUDA_ERROR_OUT_OF_MEMORY, "no address space left: " + std::string(std::strerror(errno)));
  const auto raw = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t base = (raw + align - 1) / align * align;
  if (base > raw) munmap(p, base - raw);
  if (raw + span > base + size) munmap(reinterpret_cast<void*>(base + size), raw + span - (base + size));
  reservations_.emplace(base, size);
  *out = static_cast<CUdeviceptr>(base);
  return success();
}

Status Memory::free_reservation(CUdeviceptr ptr, std::size_t size) {
  auto it = reservations_.find(static_cast<std::uintptr_t>(ptr));
  if (it == reservations_.end())
    return fail(CUDA_ERROR_INVALID_VALUE, hex(ptr) + " is not the start of a reservation");
  if (it->second != size)
    return fail(CUDA_ERROR_INVALID_VALUE, "size " + std::to_string(size) + " differs from the reserved size " +
                                              std::to_string(it->second));
  auto m = mappings_.lower_bound(it->first);
  if (m != mappings_.end() && m->first < it->first + it->second)
    return fail(CUDA_ERROR_INVALID_VALUE, "the reservation still has mappings (the first at " + hex(m->first) +
                                              "): unmap them before freeing the address range");
  munmap(reinterpret_cast<void*>(it->first), it->second);
  reservations_.erase(it);
  return success();
}

off_t Memory::take_extent(std::size_t size) {
  for (auto it = free_extents_.begin(); it != free_extents_.end(); ++it) {
    if (it->second < size) continue;
    const off_t offset = it->first;
    const std::size_t rest = it->second - size;
    free_extents_.erase(it);
    if (rest) free_extents_.emplace(offset + static_cast<off_t>(size), rest);
    return offset;
  }
  if (ftruncate(fd_, file_end_ + static_cast<off_t>(size)) != 0) return -1;
  const off_t offset = file_end_;
  file_end_ += static_cast<off_t>(size);
  return offset;
}

void Memory::give_extent(off_t offset, std::size_t size) {
  // The pages go back now; the next allocation in this extent reads zeros, which a GPU does not promise
  // either way.
  fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, static_cast<off_t>(size));
  auto [it, inserted] = free_extents_.emplace(offset, size);
  (void)inserted;
  auto next = std::next(it);
  if (next != free_extents_.end() && it->first + static_cast<off_t>(it->second) == next->first) {
    it->second += next->second;
    free_extents_.erase(next);
  }
  if (it != free_extents_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + static_cast<off_t>(prev->second) == it->first) {
      prev->second += it->second;
      free_extents_.erase(it);
    }
  }
}

Status Memory::create(std::size_t size, const CUmemAllocationProp* prop, unsigned long long flags,
                      CUmemGenericAllocationHandle* out) {
  if (!out) return fail(CUDA_ERROR_INVALID_VALUE, "null handle pointer");
  if (flags != 0) return fail(CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  std::size_t g = 0;
  Status s = granularity_for(prop, &g);
  if (!s.ok()) return s;
  if (size == 0 || !multiple(size, g))
    return fail(CUDA_ERROR_INVALID_VALUE,
                "size " + std::to_string(size) + " is not a positive multiple of the granularity " + std::to_string(g));
  const int device = prop->location.id;
  std::size_t& used = used_[static_cast<std::size_t>(device)];
  if (size > config_.total_mem - used)
    return fail(CUDA_ERROR_OUT_OF_MEMORY, "device " + std::to_string(device) + " has " +
                                              std::to_string(config_.total_mem - used) + " of " +
                                              std::to_string(config_.total_mem) + " bytes free, " +
                                              std::to_string(size) + " asked");
  const off_t offset = take_extent(size);
  if (offset < 0) return fail(CUDA_ERROR_OUT_OF_MEMORY, "growing the memfd: " + std::string(std::strerror(errno)));
  used += size;
  const CUmemGenericAllocationHandle h = next_handle_++;
  allocations_.emplace(h, Allocation{next_id_++, size, device, offset});
  *out = h;
  return success();
}

void Memory::destroy(CUmemGenericAllocationHandle handle, std::vector<std::uint64_t>* freed) {
  auto it = allocations_.find(handle);
  give_extent(it->second.offset, it->second.size);
  used_[static_cast<std::size_t>(it->second.device)] -= it->second.size;
  if (freed) freed->push_back(it->second.id);
  allocations_.erase(it);
  dead_handles_.insert(handle);
}

Status Memory::release(CUmemGenericAllocationHandle handle, std::vector<std::uint64_t>* freed) {
  auto it = allocations_.find(handle);
  if (it == allocations_.end() || it->second.released)
    return fail(CUDA_ERROR_INVALID_VALUE, "handle " + hex(handle) +
                                              (it != allocations_.end() || dead_handles_.count(handle)
                                                   ? " was already released (double release)"
                                                   : " was never returned by cuMemCreate"));
  it->second.released = true;
  if (it->second.mappings == 0) destroy(handle, freed);
  return success();
}

Status Memory::map(CUdeviceptr ptr, std::size_t size, std::size_t offset, CUmemGenericAllocationHandle handle,
                   unsigned long long flags) {
  const std::size_t g = config_.granularity;
  const auto addr = static_cast<std::uintptr_t>(ptr);
  if (flags != 0) return fail(CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  if (offset != 0 && !config_.map_offsets)  // Note [Mapping at an offset]
    return fail(CUDA_ERROR_INVALID_VALUE, "offset must be 0 (cuda.h: currently must be zero; FAKECUDA_MAP_OFFSETS=0)");
  auto a = allocations_.find(handle);
  if (a == allocations_.end() || a->second.released)
    return fail(CUDA_ERROR_INVALID_VALUE, "handle " + hex(handle) +
                                              (a != allocations_.end() || dead_handles_.count(handle)
                                                   ? " was released" : " was never returned by cuMemCreate"));
  if (size == 0 || !multiple(size, g) || !multiple(addr, g) || !multiple(offset, g))
    return fail(CUDA_ERROR_INVALID_VALUE, "address " + hex(addr) + ", size " + std::to_string(size) + " and offset " +
                                              std::to_string(offset) + " must be multiples of the granularity " +
                                              std::to_string(g));
  if (size > a->second.size || offset > a->second.size - size)
    return fail(CUDA_ERROR_INVALID_VALUE, "offset " + std::to_string(offset) + " + size " + std::to_string(size) +
                                              " exceeds the allocation's " + std::to_string(a->second.size) +
                                              " bytes");
  auto r = reservations_.upper_bound(addr);
  if (r == reservations_.begin() || (--r, addr + size > r->first + r->second))
    return fail(CUDA_ERROR_INVALID_VALUE, range_text(addr, size) + " is not inside one reservation");
  auto m = mappings_.lower_bound(addr);
  if (m != mappings_.begin() && std::prev(m)->first + std::prev(m)->second.size > addr) --m;
  if (m != mappings_.end() && m->first < addr + size)
    return fail(CUDA_ERROR_INVALID_VALUE, range_text(addr, size) + " overlaps the mapping at " +
                                              range_text(m->first, m->second.size) + ": unmap it first");
  void* p = mmap(reinterpret_cast<void*>(addr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd_,
                 a->second.offset + static_cast<off_t>(offset));
  if (p == MAP_FAILED) return fail(CUDA_ERROR_OUT_OF_MEMORY, "mmap: " + std::string(std::strerror(errno)));
  mappings_.emplace(addr, Mapping{size, offset, handle, std::vector<unsigned char>(used_.size(), 0)});
  ++a->second.mappings;
  return success();
}

Status Memory::whole_mappings(std::uintptr_t ptr, std::size_t size, std::vector<std::uintptr_t>* starts) const {
  if (size == 0) return fail(CUDA_ERROR_INVALID_VALUE, "size is 0");
  std::uintptr_t cur = ptr;
  while (cur < ptr + size) {
    auto m = mappings_.find(cur);
    if (m == mappings_.end()) {
      auto holder = mappings_.upper_bound(cur);
      if (holder != mappings_.begin() && std::prev(holder)->first + std::prev(holder)->second.size > cur)
        return fail(CUDA_ERROR_INVALID_VALUE, range_text(ptr, size) + " starts or continues inside the mapping at " +
                                                  range_text(std::prev(holder)->first, std::prev(holder)->second.size) +
                                                  ": the range must cover whole mappings");
      return fail(CUDA_ERROR_INVALID_VALUE, range_text(ptr, size) + " is not mapped at " + hex(cur));
    }
    if (m->first + m->second.size > ptr + size)
      return fail(CUDA_ERROR_INVALID_VALUE, range_text(ptr, size) + " ends inside the mapping at " +
                                                range_text(m->first, m->second.size) +
                                                ": the range must cover whole mappings");
    starts->push_back(cur);
    cur += m->second.size;
  }
  return success();
}

Status Memory::unmap(CUdeviceptr ptr, std::size_t size, std::vector<std::uint64_t>* freed) {
  std::vector<std::uintptr_t> starts;
  Status s = whole_mappings(static_cast<std::uintptr_t>(ptr), size, &starts);
  if (!s.ok()) return s;
  for (std::uintptr_t start : starts) {
    auto m = mappings_.find(start);
    void* p = mmap(reinterpret_cast<void*>(start), m->second.size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return fail(CUDA_ERROR_OUT_OF_MEMORY, "mmap: " + std::string(std::strerror(errno)));
    const CUmemGenericAllocationHandle h = m->second.handle;
    mappings_.erase(m);
    Allocation& a = allocations_.at(h);
    if (--a.mappings == 0 && a.released) destroy(h, freed);
  }
  return success();
}

Status Memory::set_access(CUdeviceptr ptr, std::size_t size, const CUmemAccessDesc* desc, std::size_t count) {
  if (!desc || count == 0) return fail(CUDA_ERROR_INVALID_VALUE, "no access descriptors");
  for (std::size_t i = 0; i < count; ++i) {
    Status s = check_device_location(desc[i].location, config_.devices, "desc.location");
    if (!s.ok()) return s;
    const auto f = desc[i].flags;
    if (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ &&
        f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      return fail(CUDA_ERROR_INVALID_VALUE, "desc.flags " + std::to_string(f) + " is not a CUmemAccess_flags value");
  }
  std::vector<std::uintptr_t> starts;
  Status s = whole_mappings(static_cast<std::uintptr_t>(ptr), size, &starts);
  if (!s.ok()) {
    s.why = "set access needs a fully mapped range: " + s.why;
    return s;
  }
  for (std::uintptr_t start : starts) {
    Mapping& m = mappings_.at(start);
    for (std::size_t i = 0; i < count; ++i) m.access[static_cast<std::size_t>(desc[i].location.id)] = desc[i].flags;
    // The host protection is the widest any device has: one process plays every device.
    int prot = PROT_NONE;
    for (unsigned char f : m.access) prot |= host_prot(f);
    if (mprotect(reinterpret_cast<void*>(start), m.size, prot) != 0)
      return fail(CUDA_ERROR_OUT_OF_MEMORY, "mprotect: " + std::string(std::strerror(errno)));
  }
  return success();
}

Status Memory::get_access(unsigned long long* flags, const CUmemLocation* location, CUdeviceptr ptr) const {
  if (!flags || !location) return fail(CUDA_ERROR_INVALID_VALUE, "null flags or location");
  Status s = check_device_location(*location, config_.devices, "location");
  if (!s.ok()) return s;
  auto m = mappings_.upper_bound(static_cast<std::uintptr_t>(ptr));
  if (m == mappings_.begin() || (--m, m->first + m->second.size <= ptr))
    return fail(CUDA_ERROR_INVALID_VALUE, hex(ptr) + " is not mapped");
  *flags = m->second.access[static_cast<std::size_t>(location->id)];
  return success();
}

Status Memory::check_access(std::uintptr_t addr, std::size_t n, int device, bool write) const {
  const unsigned char need = write ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ;
  std::uintptr_t cur = addr;
  while (cur < addr + n) {
    auto m = mappings_.upper_bound(cur);
    if (m == mappings_.begin() || (--m, m->first + m->second.size <= cur))
      return fail(CUDA_ERROR_ILLEGAL_ADDRESS, hex(cur) + " is not mapped");
    const unsigned char has = m->second.access[static_cast<std::size_t>(device)];
    if ((has & need) != need)
      return fail(CUDA_ERROR_ILLEGAL_ADDRESS, "device " + std::to_string(device) + " may not " +
                                                  (write ? "write" : "read") + " the mapping at " +
                                                  range_text(m->first, m->second.size) +
                                                  " (cuMemSetAccess not called for it?)");
    cur = m->first + m->second.size;
  }
  return success();
}

std::vector<std::uint64_t> Memory::allocations_in(std::uintptr_t addr, std::size_t n) const {
  std::vector<std::uint64_t> ids;
  auto m = mappings_.upper_bound(addr);
  if (m != mappings_.begin()) --m;
  for (; m != mappings_.end() && m->first < addr + n; ++m) {
    if (m->first + m->second.size <= addr) continue;
    ids.push_back(allocations_.at(m->second.handle).id);
  }
  return ids;
}

bool Memory::find_mapping(std::uintptr_t ptr, std::uintptr_t* start, std::size_t* size, int* device) const {
  auto m = mappings_.upper_bound(ptr);
  if (m == mappings_.begin() || (--m, m->first + m->second.size <= ptr)) return false;
  *start = m->first;
  *size = m->second.size;
  *device = allocations_.at(m->second.handle).device;
  return true;
}

}  // namespace fakecuda
