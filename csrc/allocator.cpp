#include "allocator.h"

#include <algorithm>
#include <sstream>

namespace vmalloc {
namespace {

constexpr std::size_t kSmallRound = 512;  // as PyTorch's kMinBlockSize

std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

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
  std::size_t cap = c.capacity;
  if (cap == 0) {
    const std::size_t total = b.total_memory();
    if (std::string(b.name()) == "cuda") cap = total - std::min(total / 2, std::max(total / 16, std::size_t{1} << 30));
    else if (std::string(b.name()) == "host") cap = total / 2;
    else cap = total;
  }
  if (cap < c.chunk_size) {
    throw std::invalid_argument("capacity " + format_size(cap) + " is smaller than one chunk (" +
                                format_size(c.chunk_size) + "): raise capacity or lower chunk_size");
  }
  return cap / c.chunk_size;
}

}  // namespace

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
      backend_(backend ? std::move(backend) : make_backend(config.backend, config.device)),
      chunk_(checked_chunk_size(config_, *backend_)),
      capacity_chunks_(initial_capacity_chunks(config_, *backend_)),
      small_max_(config.small_max),
      // Address space is cheap; reserve 4x the capacity up front so ranges rarely need a new reservation.
      va_(*backend_, 4 * capacity_chunks_ * chunk_),
      trace_(config.history) {
  config_.capacity = capacity_chunks_ * chunk_;
}

Allocator::~Allocator() {
  // Live allocations' chunks are released too: whoever still holds them is past caring (process exit).
  for (auto& [seq, event] : fences_) {
    backend_->event_synchronize(event);
    backend_->release_event(event);
  }
  for (auto& [addr, chunk] : chunk_at_) {
    backend_->unmap(addr, chunk_);
    backend_->release_chunk(chunk, chunk_);
  }
  for (ChunkHandle c : pool_) backend_->release_chunk(c, chunk_);
}

std::size_t Allocator::capacity() const {
  std::lock_guard<std::mutex> lock(mu_);
  return capacity_chunks_ * chunk_;
}

std::size_t Allocator::creatable_chunks() const {
  if (device_full_ || num_chunks_ >= capacity_chunks_) return 0;
  return capacity_chunks_ - num_chunks_;
}

// ---------------------------------------------------------------------------------------------------------
// malloc

std::uintptr_t Allocator::malloc(std::size_t nbytes, Stream stream, bool call_handler) {
  if (nbytes == 0) return 0;
  const bool small = nbytes <= small_max_;
  std::shared_ptr<OomHandler> handler;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (nbytes <= capacity_chunks_ * chunk_) {
      if (std::uintptr_t p = try_malloc(nbytes, stream)) return p;
      if (call_handler) handler = oom_handler_;
    }
    if (handler) ++stats_.num_oom_handler_calls;
  }
  // The handler runs unlocked: it frees memory through this allocator (the swap runtime evicts).
  if (handler && (*handler)(nbytes)) {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.num_alloc_retries;
    if (std::uintptr_t p = try_malloc(nbytes, stream)) return p;
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.num_ooms;
  trace_.record(TraceEntry::kOom, 0, nbytes, stream);
  throw OutOfMemory(oom_message(nbytes, small ? round_up(nbytes, kSmallRound) : round_up(nbytes, chunk_)));
}

std::uintptr_t Allocator::try_malloc(std::size_t nbytes, Stream stream) {
  const bool small = nbytes <= small_max_;
  const std::size_t size = small ? round_up(nbytes, kSmallRound) : round_up(nbytes, chunk_);
  const std::uintptr_t p = small ? malloc_small(size, stream) : malloc_large(size / chunk_, stream);
  if (!p) return 0;
  live_.emplace(p, Allocation{nbytes, size, stream, small, {}});
  stats_.requested_bytes.increase(static_cast<std::int64_t>(nbytes));
  stats_.allocated_bytes.increase(static_cast<std::int64_t>(size));
  stats_.allocation.increase(1);
  ++stats_.num_alloc;
  trace_.record(TraceEntry::kAlloc, p, size, stream);
  return p;
}

std::uintptr_t Allocator::malloc_small(std::size_t size, Stream stream) {
  SizeSet& free_blocks = small_free_[stream];
  auto it = free_blocks.lower_bound({size, 0});
  if (it == free_blocks.end()) {
    const std::uintptr_t slab = malloc_large(1, stream);
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
std::uintptr_t Allocator::malloc_large(std::size_t k, Stream stream) {
  // 2. best fit among this stream's cached ranges
  auto cached = cached_.find(stream);
  if (cached != cached_.end()) {
    auto it = cached->second.lower_bound({k, 0});
    if (it != cached->second.end()) return take_cached(it->second, k);
  }
  // 3. chunks that are already free (the pool), then fresh ones, in the order the policy prefers
  const std::size_t idle = cached_chunks_ + empty_slabs_.size();
  if (config_.eager_growth && pool_.size() + creatable_chunks() >= k) {
    if (std::uintptr_t p = map_fresh(k, stream)) return p;
  }
  if (pool_.size() + idle + creatable_chunks() < k) return 0;
  // 4. reclaim chunks of cached ranges (any stream) and empty slabs; create only what is still missing
  if (pool_.size() < k) {
    retire_empty_slabs();
    const std::size_t want = k - pool_.size();
    const std::size_t from_cache = config_.eager_growth ? want - std::min(want, creatable_chunks())
                                                        : std::min(want, cached_chunks_);
    if (!reclaim(from_cache)) return 0;
  }
  if (std::uintptr_t p = map_fresh(k, stream)) return p;
  // The device refused chunks below the capacity (map_fresh set device_full_): stitch what is cached.
  if (pool_.size() + cached_chunks_ < k) return 0;
  if (!reclaim(k - pool_.size())) return 0;
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
  std::vector<ChunkHandle> chunks;
  chunks.reserve(k);
  while (chunks.size() < k && !pool_.empty()) {
    chunks.push_back(pool_.back());
    pool_.pop_back();
  }
  try {
    while (chunks.size() < k && creatable_chunks() > 0) {
      chunks.push_back(backend_->create_chunk(chunk_));
      ++num_chunks_;
      ++stats_.num_device_alloc;
      stats_.reserved_bytes.increase(static_cast<std::int64_t>(chunk_));
    }
  } catch (const BackendOutOfMemory&) {
    device_full_ = true;  // the device has less than our capacity: work with the chunks we have
  }
  if (chunks.size() < k) {
    pool_.insert(pool_.end(), chunks.begin(), chunks.end());
    return 0;
  }
  const auto slice = va_.take(k * chunk_);
  std::size_t mapped = 0;
  try {
    for (; mapped < k; ++mapped) backend_->map(slice.addr + mapped * chunk_, chunk_, chunks[mapped]);
    backend_->set_access(slice.addr, k * chunk_);
  } catch (...) {
    for (std::size_t i = 0; i < mapped; ++i) backend_->unmap(slice.addr + i * chunk_, chunk_);
    pool_.insert(pool_.end(), chunks.begin(), chunks.end());
    va_.give(slice.reservation, slice.addr, k * chunk_);
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
// serve its stream.
bool Allocator::reclaim(std::size_t need) {
  if (need == 0) return true;
  ++stats_.num_reclaims;
  while (need > 0 && !lru_.empty()) {
    const auto [seq, addr] = *lru_.begin();
    const std::size_t take = std::min(need, ranges_.at(addr).nchunks);
    fence(seq);
    unmap_tail(addr, take);
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

void Allocator::unmap_tail(std::uintptr_t addr, std::size_t m) {
  auto it = ranges_.find(addr);
  Range& r = it->second;
  erase_cached(addr, r);
  const std::size_t keep = r.nchunks - m;
  const std::uintptr_t tail = addr + keep * chunk_;
  for (std::size_t i = 0; i < m; ++i) {
    const std::uintptr_t a = tail + i * chunk_;
    backend_->unmap(a, chunk_);
    auto c = chunk_at_.find(a);
    pool_.push_back(c->second);
    chunk_at_.erase(c);
  }
  stats_.num_unmaps += static_cast<std::int64_t>(m);
  stats_.mapped_bytes.decrease(static_cast<std::int64_t>(m * chunk_));
  va_.give(r.reservation, tail, m * chunk_);
  trace_.record(TraceEntry::kSegmentUnmap, tail, m * chunk_, r.stream);
  if (keep == 0) {
    ranges_.erase(it);
    stats_.segment.decrease(1);
  } else {
    r.nchunks = keep;
    insert_cached(addr, r);
  }
}

// ---------------------------------------------------------------------------------------------------------
// free

// Note [Stream safety]
// Reuse on the allocation's own stream is safe by stream order, so a freed block is reusable at once there.
// Every other use of the memory goes through unmapping (reclaim, empty_cache), and unmapping is not stream
// ordered, so each free records an event on its stream and an unmap first waits for every event recorded at
// or before the range's last free (fence). Streams added with record_stream are folded into the
// allocation's stream at free time: the stream waits for an event on each, so "the allocation stream has
// passed the free" implies "every stream that used the block has".
std::uint64_t Allocator::record_free(const Allocation& a) {
  const std::uint64_t seq = ++free_seq_;
  for (Stream s : a.other_streams) {
    if (Event e = backend_->record_event(s)) {
      backend_->stream_wait(a.stream, e);
      backend_->release_event(e);
      ++stats_.num_stream_waits;
    }
  }
  if (Event e = backend_->record_event(a.stream)) fences_.emplace_back(seq, e);
  while (fences_.size() > 64 && backend_->event_done(fences_.front().second)) {
    backend_->release_event(fences_.front().second);
    fences_.pop_front();
  }
  return seq;
}

void Allocator::fence(std::uint64_t seq) {
  while (!fences_.empty() && fences_.front().first <= seq) {
    backend_->event_synchronize(fences_.front().second);
    backend_->release_event(fences_.front().second);
    fences_.pop_front();
    ++stats_.num_event_syncs;
  }
}

void Allocator::free(std::uintptr_t addr) {
  if (addr == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(addr);
  if (it == live_.end()) {
    std::ostringstream msg;
    msg << "vmalloc: free of 0x" << std::hex << addr
        << ", which is not a live allocation of this arena (a double free, or a pointer from another allocator)";
    throw std::invalid_argument(msg.str());
  }
  const Allocation a = std::move(it->second);
  live_.erase(it);
  trace_.record(TraceEntry::kFreeRequested, addr, a.size, a.stream);
  const std::uint64_t seq = record_free(a);
  stats_.requested_bytes.decrease(static_cast<std::int64_t>(a.requested));
  stats_.allocated_bytes.decrease(static_cast<std::int64_t>(a.size));
  stats_.allocation.decrease(1);
  ++stats_.num_free;
  if (a.small) free_small(addr, seq);
  else cache_range(addr, seq);
  trace_.record(TraceEntry::kFreeCompleted, addr, a.size, a.stream);
  if (num_chunks_ > capacity_chunks_) shrink_to_capacity();
}

void Allocator::free_small(std::uintptr_t addr, std::uint64_t seq) {
  auto it = small_.find(addr);
  const std::uintptr_t slab_addr = it->second.slab;
  Range& slab = ranges_.at(slab_addr);
  slab.slab_used -= it->second.size;
  slab.free_seq = seq;
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
  if (it == live_.end()) throw std::invalid_argument("vmalloc: record_stream on an address that is not a live allocation");
  Allocation& a = it->second;
  if (stream != a.stream && std::find(a.other_streams.begin(), a.other_streams.end(), stream) == a.other_streams.end())
    a.other_streams.push_back(stream);
}

// ---------------------------------------------------------------------------------------------------------
// releasing memory

void Allocator::release_pool_chunks(std::size_t keep) {
  while (pool_.size() > keep) {
    backend_->release_chunk(pool_.back(), chunk_);
    pool_.pop_back();
    --num_chunks_;
    ++stats_.num_device_free;
    stats_.reserved_bytes.decrease(static_cast<std::int64_t>(chunk_));
  }
  device_full_ = false;
}

void Allocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  retire_empty_slabs();
  while (!lru_.empty()) {
    const auto [seq, addr] = *lru_.begin();
    fence(seq);
    unmap_tail(addr, ranges_.at(addr).nchunks);
  }
  release_pool_chunks(0);
}

void Allocator::shrink_to_capacity() {
  auto excess = [&] { return num_chunks_ > capacity_chunks_ ? num_chunks_ - capacity_chunks_ : 0; };
  release_pool_chunks(pool_.size() - std::min(pool_.size(), excess()));
  if (excess() == 0) return;
  retire_empty_slabs();
  reclaim(std::min(excess(), cached_chunks_));
  release_pool_chunks(pool_.size() - std::min(pool_.size(), excess()));
}

void Allocator::set_capacity(std::size_t bytes) {
  if (bytes < chunk_)
    throw std::invalid_argument("capacity " + format_size(bytes) + " is smaller than one chunk (" +
                                format_size(chunk_) + ")");
  std::lock_guard<std::mutex> lock(mu_);
  capacity_chunks_ = bytes / chunk_;
  config_.capacity = capacity_chunks_ * chunk_;
  device_full_ = false;
  shrink_to_capacity();
}

void Allocator::set_oom_handler(OomHandler handler) {
  std::lock_guard<std::mutex> lock(mu_);
  oom_handler_ = handler ? std::make_shared<OomHandler>(std::move(handler)) : nullptr;
}

void Allocator::set_history(std::size_t entries) {
  std::lock_guard<std::mutex> lock(mu_);
  config_.history = entries;
  trace_.set_capacity(entries);
}

void Allocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  for (detail::Stat* s : {&stats_.requested_bytes, &stats_.allocated_bytes, &stats_.allocation, &stats_.reserved_bytes,
                          &stats_.mapped_bytes, &stats_.segment, &stats_.slab_bytes})
    s->reset_peak();
}

// ---------------------------------------------------------------------------------------------------------
// introspection

std::string Allocator::oom_message(std::size_t nbytes, std::size_t rounded) const {
  const std::size_t allocated = static_cast<std::size_t>(stats_.allocated_bytes.current);
  const std::size_t reserved = num_chunks_ * chunk_;
  const std::size_t capacity = capacity_chunks_ * chunk_;
  const std::size_t cached = reserved - std::min(reserved, allocated);
  std::ostringstream m;
  m << "vmalloc out of memory: tried to allocate " << format_size(nbytes) << " (" << nbytes << " bytes, "
    << rounded << " after rounding to " << (nbytes <= small_max_ ? "512 B" : format_size(chunk_) + " chunks")
    << ") on the " << backend_->name() << " backend; " << format_size(allocated) << " allocated (" << allocated
    << " bytes), " << format_size(cached) << " cached free (" << cached << " bytes), " << format_size(reserved)
    << " reserved (" << reserved << " bytes) of capacity " << format_size(capacity) << " (" << capacity
    << " bytes)";
  if (device_full_) m << "; the device itself refused more chunks below the capacity (other processes?)";
  m << ". Free tensors, lower the batch size, raise the capacity (Arena(capacity=...) or VMALLOC_CONF=capacity=...)"
       ", or let the swap runtime evict.";
  return m.str();
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
  // Nothing waits on events before reuse (Note [Stream safety]), so active == allocated, as in PyTorch
  // without record_stream.
  stat("active_bytes", stats_.allocated_bytes);
  stat("allocation", stats_.allocation);
  stat("active", stats_.allocation);
  stat("reserved_bytes", stats_.reserved_bytes);
  stat("mapped_bytes", stats_.mapped_bytes);
  stat("segment", stats_.segment);
  stat("slab_bytes", stats_.slab_bytes);
  const auto mapped = stats_.mapped_bytes.current, allocated = stats_.allocated_bytes.current;
  out.emplace_back("inactive_split_bytes.all.current", mapped - allocated);
  out.emplace_back("cached_free_bytes", stats_.reserved_bytes.current - allocated);
  out.emplace_back("internal_fragmentation_bytes", allocated - stats_.requested_bytes.current);
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
  std::vector<SegmentInfo> out;
  out.reserve(ranges_.size());
  for (const auto& [addr, r] : ranges_) {
    SegmentInfo s{addr, r.nchunks * chunk_, r.stream, r.kind == Kind::kSlab, {}};
    if (r.kind == Kind::kSlab) {
      for (auto b = small_.lower_bound(addr); b != small_.end() && b->second.slab == addr; ++b) {
        const std::size_t req = b->second.free ? 0 : live_.at(b->first).requested;
        s.blocks.push_back({b->first, b->second.size, req, !b->second.free});
      }
    } else if (r.kind == Kind::kAllocated) {
      s.blocks.push_back({addr, s.size, live_.at(addr).requested, true});
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
  return addr + nbytes <= b->first + live_.at(b->first).requested;
}

void Allocator::check_invariants() const {
  std::lock_guard<std::mutex> lock(mu_);
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw std::logic_error("vmalloc invariant violated: " + what);
  };
  std::int64_t requested = 0, allocated = 0;
  for (const auto& [addr, a] : live_) {
    requested += static_cast<std::int64_t>(a.requested);
    allocated += static_cast<std::int64_t>(a.size);
    if (a.small) {
      auto b = small_.find(addr);
      require(b != small_.end() && !b->second.free && b->second.size == a.size, "small allocation without its block");
    } else {
      auto r = ranges_.find(addr);
      require(r != ranges_.end() && r->second.kind == Kind::kAllocated && r->second.nchunks * chunk_ == a.size,
              "large allocation without its range");
    }
  }
  require(requested == stats_.requested_bytes.current, "requested_bytes != recount");
  require(allocated == stats_.allocated_bytes.current, "allocated_bytes != recount");
  require(static_cast<std::int64_t>(live_.size()) == stats_.allocation.current, "allocation count != recount");

  std::size_t mapped = 0, cached = 0, slabs = 0, empty = 0, nallocated_ranges = 0;
  std::uintptr_t prev_end = 0;
  const Range* prev = nullptr;
  for (const auto& [addr, r] : ranges_) {
    require(addr >= prev_end, "mapped ranges overlap");
    if (prev && prev_end == addr && prev->kind == Kind::kCached && r.kind == Kind::kCached &&
        prev->stream == r.stream && prev->reservation == r.reservation)
      require(false, "adjacent cached ranges of one stream were not merged");
    prev_end = addr + r.nchunks * chunk_;
    prev = &r;
    mapped += r.nchunks;
    for (std::size_t i = 0; i < r.nchunks; ++i)
      require(chunk_at_.count(addr + i * chunk_) == 1, "a mapped chunk address has no chunk");
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
          require(live_.count(b->first) == 1, "used small block is not a live allocation");
        }
        prev_free = b->second.free;
      }
      require(covered == chunk_, "slab blocks do not cover the slab");
      require(used == r.slab_used, "slab_used != recount");
      if (used == 0) {
        ++empty;
        require(empty_slabs_.count(addr) == 1, "empty slab not listed");
      }
    } else {
      ++nallocated_ranges;
      require(live_.count(addr) == 1, "allocated range is not a live allocation");
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
  require(num_chunks_ == pool_.size() + mapped, "chunks held != pool + mapped");
  require(static_cast<std::int64_t>(num_chunks_ * chunk_) == stats_.reserved_bytes.current, "reserved_bytes != recount");
  require(num_chunks_ <= capacity_chunks_ || (pool_.empty() && cached_chunks_ == 0 && empty_slabs_.empty()),
          "reserved bytes exceed the capacity while cached memory could be released");
}

}  // namespace vmalloc
