// Allocator: slabs, ranges carved into blocks for small and mid-size requests (see allocator.h).
#include <algorithm>

#include "allocator.h"

namespace vmalloc {

// Note [Mid-size blocks]
// A request just above small_max used to be rounded to whole chunks: 2.25 MiB took 4 MiB, 1.1 MiB took 2.
// On the first GPU run a small ResNet (tensors of 1.1, 2.25 and 4.5 MiB) trained under a 210 MiB budget ran
// out of memory with 204 MiB allocated. Replaying its steps (bench/steady_state.py) reserves 0.262 GiB with
// chunk rounding for 0.187 GiB requested, 0.234 GiB with mid slabs; swapped, the largest plan budget whose
// steps fit 210 MiB rises from 147 to 178 MiB. On full-size models rounding costs 1 to 3 %, and mid slabs
// change reserved memory by under 1 %. So
// requests up to mid_max_ (mid_chunks chunks, default 4: 8 MiB) are blocks of mid slabs: ranges of
// mid_chunks chunks carved like small slabs (best fit among the stream's free mid blocks, split, merged
// with free neighbours when freed), rounded to mid_round_ (a quarter chunk: 512 KiB), so a block wastes
// less than that. What this gives up: a slab with one block in use holds all its chunks, as a small slab
// holds its one chunk, so up to mid_chunks chunks per slab cannot be reclaimed while any block of it
// lives. An empty mid slab is retired to the cache at once (bookkeeping, no driver call), where it merges
// with its free neighbours: kept as slabs, empty ones ate the large cached ranges they were cut from, and
// large requests then missed and grew. A slab is only as large as the chunks
// that are free allow: when mid_chunks cannot be had, the slab is just as large as the request. And a chunk
// of a slab that no block in use overlaps is a free chunk like any other: when a request cannot be met
// otherwise (at the capacity), and in empty_cache and shrinking, trim_slabs() cuts such chunks out of their
// slabs into cached ranges, which reclaim stitches. So a request still succeeds whenever enough chunks
// hold no data in use, and the only chunks out of reach are those partly in use, as with small slabs.
// That is also why this is not the default (mid_chunks=0): with whole-chunk rounding every byte that is not
// allocated lies in a free chunk, so one request can take all of it (examples/fragmentation_demo.py: after
// freeing every other tensor of 1.5 to 24 MiB, 306 MiB free, served in one piece); with mid slabs the free
// parts of chunks that kept blocks still touch are out of reach of large requests (there, 314 MiB are free
// by the allocated bytes, and one request for them fails). Turn it on (mid_chunks=4) where tensors of one to a few chunks dominate and capacity is tight.
std::uintptr_t Allocator::malloc_in_slab(std::size_t size, Stream stream, bool cached_only, bool mid) {
  SizeSet& free_blocks = (mid ? mid_free_ : small_free_)[stream];
  auto it = free_blocks.lower_bound({size, 0});
  if (it == free_blocks.end()) {
    const std::size_t want = mid ? std::max(config_.mid_chunks, (size + chunk_ - 1) / chunk_) : 1;
    std::uintptr_t slab = malloc_large(want, stream, cached_only);
    if (!slab && mid && want * chunk_ > size) slab = malloc_large((size + chunk_ - 1) / chunk_, stream, cached_only);
    if (!slab) return 0;
    Range& r = ranges_.at(slab);
    r.kind = Kind::kSlab;
    r.mid = mid;
    r.slab_used = 0;
    const std::size_t bytes = r.nchunks * chunk_;
    stats_.slab_bytes.increase(static_cast<std::int64_t>(bytes));
    small_.emplace(slab, SmallBlock{bytes, slab, true});
    empty_slabs_.insert(slab);
    empty_slab_chunks_ += r.nchunks;
    it = free_blocks.insert({bytes, slab}).first;
  }
  const auto [block_size, addr] = *it;
  free_blocks.erase(it);
  SmallBlock& b = small_.at(addr);
  if (block_size > size) {  // sizes are multiples of the slab's rounding, so the rest is a usable block
    small_.emplace(addr + size, SmallBlock{block_size - size, b.slab, true});
    free_blocks.insert({block_size - size, addr + size});
    b.size = size;
    ++stats_.num_splits;
  }
  b.free = false;
  Range& slab = ranges_.at(b.slab);
  if (slab.slab_used == 0) {
    empty_slabs_.erase(b.slab);
    empty_slab_chunks_ -= slab.nchunks;
  }
  slab.slab_used += size;
  return addr;
}

void Allocator::free_in_slab(std::uintptr_t addr, std::uint64_t seq) {
  auto it = small_.find(addr);
  const std::uintptr_t slab_addr = it->second.slab;
  Range& slab = ranges_.at(slab_addr);
  slab.slab_used -= it->second.size;
  slab.free_seq = std::max(slab.free_seq, seq);
  SizeSet& free_blocks = (slab.mid ? mid_free_ : small_free_)[slab.stream];
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
  // An empty small slab stays a slab (small alloc/free churn then costs no remapping); reclaim and
  // empty_cache retire it, so its chunk still counts as free for large requests. An empty mid slab is
  // retired at once (bookkeeping only): as a cached range it merges with its free neighbours, so the large
  // cached ranges that slabs were cut from form again (Note [Mid-size blocks]).
  if (slab.slab_used == 0) {
    empty_slabs_.insert(slab_addr);
    empty_slab_chunks_ += slab.nchunks;
    if (slab.mid) retire_slab(slab_addr);
  }
}

void Allocator::retire_empty_slabs() {
  while (!empty_slabs_.empty()) retire_slab(*empty_slabs_.begin());
}

// The empty slab at `slab` becomes a cached range.
void Allocator::retire_slab(std::uintptr_t slab) {
  empty_slabs_.erase(slab);
  Range& r = ranges_.at(slab);
  (r.mid ? mid_free_ : small_free_)[r.stream].erase({r.nchunks * chunk_, slab});
  small_.erase(slab);
  stats_.slab_bytes.decrease(static_cast<std::int64_t>(r.nchunks * chunk_));
  empty_slab_chunks_ -= r.nchunks;
  r.mid = false;
  cache_range(slab, r.free_seq);
}

// Cuts every chunk of a mid slab that no block in use (or pending) overlaps out of its slab: the slab becomes
// slabs of the runs of chunks in use, with their blocks, and cached ranges of the free runs, with the slab's
// last free as their fence (Note [Mid-size blocks]). Bookkeeping only: nothing is mapped or unmapped.
// Returns whether any chunk was cut out.
bool Allocator::trim_slabs() {
  std::vector<std::uintptr_t> slabs;
  for (const auto& [addr, r] : ranges_)
    if (r.kind == Kind::kSlab && r.mid && r.slab_used > 0) slabs.push_back(addr);
  bool trimmed = false;
  for (std::uintptr_t addr : slabs) trimmed = trim_slab(addr) || trimmed;
  return trimmed;
}

bool Allocator::trim_slab(std::uintptr_t addr) {
  const Range slab = ranges_.at(addr);
  std::vector<bool> used(slab.nchunks, false);
  std::vector<std::pair<std::uintptr_t, std::size_t>> in_use;  // blocks in use or pending: (addr, size)
  for (auto b = small_.lower_bound(addr); b != small_.end() && b->second.slab == addr; ++b) {
    if (b->second.free) continue;
    in_use.emplace_back(b->first, b->second.size);
    for (std::size_t c = (b->first - addr) / chunk_; c * chunk_ < b->first + b->second.size - addr; ++c) used[c] = true;
  }
  if (std::all_of(used.begin(), used.end(), [](bool u) { return u; })) return false;
  // Take the slab apart, then put the pieces back: slabs where chunks are used, cached ranges where not.
  SizeSet& free_blocks = mid_free_[slab.stream];
  for (auto b = small_.lower_bound(addr); b != small_.end() && b->second.slab == addr;) {
    if (b->second.free) free_blocks.erase({b->second.size, b->first});
    b = small_.erase(b);
  }
  ranges_.erase(addr);
  stats_.segment.decrease(1);
  stats_.slab_bytes.decrease(static_cast<std::int64_t>(slab.nchunks * chunk_));
  auto block = in_use.begin();
  for (std::size_t first = 0; first < slab.nchunks;) {
    std::size_t end = first;
    while (end < slab.nchunks && used[end] == used[first]) ++end;
    const std::uintptr_t piece = addr + first * chunk_, piece_end = addr + end * chunk_;
    Range r = slab;
    r.nchunks = end - first;
    stats_.segment.increase(1);
    if (!used[first]) {
      r.kind = Kind::kCached;
      r.mid = false;
      r.slab_used = 0;
      ranges_.emplace(piece, r);
      cache_range(piece, slab.free_seq);
    } else {
      r.slab_used = 0;
      std::uintptr_t at = piece;  // blocks in use, with free blocks in the gaps between them
      auto free_gap = [&](std::uintptr_t to) {
        if (to == at) return;
        small_.emplace(at, SmallBlock{to - at, piece, true});
        free_blocks.insert({to - at, at});
      };
      for (; block != in_use.end() && block->first < piece_end; ++block) {
        free_gap(block->first);
        small_.emplace(block->first, SmallBlock{block->second, piece, false});
        r.slab_used += block->second;
        at = block->first + block->second;
      }
      free_gap(piece_end);
      ranges_.emplace(piece, r);
      stats_.slab_bytes.increase(static_cast<std::int64_t>(r.nchunks * chunk_));
    }
    first = end;
  }
  return true;
}

}  // namespace vmalloc
