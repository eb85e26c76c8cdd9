// Allocator: free, record_stream, pending frees and the cache of free ranges (see allocator.h).
#include "allocator.h"

#include <algorithm>

#include "detail/util.h"

namespace vmalloc {

using detail::hex;

// Note [Stream safety]
// Reuse on the allocation's own stream is safe by stream order, so a block freed there is reusable at once
// on that stream. Every other use of the memory goes through chunks leaving their range (reclaim,
// empty_cache, shrinking), to be mapped elsewhere or unmapped, neither of which is stream ordered: before
// chunks leave a cached range the host makes sure the range's stream has done the work queued before the
// range's last free (fence()). A mapping is unmapped only once all its chunks have left their ranges, each
// after such a wait, so no work in flight can touch it (Note [Blocks and slices]).
//
// Note [Sparse fences]
// The wait needs an event recorded on the stream at or after the free. Recording one at every free cost a
// driver call per free (cuEventRecord, plus a cuEventQuery per free to prune the list) although a training
// step that settles never reclaims (Note [Reuse before growth]). So a free records a fence only every
// kFenceStride frees of its stream; a range freed after its stream's newest fence gets one when it must
// leave: fence() records an event then on that stream if the malloc that reclaims runs on it (the stream is
// then known to be alive), else it waits for the whole device (cuCtxSynchronize); either waits for
// everything queued so far rather than only up to the free. Reclaim takes the least recently freed ranges first, whose fence has usually long
// completed; fence() asks (cuEventQuery) before it waits, and num_event_syncs counts only the waits for an
// event not yet complete, the host waits that stop the CPU running ahead of the GPU.
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
      fence_event = fence_due(a.stream) ? backend_->record_event(a.stream) : 0;
    }
  } catch (const BackendError&) {
    for (auto& [s, e] : events) backend_->release_event(e);
    ++stats_.num_backend_errors;
    throw;
  }
  const std::uint64_t seq = ++free_seq_;
  if (!defer) add_fence(a.stream, seq, fence_event);
  if (a.step_index != detail::StepLearner::kNone) learner_.on_free(a.step_index);  // Note [Step plan]
  Allocation freed = std::move(a);
  live_.erase(it);
  trace_.record(TraceEntry::kFreeRequested, addr, freed.size, freed.stream);
  stats_.requested_bytes.decrease(static_cast<std::int64_t>(freed.requested));
  stats_.allocated_bytes.decrease(static_cast<std::int64_t>(freed.size));
  stats_.allocation.decrease(1);
  ++stats_.num_free;
  if (defer || !events.empty()) {
    if (!freed.in_slab && freed.slot < 0) ranges_.at(addr).kind = Kind::kPending;
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
  if (a.in_slab) free_in_slab(addr, seq);
  else if (a.slot >= 0) plan_release(a, seq);
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
  try {
    settle_frees_now(wait);
  } catch (...) {
    shrink_if_over_capacity();  // what settled before the failure is cached: above a lowered capacity, it goes
    throw;
  }
  shrink_if_over_capacity();
}

void Allocator::settle_frees_now(bool wait) {
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
      fence_event = fence_due(d->a.stream) ? backend_->record_event(d->a.stream) : 0;
    } catch (...) {
      for (auto& [s, e] : events) backend_->release_event(e);
      throw;
    }
    const std::uint64_t seq = ++free_seq_;
    add_fence(d->a.stream, seq, fence_event);
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

// Whether the next free on `stream` records a fence (Note [Sparse fences]).
bool Allocator::fence_due(Stream stream) const {
  auto it = fences_.find(stream);
  return it != fences_.end() && it->second.unfenced + 1 >= kFenceStride;
}

// Notes a free at `seq` on `stream`; `event` is what was recorded for it if fence_due(stream) (0 from a
// backend without asynchronous work), and becomes the stream's newest fence.
void Allocator::add_fence(Stream stream, std::uint64_t seq, Event event) {
  const bool due = fence_due(stream);
  auto it = fences_.try_emplace(stream).first;
  Fences& f = it->second;
  if (!due) {
    ++f.unfenced;
    return;
  }
  f.unfenced = 0;
  if (!event) {
    if (f.events.empty()) fences_.erase(it);
    return;
  }
  f.events.emplace_back(seq, event);
  prune_fences(f);
}

// Waits until `stream` has done the work queued before its free at `seq`: the oldest fence recorded at or after
// it, else one recorded now (Note [Sparse fences]). Fences before the one waited for complete with it (stream
// order) and are dropped. A failure changes nothing: the events stay, nothing is unmapped.
void Allocator::fence(Stream stream, std::uint64_t seq) {
  auto it = fences_.find(stream);
  if (it == fences_.end()) return;  // nothing freed on the stream since its last wait
  auto& events = it->second.events;
  auto due = std::find_if(events.begin(), events.end(), [&](const auto& e) { return e.first >= seq; });
  if (due == events.end()) {
    if (it->second.unfenced == 0) return;  // its newest fence is no older than the free, and completed
    if (!calling_stream_ || *calling_stream_ != stream) {
      // Recording on a stream the caller is not using could touch a destroyed stream's handle: wait for the
      // whole device instead, which completes every stream's fences.
      backend_->synchronize();  // throws: nothing changed
      ++stats_.num_event_syncs;
      drop_fences();
      return;
    }
    const Event now = backend_->record_event(stream);
    if (!now) {  // a backend without asynchronous work: nothing is in flight
      it->second.unfenced = 0;
      if (events.empty()) fences_.erase(it);
      return;
    }
    events.emplace_back(free_seq_, now);
    it->second.unfenced = 0;
    due = std::prev(events.end());
  }
  if (!backend_->event_done(due->second)) {
    backend_->event_synchronize(due->second);  // throws: the events stay, nothing is unmapped
    ++stats_.num_event_syncs;
  }
  for (auto e = events.begin(); e != std::next(due); ++e) backend_->release_event(e->second);
  events.erase(events.begin(), std::next(due));
  if (events.empty() && it->second.unfenced == 0) fences_.erase(it);
}

// After the device has done all work submitted so far: every stream's fences are complete.
void Allocator::drop_fences() noexcept {
  for (auto& [stream, f] : fences_)
    for (auto& [seq, event] : f.events) backend_->release_event(event);
  fences_.clear();
}

// Drops fences that have completed, so that the list stays short on a stream that is never reclaimed.
void Allocator::prune_fences(Fences& f) noexcept {
  if (quiet()) return;
  try {
    while (f.events.size() > 64 && backend_->event_done(f.events.front().second)) {
      backend_->release_event(f.events.front().second);
      f.events.pop_front();
    }
  } catch (const std::exception& e) {  // querying failed: keep the event, a later fence waits for it
    note_backend_error(e);
  }
}

}  // namespace vmalloc
