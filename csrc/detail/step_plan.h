// StepLearner: learns the repeating step of a training loop from the sequence of mallocs and frees, and
// color_period plans a layout for it in which allocations whose lifetimes do not overlap share physical
// chunks (Note [Step plan] in allocator_plan.cpp). Pure policy: no backend, no I/O, no CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <unordered_map>
#include <vector>

namespace vmalloc::detail {

// What a malloc asks for, as the plan matches it: the size it holds once served, and its stream.
struct StepToken {
  std::size_t size = 0;
  std::uintptr_t stream = 0;
  bool operator==(const StepToken& o) const { return size == o.size && stream == o.stream; }
  bool operator!=(const StepToken& o) const { return !(*this == o); }
};

// One malloc of the period, as the coloring sees it.
struct PeriodAlloc {
  std::size_t chunks = 0;  // 0: not planned (a slab block, or one that outlives the period)
  std::size_t life = 0;    // mallocs from its own to the one after its free: busy for phases [j, j + life) mod L
  std::uintptr_t stream = 0;
};

// A period found and planned: the tokens of its L mallocs from the phase it starts at, and for each the
// colors (indices of physical chunks) it is mapped onto; empty colors: served by the usual path.
struct StepLayout {
  std::vector<StepToken> tokens;
  std::vector<std::vector<std::uint32_t>> colors;
  std::uint32_t num_colors = 0;
  std::size_t peak_chunks = 0;  // the most planned chunks live at once (the least any layout needs)
  std::size_t next_phase = 0;   // the phase of the next malloc
};

// Colors the period's planned allocations: two allocations share a color only if they are on the same
// stream (reuse stays stream ordered) and never live at once, counting lifetimes that wrap around the
// period's end. Greedy in phase order, lowest free colors first; without wrapping lifetimes it needs exactly
// the most chunks live at once per stream (interval graphs are perfect). Returns the colors per allocation
// (empty for unplanned ones) and sets *num_colors and *peak_chunks.
std::vector<std::vector<std::uint32_t>> color_period(const std::vector<PeriodAlloc>& period, std::uint32_t* num_colors,
                                                     std::size_t* peak_chunks);

class StepLearner {
 public:
  static constexpr std::uint64_t kNone = std::numeric_limits<std::uint64_t>::max();
  // chunk: the chunk size (planned allocations hold whole chunks); history: mallocs remembered at most, so
  // the longest period found is history / 2.
  explicit StepLearner(std::size_t chunk, std::size_t history = std::size_t{1} << 17) : chunk_(chunk), history_(history) {}

  // Records a malloc (large: it holds whole chunks of its own) and the bytes allocated after it; returns its
  // index, for on_free.
  std::uint64_t on_malloc(const StepToken& token, bool large, std::int64_t allocated_after);
  // The malloc of that index was freed (ignored if forgotten, or before the last reset).
  void on_free(std::uint64_t index);
  // Whether the last 3L mallocs are one period of L mallocs repeated (same tokens, the same bytes allocated
  // after the last malloc of each), for the L that last met the state after the newest
  // malloc; then the layout of the next period, which starts with the next malloc.
  std::optional<StepLayout> detect();
  // Forgets everything; periods shorter than min_period are not looked for until the next reset.
  void reset(std::size_t min_period = 1);
  std::uint64_t count() const { return next_; }
  std::size_t min_period() const { return min_period_; }

 private:
  struct Rec {
    StepToken token;
    bool large;
    std::int64_t allocated;
    std::uint64_t prefix;  // hash of the tokens up to this one
    std::uint64_t free_at = kNone;  // mallocs before its free
  };
  const Rec& at(std::uint64_t i) const { return recs_[i - base_]; }
  std::uint64_t window_hash(std::uint64_t from, std::uint64_t to) const;  // tokens (from, to]

  static constexpr std::size_t kContext = 8;  // tokens in the key that proposes a period
  // The shortest period looked for: a loop inside a step (the same temporary allocated and freed over and
  // over) is no step, and planning it would reset the learning of the step at every abandonment.
  static constexpr std::size_t kMinPeriod = 16;
  std::size_t chunk_;
  std::size_t history_;
  std::size_t min_period_ = kMinPeriod;
  std::deque<Rec> recs_;
  std::uint64_t base_ = 0;  // index of recs_.front()
  std::uint64_t next_ = 0;  // index of the next malloc
  std::unordered_map<std::uint64_t, std::uint64_t> last_;  // (context, allocated) key -> last index
};

}  // namespace vmalloc::detail
