#include "allocator.h"

#include <algorithm>
#include <limits>
#include <sstream>

namespace vmalloc {
namespace {

constexpr std::size_t kSmallRound = 512;  // as PyTorch's kMinBlockSize

std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

thread_local bool t_oom_handler_suppressed = false;

std::string hex(std::uintptr_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

std::size_t checked_chunk_size(const Config& c, const Backend& b) {
  const std::size_t g = b.granularity();
  if (c.chunk_size == 0 || c.chunk_size % g != 0) {
    throw std::invalid_argument("chunk_size " + std::to_string(c.chunk_size) + " is not a multiple of the " +
                                b.name() + " backend's granularity (" + format_size(g) + " = " +
                                std::to_string(g) + " bytes): use a multiple such as " +
                                std::to_string(round_up(c.chunk_size ? c.chunk_size : g, g)));
  }
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
      // Address space is cheap; reserve 4x the capacity up front so ranges rarely need a new reservation.
      // (capacity <= kMaxCapacity = 2^50, so this cannot overflow.)
      va_(*backend_, 4 * capacity_chunks_ * chunk_),
      trace_(config.history) {
  config_.capacity = capacity_chunks_ * chunk_;
}

// Note [Failure guarantees]
// Every backend call can fail (another process took the memory, the driver is in a bad state, the host ran
// out of mappings). Each operation keeps one of two promises, and check_invariants() holds after either:
//   - nothing changed: a failed reserve, create_chunk, record_event or capture query happens before any
//     state is touched (chunks created so far go to the pool, where they are counted and reusable);
//   - consistently degraded: map_fresh rolls back what it mapped; reclaim and empty_cache stop at the
//     failing chunk with everything before it done. A chunk that cannot be unmapped (or released) is
//     quarantined: kept out of every range and out of the pool, its address kept out of the address space,
//     counted in reserved bytes and in stats()["num_quarantined_chunks"]; empty_cache() tries it again.
// The error propagates to the caller (BackendError names the call and the system's reason), except where
// the failing work was a follow-up the caller did not ask for (free() shrinking to a lowered capacity,
// retrying quarantined chunks): there it is counted in "num_backend_errors" and kept in
// last_backend_error(). The destructor tries every release and never throws.
Allocator::~Allocator() {
  auto attempt = [this](auto&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      note_backend_error(e);
    } catch (...) {
    }
  };
  for (auto& [stream, events] : fences_) {
    for (auto& [seq, event] : events) {
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
  // Live allocations' chunks are released too: whoever still holds them is past caring (process exit).
  for (auto& [addr, chunk] : chunk_at_) {
    attempt([&] {
      backend_->unmap(addr, chunk_);
      backend_->release_chunk(chunk, chunk_);
    });
  }
  for (const Stuck& s : quarantine_) {
    attempt([&] {
      if (s.addr) backend_->unmap(s.addr, chunk_);
      backend_->release_chunk(s.chunk, chunk_);
    });
  }
  for (ChunkHandle c : pool_) attempt([&] { backend_->release_chunk(c, chunk_); });
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

void Allocator::capture_begin() {
  std::lock_guard<std::mutex> lock(mu_);
  ++announced_captures_;
}

void Allocator::capture_end() {
  std::lock_guard<std::mutex> lock(mu_);
  if (announced_captures_ == 0) throw std::logic_error("vmalloc: capture_end() without capture_begin()");
  --announced_captures_;
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
          if (std::uintptr_t p = try_malloc(nbytes, stream, false)) return p;
          if (!pending_.empty()) {  // memory freed on other streams' work: wait for it rather than fail
            settle_frees(/*wait=*/true);
            if (std::uintptr_t p = try_malloc(nbytes, stream, false)) return p;
          }
          if (device_full_) {  // the device refused chunks earlier; others may have freed memory since
            device_full_ = false;
            if (std::uintptr_t p = try_malloc(nbytes, stream, false)) return p;
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
      if (std::uintptr_t p = try_malloc(nbytes, stream, false)) return p;
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

std::uintptr_t Allocator::try_malloc(std::size_t nbytes, Stream stream, bool cached_only) {
  const bool small = nbytes <= small_max_;
  const std::size_t size = small ? round_up(nbytes, kSmallRound) : round_up(nbytes, chunk_);
  const std::uintptr_t p = small ? malloc_small(size, stream, cached_only) : malloc_large(size / chunk_, stream, cached_only);
  if (!p) return 0;
  live_.emplace(p, Allocation{nbytes, size, stream, small, {}});
  stats_.requested_bytes.increase(static_cast<std::int64_t>(nbytes));
  stats_.allocated_bytes.increase(static_cast<std::int64_t>(size));
  stats_.active_bytes.increase(static_cast<std::int64_t>(size));
  stats_.allocation.increase(1);
  stats_.active.increase(1);
  ++stats_.num_alloc;
  trace_.record(TraceEntry::kAlloc, p, size, stream);
  return p;
}

std::uintptr_t Allocator::malloc_small(std::size_t size, Stream stream, bool cached_only) {
  SizeSet& free_blocks = small_free_[stream];
  auto it = free_blocks.lower_bound({size, 0});
  if (it == free_blocks.end()) {
    const std::uintptr_t slab = malloc_large(1, stream, cached_only);
    if (!slab) return 0;
    Range& r = ranges_.at(slab);
    r.kind = Kind::kSlab;
    r.slab_used = 0;
    stats_.slab_bytes.increase(static_cast<std::int64_t>(chunk_));
    small_.emplace(slab, SmallBlock{chunk_, slab, true});
    empty_slabs_.insert(slab);
    it = free_blocks.insert({chunk_, slab}).first;
  }
  const auto [block_size, addr] = *it;
  free_blocks.erase(it);
  SmallBlock& b = small_.at(addr);
  if (block_size > size) {  // sizes are multiples of 512, so the rest is a usable block
    small_.emplace(addr + size, SmallBlock{block_size - size, b.slab, true});
    free_blocks.insert({block_size - size, addr + size});
    b.size = size;
    ++stats_.num_splits;
  }
  b.free = false;
  Range& slab = ranges_.at(b.slab);
  if (slab.slab_used == 0) empty_slabs_.erase(b.slab);
  slab.slab_used += size;
  return addr;
}

// Note [Reuse before growth]
// DESIGN.md's ladder creates new chunks while under capacity and reclaims only at the capacity. Replaying
// training traces (bench/fragmentation.py) showed the cost: whenever no cached range of the stream fits,
// fresh chunks are created although enough cached chunks sit idle, so reserved memory grows past the peak
// of allocated memory (utilization 0.85 on a swap trace, below PyTorch's policies). Because reclaim makes
// every cached chunk usable for any request, the default is to use the pool, then reclaim cached chunks,
// and create chunks only for what is still missing: reserved stays at the peak of allocated, at the price
// of more unmap/map calls on a cache miss. eager_growth=true restores the grow-first order.
std::uintptr_t Allocator::malloc_large(std::size_t k, Stream stream, bool cached_only) {
  // 2. best fit among this stream's cached ranges
  auto cached = cached_.find(stream);
  if (cached != cached_.end()) {
    auto it = cached->second.lower_bound({k, 0});
    if (it != cached->second.end()) return take_cached(it->second, k);
  }
  if (cached_only) return 0;
  // 3. chunks that are already free (the pool), then fresh ones, in the order the policy prefers
  const std::size_t idle = cached_chunks_ + empty_slabs_.size();
  if (config_.eager_growth && pool_.size() + creatable_chunks() >= k) {
    if (std::uintptr_t p = map_fresh(k, stream)) return p;
  }
  if (pool_.size() + idle + creatable_chunks() < k) return 0;
  // 4. reclaim chunks of cached ranges (any stream) and empty slabs; create only what is still missing
  if (pool_.size() < k && !quiet()) {
    retire_empty_slabs();
    const std::size_t want = k - pool_.size();
    const std::size_t from_cache = config_.eager_growth ? want - std::min(want, creatable_chunks())
                                                        : std::min(want, cached_chunks_);
    if (!reclaim(from_cache)) return 0;
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

// Unmaps a chunk that map_fresh mapped before a later step failed, returning it to the pool and its address
// to the address space; a chunk that cannot be unmapped is quarantined with its address.
void Allocator::unmap_for_rollback(std::uintptr_t addr, ChunkHandle chunk, std::uint32_t reservation) {
  try {
    backend_->unmap(addr, chunk_);
  } catch (const std::exception& e) {
    note_backend_error(e);
    quarantine_.push_back({addr, chunk, reservation});
    return;
  }
  pool_.push_back(chunk);
  va_.give(reservation, addr, chunk_);
}

std::uintptr_t Allocator::map_fresh(std::size_t k, Stream stream) {
  std::vector<ChunkHandle> chunks;
  chunks.reserve(k);
  while (chunks.size() < k && !pool_.empty()) {
    chunks.push_back(pool_.back());
    pool_.pop_back();
  }
  // From here until the chunks are mapped, each one is either in `chunks` or back in the pool.
  try {
    while (chunks.size() < k && creatable_chunks() > 0) {
      chunks.push_back(backend_->create_chunk(chunk_));
      ++num_chunks_;
      ++stats_.num_device_alloc;
      stats_.reserved_bytes.increase(static_cast<std::int64_t>(chunk_));
    }
  } catch (const BackendOutOfMemory& e) {
    note_backend_error(e);
    device_full_ = true;  // the device has less than our capacity: work with the chunks we have
  } catch (...) {
    pool_.insert(pool_.end(), chunks.begin(), chunks.end());
    throw;
  }
  if (chunks.size() < k) {
    pool_.insert(pool_.end(), chunks.begin(), chunks.end());
    return 0;
  }
  detail::VaSpace::Slice slice{};
  try {
    slice = va_.take(k * chunk_);
  } catch (...) {  // no address space: the chunks stay in the pool, created and counted
    pool_.insert(pool_.end(), chunks.begin(), chunks.end());
    throw;
  }
  std::size_t mapped = 0;
  try {
    for (; mapped < k; ++mapped) backend_->map(slice.addr + mapped * chunk_, chunk_, chunks[mapped]);
    backend_->set_access(slice.addr, k * chunk_);
  } catch (...) {
    const std::size_t stuck = quarantine_.size();
    for (std::size_t i = 0; i < mapped; ++i) unmap_for_rollback(slice.addr + i * chunk_, chunks[i], slice.reservation);
    for (std::size_t i = mapped; i < k; ++i) {
      pool_.push_back(chunks[i]);
      va_.give(slice.reservation, slice.addr + i * chunk_, chunk_);
    }
    stats_.num_maps += static_cast<std::int64_t>(mapped);
    stats_.num_unmaps += static_cast<std::int64_t>(mapped - (quarantine_.size() - stuck));
    throw;
  }
  for (std::size_t i = 0; i < k; ++i) chunk_at_.emplace(slice.addr + i * chunk_, chunks[i]);
  stats_.num_maps += static_cast<std::int64_t>(k);
  ++stats_.num_set_access;
  stats_.mapped_bytes.increase(static_cast<std::int64_t>(k * chunk_));
  stats_.segment.increase(1);
  ranges_.emplace(slice.addr, Range{k, stream, slice.reservation, Kind::kAllocated});
  trace_.record(TraceEntry::kSegmentMap, slice.addr, k * chunk_, stream);
  return slice.addr;
}

// Note [Reclaim]
// When neither the stream's cache nor the pool can serve k chunks, chunks are unmapped from cached free
// ranges, least recently freed first, and mapped into the new range. Because a chunk is interchangeable,
// this stitches scattered free memory into one contiguous allocation: a request succeeds whenever enough
// chunks are free in total. Each range gives up its tail, so what is left keeps its address and can still
// serve its stream. Nothing is reclaimed while a capture is announced (Note [Graph capture]).
bool Allocator::reclaim(std::size_t need) {
  if (need == 0) return true;
  if (quiet()) return false;
  ++stats_.num_reclaims;
  auto it = lru_.begin();
  while (need > 0 && it != lru_.end()) {
    const auto [seq, addr] = *it;
    ++it;  // unmap_tail erases (and may re-insert) this entry; the next one stays valid
    const Range& r = ranges_.at(addr);
    const std::size_t take = std::min(need, r.nchunks);
    fence(r.stream, seq);
    const std::size_t pooled = pool_.size();
    try {
      unmap_tail(addr, take);
    } catch (...) {
      stats_.num_reclaimed_chunks += static_cast<std::int64_t>(pool_.size() - pooled);
      throw;
    }
    stats_.num_reclaimed_chunks += static_cast<std::int64_t>(take);
    need -= take;
  }
  return need == 0;
}

void Allocator::retire_empty_slabs() {
  while (!empty_slabs_.empty()) {
    const std::uintptr_t slab = *empty_slabs_.begin();
    empty_slabs_.erase(empty_slabs_.begin());
    Range& r = ranges_.at(slab);
    small_free_[r.stream].erase({chunk_, slab});
    small_.erase(slab);
    stats_.slab_bytes.decrease(static_cast<std::int64_t>(chunk_));
    cache_range(slab, r.free_seq);
  }
}

// Unmaps the last m chunks of the cached range at addr, last chunk first, so that after a failure the range
// still holds the chunks before the failing one, all mapped; the failing chunk is quarantined.
void Allocator::unmap_tail(std::uintptr_t addr, std::size_t m) {
  auto it = ranges_.find(addr);
  Range& r = it->second;
  erase_cached(addr, r);
  const std::size_t keep = r.nchunks - m;
  std::size_t end = r.nchunks;  // chunks [keep, end) are still to unmap; [end, nchunks) are done
  const std::size_t total = r.nchunks;
  std::exception_ptr failure;
  while (end > keep) {
    const std::uintptr_t a = addr + (end - 1) * chunk_;
    auto c = chunk_at_.find(a);
    try {
      backend_->unmap(a, chunk_);
    } catch (...) {  // counted by the public entry point the error leaves through
      quarantine_.push_back({a, c->second, r.reservation});
      chunk_at_.erase(c);
      failure = std::current_exception();
      break;
    }
    pool_.push_back(c->second);
    chunk_at_.erase(c);
    va_.give(r.reservation, a, chunk_);
    --end;
  }
  // A failure quarantined chunk end - 1: the range keeps [0, end - 1).
  const std::size_t left = failure ? end - 1 : keep;
  const std::size_t gone = total - left;
  const std::size_t unmapped = failure ? gone - 1 : gone;
  stats_.num_unmaps += static_cast<std::int64_t>(unmapped);
  stats_.mapped_bytes.decrease(static_cast<std::int64_t>(gone * chunk_));
  trace_.record(TraceEntry::kSegmentUnmap, addr + left * chunk_, gone * chunk_, r.stream);
  if (left == 0) {
    ranges_.erase(it);
    stats_.segment.decrease(1);
  } else {
    r.nchunks = left;
    insert_cached(addr, r);
  }
  if (failure) std::rethrow_exception(failure);
}

// ---------------------------------------------------------------------------------------------------------
// free

// Note [Stream safety]
// Reuse on the allocation's own stream is safe by stream order, so a block freed there is reusable at once
// on that stream. Every other use of the memory goes through unmapping (reclaim, empty_cache), and unmapping
// is not stream ordered: each free records an event on its stream (the stream's fences, oldest first), and
// an unmap first waits on the host for the events of the range's stream up to the range's last free.
//
// Streams added with record_stream are not folded into the allocation stream (that made the allocation
// stream wait for all the work queued on them, e.g. every prefetch the swap engine queued after the
// tensor). As in PyTorch's caching allocator, the free records one event on each such stream and the block
// waits, in pending_, still mapped and counted in active_bytes, until they complete: malloc queries them
// (cuEventQuery) and moves completed blocks to the cache; when memory runs short, malloc and empty_cache
// wait for them on the host. No stream waits on another, and the allocation stream is not delayed.
void Allocator::free(std::uintptr_t addr) {
  if (addr == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(addr);
  if (it == live_.end()) {
    throw std::invalid_argument("vmalloc: free of " + hex(addr) +
                                ", which is not a live allocation of this arena (a double free, or a pointer from "
                                "another allocator)");
  }
  Allocation& a = it->second;
  // Everything that can fail comes first, so that a failure changes nothing (the allocation stays live).
  bool defer = false;
  std::vector<std::pair<Stream, Event>> events;
  Event fence_event = 0;
  try {
    defer = backend_->capturing(a.stream);
    for (Stream s : a.other_streams) defer = defer || backend_->capturing(s);
    if (!defer) {
      for (Stream s : a.other_streams)
        if (Event e = backend_->record_event(s)) events.emplace_back(s, e);
      fence_event = backend_->record_event(a.stream);
    }
  } catch (const BackendError&) {
    for (auto& [s, e] : events) backend_->release_event(e);
    ++stats_.num_backend_errors;
    throw;
  }
  const std::uint64_t seq = ++free_seq_;
  if (fence_event) fences_[a.stream].emplace_back(seq, fence_event);
  Allocation freed = std::move(a);
  live_.erase(it);
  trace_.record(TraceEntry::kFreeRequested, addr, freed.size, freed.stream);
  stats_.requested_bytes.decrease(static_cast<std::int64_t>(freed.requested));
  stats_.allocated_bytes.decrease(static_cast<std::int64_t>(freed.size));
  stats_.allocation.decrease(1);
  ++stats_.num_free;
  if (defer || !events.empty()) {
    if (!freed.small) ranges_.at(addr).kind = Kind::kPending;
    if (defer) {
      ++stats_.num_deferred_frees;
      deferred_.push_back(PendingFree{addr, std::move(freed), {}});
    } else {
      ++stats_.num_pending_frees;
      pending_.emplace(seq, PendingFree{addr, std::move(freed), std::move(events)});
    }
  } else {
    complete_free(addr, freed, seq);
  }
  if (fence_event) prune_fences(freed.stream);
  shrink_if_over_capacity();
}

// After memory returns to the cache above a lowered capacity. A follow-up the caller did not ask for: a
// failure is counted, not thrown.
void Allocator::shrink_if_over_capacity() noexcept {
  if (num_chunks_ <= capacity_chunks_) return;
  try {
    shrink_to_capacity();
  } catch (const std::exception& e) {
    note_backend_error(e);
  }
}

void Allocator::complete_free(std::uintptr_t addr, const Allocation& a, std::uint64_t seq) {
  if (a.small) free_small(addr, seq);
  else cache_range(addr, seq);
  stats_.active_bytes.decrease(static_cast<std::int64_t>(a.size));
  stats_.active.decrease(1);
  trace_.record(TraceEntry::kFreeCompleted, addr, a.size, a.stream);
}

// Moves frees whose other streams have finished (or, with wait, after waiting for them on the host) to the
// cache, and frees deferred by a capture that has ended to pending_. Nothing is queried or waited for while
// a capture is announced.
void Allocator::settle_frees(bool wait) {
  if ((pending_.empty() && deferred_.empty()) || quiet()) return;
  for (auto d = deferred_.begin(); d != deferred_.end();) {
    bool still = backend_->capturing(d->a.stream);
    for (Stream s : d->a.other_streams) still = still || backend_->capturing(s);
    if (still) {
      ++d;
      continue;
    }
    std::vector<std::pair<Stream, Event>> events;
    Event fence_event = 0;
    try {
      for (Stream s : d->a.other_streams)
        if (Event e = backend_->record_event(s)) events.emplace_back(s, e);
      fence_event = backend_->record_event(d->a.stream);
    } catch (...) {
      for (auto& [s, e] : events) backend_->release_event(e);
      throw;
    }
    const std::uint64_t seq = ++free_seq_;
    if (fence_event) fences_[d->a.stream].emplace_back(seq, fence_event);
    if (events.empty()) {
      complete_free(d->addr, d->a, seq);
    } else {
      d->events = std::move(events);
      pending_.emplace(seq, std::move(*d));
    }
    d = deferred_.erase(d);
  }
  // Events on one stream complete in order: once one is not done, later ones on that stream are not either.
  std::unordered_map<Stream, bool> busy;
  for (auto p = pending_.begin(); p != pending_.end();) {
    bool ready = true;
    for (auto& [s, e] : p->second.events) {
      if (busy[s]) {
        ready = false;
        break;
      }
      if (wait) {
        backend_->event_synchronize(e);
        ++stats_.num_event_syncs;
      } else if (!backend_->event_done(e)) {
        busy[s] = true;
        ready = false;
        break;
      }
    }
    if (!ready) {
      ++p;
      continue;
    }
    for (auto& [s, e] : p->second.events) backend_->release_event(e);
    complete_free(p->second.addr, p->second.a, p->first);
    p = pending_.erase(p);
  }
  shrink_if_over_capacity();
}

void Allocator::free_small(std::uintptr_t addr, std::uint64_t seq) {
  auto it = small_.find(addr);
  const std::uintptr_t slab_addr = it->second.slab;
  Range& slab = ranges_.at(slab_addr);
  slab.slab_used -= it->second.size;
  slab.free_seq = std::max(slab.free_seq, seq);
  SizeSet& free_blocks = small_free_[slab.stream];
  it->second.free = true;
  auto next = std::next(it);
  if (next != small_.end() && next->second.slab == slab_addr && next->second.free) {
    free_blocks.erase({next->second.size, next->first});
    it->second.size += next->second.size;
    small_.erase(next);
  }
  if (it != small_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.slab == slab_addr && prev->second.free) {
      free_blocks.erase({prev->second.size, prev->first});
      prev->second.size += it->second.size;
      small_.erase(it);
      it = prev;
    }
  }
  free_blocks.insert({it->second.size, it->first});
  // An empty slab stays a slab (small alloc/free churn then costs no remapping); reclaim and empty_cache
  // retire it, so its chunk still counts as free for large requests.
  if (slab.slab_used == 0) empty_slabs_.insert(slab_addr);
}

void Allocator::cache_range(std::uintptr_t addr, std::uint64_t seq) {
  auto it = ranges_.find(addr);
  Range& r = it->second;
  r.kind = Kind::kCached;
  r.free_seq = std::max(r.free_seq, seq);
  auto mergeable = [&](const Range& o) {
    return o.kind == Kind::kCached && o.stream == r.stream && o.reservation == r.reservation;
  };
  auto next = std::next(it);
  if (next != ranges_.end() && next->first == addr + r.nchunks * chunk_ && mergeable(next->second)) {
    erase_cached(next->first, next->second);
    r.nchunks += next->second.nchunks;
    r.free_seq = std::max(r.free_seq, next->second.free_seq);
    ranges_.erase(next);
    stats_.segment.decrease(1);
    ++stats_.num_merges;
  }
  if (it != ranges_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second.nchunks * chunk_ == addr && mergeable(prev->second)) {
      erase_cached(prev->first, prev->second);
      prev->second.nchunks += r.nchunks;
      prev->second.free_seq = std::max(prev->second.free_seq, r.free_seq);
      ranges_.erase(it);
      stats_.segment.decrease(1);
      ++stats_.num_merges;
      insert_cached(prev->first, prev->second);
      return;
    }
  }
  insert_cached(addr, r);
}

void Allocator::insert_cached(std::uintptr_t addr, const Range& r) {
  cached_[r.stream].insert({r.nchunks, addr});
  lru_.insert({r.free_seq, addr});
  cached_chunks_ += r.nchunks;
}

void Allocator::erase_cached(std::uintptr_t addr, const Range& r) {
  auto it = cached_.find(r.stream);
  it->second.erase({r.nchunks, addr});
  if (it->second.empty()) cached_.erase(it);
  lru_.erase({r.free_seq, addr});
  cached_chunks_ -= r.nchunks;
}

void Allocator::record_stream(std::uintptr_t addr, Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(addr);
  if (it == live_.end())
    throw std::invalid_argument("vmalloc: record_stream on " + hex(addr) + ", which is not a live allocation");
  Allocation& a = it->second;
  if (stream != a.stream && std::find(a.other_streams.begin(), a.other_streams.end(), stream) == a.other_streams.end())
    a.other_streams.push_back(stream);
}

void Allocator::fence(Stream stream, std::uint64_t seq) {
  auto it = fences_.find(stream);
  if (it == fences_.end()) return;
  auto& events = it->second;
  while (!events.empty() && events.front().first <= seq) {
    backend_->event_synchronize(events.front().second);  // throws: the event stays, nothing is unmapped
    backend_->release_event(events.front().second);
    events.pop_front();
    ++stats_.num_event_syncs;
  }
  if (events.empty()) fences_.erase(it);
}

// Drops fences that have completed, so that the list stays short on a stream that is never reclaimed.
void Allocator::prune_fences(Stream stream) noexcept {
  auto it = fences_.find(stream);
  if (it == fences_.end() || quiet()) return;
  auto& events = it->second;
  try {
    while (events.size() > 64 && backend_->event_done(events.front().second)) {
      backend_->release_event(events.front().second);
      events.pop_front();
    }
  } catch (const std::exception& e) {  // querying failed: keep the event, a later fence waits for it
    note_backend_error(e);
  }
}

// ---------------------------------------------------------------------------------------------------------
// releasing memory

void Allocator::release_pool_chunks(std::size_t keep) {
  while (pool_.size() > keep) {
    const ChunkHandle c = pool_.back();
    try {
      backend_->release_chunk(c, chunk_);
    } catch (...) {
      pool_.pop_back();
      quarantine_.push_back({0, c, 0});
      throw;
    }
    pool_.pop_back();
    --num_chunks_;
    ++stats_.num_device_free;
    stats_.reserved_bytes.decrease(static_cast<std::int64_t>(chunk_));
  }
  device_full_ = false;
}

void Allocator::retry_quarantine() noexcept {
  for (auto s = quarantine_.begin(); s != quarantine_.end();) {
    try {
      if (s->addr) {
        backend_->unmap(s->addr, chunk_);
        ++stats_.num_unmaps;
        va_.give(s->reservation, s->addr, chunk_);
        s->addr = 0;
      }
      backend_->release_chunk(s->chunk, chunk_);
    } catch (const std::exception& e) {
      note_backend_error(e);
      ++s;
      continue;
    }
    --num_chunks_;
    ++stats_.num_device_free;
    stats_.reserved_bytes.decrease(static_cast<std::int64_t>(chunk_));
    s = quarantine_.erase(s);
  }
}

// Note [Empty cache]
// empty_cache keeps going past a range it fails to unmap (the chunk is quarantined) and then retries: at the
// host's mapping limit, unmapping other ranges is what makes the failing one possible again. It throws the
// first backend error only if it could not empty the cache in the end; errors it got past are counted.
void Allocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  std::exception_ptr first;
  auto attempt = [&](auto&& fn) {
    try {
      fn();
    } catch (const BackendError& e) {
      ++stats_.num_backend_errors;
      if (!first) first = std::current_exception();
      try {
        last_backend_error_ = e.what();
      } catch (...) {
      }
    }
  };
  attempt([&] { settle_frees(/*wait=*/true); });
  if (quiet()) {  // a capture is announced: no waiting and no unmapping; the pool can go
    attempt([&] { release_pool_chunks(0); });
    shrink_blocked_ = over_capacity_with_cache();
    if (first && !pool_.empty()) std::rethrow_exception(first);
    return;
  }
  retire_empty_slabs();
  auto remaining = [&] { return pool_.size() + quarantine_.size() + cached_chunks_; };
  for (std::size_t left = remaining(), before = left + 1; left > 0 && left < before; before = left, left = remaining()) {
    for (auto it = lru_.begin(); it != lru_.end();) {
      const auto [seq, addr] = *it;
      ++it;  // unmap_tail erases this entry (and re-inserts it only after a failure)
      const Stream stream = ranges_.at(addr).stream;
      attempt([&] {
        fence(stream, seq);
        unmap_tail(addr, ranges_.at(addr).nchunks);
      });
    }
    attempt([&] { release_pool_chunks(0); });
    retry_quarantine();
  }
  // Chunks whose release failed may remain above a lowered capacity.
  shrink_blocked_ = over_capacity_with_cache();
  if (first && remaining() > 0) std::rethrow_exception(first);
}

bool Allocator::over_capacity_with_cache() const {
  return num_chunks_ > capacity_chunks_ && (cached_chunks_ > 0 || !pool_.empty() || !empty_slabs_.empty());
}

void Allocator::shrink_to_capacity() {
  auto excess = [&] { return num_chunks_ > capacity_chunks_ ? num_chunks_ - capacity_chunks_ : 0; };
  shrink_blocked_ = true;  // until this completes
  release_pool_chunks(pool_.size() - std::min(pool_.size(), excess()));
  if (excess() > 0) {
    retire_empty_slabs();
    reclaim(std::min(excess(), cached_chunks_));
    release_pool_chunks(pool_.size() - std::min(pool_.size(), excess()));
  }
  // While a capture is announced cached ranges stay (no unmapping): released when it ends.
  shrink_blocked_ = over_capacity_with_cache();
}

void Allocator::set_capacity(std::size_t bytes) {
  if (bytes < chunk_)
    throw std::invalid_argument("capacity " + format_size(bytes) + " is smaller than one chunk (" +
                                format_size(chunk_) + ")");
  if (bytes > kMaxCapacity)
    throw std::invalid_argument("capacity " + format_size(bytes) + " is more than vmalloc supports (" +
                                format_size(kMaxCapacity) + ")");
  std::lock_guard<std::mutex> lock(mu_);
  capacity_chunks_ = bytes / chunk_;
  config_.capacity = capacity_chunks_ * chunk_;
  device_full_ = false;
  try {
    shrink_to_capacity();
  } catch (const BackendError&) {
    ++stats_.num_backend_errors;
    throw;
  }
}

void Allocator::set_oom_handler(OomHandler handler) {
  auto fresh = handler ? std::make_shared<OomHandler>(std::move(handler)) : nullptr;
  std::shared_ptr<OomHandler> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old = std::move(oom_handler_);
    oom_handler_ = std::move(fresh);
  }
  // `old` is dropped here, unlocked: dropping a Python handler takes the GIL.
}

void Allocator::set_history(std::size_t entries) {
  std::lock_guard<std::mutex> lock(mu_);
  config_.history = entries;
  trace_.set_capacity(entries);
}

void Allocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  for (detail::Stat* s : {&stats_.requested_bytes, &stats_.allocated_bytes, &stats_.allocation, &stats_.reserved_bytes,
                          &stats_.mapped_bytes, &stats_.segment, &stats_.slab_bytes, &stats_.active_bytes,
                          &stats_.active})
    s->reset_peak();
}

// ---------------------------------------------------------------------------------------------------------
// introspection

std::string Allocator::oom_message(std::size_t nbytes) const {
  const std::size_t allocated = static_cast<std::size_t>(stats_.allocated_bytes.current);
  const std::size_t active = static_cast<std::size_t>(stats_.active_bytes.current);
  const std::size_t reserved = num_chunks_ * chunk_;
  const std::size_t capacity = capacity_chunks_ * chunk_;
  const std::size_t cached = reserved - std::min(reserved, active);
  std::ostringstream m;
  // PyTorch's phrase first on a GPU: tools that catch OOM by its message (e.g. Hugging Face accelerate's
  // find_executable_batch_size) look for it.
  if (std::string(backend_->name()) == "cuda") m << "CUDA out of memory. ";
  m << "vmalloc out of memory: tried to allocate " << format_size(nbytes) << " (" << nbytes << " bytes";
  if (nbytes > capacity) {
    m << ", more than the whole capacity";
  } else {
    const bool small = nbytes <= small_max_;
    m << ", " << (small ? round_up(nbytes, kSmallRound) : round_up(nbytes, chunk_)) << " after rounding to "
      << (small ? "512 B" : format_size(chunk_) + " chunks");
  }
  m << ") on the " << backend_->name() << " backend; " << format_size(allocated) << " allocated (" << allocated
    << " bytes), " << format_size(cached) << " cached free (" << cached << " bytes), " << format_size(reserved)
    << " reserved (" << reserved << " bytes) of capacity " << format_size(capacity) << " (" << capacity
    << " bytes)";
  if (active > allocated)
    m << "; " << format_size(active - allocated) << " freed but still in use by other streams (record_stream)";
  if (!quarantine_.empty())
    m << "; " << quarantine_.size() << " chunk(s) quarantined after backend failures (last: " << last_backend_error_
      << ")";
  if (device_full_) m << "; the device itself refused more chunks below the capacity (other processes?)";
  m << ". Free tensors, lower the batch size, raise the capacity (Arena(capacity=...) or VMALLOC_CONF=capacity=...)"
       ", or let the swap runtime evict.";
  return m.str();
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

std::vector<std::pair<std::string, std::int64_t>> Allocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::string, std::int64_t>> out;
  auto stat = [&](const std::string& name, const detail::Stat& s) {
    out.emplace_back(name + ".all.current", s.current);
    out.emplace_back(name + ".all.peak", s.peak);
    out.emplace_back(name + ".all.allocated", s.allocated);
    out.emplace_back(name + ".all.freed", s.freed);
  };
  stat("requested_bytes", stats_.requested_bytes);
  stat("allocated_bytes", stats_.allocated_bytes);
  // active = allocated + freed blocks still pending other streams' work (record_stream) or a capture, as in
  // PyTorch.
  stat("active_bytes", stats_.active_bytes);
  stat("allocation", stats_.allocation);
  stat("active", stats_.active);
  stat("reserved_bytes", stats_.reserved_bytes);
  stat("mapped_bytes", stats_.mapped_bytes);
  stat("segment", stats_.segment);
  stat("slab_bytes", stats_.slab_bytes);
  const auto mapped = stats_.mapped_bytes.current, active = stats_.active_bytes.current;
  out.emplace_back("inactive_split_bytes.all.current", mapped - active);
  out.emplace_back("cached_free_bytes", stats_.reserved_bytes.current - active);
  out.emplace_back("pending_free_bytes", active - stats_.allocated_bytes.current);
  out.emplace_back("internal_fragmentation_bytes", stats_.allocated_bytes.current - stats_.requested_bytes.current);
  out.emplace_back("num_alloc", stats_.num_alloc);
  out.emplace_back("num_free", stats_.num_free);
  out.emplace_back("num_ooms", stats_.num_ooms);
  out.emplace_back("num_alloc_retries", stats_.num_alloc_retries);
  out.emplace_back("num_oom_handler_calls", stats_.num_oom_handler_calls);
  out.emplace_back("num_maps", stats_.num_maps);
  out.emplace_back("num_unmaps", stats_.num_unmaps);
  out.emplace_back("num_set_access", stats_.num_set_access);
  out.emplace_back("num_reclaims", stats_.num_reclaims);
  out.emplace_back("num_reclaimed_chunks", stats_.num_reclaimed_chunks);
  out.emplace_back("num_device_alloc", stats_.num_device_alloc);
  out.emplace_back("num_device_free", stats_.num_device_free);
  out.emplace_back("num_event_syncs", stats_.num_event_syncs);
  out.emplace_back("num_stream_waits", stats_.num_stream_waits);
  out.emplace_back("num_splits", stats_.num_splits);
  out.emplace_back("num_merges", stats_.num_merges);
  out.emplace_back("num_pending_frees", stats_.num_pending_frees);
  out.emplace_back("num_deferred_frees", stats_.num_deferred_frees);
  out.emplace_back("num_capture_errors", stats_.num_capture_errors);
  out.emplace_back("num_backend_errors", stats_.num_backend_errors);
  out.emplace_back("num_quarantined_chunks", static_cast<std::int64_t>(quarantine_.size()));
  out.emplace_back("num_chunks", static_cast<std::int64_t>(num_chunks_));
  out.emplace_back("num_pool_chunks", static_cast<std::int64_t>(pool_.size()));
  out.emplace_back("num_cached_chunks", static_cast<std::int64_t>(cached_chunks_));
  out.emplace_back("num_empty_slabs", static_cast<std::int64_t>(empty_slabs_.size()));
  out.emplace_back("va_reserved_bytes", static_cast<std::int64_t>(va_.reserved_bytes()));
  out.emplace_back("chunk_size", static_cast<std::int64_t>(chunk_));
  out.emplace_back("small_max", static_cast<std::int64_t>(small_max_));
  out.emplace_back("capacity", static_cast<std::int64_t>(capacity_chunks_ * chunk_));
  return out;
}

std::vector<SegmentInfo> Allocator::segments() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::unordered_map<std::uintptr_t, const Allocation*> pending;
  for (const auto& [seq, p] : pending_) pending.emplace(p.addr, &p.a);
  for (const auto& p : deferred_) pending.emplace(p.addr, &p.a);
  auto requested = [&](std::uintptr_t addr, bool& is_pending) -> std::size_t {
    auto l = live_.find(addr);
    if (l != live_.end()) return l->second.requested;
    is_pending = true;
    return pending.at(addr)->requested;
  };
  std::vector<SegmentInfo> out;
  out.reserve(ranges_.size());
  for (const auto& [addr, r] : ranges_) {
    SegmentInfo s{addr, r.nchunks * chunk_, r.stream, r.kind == Kind::kSlab, {}};
    if (r.kind == Kind::kSlab) {
      for (auto b = small_.lower_bound(addr); b != small_.end() && b->second.slab == addr; ++b) {
        bool is_pending = false;
        const std::size_t req = b->second.free ? 0 : requested(b->first, is_pending);
        s.blocks.push_back({b->first, b->second.size, req, !b->second.free && !is_pending, is_pending});
      }
    } else if (r.kind == Kind::kAllocated || r.kind == Kind::kPending) {
      bool is_pending = false;
      const std::size_t req = requested(addr, is_pending);
      s.blocks.push_back({addr, s.size, req, !is_pending, is_pending});
    } else {
      s.blocks.push_back({addr, s.size, 0, false});
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<TraceEntry> Allocator::trace() const {
  std::lock_guard<std::mutex> lock(mu_);
  return trace_.entries();
}

bool Allocator::owns(std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.count(addr) != 0;
}

bool Allocator::is_live(std::uintptr_t addr, std::size_t nbytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (addr + nbytes < addr) return false;
  auto r = ranges_.upper_bound(addr);
  if (r == ranges_.begin()) return false;
  --r;
  if (r->second.kind == Kind::kAllocated) {
    const auto& a = live_.at(r->first);
    return addr + nbytes <= r->first + a.requested;
  }
  if (r->second.kind != Kind::kSlab) return false;
  auto b = small_.upper_bound(addr);
  if (b == small_.begin()) return false;
  --b;
  if (b->second.free) return false;
  auto a = live_.find(b->first);  // a used block that is not live is a pending free
  return a != live_.end() && addr + nbytes <= b->first + a->second.requested;
}

void Allocator::check_invariants() const {
  std::lock_guard<std::mutex> lock(mu_);
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw std::logic_error("vmalloc invariant violated: " + what);
  };
  std::unordered_map<std::uintptr_t, const Allocation*> pending;
  for (const auto& [seq, p] : pending_) {
    require(pending.emplace(p.addr, &p.a).second, "a block is pending twice");
    require(!p.events.empty(), "a pending free waits for no event");
  }
  for (const auto& p : deferred_) require(pending.emplace(p.addr, &p.a).second, "a block is pending twice");
  std::int64_t requested = 0, allocated = 0, active_bytes = 0;
  auto check_block = [&](std::uintptr_t addr, const Allocation& a, Kind large_kind) {
    if (a.small) {
      auto b = small_.find(addr);
      require(b != small_.end() && !b->second.free && b->second.size == a.size, "small allocation without its block");
    } else {
      auto r = ranges_.find(addr);
      require(r != ranges_.end() && r->second.kind == large_kind && r->second.nchunks * chunk_ == a.size,
              large_kind == Kind::kPending ? "pending free without its range" : "large allocation without its range");
    }
  };
  for (const auto& [addr, a] : live_) {
    require(pending.count(addr) == 0, "a live allocation is also pending");
    requested += static_cast<std::int64_t>(a.requested);
    allocated += static_cast<std::int64_t>(a.size);
    check_block(addr, a, Kind::kAllocated);
  }
  active_bytes = allocated;
  for (const auto& [addr, a] : pending) {
    active_bytes += static_cast<std::int64_t>(a->size);
    check_block(addr, *a, Kind::kPending);
  }
  require(requested == stats_.requested_bytes.current, "requested_bytes != recount");
  require(allocated == stats_.allocated_bytes.current, "allocated_bytes != recount");
  require(active_bytes == stats_.active_bytes.current, "active_bytes != recount");
  require(static_cast<std::int64_t>(live_.size()) == stats_.allocation.current, "allocation count != recount");
  require(static_cast<std::int64_t>(live_.size() + pending.size()) == stats_.active.current, "active count != recount");

  std::set<std::uintptr_t> stuck_addrs;
  for (const Stuck& s : quarantine_)
    if (s.addr) require(stuck_addrs.insert(s.addr).second, "a quarantined address twice");
  std::size_t mapped = 0, cached = 0, slabs = 0, empty = 0;
  std::uintptr_t prev_end = 0;
  const Range* prev = nullptr;
  for (const auto& [addr, r] : ranges_) {
    require(r.nchunks > 0, "an empty range");
    require(addr >= prev_end, "mapped ranges overlap");
    if (prev && prev_end == addr && prev->kind == Kind::kCached && r.kind == Kind::kCached &&
        prev->stream == r.stream && prev->reservation == r.reservation)
      require(false, "adjacent cached ranges of one stream were not merged");
    prev_end = addr + r.nchunks * chunk_;
    prev = &r;
    mapped += r.nchunks;
    for (std::size_t i = 0; i < r.nchunks; ++i) {
      require(chunk_at_.count(addr + i * chunk_) == 1, "a mapped chunk address has no chunk");
      require(stuck_addrs.count(addr + i * chunk_) == 0, "a quarantined chunk's address is inside a range");
    }
    if (r.kind == Kind::kCached) {
      cached += r.nchunks;
      auto c = cached_.find(r.stream);
      require(c != cached_.end() && c->second.count({r.nchunks, addr}), "cached range missing from its stream's set");
      require(lru_.count({r.free_seq, addr}) == 1, "cached range missing from the LRU order");
    } else if (r.kind == Kind::kSlab) {
      ++slabs;
      std::size_t covered = 0, used = 0;
      bool prev_free = false;
      for (auto b = small_.lower_bound(addr); b != small_.end() && b->second.slab == addr; ++b) {
        require(b->first == addr + covered, "slab blocks do not tile the slab");
        covered += b->second.size;
        if (b->second.free) {
          require(!prev_free, "adjacent free small blocks were not merged");
          auto f = small_free_.find(r.stream);
          require(f != small_free_.end() && f->second.count({b->second.size, b->first}), "free block missing from its set");
        } else {
          used += b->second.size;
          require(live_.count(b->first) + pending.count(b->first) == 1,
                  "used small block is neither a live allocation nor a pending free");
        }
        prev_free = b->second.free;
      }
      require(covered == chunk_, "slab blocks do not cover the slab");
      require(used == r.slab_used, "slab_used != recount");
      if (used == 0) {
        ++empty;
        require(empty_slabs_.count(addr) == 1, "empty slab not listed");
      }
    } else if (r.kind == Kind::kAllocated) {
      require(live_.count(addr) == 1, "allocated range is not a live allocation");
    } else {
      require(pending.count(addr) == 1, "pending range is not a pending free");
    }
  }
  std::size_t cached_entries = 0, free_block_entries = 0, free_blocks = 0;
  for (const auto& [s, set] : cached_) cached_entries += set.size();
  for (const auto& [s, set] : small_free_) free_block_entries += set.size();
  for (const auto& [a, b] : small_) free_blocks += b.free ? 1 : 0;
  require(cached_entries == lru_.size(), "per-stream cache and LRU order disagree");
  require(free_block_entries == free_blocks, "free small block sets hold stale entries");
  require(cached == cached_chunks_, "cached chunk count != recount");
  require(empty == empty_slabs_.size(), "empty slab list != recount");
  require(mapped == chunk_at_.size(), "chunk table != mapped chunks");
  require(static_cast<std::int64_t>(mapped * chunk_) == stats_.mapped_bytes.current, "mapped_bytes != recount");
  require(static_cast<std::int64_t>(slabs * chunk_) == stats_.slab_bytes.current, "slab_bytes != recount");
  require(static_cast<std::int64_t>(ranges_.size()) == stats_.segment.current, "segment count != recount");
  require(num_chunks_ == pool_.size() + mapped + quarantine_.size(), "chunks held != pool + mapped + quarantined");
  require(static_cast<std::int64_t>(num_chunks_ * chunk_) == stats_.reserved_bytes.current, "reserved_bytes != recount");
  require(!over_capacity_with_cache() || shrink_blocked_,
          "reserved bytes exceed the capacity while cached memory could be released");
  for (const auto& [s, events] : fences_) {
    require(!events.empty(), "an empty fence list");
    for (std::size_t i = 1; i < events.size(); ++i)
      require(events[i - 1].first < events[i].first, "a stream's fences are out of order");
  }
}

}  // namespace vmalloc
