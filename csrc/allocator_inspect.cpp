// Allocator: statistics, segments, trace, messages and the invariant check (see allocator.h).
#include "allocator.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "detail/util.h"

namespace vmalloc {

using detail::kSmallRound;
using detail::round_up;

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
    const bool small = nbytes <= small_max_, mid = !small && nbytes <= mid_max_;
    m << ", " << round_up(nbytes, small ? kSmallRound : mid ? mid_round_ : chunk_) << " after rounding to "
      << (small ? "512 B" : mid ? format_size(mid_round_) + " in a mid-size slab" : format_size(chunk_) + " chunks");
  }
  m << ") on the " << backend_->name() << " backend; " << format_size(allocated) << " allocated (" << allocated
    << " bytes), " << format_size(cached) << " cached free (" << cached << " bytes), " << format_size(reserved)
    << " reserved (" << reserved << " bytes) of capacity " << format_size(capacity) << " (" << capacity
    << " bytes)";
  if (active > allocated)
    m << "; " << format_size(active - allocated) << " freed but still in use by other streams (record_stream)";
  if (quarantined_chunks_ > 0)
    m << "; " << quarantined_chunks_ << " chunk(s) quarantined after backend failures (last: " << last_backend_error_
      << ")";
  if (device_full_) m << "; the device itself refused more chunks below the capacity (other processes?)";
  m << ". Free tensors, lower the batch size, raise the capacity (Arena(capacity=...) or VMALLOC_CONF=capacity=...)"
       ", or let the swap runtime evict.";
  return m.str();
}

std::int64_t Allocator::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_.allocated_bytes.current;
}

std::int64_t Allocator::peak_allocated_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_.allocated_bytes.peak;
}

std::int64_t Allocator::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_.reserved_bytes.current;
}

std::int64_t Allocator::held_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<std::int64_t>(held_chunks() * chunk_);
}

std::int64_t Allocator::peak_held_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<std::int64_t>(std::max(held_peak_chunks_, held_chunks()) * chunk_);
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
  // Note [Slack reported apart]
  out.emplace_back("slack_bytes.all.current", static_cast<std::int64_t>(slack_chunks() * chunk_));
  out.emplace_back("slack_bytes.all.peak", static_cast<std::int64_t>(slack_peak_chunks_ * chunk_));
  // Note [Held bytes] in allocator.cpp
  out.emplace_back("held_bytes.all.current", static_cast<std::int64_t>(held_chunks() * chunk_));
  out.emplace_back("held_bytes.all.peak", static_cast<std::int64_t>(std::max(held_peak_chunks_, held_chunks()) * chunk_));
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
  // Backend calls (Note [Blocks and slices]: one map per run of a block's chunks), and the chunks they moved.
  out.emplace_back("num_maps", stats_.num_maps);
  out.emplace_back("num_unmaps", stats_.num_unmaps);
  out.emplace_back("num_set_access", stats_.num_set_access);
  out.emplace_back("num_mapped_chunks", stats_.num_mapped_chunks);
  out.emplace_back("num_unmapped_chunks", stats_.num_unmapped_chunks);
  out.emplace_back("num_created_chunks", stats_.num_created_chunks);
  out.emplace_back("num_released_chunks", stats_.num_released_chunks);
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
  // Note [Step plan]: plans made and abandoned, mallocs served from a slot, slots that could not serve; the
  // chunks the plan holds (counted in reserved_bytes) and those of them no allocation uses now; its period.
  out.emplace_back("num_plans", stats_.num_plans);
  out.emplace_back("num_plans_abandoned", stats_.num_plans_abandoned);
  out.emplace_back("num_plan_hits", stats_.num_plan_hits);
  out.emplace_back("num_plan_misses", stats_.num_plan_misses);
  out.emplace_back("plan_chunks", static_cast<std::int64_t>(plan_held_chunks_));
  out.emplace_back("plan_idle_chunks", static_cast<std::int64_t>(plan_idle_chunks_));
  out.emplace_back("plan_period", static_cast<std::int64_t>(plan_ ? plan_->tokens.size() : 0));
  out.emplace_back("plan_colors", static_cast<std::int64_t>(plan_ ? plan_->colors.size() : 0));
  out.emplace_back("plan_peak_chunks", static_cast<std::int64_t>(plan_ ? plan_->peak_chunks : 0));
  out.emplace_back("num_backend_errors", stats_.num_backend_errors);
  out.emplace_back("num_quarantined_chunks", static_cast<std::int64_t>(quarantined_chunks_));
  out.emplace_back("num_stuck_mappings", static_cast<std::int64_t>(stuck_.size()));
  out.emplace_back("num_chunks", static_cast<std::int64_t>(num_chunks_));
  out.emplace_back("num_blocks", static_cast<std::int64_t>(blocks_.size()));
  // Chunks of wholly free, unmapped blocks: what empty_cache would give back without unmapping anything.
  out.emplace_back("num_releasable_chunks", static_cast<std::int64_t>(releasable_chunks()));
  out.emplace_back("num_mappings", static_cast<std::int64_t>(mappings_.size()));
  // Chunk addresses still mapped although out of every range (their mapping also holds chunks in use).
  out.emplace_back("num_idle_mapped_chunks",
                   static_cast<std::int64_t>(mapping_chunks_) - stats_.mapped_bytes.current / static_cast<std::int64_t>(chunk_));
  out.emplace_back("num_pool_chunks", static_cast<std::int64_t>(pool_.size()));
  out.emplace_back("num_pool_runs", static_cast<std::int64_t>(pool_.runs()));
  out.emplace_back("num_cached_chunks", static_cast<std::int64_t>(cached_chunks_));
  out.emplace_back("num_empty_slabs", static_cast<std::int64_t>(empty_slabs_.size()));
  out.emplace_back("va_reserved_bytes", static_cast<std::int64_t>(va_.reserved_bytes()));
  out.emplace_back("chunk_size", static_cast<std::int64_t>(chunk_));
  out.emplace_back("small_max", static_cast<std::int64_t>(small_max_));
  out.emplace_back("block_size", static_cast<std::int64_t>(max_block_chunks_ * chunk_));
  out.emplace_back("capacity", static_cast<std::int64_t>(capacity_chunks_ * chunk_));
  return out;
}

// Note [Workspace offers]
// cuDNN's benchmark mode (torch.backends.cudnn.benchmark=True) asks the allocator for the largest block it
// could get (torch's cacheInfo) and tries workspaces up to it. vmalloc can stitch any idle chunks into one
// range, so the honest answer is the idle chunks plus what may still be created: at most capacity minus
// what is in use. Under the swap runtime that is still too much: the capacity is the device's memory, the
// budget is far lower, and iteration 1's workspace trials of several GiB would show up as transient
// memory the plan must leave room for. The runtime sets its budget as the workspace limit, and the offer
// becomes min(idle + creatable, limit - allocated): a workspace within it keeps the step within the budget.
std::size_t Allocator::largest_allocatable(std::size_t creatable_cap) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::size_t idle = pool_.size() + cached_chunks_ + empty_slab_chunks_;
  std::size_t offer = idle * chunk_ + std::min(creatable_chunks() * chunk_, creatable_cap / chunk_ * chunk_);
  if (workspace_limit_) {
    const auto allocated = static_cast<std::size_t>(stats_.allocated_bytes.current);
    offer = std::min(offer, workspace_limit_ > allocated ? workspace_limit_ - allocated : 0);
  }
  return offer;
}

void Allocator::set_workspace_limit(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  workspace_limit_ = bytes;
}

std::size_t Allocator::workspace_limit() const {
  std::lock_guard<std::mutex> lock(mu_);
  return workspace_limit_;
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
  for (const auto& [addr, slot] : plan_live_) {  // Note [Step plan]: slots in use, each its own segment
    const PlanSlot& ps = plan_->slots[slot];
    SegmentInfo s{addr, ps.nchunks * chunk_, ps.stream, false, {}};
    bool is_pending = false;
    const std::size_t req = requested(addr, is_pending);
    s.blocks.push_back({addr, s.size, req, !is_pending, is_pending});
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
  if (plan_) {  // Note [Step plan]: a slot's address may lie anywhere in the address space
    for (const auto& [at, slot] : plan_live_) {
      const std::size_t size = plan_->slots[slot].nchunks * chunk_;
      if (addr >= at && addr - at < size) {
        auto a = live_.find(at);
        return a != live_.end() && addr + nbytes <= at + a->second.requested;
      }
    }
  }
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
    if (a.slot >= 0) {
      require(plan_ && static_cast<std::size_t>(a.slot) < plan_->slots.size(), "a planned allocation without a plan");
      const PlanSlot& s = plan_->slots[a.slot];
      require(s.busy && s.addr == addr && s.nchunks * chunk_ == a.size && plan_live_.count(addr) == 1,
              "a planned allocation without its slot");
    } else if (a.in_slab) {
      auto b = small_.find(addr);
      require(b != small_.end() && !b->second.free && b->second.size == a.size, "slab allocation without its block");
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

  std::size_t mapped = 0, cached = 0, slabs = 0, empty = 0, empty_chunks = 0;
  std::uintptr_t prev_end = 0;
  const Range* prev = nullptr;
  // Note [Blocks and slices]: every chunk address of a range lies in a mapping, whose slice there is in no
  // other range and not in the pool.
  std::unordered_map<std::uintptr_t, std::uint32_t> live_in;  // mapping address -> its chunks in ranges
  std::set<std::pair<detail::BlockId, std::uint32_t>> live_slices;
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
      const std::uintptr_t p = addr + i * chunk_;
      auto m = mappings_.upper_bound(p);
      require(m != mappings_.begin() && p < std::prev(m)->first + std::prev(m)->second.n * chunk_,
              "a chunk address of a range is not mapped");
      --m;
      require(m->second.reservation == r.reservation, "a range and its mapping are in different reservations");
      ++live_in[m->first];
      const auto slice = static_cast<std::uint32_t>(m->second.first + (p - m->first) / chunk_);
      require(live_slices.insert({m->second.block, slice}).second, "a chunk is in two ranges");
    }
    if (r.kind == Kind::kCached) {
      cached += r.nchunks;
      auto c = cached_.find(r.stream);
      require(c != cached_.end() && c->second.count({r.nchunks, addr}), "cached range missing from its stream's set");
      require(lru_.count({r.free_seq, addr}) == 1, "cached range missing from the LRU order");
    } else if (r.kind == Kind::kSlab) {
      slabs += r.nchunks;
      require(r.mid || r.nchunks == 1, "a small slab of more than one chunk");
      std::size_t covered = 0, used = 0;
      bool prev_free = false;
      for (auto b = small_.lower_bound(addr); b != small_.end() && b->second.slab == addr; ++b) {
        require(b->first == addr + covered, "slab blocks do not tile the slab");
        covered += b->second.size;
        if (b->second.free) {
          require(!prev_free, "adjacent free small blocks were not merged");
          const auto& sets = r.mid ? mid_free_ : small_free_;
          auto f = sets.find(r.stream);
          require(f != sets.end() && f->second.count({b->second.size, b->first}), "free block missing from its set");
        } else {
          used += b->second.size;
          require(live_.count(b->first) + pending.count(b->first) == 1,
                  "used small block is neither a live allocation nor a pending free");
        }
        prev_free = b->second.free;
      }
      require(covered == r.nchunks * chunk_, "slab blocks do not cover the slab");
      require(used == r.slab_used, "slab_used != recount");
      if (used == 0) {
        ++empty;
        empty_chunks += r.nchunks;
        require(empty_slabs_.count(addr) == 1, "empty slab not listed");
      }
    } else if (r.kind == Kind::kAllocated) {
      require(!r.mid, "a range that is not a slab is marked mid");
      require(live_.count(addr) == 1, "allocated range is not a live allocation");
    } else {
      require(pending.count(addr) == 1, "pending range is not a pending free");
    }
  }
  std::size_t cached_entries = 0, free_block_entries = 0, free_blocks = 0;
  for (const auto& [s, set] : cached_) cached_entries += set.size();
  for (const auto* sets : {&small_free_, &mid_free_})
    for (const auto& [s, set] : *sets) free_block_entries += set.size();
  for (const auto& [a, b] : small_) free_blocks += b.free ? 1 : 0;
  require(cached_entries == lru_.size(), "per-stream cache and LRU order disagree");
  require(free_block_entries == free_blocks, "free small block sets hold stale entries");
  require(cached == cached_chunks_, "cached chunk count != recount");
  require(empty == empty_slabs_.size(), "empty slab list != recount");
  require(empty_chunks == empty_slab_chunks_, "empty slab chunk count != recount");
  // Mappings: disjoint, inside their blocks; a mapping with no chunk in a range is stuck, and only then.
  std::unordered_map<detail::BlockId, std::uint32_t> block_mappings;
  std::size_t mapping_chunks = 0;
  std::uintptr_t mapping_end = 0;
  for (const auto& [a, m] : mappings_) {
    require(a >= mapping_end, "mappings overlap");
    mapping_end = a + m.n * chunk_;
    auto b = blocks_.find(m.block);
    require(b != blocks_.end() && !b->second.quarantined && m.n > 0 && m.first + m.n <= b->second.nchunks,
            "a mapping outside a live block");
    ++block_mappings[m.block];
    mapping_chunks += m.n;
    auto l = live_in.find(a);
    const std::uint32_t live = l == live_in.end() ? 0 : l->second;
    require(live == m.live, "a mapping's count of chunks in ranges != recount");
    require((live == 0) == (stuck_.count(a) == 1), "a mapping with no chunk in a range is not stuck, or the reverse");
  }
  require(stuck_.size() <= mappings_.size(), "a stuck mapping that does not exist");
  require(mapping_chunks == mapping_chunks_, "mapped chunk addresses != recount");
  // Blocks: each slice is in a range, in the pool or in a quarantined block, exactly once.
  require(pool_.consistent(), "the pool's runs are inconsistent");
  std::size_t block_chunks = 0, quarantined = 0;
  for (const auto& [id, b] : blocks_) {
    auto n = block_mappings.find(id);
    require((n == block_mappings.end() ? 0 : n->second) == b.mappings, "a block's mapping count != recount");
    block_chunks += b.nchunks;
    if (b.quarantined) quarantined += b.nchunks;
  }
  for (const detail::Run& run : pool_.all()) {
    auto b = blocks_.find(run.block);
    require(b != blocks_.end() && !b->second.quarantined && run.first + run.n <= b->second.nchunks,
            "a pooled chunk outside a live block");
    for (std::uint32_t i = run.first; i < run.first + run.n; ++i)
      require(live_slices.count({run.block, i}) == 0, "a chunk is both pooled and in a range");
  }
  require(block_chunks == num_chunks_, "chunks held != the blocks' chunks");
  require(quarantined == quarantined_chunks_, "quarantined chunk count != recount");
  require(static_cast<std::int64_t>(slabs * chunk_) == stats_.slab_bytes.current, "slab_bytes != recount");
  require(static_cast<std::int64_t>(ranges_.size()) == stats_.segment.current, "segment count != recount");
  // Note [Step plan]: the plan's chunks are in no range and not in the pool; a busy slot's colors are its own.
  std::size_t plan_held = 0, plan_idle = 0, plan_mapped = 0;
  if (plan_) {
    std::set<std::pair<detail::BlockId, std::uint32_t>> plan_slices;
    for (const PlanColor& c : plan_->colors) {
      if (!c.held) continue;
      ++plan_held;
      if (c.user < 0) ++plan_idle;
      require(plan_slices.insert({c.block, c.slice}).second, "two colors of the plan hold one chunk");
      require(live_slices.count({c.block, c.slice}) == 0 && !pool_.contains(c.block, c.slice),
              "a chunk of the plan is also in a range or in the pool");
    }
    std::size_t busy = 0;
    for (std::size_t id = 0; id < plan_->slots.size(); ++id) {
      const PlanSlot& s = plan_->slots[id];
      if (!s.busy) continue;
      ++busy;
      plan_mapped += s.nchunks;
      for (std::uint32_t c : s.colors)
        require(plan_->colors[c].held && plan_->colors[c].user == static_cast<std::int32_t>(id),
                "a busy slot's color is not its own");
    }
    require(busy == plan_->busy_slots && busy == plan_live_.size(), "busy slots != recount");
  }
  require(plan_held == plan_held_chunks_ && plan_idle == plan_idle_chunks_, "the plan's chunk counts != recount");
  require(num_chunks_ == pool_.size() + mapped + quarantined_chunks_ + plan_held,
          "chunks held != pool + mapped + quarantined + plan");
  require(static_cast<std::int64_t>((mapped + plan_mapped) * chunk_) == stats_.mapped_bytes.current,
          "mapped_bytes != recount");
  require(static_cast<std::int64_t>(num_chunks_ * chunk_) == stats_.reserved_bytes.current, "reserved_bytes != recount");
  require(!over_capacity_with_cache() || shrink_blocked_,
          "reserved bytes exceed the capacity while cached memory could be released");
  for (const auto& [s, f] : fences_) {
    require(!f.events.empty() || f.unfenced > 0, "a stream with neither fences nor unfenced frees");
    require(f.unfenced < kFenceStride, "a stream went kFenceStride frees without a fence");
    for (std::size_t i = 1; i < f.events.size(); ++i)
      require(f.events[i - 1].first < f.events[i].first, "a stream's fences are out of order");
  }
}

}  // namespace vmalloc
