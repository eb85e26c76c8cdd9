// SlicePool: the free chunks of an arena, as runs of consecutive slices of one block (Note [Blocks and
// slices] in allocator.cpp). A run maps with one backend call, so the pool hands out as few runs as it can:
// the smallest run that holds the whole request, else the longest runs first. Freed slices merge with their
// free neighbours in the same block, so runs grow back as memory returns.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

namespace vmalloc::detail {

using BlockId = std::uint64_t;

struct Run {  // slices [first, first + n) of a block
  BlockId block;
  std::uint32_t first;
  std::uint32_t n;
};

class SlicePool {
 public:
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::size_t runs() const { return by_start_.size(); }

  // Slices [first, first + n) of `block` become free; none of them may be free already.
  void add(BlockId block, std::uint32_t first, std::uint32_t n) {
    if (n == 0) return;
    size_ += n;
    auto next = by_start_.lower_bound({block, first});
    if (next != by_start_.end() && next->first.first == block && next->first.second == first + n) {
      n += next->second;
      by_len_.erase({next->second, block, next->first.second});
      next = by_start_.erase(next);
    }
    if (next != by_start_.begin()) {
      auto prev = std::prev(next);
      if (prev->first.first == block && prev->first.second + prev->second == first) {
        by_len_.erase({prev->second, block, prev->first.second});
        prev->second += n;
        by_len_.insert({prev->second, block, prev->first.second});
        return;
      }
    }
    by_start_.emplace(std::make_pair(block, first), n);
    by_len_.insert({n, block, first});
  }

  // Takes k <= size() slices as few runs as possible: the smallest run of at least what is still wanted
  // (taken from its start), else the longest run whole.
  std::vector<Run> take(std::size_t k) {
    std::vector<Run> out;
    while (k > 0) {
      const auto want = static_cast<std::uint32_t>(std::min<std::size_t>(k, std::numeric_limits<std::uint32_t>::max()));
      auto it = by_len_.lower_bound({want, 0, 0});
      if (it == by_len_.end()) it = std::prev(by_len_.end());
      const auto [n, block, first] = *it;
      const std::uint32_t got = static_cast<std::uint32_t>(std::min<std::size_t>(n, k));
      remove(block, first, got);
      out.push_back({block, first, got});
      k -= got;
    }
    return out;
  }

  // Removes slices [first, first + n) of `block`, which must all be free (inside one run).
  void remove(BlockId block, std::uint32_t first, std::uint32_t n) {
    auto it = std::prev(by_start_.upper_bound({block, first}));
    const std::uint32_t start = it->first.second, len = it->second;
    by_len_.erase({len, block, start});
    by_start_.erase(it);
    size_ -= n;
    if (first > start) {
      by_start_.emplace(std::make_pair(block, start), first - start);
      by_len_.insert({first - start, block, start});
    }
    if (start + len > first + n) {
      by_start_.emplace(std::make_pair(block, first + n), start + len - (first + n));
      by_len_.insert({start + len - (first + n), block, first + n});
    }
  }

  // Whether all n slices of `block` are free (one run from slice 0).
  bool whole(BlockId block, std::uint32_t n) const {
    auto it = by_start_.find({block, 0});
    return it != by_start_.end() && it->second == n;
  }
  // Whether slice i of `block` is free.
  bool contains(BlockId block, std::uint32_t i) const {
    auto it = by_start_.upper_bound({block, i});
    if (it == by_start_.begin()) return false;
    --it;
    return it->first.first == block && it->first.second + it->second > i;
  }

  // Every run, in (block, first) order.
  std::vector<Run> all() const {
    std::vector<Run> out;
    out.reserve(by_start_.size());
    for (const auto& [key, n] : by_start_) out.push_back({key.first, key.second, n});
    return out;
  }
  // Whether the two indexes agree and runs are maximal (for check_invariants).
  bool consistent() const {
    if (by_start_.size() != by_len_.size()) return false;
    std::size_t total = 0;
    const std::pair<BlockId, std::uint32_t>* prev_key = nullptr;
    std::uint32_t prev_n = 0;
    for (const auto& [key, n] : by_start_) {
      if (n == 0 || !by_len_.count({n, key.first, key.second})) return false;
      if (prev_key && prev_key->first == key.first && prev_key->second + prev_n >= key.second) return false;
      prev_key = &key;
      prev_n = n;
      total += n;
    }
    return total == size_;
  }

 private:
  std::map<std::pair<BlockId, std::uint32_t>, std::uint32_t> by_start_;  // (block, first) -> n
  std::set<std::tuple<std::uint32_t, BlockId, std::uint32_t>> by_len_;    // (n, block, first)
  std::size_t size_ = 0;
};

}  // namespace vmalloc::detail
