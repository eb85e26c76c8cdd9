// VaSpace: virtual address reservations, handed out as ranges.
//
// Virtual address space is plentiful, physical chunks are not: the first reservation is several times the
// capacity, and more are made only when a range does not fit. A range never spans two reservations, so each
// reservation can be released whole, as cuMemAddressFree requires. take() changes nothing when the backend
// cannot reserve (it throws the backend's error); give() cannot fail.
#pragma once

#include <cstdint>
#include <iterator>
#include <map>
#include <vector>

#include "../backend.h"

namespace vmalloc::detail {

class VaSpace {
 public:
  VaSpace(Backend& backend, std::size_t reservation_bytes)
      : backend_(backend), reservation_bytes_(reservation_bytes) {}
  ~VaSpace() {
    for (auto& r : reservations_) {
      try {
        backend_.release_reservation(r.base, r.bytes);
      } catch (...) {  // destructors never throw; the address space goes with the process
      }
    }
  }
  VaSpace(const VaSpace&) = delete;
  VaSpace& operator=(const VaSpace&) = delete;

  struct Slice {
    std::uintptr_t addr;
    std::uint32_t reservation;
  };

  // First fit over the reservations' free intervals; reserves more address space when none fits.
  Slice take(std::size_t bytes) {
    for (std::uint32_t i = 0; i < reservations_.size(); ++i) {
      auto& free = reservations_[i].free;
      for (auto it = free.begin(); it != free.end(); ++it) {
        if (it->second < bytes) continue;
        const std::uintptr_t addr = it->first;
        const std::size_t left = it->second - bytes;
        free.erase(it);
        if (left) free.emplace(addr + bytes, left);
        return {addr, i};
      }
    }
    std::size_t size = bytes > reservation_bytes_ ? bytes : reservation_bytes_;
    Reservation r;
    try {
      r.base = backend_.reserve(size);
    } catch (const BackendError&) {
      if (size == bytes) throw;
      size = bytes;  // the generous reservation did not fit the address space: take just what is needed
      r.base = backend_.reserve(size);
    }
    r.bytes = size;
    if (size > bytes) r.free.emplace(r.base + bytes, size - bytes);
    reservations_.push_back(std::move(r));
    return {reservations_.back().base, static_cast<std::uint32_t>(reservations_.size() - 1)};
  }

  // Note [Spread placement]: in the middle of the largest free interval (aligned to `align`) when it is at
  // least four times `bytes`, else at its start; a new reservation (as take makes) when no interval fits. A range
  // placed so has free address space on both sides to grow into (Note [Grow in place] in allocator.cpp).
  Slice take_spread(std::size_t bytes, std::size_t align) {
    std::uint32_t best_r = 0;
    std::uintptr_t best_a = 0;
    std::size_t best_n = 0;
    for (std::uint32_t i = 0; i < reservations_.size(); ++i) {
      for (const auto& [a, n] : reservations_[i].free) {
        if (n > best_n) {
          best_r = i;
          best_a = a;
          best_n = n;
        }
      }
    }
    if (best_n < bytes) {  // reserve more, then place in it as above
      const Slice fresh = take(bytes);
      give(fresh.reservation, fresh.addr, bytes);
      return take_spread(bytes, align);
    }
    const std::uintptr_t addr = best_n >= 4 * bytes ? best_a + (best_n / 2) / align * align : best_a;
    take_at(best_r, addr, bytes);
    return {addr, best_r};
  }

  // Free address bytes of reservation i that start exactly at `end` / end exactly at `begin`.
  std::size_t free_after(std::uint32_t i, std::uintptr_t end) const {
    const auto& free = reservations_[i].free;
    auto it = free.find(end);
    return it == free.end() ? 0 : it->second;
  }
  std::size_t free_before(std::uint32_t i, std::uintptr_t begin) const {
    const auto& free = reservations_[i].free;
    auto it = free.lower_bound(begin);
    if (it == free.begin()) return 0;
    --it;
    return it->first + it->second == begin ? it->second : 0;
  }

  // Takes [addr, addr + bytes) of reservation i, which must lie inside one free interval (a caller checked
  // it with free_after / free_before, or found the interval itself).
  void take_at(std::uint32_t i, std::uintptr_t addr, std::size_t bytes) {
    auto& free = reservations_[i].free;
    auto it = std::prev(free.upper_bound(addr));
    const std::uintptr_t a = it->first;
    const std::size_t n = it->second;
    free.erase(it);
    if (addr > a) free.emplace(a, addr - a);
    if (a + n > addr + bytes) free.emplace(addr + bytes, a + n - (addr + bytes));
  }

  // Returns [addr, addr + bytes) of reservation i to its free list, merging with free neighbours.
  void give(std::uint32_t i, std::uintptr_t addr, std::size_t bytes) {
    auto& free = reservations_[i].free;
    auto next = free.lower_bound(addr);
    if (next != free.end() && addr + bytes == next->first) {
      bytes += next->second;
      next = free.erase(next);
    }
    if (next != free.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == addr) {
        prev->second += bytes;
        return;
      }
    }
    free.emplace(addr, bytes);
  }

  std::size_t reserved_bytes() const {
    std::size_t n = 0;
    for (auto& r : reservations_) n += r.bytes;
    return n;
  }

 private:
  struct Reservation {
    std::uintptr_t base = 0;
    std::size_t bytes = 0;
    std::map<std::uintptr_t, std::size_t> free;  // unused address intervals
  };

  Backend& backend_;
  std::size_t reservation_bytes_;
  std::vector<Reservation> reservations_;
};

}  // namespace vmalloc::detail
