// Allocator: a caching allocator that backs every allocation with fixed-size physical chunks mapped into a
// contiguous virtual range. Any free chunk can serve any request, so physical memory has no external
// fragmentation; the only waste is the tail of each large allocation's last chunk.
//
// Request path, malloc(n, stream):
// Physical memory is created in blocks of several chunks, and a chunk is a slice of a block; a run of a
// block's slices maps with one backend call (Note [Blocks and slices] in allocator_blocks.cpp). The chunk
// stays the unit of everything else: capacity, the pool, reclaim, stats and the guarantees count chunks.
//
//   0. a step plan (Note [Step plan] in allocator_plan.cpp): a training step that repeated is served from a
//      planned layout; a large malloc that matches its phase gets its slot, mapped once, no backend call after;
//   1. small (n <= small_max): a 512 B-rounded block from a slab (one chunk) of the same stream, best fit;
//      mid-size (n <= mid_chunks chunks, when mid_chunks > 0): a quarter-chunk-rounded block from a mid slab
//      of mid_chunks chunks (Note [Mid-size blocks]);
//   2. large: ceil(n / chunk) chunks; best fit among cached free ranges of the same stream, split at a chunk
//      boundary;
//   3. grow in place: the stream's largest cached range that has free address space around it takes the
//      missing chunks (from the pool, reclaimed, or created) next to it, so only those are mapped;
//      otherwise free chunks from the pool (created while under capacity), mapped into a fresh virtual range
//      placed with room around it (Note [Grow in place]);
//   4. reclaim: chunks leave cached free ranges, least recently freed first, and are mapped into the new
//      range, so a request of k chunks succeeds whenever k chunks are free in total;
//   5. the OOM handler (the swap runtime evicts), then one more try from 1;
//   6. OutOfMemory, with the allocator's state intact.
// Every backend failure on the way leaves the arena as it was or consistently degraded (Note [Failure
// guarantees] in allocator.cpp).
#pragma once

#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend.h"
#include "config.h"
#include "detail/slice_pool.h"
#include "detail/stats.h"
#include "detail/step_plan.h"
#include "detail/trace.h"
#include "detail/va_space.h"

namespace vmalloc {

// The request cannot be met within the capacity even after reclaiming every cached chunk and calling the
// OOM handler. The message names the request, allocated, cached-free, reserved and capacity bytes (and,
// on the cuda backend, starts with "CUDA out of memory." as PyTorch's does, which tools match on).
struct VMALLOC_API OutOfMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// malloc on a stream that is being captured into a CUDA graph needs more than the memory already cached for
// that stream (Note [Graph capture] in allocator.cpp). The message names the alternatives.
struct VMALLOC_API CaptureError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct BlockInfo {
  std::uintptr_t addr;
  std::size_t size;
  std::size_t requested;  // 0 for free blocks
  bool allocated;
  bool pending = false;   // freed, but other streams' work on it may still run (record_stream) or a capture is on
};

struct SegmentInfo {  // one mapped range: a large allocation, a cached free range, or a slab
  std::uintptr_t addr;
  std::size_t size;
  Stream stream;
  bool small;
  std::vector<BlockInfo> blocks;
};

// While an instance lives, Allocator::malloc on this thread fails with OutOfMemory instead of calling the
// OOM handler (Note [OOM handler and locks] in allocator.cpp). Nests.
class VMALLOC_API OomHandlerSuppressed {
 public:
  OomHandlerSuppressed();
  ~OomHandlerSuppressed();
  OomHandlerSuppressed(const OomHandlerSuppressed&) = delete;
  OomHandlerSuppressed& operator=(const OomHandlerSuppressed&) = delete;

 private:
  bool previous_;
};

class VMALLOC_API Allocator {
 public:
  using OomHandler = std::function<bool(std::size_t)>;

  // backend may be null: then one is made from config.backend and config.device. Throws
  // std::invalid_argument for a bad configuration (naming what to change), BackendError if the backend fails.
  explicit Allocator(const Config& config, std::unique_ptr<Backend> backend = nullptr);
  ~Allocator();  // never throws; releases everything, live allocations included
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // Returns 0 for nbytes == 0. Throws OutOfMemory; CaptureError; BackendError (the arena unchanged or
  // consistently degraded, Note [Failure guarantees]). call_oom_handler=false fails with OutOfMemory instead
  // of calling the handler, for callers that hold a lock the handler may need (Note [OOM handler and locks]).
  std::uintptr_t malloc(std::size_t nbytes, Stream stream, bool call_oom_handler = true);
  // Throws std::invalid_argument, changing nothing, if addr is not a live allocation; BackendError, changing
  // nothing, if an event cannot be recorded. free(0) does nothing.
  void free(std::uintptr_t addr);
  // The allocation is also used on `stream`: its memory is not reused before that stream's work so far
  // (Note [Stream safety]).
  void record_stream(std::uintptr_t addr, Stream stream);
  // Unmaps every cached free range and releases every block whose chunks are all free (waiting for frees
  // pending on other streams first); a block with a chunk in use stays (Note [Blocks and slices]). Ranges of
  // streams being captured stay (Note [Graph capture]).
  void empty_cache();
  // Changes the capacity; cached memory above it is released now, in whole blocks, and the rest as it is
  // freed (Note [Blocks and slices]).
  void set_capacity(std::size_t bytes);
  void set_oom_handler(OomHandler handler);
  void set_history(std::size_t entries);
  void reset_peak_stats();
  // A CUDA graph capture begins / ends somewhere in the process (Note [Graph capture]): until the matching
  // end, nothing is waited for or unmapped, on any stream. Nests. capture_end throws std::logic_error
  // without a matching begin.
  void capture_begin();
  void capture_end();

  std::vector<std::pair<std::string, std::int64_t>> stats() const;
  // Single counters, without building stats(): the swap runtime reads them at every saved tensor.
  std::int64_t allocated_bytes() const;       // stats()["allocated_bytes.all.current"]
  std::int64_t peak_allocated_bytes() const;  // stats()["allocated_bytes.all.peak"]
  std::int64_t reserved_bytes() const;        // stats()["reserved_bytes.all.current"]
  // Bytes of the chunks no request can have now (Note [Held bytes] in allocator.cpp): stats()["held_bytes.all
  // .current"], and its peak since reset_peak_stats(). What a budget on physical memory must count.
  std::int64_t held_bytes() const;
  std::int64_t peak_held_bytes() const;
  // The largest request that can succeed now without the OOM handler: idle chunks (the pool, cached ranges,
  // empty slabs) stitch into one range, plus what may still be created under the capacity, at most
  // `creatable_cap` bytes of it (the device's free memory), and no more than the workspace limit leaves
  // (Note [Workspace offers]).
  std::size_t largest_allocatable(std::size_t creatable_cap) const;
  // Caps largest_allocatable() at `bytes` minus the allocated bytes (0: no cap). The swap runtime sets its
  // budget here, so that cuDNN's benchmark mode does not try workspaces that the budget cannot hold.
  void set_workspace_limit(std::size_t bytes);
  std::size_t workspace_limit() const;
  std::vector<SegmentInfo> segments() const;
  std::vector<TraceEntry> trace() const;
  // Recounts every statistic from the data structures and checks the invariants; throws std::logic_error.
  void check_invariants() const;
  // Whether [addr, addr + nbytes) lies inside one live allocation.
  bool is_live(std::uintptr_t addr, std::size_t nbytes) const;
  bool owns(std::uintptr_t addr) const;
  // The message of the last backend failure that the arena survived without throwing (e.g. a release that
  // failed while free() shrank the cache); "" if none. Each is also counted in stats()["num_backend_errors"].
  std::string last_backend_error() const;

  const Config& config() const { return config_; }
  Backend& backend() { return *backend_; }
  std::size_t chunk_size() const { return chunk_; }
  std::size_t capacity() const;
  // The bytes a request of `nbytes` holds once served: what malloc adds to allocated_bytes (512 B steps in
  // a slab, quarter chunks in a mid slab, whole chunks otherwise; 0 for 0). A planner that budgets in
  // allocated bytes counts each tensor at this size, not at its own: a 2.25 MiB tensor holds 4 MiB.
  std::size_t allocation_size(std::size_t nbytes) const;

 private:
  enum class Kind : std::uint8_t { kAllocated, kCached, kSlab, kPending };
  struct Range {  // a contiguous virtual range with nchunks chunks mapped into it
    std::size_t nchunks;
    Stream stream;
    std::uint32_t reservation;
    Kind kind;
    std::uint64_t free_seq = 0;  // when last freed: orders reclaim (oldest first) and names its fence
    std::size_t slab_used = 0;   // bytes of blocks in use or pending, for slabs
    bool mid = false;            // a slab of mid-size blocks (Note [Mid-size blocks]), else of small ones
  };
  struct SmallBlock {  // a block of a slab, small or mid-size
    std::size_t size;
    std::uintptr_t slab;
    bool free;
  };
  struct Allocation {
    std::size_t requested;
    std::size_t size;
    Stream stream;
    bool in_slab;                       // a block of a slab (small or mid-size), else a range of its own
    std::vector<Stream> other_streams;  // from record_stream
    std::int32_t slot = -1;             // the step plan's slot it was served from (Note [Step plan]), else -1
    std::uint64_t step_index = detail::StepLearner::kNone;  // its index in the learner's sequence
  };
  struct PendingFree {  // freed; reusable once `events` (other streams' work) complete, or capture ends
    std::uintptr_t addr;
    Allocation a;
    std::vector<std::pair<Stream, Event>> events;
  };
  struct Block {  // one physical allocation of nchunks chunks (Note [Blocks and slices])
    ChunkHandle handle;
    std::uint32_t nchunks;
    std::uint32_t mappings = 0;  // mappings of its slices, stuck ones included
    bool quarantined = false;    // its release failed: kept out of the pool, retried by empty_cache
  };
  struct Mapping {  // one backend mapping: slices [first, first + n) of a block at consecutive chunk addresses
    detail::BlockId block;
    std::uint32_t first;
    std::uint32_t n;
    std::uint32_t live;  // its chunk addresses that lie in a range; 0 only while stuck (its unmap failed)
    std::uint32_t reservation;
  };
  using SizeSet = std::set<std::pair<std::size_t, std::uintptr_t>>;  // (size, address): best fit
  // Note [Step plan] (allocator_plan.cpp)
  struct PlanColor {  // one physical chunk of the plan, once it has one
    detail::BlockId block = 0;
    std::uint32_t slice = 0;
    bool held = false;      // has its chunk (taken out of the pool)
    std::int32_t user = -1;  // the slot using it now, or -1
  };
  struct PlanMapping {  // one backend mapping of a slot: slices [first, first + n) of a block
    std::uintptr_t addr;
    detail::BlockId block;
    std::uint32_t first;
    std::uint32_t n;
  };
  struct PlanSlot {  // the address one malloc of the period gets, with its colors' chunks mapped there
    std::size_t nchunks = 0;
    Stream stream = 0;
    std::vector<std::uint32_t> colors;
    std::uintptr_t addr = 0;  // 0 until first served
    std::uint32_t reservation = 0;
    std::vector<PlanMapping> maps;
    bool busy = false;  // served, and not yet freed (pending frees included)
  };
  struct Plan {
    std::vector<detail::StepToken> tokens;  // the period's mallocs, from phase 0
    std::vector<std::int32_t> slot_of;      // per phase: its slot, or -1 (the usual path)
    std::vector<PlanSlot> slots;
    std::vector<PlanColor> colors;
    std::size_t cursor = 0;       // the phase of the next malloc
    std::size_t peak_chunks = 0;  // the most planned chunks live at once: the least any layout needs
    std::size_t since_match = 0;  // mallocs since one matched its phase's token
    std::uint64_t hits = 0;       // mallocs served from a slot
    std::size_t busy_slots = 0;
    bool retiring = false;  // abandoned: serves nothing, torn down once no slot is busy
    std::unordered_map<Stream, std::uint64_t> last_free;  // per stream: free_seq of its slots' last free
  };

  std::uintptr_t try_malloc(std::size_t nbytes, Stream stream, bool cached_only);
  std::uintptr_t try_malloc_unmapping(std::size_t nbytes, Stream stream);  // Note [Out of mappings]
  bool uncache_all(std::exception_ptr& first);
  std::uintptr_t malloc_in_slab(std::size_t size, Stream stream, bool cached_only, bool mid);
  std::uintptr_t malloc_large(std::size_t nchunks, Stream stream, bool cached_only);  // a kAllocated range, or 0
  std::uintptr_t take_cached(std::uintptr_t addr, std::size_t nchunks);
  std::uintptr_t map_fresh(std::size_t nchunks, Stream stream);
  std::uintptr_t grow_cached(std::size_t nchunks, Stream stream);
  void map_into(std::uintptr_t at, std::size_t nchunks, std::uint32_t reservation, Stream stream);
  // allocator_blocks.cpp (Note [Blocks and slices])
  void create_blocks(std::size_t pooled);
  void map_runs(std::uintptr_t at, std::size_t nchunks, std::uint32_t reservation);
  std::vector<std::uintptr_t> leave_ranges(std::uintptr_t addr, std::size_t nchunks);
  std::exception_ptr unmap_dead(const std::vector<std::uintptr_t>& dead);
  bool unmap_mapping(std::uintptr_t addr, std::exception_ptr* error) noexcept;
  std::size_t releasable_chunks() const;
  bool reclaim(std::size_t nchunks);
  void retire_empty_slabs();
  void retire_slab(std::uintptr_t slab);
  bool trim_slabs();
  bool trim_slab(std::uintptr_t addr);
  std::exception_ptr shrink_to_capacity();
  void shrink_if_over_capacity() noexcept;
  bool over_capacity_with_cache() const;
  void free_in_slab(std::uintptr_t addr, std::uint64_t seq);
  void cache_range(std::uintptr_t addr, std::uint64_t seq);
  void complete_free(std::uintptr_t addr, const Allocation& a, std::uint64_t seq);
  void settle_frees(bool wait);
  void settle_frees_now(bool wait);
  std::exception_ptr release_tail(std::uintptr_t addr, std::size_t nchunks);
  std::vector<std::uintptr_t> detach_tail(std::uintptr_t addr, std::size_t nchunks);
  void release_free_blocks(std::size_t chunks);
  void retry_quarantine() noexcept;
  struct Fences {  // Note [Sparse fences]
    std::deque<std::pair<std::uint64_t, Event>> events;  // (free_seq, event), oldest first
    std::size_t unfenced = 0;                             // frees since the newest fence
  };
  static constexpr std::size_t kFenceStride = 32;  // a free records a fence every this many frees of its stream
  bool fence_due(Stream stream) const;
  void add_fence(Stream stream, std::uint64_t seq, Event event);
  void fence(Stream stream, std::uint64_t seq);
  void prune_fences(Fences& f) noexcept;
  void drop_fences() noexcept;
  void insert_cached(std::uintptr_t addr, const Range& r);
  void erase_cached(std::uintptr_t addr, const Range& r);
  bool quiet() const { return announced_captures_ > 0; }
  void note_backend_error(const std::exception& e) noexcept;
  std::size_t creatable_chunks() const;
  std::size_t growable_chunks(std::size_t need) const;  // Note [Reuse before growth]
  std::size_t chunks_in_use() const;
  std::size_t held_chunks() const;  // Note [Held bytes]
  std::size_t slack_chunks() const;  // Note [Slack reported apart]
  // allocator_plan.cpp (Note [Step plan])
  std::uintptr_t plan_malloc(std::size_t size, Stream stream, bool cached_only, std::int32_t* slot);
  bool plan_populate(PlanSlot& s);
  void plan_release(const Allocation& a, std::uint64_t seq);
  void plan_learn(Allocation& a, bool large);
  void plan_retire() noexcept;
  void plan_teardown();
  bool plan_unmap(const PlanMapping& m, std::uint32_t reservation) noexcept;
  void plan_unmap_all() noexcept;
  std::string oom_message(std::size_t nbytes) const;
  std::string capture_message(std::size_t nbytes, Stream stream) const;

  Config config_;
  std::unique_ptr<Backend> backend_;
  std::size_t chunk_;
  std::size_t capacity_chunks_;
  std::size_t small_max_;
  std::size_t mid_max_;    // Note [Mid-size blocks]: requests up to this are blocks of mid slabs
  std::size_t mid_round_;  // and are rounded to this

  mutable std::mutex mu_;
  detail::VaSpace va_;
  std::size_t max_block_chunks_;                              // chunks per block at most (Note [Blocks and slices])
  std::unordered_map<detail::BlockId, Block> blocks_;         // every block created and not released
  detail::BlockId next_block_ = 0;
  detail::SlicePool pool_;                                    // free chunks: slices in no range
  std::map<std::uintptr_t, Mapping> mappings_;                // every backend mapping, by address
  std::set<std::uintptr_t> stuck_;                            // mappings the backend failed to unmap
  std::size_t mapping_chunks_ = 0;                            // chunk addresses covered by mappings_
  std::size_t quarantined_chunks_ = 0;                        // chunks of quarantined blocks
  std::set<std::uintptr_t> empty_slabs_;                      // slabs with no block in use
  std::size_t empty_slab_chunks_ = 0;                         // their chunks
  bool device_full_ = false;                                  // the backend refused a chunk below capacity
  bool shrink_blocked_ = false;                               // the last shrink could not release everything
  std::size_t announced_captures_ = 0;                        // capture_begin() calls not yet ended
  std::size_t num_chunks_ = 0;                                // created and not released
  std::size_t high_water_chunks_ = 0;                         // the most chunks_in_use() after any malloc
  std::size_t growth_credit_ = 0;                             // chunks reclaimed not yet grown (Note [Reuse before growth])
  std::size_t slack_peak_chunks_ = 0;                         // the most slack_chunks() (Note [Slack reported apart])
  std::size_t held_peak_chunks_ = 0;                          // the most chunks_in_use() since reset_peak_stats (Note [Held bytes])
  std::size_t cached_chunks_ = 0;                             // chunks in kCached ranges
  std::map<std::uintptr_t, Range> ranges_;                    // every mapped range, by address
  std::unordered_map<Stream, SizeSet> cached_;                // cached free ranges per stream: (nchunks, addr)
  std::set<std::pair<std::uint64_t, std::uintptr_t>> lru_;    // cached free ranges: (free_seq, addr)
  std::map<std::uintptr_t, SmallBlock> small_;                // every block of every slab, by address
  std::unordered_map<Stream, SizeSet> small_free_;            // free small blocks per stream: (size, addr)
  std::unordered_map<Stream, SizeSet> mid_free_;              // free mid-size blocks per stream: (size, addr)
  std::unordered_map<std::uintptr_t, Allocation> live_;       // live allocations by address
  std::map<std::uint64_t, PendingFree> pending_;              // frees waiting for other streams, by free_seq
  std::vector<PendingFree> deferred_;                         // frees made while their stream was captured
  // Per stream with frees not yet waited for: its fences (Note [Stream safety], Note [Sparse fences]).
  std::unordered_map<Stream, Fences> fences_;
  std::uint64_t free_seq_ = 0;
  std::size_t workspace_limit_ = 0;  // Note [Workspace offers]; 0: none
  std::optional<Stream> calling_stream_;  // the stream of the malloc under way, known alive (Note [Sparse fences])
  std::string last_backend_error_;
  detail::Stats stats_;
  detail::TraceRing trace_;
  std::shared_ptr<OomHandler> oom_handler_;
  // Note [Step plan]
  detail::StepLearner learner_;
  std::unique_ptr<Plan> plan_;
  std::unordered_map<std::uintptr_t, std::int32_t> plan_live_;  // served slot addresses (live or pending) -> slot
  std::size_t plan_held_chunks_ = 0;  // chunks the plan holds
  std::size_t plan_idle_chunks_ = 0;  // of those, chunks no busy slot uses
};

}  // namespace vmalloc
