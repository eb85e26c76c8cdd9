#include "allocator.h"

#include <algorithm>

#include "detail/util.h"

namespace vmalloc {
namespace {

using detail::hex;
using detail::kSmallRound;
constexpr std::size_t kSpreadMinChunks = 16;  // Note [Grow in place]
using detail::round_up;

thread_local bool t_oom_handler_suppressed = false;

std::size_t checked_chunk_size(const Config& c, const Backend& b) {
  check_chunk_size(c.chunk_size, b.granularity(), b.name());
  if (c.small_max > c.chunk_size) {
    throw std::invalid_argument("small_max (" + format_size(c.small_max) + ") must not exceed chunk_size (" +
                                format_size(c.chunk_size) + "): small blocks are carved from one chunk");
  }
  return c.chunk_size;
}

// Note [Default capacity]
// cuda: the device's memory less max(1 GiB, 1/16) for the context, cuBLAS/cuDNN workspaces and other
// processes; host: half the machine's memory; sim: the simulated device's whole memory (80 GiB).
std::size_t initial_capacity_chunks(const Config& c, const Backend& b) {
  validate(c);  // after the chunk size checks, whose messages name the backend's granularity
  std::size_t cap = c.capacity;
  if (cap == 0) {
    const std::size_t total = b.total_memory();
    if (std::string(b.name()) == "cuda") cap = total - std::min(total / 2, std::max(total / 16, std::size_t{1} << 30));
    else if (std::string(b.name()) == "host") cap = total / 2;
    else cap = total;
    cap = std::min(cap, kMaxCapacity);
  }
  if (cap < c.chunk_size) {
    throw std::invalid_argument("capacity " + format_size(cap) + " is smaller than one chunk (" +
                                format_size(c.chunk_size) + "): raise capacity or lower chunk_size");
  }
  return cap / c.chunk_size;
}

// Note [Blocks and slices]: chunks per block at most (block_size was validated with the capacity). 0 means
// kDefaultBlockBytes, at least one chunk; a backend that cannot map at an offset gets one chunk per block.
std::size_t block_chunks(const Config& c, Backend& b) {
  const std::size_t bytes = c.block_size ? c.block_size : kDefaultBlockBytes;
  const std::size_t n = std::clamp<std::size_t>(bytes / c.chunk_size, 1, std::size_t{1} << 30);
  return n > 1 && !b.maps_at_offsets() ? 1 : n;
}

std::unique_ptr<Backend> make_checked_backend(const Config& c) {
  if (c.backend != "cuda" && c.backend != "host" && c.backend != "sim") validate(c);  // names the choices
  check_device(c, c.device);
  return make_backend(c.backend, c.device);
}

}  // namespace

OomHandlerSuppressed::OomHandlerSuppressed() : previous_(t_oom_handler_suppressed) { t_oom_handler_suppressed = true; }
OomHandlerSuppressed::~OomHandlerSuppressed() { t_oom_handler_suppressed = previous_; }

const char* action_name(TraceEntry::Action a) {
  switch (a) {
    case TraceEntry::kAlloc: return "alloc";
    case TraceEntry::kFreeRequested: return "free_requested";
    case TraceEntry::kFreeCompleted: return "free_completed";
    case TraceEntry::kSegmentMap: return "segment_map";
    case TraceEntry::kSegmentUnmap: return "segment_unmap";
    case TraceEntry::kOom: return "oom";
  }
  return "?";
}

Allocator::Allocator(const Config& config, std::unique_ptr<Backend> backend)
    : config_(config),
      backend_(backend ? std::move(backend) : make_checked_backend(config)),
      chunk_(checked_chunk_size(config_, *backend_)),
      capacity_chunks_(initial_capacity_chunks(config_, *backend_)),
      small_max_(config.small_max),
      mid_max_(config.mid_chunks * chunk_),
      mid_round_(std::max(chunk_ / 4, kSmallRound)),
      // Address space is cheap; reserve 4x the capacity up front so ranges rarely need a new reservation.
      // (capacity <= kMaxCapacity = 2^50, so this cannot overflow.)
      va_(*backend_, 4 * capacity_chunks_ * chunk_),
      max_block_chunks_(block_chunks(config_, *backend_)),
      trace_(config.history),
      learner_(chunk_) {
  config_.capacity = capacity_chunks_ * chunk_;
}

// Note [Failure guarantees]
// Every backend call can fail (another process took the memory, the driver is in a bad state, the host ran
// out of mappings). Each operation keeps one of two promises, and check_invariants() holds after either:
//   - nothing changed: a failed reserve, create_chunk, record_event or capture query happens before any
//     state is touched (blocks created so far go to the pool, where they are counted and reusable; a block
//     the device refuses for want of memory is tried again half as large);
//   - consistently degraded: mapping a range rolls back what it mapped (map_runs); reclaim, empty_cache and
//     shrinking take chunks out of their ranges before unmapping (Note [Blocks and slices]), so a mapping
//     that cannot be unmapped loses nothing: it is kept stuck, its address out of the address space,
//     counted in stats()["num_stuck_mappings"] and tried again by empty_cache() and shrinking. A block that
//     cannot be released is quarantined: kept out of the pool, counted in reserved bytes and in
//     stats()["num_quarantined_chunks"]; empty_cache() tries it again.
// The error propagates to the caller (BackendError names the call and the system's reason), except where
// the failing work was a follow-up the caller did not need (unmapping the mapping reclaimed chunks leave,
// free() shrinking to a lowered capacity, retrying stuck or quarantined ones): there it is counted in
// "num_backend_errors" and kept in last_backend_error(). empty_cache and set_capacity report an unmap
// failure when it kept them from their goal. The destructor tries every release and never throws.
Allocator::~Allocator() {
  auto attempt = [this](auto&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      note_backend_error(e);
    } catch (...) {
    }
  };
  // Frees since a stream's newest fence have no event to wait for (Note [Sparse fences]): wait for the device.
  if (std::any_of(fences_.begin(), fences_.end(), [](const auto& sf) { return sf.second.unfenced > 0; }))
    attempt([&] { backend_->synchronize(); });
  for (auto& [stream, f] : fences_) {
    for (auto& [seq, event] : f.events) {
      attempt([&] { backend_->event_synchronize(event); });
      backend_->release_event(event);
    }
  }
  for (auto& [seq, p] : pending_) {
    for (auto& [stream, event] : p.events) {
      attempt([&] { backend_->event_synchronize(event); });
      backend_->release_event(event);
    }
  }
  // Live allocations' chunks are released too: whoever still holds them is past caring (process exit). A
  // block is released even if one of its mappings could not be unmapped (its memory then goes with that
  // mapping, as the driver documents).
  plan_unmap_all();
  for (const auto& [addr, m] : mappings_) attempt([&] { backend_->unmap(addr, m.n * chunk_); });
  for (const auto& [id, b] : blocks_) attempt([&] { backend_->release_chunk(b.handle, b.nchunks * chunk_); });
}

std::size_t Allocator::capacity() const {
  std::lock_guard<std::mutex> lock(mu_);
  return capacity_chunks_ * chunk_;
}

std::string Allocator::last_backend_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_backend_error_;
}

void Allocator::note_backend_error(const std::exception& e) noexcept {
  ++stats_.num_backend_errors;
  try {
    last_backend_error_ = e.what();
  } catch (...) {
  }
}

std::size_t Allocator::creatable_chunks() const {
  if (device_full_ || num_chunks_ >= capacity_chunks_) return 0;
  return capacity_chunks_ - num_chunks_;
}

// ---------------------------------------------------------------------------------------------------------
// malloc

// Note [OOM handler and locks]
// The OOM handler runs with the arena unlocked (it frees through this arena), on the thread that called
// malloc. A Python handler takes the GIL. A caller that holds a lock of its own while it calls malloc (torch's
// caching allocator holds its mutex while it asks a MemPool's allocator for memory, and torch's documented
// order is GIL first, allocator lock second) would then take the GIL under that lock and can deadlock
// against a thread that holds the GIL and waits for the lock. Such callers pass call_oom_handler=false, or
// hold an OomHandlerSuppressed on their thread: malloc then fails with OutOfMemory at once, and the caller
// runs its own recovery (e.g. torch's, which frees its cache and retries) outside its lock.
std::uintptr_t Allocator::malloc(std::size_t nbytes, Stream stream, bool call_oom_handler) {
  if (nbytes == 0) return 0;
  std::shared_ptr<OomHandler> handler;
  {
    std::lock_guard<std::mutex> lock(mu_);
    try {
      if (backend_->capturing(stream)) {
        if (nbytes <= capacity_chunks_ * chunk_) {
          if (std::uintptr_t p = try_malloc(nbytes, stream, /*cached_only=*/true)) return p;
          ++stats_.num_capture_errors;
          throw CaptureError(capture_message(nbytes, stream));
        }
      } else {
        settle_frees(/*wait=*/false);
        if (nbytes <= capacity_chunks_ * chunk_) {
          if (std::uintptr_t p = try_malloc_unmapping(nbytes, stream)) return p;
          if (!pending_.empty()) {  // memory freed on other streams' work: wait for it rather than fail
            settle_frees(/*wait=*/true);
            if (std::uintptr_t p = try_malloc_unmapping(nbytes, stream)) return p;
          }
          if (device_full_) {  // the device refused chunks earlier; others may have freed memory since
            device_full_ = false;
            if (std::uintptr_t p = try_malloc_unmapping(nbytes, stream)) return p;
          }
          if (plan_ && plan_idle_chunks_ > 0) {  // the step plan's idle chunks (Note [Step plan])
            plan_retire();
            if (!plan_)
              if (std::uintptr_t p = try_malloc_unmapping(nbytes, stream)) return p;
          }
          if (call_oom_handler && !t_oom_handler_suppressed) handler = oom_handler_;
        }
      }
    } catch (const BackendError&) {
      ++stats_.num_backend_errors;
      throw;
    }
    if (handler) ++stats_.num_oom_handler_calls;
  }
  // The handler runs unlocked: it frees memory through this allocator (the swap runtime evicts).
  if (handler && (*handler)(nbytes)) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.num_alloc_retries;
    try {
      settle_frees(/*wait=*/true);
      if (std::uintptr_t p = try_malloc_unmapping(nbytes, stream)) return p;
    } catch (const BackendError&) {
      ++stats_.num_backend_errors;
      throw;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.num_ooms;
  trace_.record(TraceEntry::kOom, 0, nbytes, stream, (capacity_chunks_ - std::min(capacity_chunks_, num_chunks_)) * chunk_);
  throw OutOfMemory(oom_message(nbytes));
}

// Note [Out of mappings]
// Physical memory is not the only thing a backend can run out of: the host backend meets the kernel's limit
// on a process's mappings (vm.max_map_count, Note [Host mapping limit] in backend_host.cpp). Cached free ranges keep their mappings, so an arena whose ranges were
// stitched from scattered chunks can hold tens of thousands of them while nothing is allocated. The backend
// then throws BackendOutOfMappings, and malloc climbs the same ladder as for physical memory: it unmaps every
// cached range (after waiting for its stream, as reclaim does), which returns their chunks to the pool as
// whole runs, and tries once more. The state after the failed try is intact (Note [Failure guarantees]); if
// nothing was cached, or the second try meets the limit too, the error propagates with the count, the limit
// and the ways out.
std::uintptr_t Allocator::try_malloc_unmapping(std::size_t nbytes, Stream stream) {
  try {
    return try_malloc(nbytes, stream, false);
  } catch (const BackendOutOfMappings& e) {
    std::exception_ptr unmap_failure;  // counted where it happened; the retry says whether it mattered
    if (quiet() || !uncache_all(unmap_failure)) throw;  // counted by malloc
    note_backend_error(e);
  }
  return try_malloc(nbytes, stream, false);
}

std::size_t Allocator::allocation_size(std::size_t nbytes) const {
  const bool small = nbytes <= small_max_, mid = !small && nbytes <= mid_max_;
  return round_up(nbytes, small ? kSmallRound : mid ? mid_round_ : chunk_);
}

std::uintptr_t Allocator::try_malloc(std::size_t nbytes, Stream stream, bool cached_only) {
  struct Calling {  // Note [Sparse fences]: the stream fence() may record on while this malloc runs
    std::optional<Stream>& slot;
    ~Calling() { slot.reset(); }
  } calling{calling_stream_};
  calling_stream_ = stream;
  const bool small = nbytes <= small_max_, mid = !small && nbytes <= mid_max_;
  const std::size_t size = allocation_size(nbytes);
  std::int32_t slot = -1;
  std::uintptr_t p = plan_ ? plan_malloc(size, stream, cached_only, &slot) : 0;  // Note [Step plan]
  if (!p) {
    p = small || mid ? malloc_in_slab(size, stream, cached_only, mid) : malloc_large(size / chunk_, stream, cached_only);
  }
  if (!p) return 0;
  high_water_chunks_ = std::max(high_water_chunks_, chunks_in_use());
  held_peak_chunks_ = std::max(held_peak_chunks_, held_chunks());  // Note [Held bytes]
  slack_peak_chunks_ = std::max(slack_peak_chunks_, slack_chunks());
  Allocation& a = live_.emplace(p, Allocation{nbytes, size, stream, small || mid, {}, slot}).first->second;
  stats_.requested_bytes.increase(static_cast<std::int64_t>(nbytes));
  stats_.allocated_bytes.increase(static_cast<std::int64_t>(size));
  stats_.active_bytes.increase(static_cast<std::int64_t>(size));
  stats_.allocation.increase(1);
  stats_.active.increase(1);
  ++stats_.num_alloc;
  trace_.record(TraceEntry::kAlloc, p, size, stream);
  plan_learn(a, !small && !mid);  // Note [Step plan]
  return p;
}

// Note [Reuse before growth]
// DESIGN.md's ladder creates new chunks while under capacity and reclaims only at the capacity. Replaying
// training traces (bench/fragmentation.py) showed the cost: whenever no cached range of the stream fits,
// fresh chunks are created although enough cached chunks sit idle, so reserved memory grows past the peak
// of allocated memory (utilization 0.85 on a swap trace, below PyTorch's policies). Reclaiming instead
// (any cached chunk serves any request) keeps reserved at the peak of allocated, but a training step that
// repeats then never settles: each miss takes the tails of other cached ranges, whose absence makes the next
// misses, iteration after iteration. On a GPU every such reclaim is unmap, map and set_access calls plus a
// host wait for the stream (Note [Stream safety]), which stops the CPU running ahead: the first H200 run
// trained ResNet-50 at 1928 images/s on vmalloc against 2062 on torch's allocator. bench/steady_state.py
// replays twelve training steps and counts per steady iteration: with pure reclaim (growth_slack=0) ResNet-50
// batch 96 makes 20 maps, 11 unmaps, 3 set_access and 6 host waits, DenseNet-121 batch 64 57, 33, 15 and 17,
// GPT-2 batch 16 31, 31, 1 and 1 (the code before, which waited for every fence up to the range's, made 285
// event synchronizations per ResNet-50 iteration: bench/results/steady_state_legacy.md).
// So a miss may create chunks instead of reclaiming, as far as reclaims have shown that the cache needs them:
// each chunk reclaimed earns a chunk of growth credit (growth_credit_), and a miss creates up to the credit
// while the chunks held stay within (1 + growth_slack) x high_water_chunks_, the most chunks ever in use at
// once (allocated ranges, slabs with a block in use, pending frees), and within the capacity; beyond any of
// these it reclaims first and creates only what is still missing. A repeated step churns for a few
// iterations, each reclaim buying the room its next occurrence needs, until the cache holds a working set
// that serves the step without misses: none of the six traces measured makes a driver call or a host wait in
// its last iterations. The price is reserved memory above the peak in use, within the slack (0.125, the default
// before Note [Step plan], which settles the step without it: the default is now 0):
// at unlimited capacity peak requested / peak reserved goes from 0.97-0.99 to 0.92-0.98 (GPT-2 batch 16
// 0.994 to 0.923, U-Net batch 8 0.992 to 0.931). At the capacity reclaim still stitches, so a request
// succeeds whenever the free chunks suffice. growth_slack=0 keeps reserved at the peak in use;
// eager_growth=true grows to the capacity first.
std::size_t Allocator::growable_chunks(std::size_t need) const {
  if (config_.eager_growth) return creatable_chunks();
  const std::size_t target = std::max(high_water_chunks_, chunks_in_use() + need);
  const std::size_t room = target + static_cast<std::size_t>(config_.growth_slack * static_cast<double>(target));
  return std::min({creatable_chunks(), room > num_chunks_ ? room - num_chunks_ : 0, growth_credit_});
}

// Note [Slack reported apart]
// The growth slack (Note [Reuse before growth]) is physical memory held beyond the most ever in use: reserved
// bytes count it, so it lowers utilization (peak allocated / peak reserved), and stats() also reports it
// apart as slack_bytes (current: chunks held beyond high_water_chunks_; peak: the most of that after any
// malloc, reset by reset_peak_stats). reserved_bytes - slack_bytes is then the memory the step's working set
// needed at its peak in use; growth_slack=0 keeps slack_bytes at 0. On the traces of bench.fragmentation and
// bench.steady_state (bench/results/fragmentation_slack.md) none of growth_slack 0, 0.008, 0.03 and 0.125
// both keeps utilization >= 0.99 and leaves every steady iteration without driver calls (0.008: utilization
// >= 0.990, but GPT-2 batch 16, DenseNet-121 batch 64 and U-Net batch 8 map every iteration; 0.125: no
// calls, utilization down to 0.887). The step plan (Note [Step plan]) meets both with growth_slack=0, now the
// default: utilization 0.997-1.000 on every fragmentation trace, no call on the steady-state traces
// (bench/results/fragmentation_slack.md, its default column).
std::size_t Allocator::slack_chunks() const {
  return num_chunks_ > high_water_chunks_ ? num_chunks_ - high_water_chunks_ : 0;
}

// Chunks held that no request can have now: in allocated or pending ranges, in slabs with a block in use,
// or quarantined.
//
// Note [Held bytes]
// allocated_bytes counts what allocations hold (512 B steps in a slab, whole chunks otherwise), but not the
// free space inside slabs that a block in use keeps mapped: a large request cannot use it. So a caller that
// keeps allocated_bytes within the capacity can still be refused: on an H200 the swap runtime, planning the
// small ResNet in allocated bytes under a capacity equal to its budget, asked for 2.25 MiB (two 2 MiB chunks)
// with 205.75 of 210 MiB allocated and 4.25 MiB free, fewer than two chunks of it whole. held_bytes is
// chunks_in_use() in bytes: every chunk that is not free for any request (allocated and pending ranges, slabs
// with a block in use, the step plan's busy slots, quarantined chunks), and the step plan's idle chunks while
// any of its slots is busy: a plan gives its chunks back only once none is (Note [Step plan]), so until then
// they serve its slots alone. The rest, capacity - held, is what the ladder serves any request from (the
// pool, cached ranges, empty slabs, a plan with no slot busy, chunks still creatable), so held_bytes +
// allocation_size(n) <= capacity means malloc(n) finds enough free chunks (on the host and sim backends it
// succeeds; on cuda the device itself may still refuse, device_full_; during a capture nothing is reclaimed).
// Its peak rises only in malloc (nothing else puts a free chunk in use or makes a slot busy), so it is kept
// there, and reset_peak_stats() resets it, as torch resets its peaks. The swap runtime measures vmalloc's memory in held bytes (ArenaMemory
// in swap/runtime/machine/memory.py): a budget given is then physical memory held, slabs included.
std::size_t Allocator::chunks_in_use() const {
  return num_chunks_ - pool_.size() - cached_chunks_ - empty_slab_chunks_ - plan_idle_chunks_;
}

std::size_t Allocator::held_chunks() const {
  return chunks_in_use() + (plan_ && plan_->busy_slots > 0 ? plan_idle_chunks_ : 0);
}

std::uintptr_t Allocator::malloc_large(std::size_t k, Stream stream, bool cached_only) {
  // 2. best fit among this stream's cached ranges
  auto cached = cached_.find(stream);
  if (cached != cached_.end()) {
    auto it = cached->second.lower_bound({k, 0});
    if (it != cached->second.end()) return take_cached(it->second, k);
  }
  if (cached_only) return 0;
  // 3. grow a cached range in place, mapping only what it lacks (Note [Grow in place])
  if (!config_.eager_growth) {
    if (std::uintptr_t p = grow_cached(k, stream)) return p;
  }
  // then chunks that are already free (the pool), then fresh ones within the slack (Note [Reuse before growth])
  if (pool_.size() + growable_chunks(k) >= k) {
    if (std::uintptr_t p = map_fresh(k, stream)) return p;
  }
  // Free chunks inside mid slabs count too, once cut out of them (Note [Mid-size blocks]).
  auto idle = [&] { return cached_chunks_ + empty_slab_chunks_; };
  if (pool_.size() + idle() + creatable_chunks() < k) {
    if (quiet() || !trim_slabs()) return 0;
    shrink_if_over_capacity();  // the cut-out chunks are freed memory: above a lowered capacity they go
  }
  if (pool_.size() + idle() + creatable_chunks() < k) return 0;
  // 4. reclaim chunks of cached ranges (any stream) and empty slabs; create only what is still missing
  if (pool_.size() < k && !quiet()) {
    retire_empty_slabs();
    const std::size_t want = k - pool_.size();
    if (!reclaim(std::min(want - std::min(want, growable_chunks(k)), cached_chunks_))) return 0;
  }
  if (std::uintptr_t p = map_fresh(k, stream)) return p;
  // The device refused chunks below the capacity (map_fresh set device_full_): stitch what is cached.
  if (pool_.size() + cached_chunks_ < k) return 0;
  if (quiet() || !reclaim(k - pool_.size())) return 0;
  return map_fresh(k, stream);
}

std::uintptr_t Allocator::take_cached(std::uintptr_t addr, std::size_t k) {
  Range& r = ranges_.at(addr);
  erase_cached(addr, r);
  if (r.nchunks > k) {
    Range rest = r;
    rest.nchunks = r.nchunks - k;
    r.nchunks = k;
    const std::uintptr_t rest_addr = addr + k * chunk_;
    ranges_.emplace(rest_addr, rest);
    insert_cached(rest_addr, rest);
    stats_.segment.increase(1);
    ++stats_.num_splits;
  }
  r.kind = Kind::kAllocated;
  return addr;
}

std::uintptr_t Allocator::map_fresh(std::size_t k, Stream stream) {
  create_blocks(k);  // a failure leaves the blocks made so far in the pool, created and counted
  if (pool_.size() < k) return 0;
  // Room around it to grow (Note [Grow in place]); small ranges (slabs among them) stay packed. A failure to
  // reserve address space changes nothing else.
  const detail::VaSpace::Slice slice =
      k >= kSpreadMinChunks ? va_.take_spread(k * chunk_, chunk_) : va_.take(k * chunk_);
  map_runs(slice.addr, k, slice.reservation);
  stats_.mapped_bytes.increase(static_cast<std::int64_t>(k * chunk_));
  stats_.segment.increase(1);
  ranges_.emplace(slice.addr, Range{k, stream, slice.reservation, Kind::kAllocated});
  trace_.record(TraceEntry::kSegmentMap, slice.addr, k * chunk_, stream);
  return slice.addr;
}

// Note [Grow in place]
// Replaying swapped training traces (bench/fragmentation.py) showed where vmalloc's driver calls come from: a
// request of k chunks that no cached range of its stream can hold was stitched into a fresh virtual range,
// k maps plus the unmaps of the reclaimed chunks, although the stream usually caches a range of m < k
// chunks (a split-off part, a range from the previous layer). Extending that range by the k - m missing
// chunks maps only those. The candidate is the stream's largest cached range whose free address
// neighbourhood (VaSpace::free_after / free_before) leaves room for k chunks; the missing chunks come from
// the pool, then reclaim (least recently freed, the candidate itself excluded), then creation, as in
// Note [Reuse before growth]; they are mapped after the range, then before it. To leave such room, fresh
// ranges of kSpreadMinChunks chunks or more are placed in the middle of the largest free interval (Note
// [Spread placement] in va_space.h), not packed first-fit. Smaller ones stay packed: they are many (slabs),
// rarely grow, and on the host backend every chunk that is not next to its neighbours costs a kernel
// mapping of its own (vm.max_map_count). Per steady iteration of the swapped ResNet-50 batch-1440 trace
// (bench/fragmentation.py, 2 MiB chunks, one chunk per block) the chunks mapped fall from 29 363 to 17 362,
// on the swapped GPT-2 batch-16 trace from 5 062 to 3 142; blocks then map them in fewer calls (Note
// [Blocks and slices]). A failure while mapping unmaps what this call mapped and leaves the
// range cached as it was (Note [Failure guarantees]); a failure on its second side keeps the first side's
// growth, mapped and cached.
std::uintptr_t Allocator::grow_cached(std::size_t k, Stream stream) {
  auto cached = cached_.find(stream);
  if (cached == cached_.end() || quiet()) return 0;
  std::uintptr_t addr = 0;
  std::size_t m = 0, after = 0;
  for (auto it = cached->second.rbegin(); it != cached->second.rend(); ++it) {  // largest first
    const Range& r = ranges_.at(it->second);
    const std::size_t right = va_.free_after(r.reservation, it->second + it->first * chunk_) / chunk_;
    const std::size_t left = va_.free_before(r.reservation, it->second) / chunk_;
    if (it->first + right + left >= k) {
      addr = it->second, m = it->first, after = right;
      break;
    }
  }
  if (!addr) return 0;
  const std::size_t need = k - m;
  if (pool_.size() + (cached_chunks_ - m) + empty_slab_chunks_ + creatable_chunks() < need) return 0;
  Range& r = ranges_.at(addr);
  erase_cached(addr, r);
  r.kind = Kind::kAllocated;  // out of reach of reclaim and of merging while it grows
  auto restore = [&](std::uintptr_t at) {
    Range& back = ranges_.at(at);
    back.kind = Kind::kCached;
    cache_range(at, back.free_seq);
  };
  try {
    if (pool_.size() + growable_chunks(need) < need) {
      retire_empty_slabs();
      const std::size_t want = need - pool_.size();
      reclaim(std::min(want - std::min(want, growable_chunks(need)), cached_chunks_));
    }
    create_blocks(need);
  } catch (...) {
    restore(addr);
    throw;
  }
  if (pool_.size() < need) {
    restore(addr);
    return 0;
  }
  const std::size_t right = std::min(need, after), left = need - right;
  try {
    map_into(addr + m * chunk_, right, r.reservation, stream);
  } catch (...) {
    restore(addr);
    throw;
  }
  r.nchunks = m + right;
  if (left == 0) return addr;
  const std::uintptr_t base = addr - left * chunk_;
  try {
    map_into(base, left, r.reservation, stream);
  } catch (...) {
    restore(addr);
    throw;
  }
  Range moved = r;
  moved.nchunks = k;
  ranges_.erase(addr);
  ranges_.emplace(base, moved);
  return base;
}

// Maps n chunks from the pool at [at, at + n chunks), free address space of `reservation`, and makes them
// accessible. On failure what it mapped is unmapped (Note [Failure guarantees]) and nothing else changed.
void Allocator::map_into(std::uintptr_t at, std::size_t n, std::uint32_t reservation, Stream stream) {
  if (n == 0) return;
  va_.take_at(reservation, at, n * chunk_);
  map_runs(at, n, reservation);
  stats_.mapped_bytes.increase(static_cast<std::int64_t>(n * chunk_));
  trace_.record(TraceEntry::kSegmentMap, at, n * chunk_, stream);
}

// Note [Reclaim]
// When neither the stream's cache nor the pool can serve k chunks, chunks leave cached free ranges, least
// recently freed first (after waiting for the range's stream), and are mapped into the new range. Because a
// chunk is interchangeable, this stitches scattered free memory into one contiguous allocation: a request
// succeeds whenever enough chunks are free in total. Each range gives up its tail, so what is left keeps its
// address and can still serve its stream. When the cut falls inside a mapping that lies in the range, the
// range gives up that whole mapping (the chunks beyond the need go to the pool): the mapping is unmapped now
// rather than left half used, and its slices stay one run, mapped again with one call (Note [Blocks and
// slices]). Per steady iteration of the swapped traces with 64 MiB blocks this took the map calls of
// ResNet-50 batch 1440 from 1 070 to 719 and of the five traces measured from 1 585 to 1 260 (GPT-2 batch 16
// alone went from 174 to 211). Nothing is reclaimed while a capture is announced (Note [Graph capture]).
bool Allocator::reclaim(std::size_t need) {
  if (need == 0) return true;
  if (quiet()) return false;
  ++stats_.num_reclaims;
  auto it = lru_.begin();
  while (need > 0 && it != lru_.end()) {
    const auto [seq, addr] = *it;
    ++it;  // release_tail erases (and may re-insert) this entry; the next one stays valid
    const Range& r = ranges_.at(addr);
    std::size_t take = std::min(need, r.nchunks);
    if (take < r.nchunks) {  // the whole mapping the cut falls in, if it lies in this range: Note [Reclaim]
      const std::uintptr_t cut = addr + (r.nchunks - take) * chunk_;
      auto m = std::prev(mappings_.upper_bound(cut));
      if (m->first < cut && m->first >= addr) take += (cut - m->first) / chunk_;
    }
    fence(r.stream, seq);  // a failure changes nothing
    // The chunks are free whatever happens to the unmapping of mappings they leave (a failure there is
    // counted, and the mapping retried by empty_cache): the caller does not need it.
    release_tail(addr, take);
    stats_.num_reclaimed_chunks += static_cast<std::int64_t>(take);
    growth_credit_ += take;
    need -= std::min(need, take);
  }
  return need == 0;
}

// Note [Graph capture]
// While a stream is being captured into a CUDA graph, work submitted to it is recorded, not run, and driver
// calls that would synchronize with it or observe it (event record/query/synchronize on it, and in the
// default global capture mode any event query or synchronization in the process) fail and invalidate the
// capture. The core therefore:
//   - asks the backend (cuStreamIsCapturing) about the stream of each malloc and free, and only about
//     those: the stream of the call is alive, an old stream of a cached range may not be (a destroyed
//     stream's handle must not reach the driver);
//   - malloc on a capturing stream serves only memory already cached for that stream (a cached range, a
//     slab block), with no other backend call; when that does not suffice it throws CaptureError (counted in
//     num_capture_errors) rather than map, reclaim or call the OOM handler;
//   - free of an allocation whose stream (or a record_stream stream) is capturing records no event: the
//     block is deferred (num_deferred_frees) until a later malloc/free/empty_cache finds the capture over;
//   - while a capture is announced (capture_begin()/capture_end(), by whoever starts captures: the torch
//     adapter), no event is queried or waited for and nothing is unmapped, on any stream: settling frees,
//     reclaim, shrinking and empty_cache's unmapping wait for the end. Mallocs on other streams may still map
//     fresh chunks (not a stream operation).
// A capture nobody announced is thus safe on its own stream; another stream's reclaim may still wait for an
// event during it, which the driver refuses (the capture fails at its end with an error, memory is never
// corrupted). Memory a graph uses must outlive the graph's replays; that is the owner's business (PyTorch
// gives each graph a private pool). The torch adapter decides whether to offer capture at all.
std::string Allocator::capture_message(std::size_t nbytes, Stream stream) const {
  return "vmalloc: cannot allocate " + format_size(nbytes) + " (" + std::to_string(nbytes) + " bytes) on stream " +
         hex(stream) +
         " while it is being captured into a CUDA graph: during capture vmalloc serves only memory already "
         "cached for that stream (it does not map, unmap or record events then), and none fits. Run the "
         "captured code once before capturing so that its memory is cached (warm-up), or capture with PyTorch's "
         "native allocator and a private pool (torch.cuda.graph(..., pool=...)) instead of vmalloc.";
}

}  // namespace vmalloc
