// Allocator: a caching allocator that backs every allocation with fixed-size physical chunks mapped into a
// contiguous virtual range. Any free chunk can serve any request, so physical memory has no external
// fragmentation; the only waste is the tail of each large allocation's last chunk.
//
// Request path, malloc(n, stream):
//   1. small (n <= small_max): a 512 B-rounded block from a slab (one chunk) of the same stream, best fit;
//   2. large: ceil(n / chunk) chunks; best fit among cached free ranges of the same stream, split at a chunk
//      boundary;
//   3. free chunks from the pool (created while under capacity), mapped into a fresh virtual range;
//   4. reclaim: unmap chunks of cached free ranges, least recently freed first, and map them into the new
//      range, so a request of k chunks succeeds whenever k chunks are free in total;
//   5. the OOM handler (the swap runtime evicts), then one more try from 1;
//   6. OutOfMemory, with the allocator's state intact.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend.h"
#include "config.h"
#include "detail/stats.h"
#include "detail/trace.h"
#include "detail/va_space.h"

namespace vmalloc {

// The request cannot be met within the capacity even after reclaiming every cached chunk and calling the
// OOM handler. The message names the request, allocated, cached-free, reserved and capacity bytes.
struct OutOfMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct BlockInfo {
  std::uintptr_t addr;
  std::size_t size;
  std::size_t requested;  // 0 for free blocks
  bool allocated;
};

struct SegmentInfo {  // one mapped range: a large allocation, a cached free range, or a slab
  std::uintptr_t addr;
  std::size_t size;
  Stream stream;
  bool small;
  std::vector<BlockInfo> blocks;
};

class Allocator {
 public:
  using OomHandler = std::function<bool(std::size_t)>;

  // backend may be null: then one is made from config.backend and config.device.
  explicit Allocator(const Config& config, std::unique_ptr<Backend> backend = nullptr);
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // Returns 0 for nbytes == 0. Throws OutOfMemory. call_handler=false skips the OOM handler (callers that
  // hold a lock the handler may need, e.g. torch's caching allocator serving a MemPool).
  std::uintptr_t malloc(std::size_t nbytes, Stream stream, bool call_handler = true);
  // Throws std::invalid_argument, changing nothing, if addr is not a live allocation. free(0) does nothing.
  void free(std::uintptr_t addr);
  // The allocation is also used on `stream`: its memory is not reused before that stream's work so far.
  void record_stream(std::uintptr_t addr, Stream stream);
  // Unmaps every cached free range and releases every unmapped chunk.
  void empty_cache();
  // Changes the capacity; cached memory above it is released now, allocated memory as it is freed.
  void set_capacity(std::size_t bytes);
  void set_oom_handler(OomHandler handler);
  void set_history(std::size_t entries);
  void reset_peak_stats();

  std::vector<std::pair<std::string, std::int64_t>> stats() const;
  std::vector<SegmentInfo> segments() const;
  std::vector<TraceEntry> trace() const;
  // Recounts every statistic from the data structures and checks the invariants; throws std::logic_error.
  void check_invariants() const;
  // Whether [addr, addr + nbytes) lies inside one live allocation.
  bool is_live(std::uintptr_t addr, std::size_t nbytes) const;
  bool owns(std::uintptr_t addr) const;

  const Config& config() const { return config_; }
  Backend& backend() { return *backend_; }
  std::size_t chunk_size() const { return chunk_; }
  std::size_t capacity() const;

 private:
  enum class Kind : std::uint8_t { kAllocated, kCached, kSlab };
  struct Range {  // a contiguous virtual range with nchunks chunks mapped into it
    std::size_t nchunks;
    Stream stream;
    std::uint32_t reservation;
    Kind kind;
    std::uint64_t free_seq = 0;  // when last freed: orders reclaim (oldest first) and names its fence
    std::size_t slab_used = 0;   // bytes of small blocks in use, for slabs
  };
  struct SmallBlock {
    std::size_t size;
    std::uintptr_t slab;
    bool free;
  };
  struct Allocation {
    std::size_t requested;
    std::size_t size;
    Stream stream;
    bool small;
    std::vector<Stream> other_streams;  // from record_stream
  };
  using SizeSet = std::set<std::pair<std::size_t, std::uintptr_t>>;  // (size, address): best fit

  std::uintptr_t try_malloc(std::size_t nbytes, Stream stream);
  std::uintptr_t malloc_small(std::size_t size, Stream stream);
  std::uintptr_t malloc_large(std::size_t nchunks, Stream stream);  // returns a kAllocated range, or 0
  std::uintptr_t take_cached(std::uintptr_t addr, std::size_t nchunks);
  std::uintptr_t map_fresh(std::size_t nchunks, Stream stream);
  bool reclaim(std::size_t nchunks);
  void retire_empty_slabs();
  void shrink_to_capacity();
  void free_small(std::uintptr_t addr, std::uint64_t seq);
  void cache_range(std::uintptr_t addr, std::uint64_t seq);
  void unmap_tail(std::uintptr_t addr, std::size_t nchunks);
  void release_pool_chunks(std::size_t keep);
  void fence(std::uint64_t seq);
  std::uint64_t record_free(const Allocation& a);
  void insert_cached(std::uintptr_t addr, const Range& r);
  void erase_cached(std::uintptr_t addr, const Range& r);
  std::size_t creatable_chunks() const;
  std::string oom_message(std::size_t nbytes, std::size_t rounded) const;

  Config config_;
  std::unique_ptr<Backend> backend_;
  std::size_t chunk_;
  std::size_t capacity_chunks_;
  std::size_t small_max_;

  mutable std::mutex mu_;
  detail::VaSpace va_;
  std::vector<ChunkHandle> pool_;                             // created, unmapped chunks
  std::unordered_map<std::uintptr_t, ChunkHandle> chunk_at_;  // the chunk mapped at each mapped chunk address
  std::set<std::uintptr_t> empty_slabs_;                      // slabs with no block in use
  bool device_full_ = false;                                  // the backend refused a chunk below capacity
  std::size_t num_chunks_ = 0;                                // created and not released
  std::size_t cached_chunks_ = 0;                             // chunks in kCached ranges
  std::map<std::uintptr_t, Range> ranges_;                    // every mapped range, by address
  std::unordered_map<Stream, SizeSet> cached_;                // cached free ranges per stream: (nchunks, addr)
  std::set<std::pair<std::uint64_t, std::uintptr_t>> lru_;    // cached free ranges: (free_seq, addr)
  std::map<std::uintptr_t, SmallBlock> small_;                // every block of every slab, by address
  std::unordered_map<Stream, SizeSet> small_free_;            // free small blocks per stream: (size, addr)
  std::unordered_map<std::uintptr_t, Allocation> live_;       // live allocations by address
  std::deque<std::pair<std::uint64_t, Event>> fences_;        // events recorded at free, oldest first
  std::uint64_t free_seq_ = 0;
  detail::Stats stats_;
  detail::TraceRing trace_;
  std::shared_ptr<OomHandler> oom_handler_;
};

}  // namespace vmalloc
