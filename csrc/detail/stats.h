// Counters in the shape of torch.cuda.memory_stats(): each Stat has current, peak, allocated (sum of
// increases) and freed (sum of decreases).
#pragma once

#include <algorithm>
#include <cstdint>

namespace vmalloc::detail {

struct Stat {
  std::int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void increase(std::int64_t n) {
    current += n;
    allocated += n;
    peak = std::max(peak, current);
  }
  void decrease(std::int64_t n) {
    current -= n;
    freed += n;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = freed = 0; }
};

struct Stats {
  Stat requested_bytes;   // what callers asked for
  Stat allocated_bytes;   // what they got (512 B rounding for small, whole chunks for large)
  Stat allocation;        // live allocations
  Stat active_bytes;      // allocated bytes plus freed bytes still pending other streams' work or a capture
  Stat active;            // live allocations plus pending frees
  Stat reserved_bytes;    // physical chunk bytes held (mapped or in the pool)
  Stat mapped_bytes;      // chunk bytes mapped into some range
  Stat segment;           // mapped ranges (slabs included)
  Stat slab_bytes;        // chunk bytes of slabs that hold small blocks
  std::int64_t num_alloc = 0, num_free = 0, num_ooms = 0, num_alloc_retries = 0, num_oom_handler_calls = 0;
  // Backend calls (map, unmap, set_access, create and release: one each per call) and the chunks they moved.
  std::int64_t num_maps = 0, num_unmaps = 0, num_set_access = 0, num_device_alloc = 0, num_device_free = 0;
  std::int64_t num_mapped_chunks = 0, num_unmapped_chunks = 0, num_created_chunks = 0, num_released_chunks = 0;
  std::int64_t num_reclaims = 0, num_reclaimed_chunks = 0, num_event_syncs = 0, num_stream_waits = 0;
  std::int64_t num_splits = 0, num_merges = 0;
  std::int64_t num_backend_errors = 0;     // backend calls that failed (each one the arena survived)
  std::int64_t num_pending_frees = 0;      // frees that waited for other streams (record_stream)
  std::int64_t num_deferred_frees = 0;     // frees deferred because a stream was being captured
  std::int64_t num_capture_errors = 0;     // mallocs refused during capture (CaptureError)
  // Note [Step plan]: plans made, mallocs served from a plan's slot, mallocs whose phase had a slot that
  // could not serve them (a lifetime or token that differed), plans abandoned.
  std::int64_t num_plans = 0, num_plan_hits = 0, num_plan_misses = 0, num_plans_abandoned = 0;
};

}  // namespace vmalloc::detail
