// Allocator: giving memory back (empty_cache, capacity, quarantine) and settings (see allocator.h).
#include "allocator.h"

namespace vmalloc {

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
