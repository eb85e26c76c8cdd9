// Allocator: giving memory back (empty_cache, capacity, quarantine) and settings (see allocator.h).
#include "allocator.h"

#include <algorithm>
#include <cstdint>

namespace vmalloc {

// Note [Empty cache]
// empty_cache releases every cached range (their chunks leave them, and mappings left with none are
// unmapped), then every block that is wholly free; it keeps going past a failure (a mapping that cannot be
// unmapped stays stuck, a block that cannot be released is quarantined) and then retries: at the host's
// mapping limit, unmapping other ranges is what makes the failing one possible again. It throws the first
// backend error only if it could not empty the cache in the end; errors it got past are counted. A block
// with a chunk still in use (a live allocation, a slab, a pending free) stays: empty_cache gives memory back
// in whole blocks (Note [Blocks and slices]).
void Allocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  std::exception_ptr first;
  auto attempt = [&](auto&& fn) {
    try {
      fn();
    } catch (const BackendError& e) {
      note_backend_error(e);
      if (!first) first = std::current_exception();
    }
  };
  attempt([&] { settle_frees(/*wait=*/true); });
  plan_retire();  // its idle chunks are cached memory too (Note [Step plan])
  if (quiet()) {  // a capture is announced: no waiting and no unmapping; wholly free blocks can go
    attempt([&] { release_free_blocks(SIZE_MAX); });
    shrink_blocked_ = over_capacity_with_cache();
    if (first && releasable_chunks() > 0) std::rethrow_exception(first);
    return;
  }
  trim_slabs();
  retire_empty_slabs();
  auto remaining = [&] { return cached_chunks_ + stuck_.size() + quarantined_chunks_ + releasable_chunks(); };
  for (std::size_t left = remaining(), before = left + 1; left > 0 && left < before; before = left, left = remaining()) {
    uncache_all(first);
    attempt([&] { release_free_blocks(SIZE_MAX); });
    retry_quarantine();
  }
  // Blocks whose release failed may remain above a lowered capacity.
  shrink_blocked_ = over_capacity_with_cache();
  if (first && remaining() > 0) std::rethrow_exception(first);
}

// Every cached range (empty slabs first become cached ranges) leaves its chunks to the pool, each after
// waiting for its stream; then the mappings left without a chunk in a range, and the stuck ones, are
// unmapped in address order: on the host backend unmapping neighbours one after another merges their holes
// instead of splitting mappings, so the process's mapping count never rises on the way down (Note [Out of
// mappings]). A range whose wait fails stays cached. The first failure (a wait, or an unmap: the mapping
// stays stuck) is kept in `first` unless it holds one already; all are counted. Returns whether anything was
// released or unmapped.
bool Allocator::uncache_all(std::exception_ptr& first) {
  trim_slabs();
  retire_empty_slabs();
  std::vector<std::uintptr_t> dead(stuck_.begin(), stuck_.end());
  const std::size_t before = mappings_.size() + cached_chunks_;
  for (auto it = lru_.begin(); it != lru_.end();) {
    const auto [seq, addr] = *it;
    ++it;  // detach_tail erases this entry
    try {
      fence(ranges_.at(addr).stream, seq);
    } catch (const BackendError& e) {  // the range stays cached
      note_backend_error(e);
      if (!first) first = std::current_exception();
      continue;
    }
    const std::vector<std::uintptr_t> more = detach_tail(addr, ranges_.at(addr).nchunks);
    dead.insert(dead.end(), more.begin(), more.end());
  }
  std::sort(dead.begin(), dead.end());
  if (std::exception_ptr e = unmap_dead(dead); e && !first) first = e;
  return mappings_.size() + cached_chunks_ < before;
}

bool Allocator::over_capacity_with_cache() const {
  return num_chunks_ > capacity_chunks_ && (cached_chunks_ > 0 || !empty_slabs_.empty() || releasable_chunks() > 0);
}

// Capacity goes back in whole blocks (Note [Blocks and slices]): wholly free blocks first, then cached ranges,
// least recently freed first, leave their chunks until enough blocks are wholly free, or none is cached.
// Returns an unmap failure (already counted) that kept the arena above the capacity, or null; throws the
// other backend failures.
std::exception_ptr Allocator::shrink_to_capacity() {
  auto excess = [&] { return num_chunks_ > capacity_chunks_ ? num_chunks_ - capacity_chunks_ : 0; };
  shrink_blocked_ = true;  // until this completes
  std::exception_ptr unmap_failure;
  if (!quiet() && (!stuck_.empty() || quarantined_chunks_ > 0)) retry_quarantine();
  if (excess() > 0) plan_retire();  // Note [Step plan]
  release_free_blocks(excess());
  if (excess() > 0 && !quiet()) {
    trim_slabs();
    retire_empty_slabs();
    while (excess() > 0 && !lru_.empty()) {
      const auto [seq, addr] = *lru_.begin();
      fence(ranges_.at(addr).stream, seq);
      if (std::exception_ptr e = release_tail(addr, ranges_.at(addr).nchunks); e && !unmap_failure) unmap_failure = e;
      release_free_blocks(excess());
    }
  }
  // While a capture is announced cached ranges stay (no unmapping): released when it ends.
  shrink_blocked_ = over_capacity_with_cache();
  return excess() > 0 ? unmap_failure : nullptr;
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
  std::exception_ptr unmap_failure;  // counted where it happened
  try {
    unmap_failure = shrink_to_capacity();
  } catch (const BackendError&) {
    ++stats_.num_backend_errors;
    throw;
  }
  if (unmap_failure) std::rethrow_exception(unmap_failure);
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
  slack_peak_chunks_ = slack_chunks();
  held_peak_chunks_ = held_chunks();
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

}  // namespace vmalloc
