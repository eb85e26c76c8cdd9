// Allocator: physical blocks, their slices, and the mappings of runs of slices (see allocator.h).
#include "allocator.h"

#include <algorithm>

namespace vmalloc {

// Note [Blocks and slices]
// The driver's cost is per call, not per byte: mapping ten separately created 2 MiB handles takes ten times
// as long as mapping one 20 MiB handle (PyTorch's expandable-segments note, pytorch#96995). With one
// cuMemCreate per chunk, every chunk a reclaim stitches into a new range is one cuMemUnmap and one cuMemMap:
// 17 362 of each per steady iteration of the swapped ResNet-50 batch-1440 trace (bench/fragmentation.py),
// even after growing in place. Larger chunks call less but round every tensor up (8 MiB chunks: DenseNet-121
// batch 64 swapped drops from 0.946 to 0.821 efficiency). Blocks keep the 2 MiB granularity and call less:
//   - physical memory is created in blocks, one backend allocation of up to max_block_chunks_ chunks
//     (block_size, default kDefaultBlockBytes = 32 MiB), each as large as what is still missing, so nothing
//     is created beyond what the policy needs (utilization and the capacity as with chunk-sized creation);
//   - a chunk is a slice (block, index) of a block. The pool (detail::SlicePool) keeps free slices as runs
//     of consecutive slices of one block and hands out as few runs as it can; a run is mapped with one
//     backend call, at its offset into the block, and a range gets one set_access however many runs it has;
//   - the chunk stays the unit of everything else: capacity, the pool, reclaim, stats and the guarantees
//     count chunks, so any k free chunks serve a request of k chunks and the waste stays under one chunk
//     per allocation.
// Mappings and ranges are independent: splitting a cached range (take_cached) may cut through a mapping, and
// the driver cannot unmap part of a mapping. So when chunks leave their range (reclaim, empty_cache, a
// capacity shrink; always after waiting for the range's stream, Note [Stream safety]) their slices go back
// to the pool at once, although their mapping may stay: the old address then maps memory that is free or
// mapped again elsewhere, an alias nobody uses (the driver allows one allocation at several addresses). A
// mapping is unmapped when none of its chunks is left in a range (num_idle_mapped_chunks counts the
// addresses that wait for it). Reclaim therefore never touches memory in use, and a failed unmap loses no
// chunk: the mapping is kept stuck, its address out of use, and retried by empty_cache and shrinking.
// Memory goes back to the backend in whole blocks: empty_cache and a lowered capacity release every block
// whose chunks are all free and unmapped; a block with a chunk still in use stays (num_releasable_chunks is
// what could go now). Creation never exceeds the capacity, so reserved <= capacity holds; after the capacity
// is lowered, reserved may stay above it until the blocks holding chunks in use are free.
// Backends map a run with map(addr, bytes, block, offset): cuda with cuMemMap at that offset (probed first,
// Note [Probing map offsets]: a driver that refuses offsets gets one chunk per block); host with one mmap of
// the block's slot of the memfd (one kernel mapping per run, which also spares vm.max_map_count); sim keeps
// the books only. stats() counts calls in num_maps, num_unmaps, num_set_access, num_device_alloc and
// num_device_free, and the chunks they moved in num_mapped_chunks, num_unmapped_chunks, num_created_chunks
// and num_released_chunks.
// Measured per steady iteration (bench/results/fragmentation.md, 2 MiB chunks, 32 MiB blocks): the swapped
// ResNet-50 batch-1440 trace makes 1 320 map and 1 304 unmap calls (17 362 each with one chunk per block;
// 29 363 before growing in place), the swapped GPT-2 batch-16 trace 212 and 194 (3 142; 5 062), with the
// same utilization (1.000) and efficiency (0.997, 0.991). The price is the coarser release: at the end of
// those traces empty_cache cannot give back 148 and 454 MiB of free chunks whose blocks hold a chunk in use
// (64 MiB blocks: 719 and 211 map calls, 482 and 614 MiB held; 16 MiB: 2 066 and 491, 98 and 230 MiB).

// Creates blocks until the pool holds `pooled` chunks, within the capacity. A block is as large as what is
// still missing, at most max_block_chunks_. When the device refuses a block (BackendOutOfMemory) the next
// one is half as large; when it refuses one chunk, device_full_ is set and the pool keeps what was made. Any
// other failure propagates; the blocks made so far stay in the pool, created and counted.
void Allocator::create_blocks(std::size_t pooled) {
  std::size_t cap = max_block_chunks_;
  while (pool_.size() < pooled && creatable_chunks() > 0) {
    const std::size_t n = std::min({pooled - pool_.size(), creatable_chunks(), cap});
    ChunkHandle handle = 0;
    try {
      handle = backend_->create_chunk(n * chunk_);
    } catch (const BackendOutOfMemory& e) {
      note_backend_error(e);
      if (n == 1) {
        device_full_ = true;  // the device has less than our capacity: work with the chunks we have
        return;
      }
      cap = n / 2;
      continue;
    }
    const detail::BlockId id = next_block_++;
    blocks_.emplace(id, Block{handle, static_cast<std::uint32_t>(n)});
    pool_.add(id, 0, static_cast<std::uint32_t>(n));
    num_chunks_ += n;
    growth_credit_ -= std::min(growth_credit_, n);
    ++stats_.num_device_alloc;
    stats_.num_created_chunks += static_cast<std::int64_t>(n);
    stats_.reserved_bytes.increase(static_cast<std::int64_t>(n * chunk_));
  }
}

// Maps k pooled chunks at [at, at + k chunks), address space of `reservation` that the caller took, as few
// runs as the pool allows (one backend map per run), and makes them accessible with one set_access. On
// failure what was mapped is unmapped (a mapping that cannot be is kept as stuck, its address out of use),
// every chunk returns to the pool and the rest of the address range to the address space; the error
// propagates (Note [Failure guarantees]).
void Allocator::map_runs(std::uintptr_t at, std::size_t k, std::uint32_t reservation) {
  const std::vector<detail::Run> runs = pool_.take(k);
  std::size_t done = 0;
  try {
    std::uintptr_t a = at;
    for (; done < runs.size(); ++done) {
      const detail::Run& r = runs[done];
      Block& b = blocks_.at(r.block);
      backend_->map(a, r.n * chunk_, b.handle, r.first * chunk_);
      mappings_.emplace(a, Mapping{r.block, r.first, r.n, r.n, reservation});
      ++b.mappings;
      mapping_chunks_ += r.n;
      ++stats_.num_maps;
      stats_.num_mapped_chunks += r.n;
      a += r.n * chunk_;
    }
    backend_->set_access(at, k * chunk_);
    ++stats_.num_set_access;
  } catch (...) {
    std::uintptr_t a = at;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const detail::Run& r = runs[i];
      pool_.add(r.block, r.first, r.n);
      if (i < done) {
        mappings_.at(a).live = 0;
        if (!unmap_mapping(a, nullptr)) stuck_.insert(a);
      } else {
        va_.give(reservation, a, r.n * chunk_);
      }
      a += r.n * chunk_;
    }
    throw;
  }
}

// The chunks at [addr, addr + n chunks) leave their range (the caller shrinks or erases it, and waited for
// the range's stream first): their slices return to the pool, although their mappings may stay, and the
// mappings left with no chunk in any range are returned, to be unmapped.
std::vector<std::uintptr_t> Allocator::leave_ranges(std::uintptr_t addr, std::size_t n) {
  std::vector<std::uintptr_t> dead;
  const std::uintptr_t end = addr + n * chunk_;
  for (auto it = std::prev(mappings_.upper_bound(addr)); it != mappings_.end() && it->first < end; ++it) {
    Mapping& m = it->second;
    const std::uintptr_t from = std::max(addr, it->first), to = std::min(end, it->first + m.n * chunk_);
    const auto count = static_cast<std::uint32_t>((to - from) / chunk_);
    pool_.add(m.block, m.first + static_cast<std::uint32_t>((from - it->first) / chunk_), count);
    m.live -= count;
    if (m.live == 0) dead.push_back(it->first);
  }
  return dead;
}

// Unmaps one mapping whose chunks are all out of ranges, returning its address to the address space; a
// failure is counted and kept in last_backend_error() (and in *error), and the mapping stays (the caller
// keeps it as stuck).
bool Allocator::unmap_mapping(std::uintptr_t addr, std::exception_ptr* error) noexcept {
  auto it = mappings_.find(addr);
  const Mapping m = it->second;
  try {
    backend_->unmap(addr, m.n * chunk_);
  } catch (const std::exception& e) {
    note_backend_error(e);
    if (error && !*error) *error = std::current_exception();
    return false;
  }
  mappings_.erase(it);
  stuck_.erase(addr);
  --blocks_.at(m.block).mappings;
  mapping_chunks_ -= m.n;
  ++stats_.num_unmaps;
  stats_.num_unmapped_chunks += m.n;
  va_.give(m.reservation, addr, m.n * chunk_);
  return true;
}

// Unmaps every mapping in `dead`; those that fail stay as stuck (retried by empty_cache). Returns the first
// failure, already counted, or null.
std::exception_ptr Allocator::unmap_dead(const std::vector<std::uintptr_t>& dead) {
  std::exception_ptr first;
  for (std::uintptr_t a : dead)
    if (!unmap_mapping(a, &first)) stuck_.insert(a);
  return first;
}

// The last m chunks of the cached range at addr leave it, to the pool (the caller waited for its stream);
// mappings left without a chunk in any range are unmapped. Returns the first unmap failure (counted), or
// null: the chunks are free either way, and a mapping that could not be unmapped stays stuck.
std::exception_ptr Allocator::release_tail(std::uintptr_t addr, std::size_t m) { return unmap_dead(detach_tail(addr, m)); }

// release_tail without the unmapping: returns the mappings to unmap.
std::vector<std::uintptr_t> Allocator::detach_tail(std::uintptr_t addr, std::size_t m) {
  auto it = ranges_.find(addr);
  Range& r = it->second;
  erase_cached(addr, r);
  const std::size_t keep = r.nchunks - m;
  const std::vector<std::uintptr_t> dead = leave_ranges(addr + keep * chunk_, m);
  stats_.mapped_bytes.decrease(static_cast<std::int64_t>(m * chunk_));
  trace_.record(TraceEntry::kSegmentUnmap, addr + keep * chunk_, m * chunk_, r.stream);
  if (keep == 0) {
    ranges_.erase(it);
    stats_.segment.decrease(1);
  } else {
    r.nchunks = keep;
    insert_cached(addr, r);
  }
  return dead;
}

// Chunks of blocks that are wholly free and unmapped: what releasing could give back now.
std::size_t Allocator::releasable_chunks() const {
  std::size_t n = 0;
  for (const auto& [id, b] : blocks_)
    if (!b.quarantined && b.mappings == 0 && pool_.whole(id, b.nchunks)) n += b.nchunks;
  return n;
}

// Releases wholly free, unmapped blocks until `chunks` chunks are released (or none is left). A block whose
// release fails is quarantined (out of the pool, still counted) and the error propagates.
void Allocator::release_free_blocks(std::size_t chunks) {
  std::size_t released = 0;
  for (auto it = blocks_.begin(); it != blocks_.end() && released < chunks;) {
    Block& b = it->second;
    if (b.quarantined || b.mappings > 0 || !pool_.whole(it->first, b.nchunks)) {
      ++it;
      continue;
    }
    pool_.remove(it->first, 0, b.nchunks);
    try {
      backend_->release_chunk(b.handle, b.nchunks * chunk_);
    } catch (...) {
      b.quarantined = true;
      quarantined_chunks_ += b.nchunks;
      throw;
    }
    released += b.nchunks;
    num_chunks_ -= b.nchunks;
    ++stats_.num_device_free;
    stats_.num_released_chunks += b.nchunks;
    stats_.reserved_bytes.decrease(static_cast<std::int64_t>(b.nchunks * chunk_));
    it = blocks_.erase(it);
  }
  device_full_ = false;
}

void Allocator::retry_quarantine() noexcept {
  for (auto it = stuck_.begin(); it != stuck_.end();) {
    const std::uintptr_t a = *it;
    ++it;  // a successful unmap erases a from stuck_
    unmap_mapping(a, nullptr);
  }
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    Block& b = it->second;
    if (!b.quarantined) {
      ++it;
      continue;
    }
    try {
      backend_->release_chunk(b.handle, b.nchunks * chunk_);
    } catch (const std::exception& e) {
      note_backend_error(e);
      ++it;
      continue;
    }
    num_chunks_ -= b.nchunks;
    quarantined_chunks_ -= b.nchunks;
    ++stats_.num_device_free;
    stats_.num_released_chunks += b.nchunks;
    stats_.reserved_bytes.decrease(static_cast<std::int64_t>(b.nchunks * chunk_));
    it = blocks_.erase(it);
  }
}

}  // namespace vmalloc
