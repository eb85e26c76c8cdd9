// Allocator: the step plan, a planned layout for a training step that repeats (see allocator.h).
#include "allocator.h"

#include <algorithm>

namespace vmalloc {

// Note [Step plan]
// A training step repeats its allocations: the same sizes, on the same stream, in the same order, freed at
// the same points, iteration after iteration (the traces of bench.steady_state from their second step on).
// Reclaim-first caching (growth_slack=0, Note [Reuse before growth]) keeps reserved memory at the peak in use
// but never settles on such a step: each miss stitches the tails of other cached ranges, whose absence makes
// the next misses, and every iteration maps and unmaps (ResNet-50 batch 96: 20 maps, 11 unmaps, 6 host waits
// per iteration). The growth slack settled it by holding up to 12.5 % more memory than the peak in use
// (utilization down to 0.887 on bench.fragmentation's swapped traces). The step plan needs neither:
//   - learning (detail::StepLearner, pure): every malloc is a token (the size it holds, its stream), and the
//     learner looks for a period L such that the last 2L mallocs are one period twice over, with the same
//     bytes allocated after the last malloc of each (this rejects the layers of a forward pass, which repeat
//     tokens while memory grows). A (last 8 tokens, bytes allocated) key seen before proposes L; rolling
//     hashes and then the tokens themselves confirm it. Lifetimes come from the two copies: a malloc's life
//     is the mallocs from it to its free, the longer of its two copies'; one whose older copy is still live
//     has outlived a period and is not planned, nor are slab blocks (their slabs stay mapped anyway).
//   - planning (detail::color_period, pure): each planned malloc of the period gets a slot, and each slot
//     a set of colors, one per chunk; slots of one stream whose lifetimes do not overlap (lifetimes that wrap
//     past the period's end included) may share colors, slots of different streams never (reuse stays stream
//     ordered, Note [Stream safety]). Greedy in phase order, lowest free colors first, this needs exactly the
//     most chunks live at once when no lifetime wraps (interval graphs are perfect); a color is one physical
//     chunk.
//   - serving: each later malloc is matched against the token of the plan's next phase (a mismatch looks
//     up to kPlanLookahead phases ahead, then waits; the phases skipped count as mismatches). The first time a slot serves, its colors get chunks
//     (the pool, reclaim, creation: the usual ladder) and a virtual range of its own, into which they are
//     mapped, a run of consecutive slices of one block per call; a chunk that several slots share is mapped
//     at each of their addresses at once (the driver allows one allocation at several addresses). From then
//     on the slot serves with no backend call: after one period every slot is mapped and a step makes no
//     driver call and no host wait. A slot serves only if none of its colors is in use (a lifetime that ran
//     longer this time); otherwise, or when its phase has no slot, the malloc takes the usual path.
//   - reserved memory is real: the colors' chunks are created and counted as any chunk (reserved_bytes, the
//     capacity); idle colors are memory held but not in use (chunks_in_use() leaves them out, so they do not
//     raise the high-water mark), and the peak reserved is the process's physical reservation. Physical
//     memory shared by aliases is counted once.
//   - a plan that stops matching (mismatches and skipped phases add up to L before a malloc matches its
//     phase exactly) is abandoned, as is one in the way of a request
//     at the capacity, of empty_cache and of a lowered capacity: once none of its slots is in use (after
//     waiting for their streams), its mappings are unmapped and its chunks return to the pool, and learning
//     starts again (above the abandoned period's length if it served less than two whole periods, so that a
//     loop inside a step, e.g. an optimizer's per-parameter temporaries, is not taken for the step twice;
//     periods under StepLearner::kMinPeriod = 16 mallocs are never looked for).
// Measured on the sim backend (bench/results/steady_state.md, 12 steps): the five training traces make no map,
// unmap or host wait per steady iteration at utilization (peak allocated / peak reserved) 0.997 to 1.000,
// with as many colors as chunks live at once at most (reclaim first without the plan: up to 57 maps, 33
// unmaps and 17 host waits per DenseNet-121 batch-64 iteration; the growth slack of 0.125: no calls,
// utilization 0.929 to 1.000). The plan needs three copies of the period, so bench.fragmentation's 3-step
// traces run reclaim first throughout (utilization 0.997 to 1.000, bench/results/fragmentation.md) and map in
// their last iteration as before the slack. Not planned: slab blocks (mid slabs too: with mid_chunks=4
// GPT-2 batch 16 still makes 1 map, 1 unmap and 1 host wait per iteration), allocations that outlive a period,
// and second streams' reuse of one another's chunks.
namespace {
constexpr std::size_t kPlanLookahead = 8;
}

void Allocator::plan_learn(Allocation& a, bool large) {
  if (!config_.step_plan || plan_) return;
  a.step_index = learner_.on_malloc({a.size, a.stream}, large, stats_.allocated_bytes.current);
  std::optional<detail::StepLayout> layout = learner_.detect();
  if (!layout) return;
  auto plan = std::make_unique<Plan>();
  const std::size_t L = layout->tokens.size();
  plan->tokens = std::move(layout->tokens);
  plan->colors.resize(layout->num_colors);
  plan->slot_of.assign(L, -1);
  plan->cursor = layout->next_phase;
  plan->peak_chunks = layout->peak_chunks;
  for (std::size_t j = 0; j < L; ++j) {
    if (layout->colors[j].empty()) continue;
    plan->slot_of[j] = static_cast<std::int32_t>(plan->slots.size());
    PlanSlot s;
    s.nchunks = plan->tokens[j].size / chunk_;
    s.stream = plan->tokens[j].stream;
    s.colors = std::move(layout->colors[j]);
    plan->slots.push_back(std::move(s));
  }
  if (plan->slots.empty()) {  // nothing to plan in this period: look for longer ones
    learner_.reset(L + 1);
    return;
  }
  plan_ = std::move(plan);
  ++stats_.num_plans;
}

std::uintptr_t Allocator::plan_malloc(std::size_t size, Stream stream, bool cached_only, std::int32_t* slot) {
  Plan& p = *plan_;
  if (p.retiring) return 0;
  const detail::StepToken token{size, stream};
  const std::size_t L = p.tokens.size();
  std::size_t phase = p.cursor;
  if (token != p.tokens[phase]) {
    std::size_t ahead = 1;
    while (ahead <= kPlanLookahead && ahead < L && p.tokens[(phase + ahead) % L] != token) ++ahead;
    // Skipped phases count as mismatches: a step that changed matches ahead often, but never for long.
    p.since_match += std::min(ahead, kPlanLookahead + 1);
    if (p.since_match > L) {
      plan_retire();
      return 0;
    }
    if (ahead > kPlanLookahead || ahead >= L) return 0;
    phase = (phase + ahead) % L;
  } else {
    p.since_match = 0;
  }
  p.cursor = (phase + 1) % L;
  const std::int32_t id = p.slot_of[phase];
  if (id < 0) return 0;
  PlanSlot& s = p.slots[id];
  const bool colors_free =
      !s.busy && std::all_of(s.colors.begin(), s.colors.end(), [&](std::uint32_t c) { return p.colors[c].user < 0; });
  if (!colors_free || (cached_only && !s.addr) || (!s.addr && !plan_populate(s))) {
    ++stats_.num_plan_misses;
    return 0;
  }
  s.busy = true;
  ++p.busy_slots;
  for (std::uint32_t c : s.colors) p.colors[c].user = id;
  plan_idle_chunks_ -= s.nchunks;
  plan_live_[s.addr] = id;
  stats_.mapped_bytes.increase(static_cast<std::int64_t>(s.nchunks * chunk_));
  ++stats_.num_plan_hits;
  ++p.hits;
  *slot = id;
  return s.addr;
}

// Gives the slot's colors that have none a chunk (pool, reclaim, creation, as a miss of malloc_large) and
// maps them all into a fresh virtual range, a run of consecutive slices of one block per call. Returns false
// if the chunks cannot be had. On a backend failure what this call mapped is unmapped (or kept stuck), the
// chunks it took stay with the plan, idle, and the error propagates (Note [Failure guarantees]).
bool Allocator::plan_populate(PlanSlot& s) {
  Plan& p = *plan_;
  std::vector<std::uint32_t> missing;
  for (std::uint32_t c : s.colors)
    if (!p.colors[c].held) missing.push_back(c);
  const std::size_t need = missing.size();
  if (pool_.size() < need) {
    if (pool_.size() + growable_chunks(need) < need && !quiet()) {
      retire_empty_slabs();
      const std::size_t want = need - std::min(need, pool_.size());
      reclaim(std::min(want - std::min(want, growable_chunks(need)), cached_chunks_));
    }
    create_blocks(need);
    if (pool_.size() < need) return false;
  }
  std::size_t i = 0;
  for (const detail::Run& run : pool_.take(need)) {
    for (std::uint32_t k = 0; k < run.n; ++k) {
      PlanColor& c = p.colors[missing[i++]];
      c.block = run.block;
      c.slice = run.first + k;
      c.held = true;
    }
  }
  plan_held_chunks_ += need;
  plan_idle_chunks_ += need;
  const detail::VaSpace::Slice va = va_.take(s.nchunks * chunk_);  // a failure changes nothing else
  std::vector<PlanMapping> maps;
  std::uintptr_t at = va.addr;
  try {
    for (std::size_t j = 0; j < s.colors.size();) {
      const PlanColor& first = p.colors[s.colors[j]];
      std::uint32_t n = 1;
      while (j + n < s.colors.size() && p.colors[s.colors[j + n]].block == first.block &&
             p.colors[s.colors[j + n]].slice == first.slice + n)
        ++n;
      backend_->map(at, n * chunk_, blocks_.at(first.block).handle, first.slice * chunk_);
      maps.push_back({at, first.block, first.slice, n});
      ++stats_.num_maps;
      stats_.num_mapped_chunks += n;
      at += n * chunk_;
      j += n;
    }
    backend_->set_access(va.addr, s.nchunks * chunk_);
    ++stats_.num_set_access;
  } catch (...) {
    for (const PlanMapping& m : maps) plan_unmap(m, va.reservation);
    va_.give(va.reservation, at, va.addr + s.nchunks * chunk_ - at);
    throw;
  }
  s.addr = va.addr;
  s.reservation = va.reservation;
  s.maps = std::move(maps);
  trace_.record(TraceEntry::kSegmentMap, s.addr, s.nchunks * chunk_, s.stream);
  return true;
}

// Unmaps one mapping of a slot and returns its address; one that cannot be unmapped becomes a stuck mapping
// (retried by empty_cache, its block kept), as in unmap_mapping. Returns whether it was unmapped.
bool Allocator::plan_unmap(const PlanMapping& m, std::uint32_t reservation) noexcept {
  try {
    backend_->unmap(m.addr, m.n * chunk_);
  } catch (const std::exception& e) {
    note_backend_error(e);
    try {
      mappings_.emplace(m.addr, Mapping{m.block, m.first, m.n, 0, reservation});
      stuck_.insert(m.addr);
    } catch (...) {
    }
    ++blocks_.at(m.block).mappings;
    mapping_chunks_ += m.n;
    return false;
  }
  ++stats_.num_unmaps;
  stats_.num_unmapped_chunks += m.n;
  va_.give(reservation, m.addr, m.n * chunk_);
  return true;
}

void Allocator::plan_release(const Allocation& a, std::uint64_t seq) {
  Plan& p = *plan_;
  PlanSlot& s = p.slots[a.slot];
  for (std::uint32_t c : s.colors) p.colors[c].user = -1;
  plan_idle_chunks_ += s.nchunks;
  s.busy = false;
  --p.busy_slots;
  plan_live_.erase(s.addr);
  stats_.mapped_bytes.decrease(static_cast<std::int64_t>(s.nchunks * chunk_));
  std::uint64_t& last = p.last_free[s.stream];
  last = std::max(last, seq);
  if (p.retiring && p.busy_slots == 0) plan_retire();
}

// Abandons the plan: it serves nothing more, and is torn down now if none of its slots is in use and no
// capture is announced, else when the last one is freed. A failure to tear down is counted; the plan then
// stays, retiring, and is tried again at the next free of one of its slots or the next abandonment.
void Allocator::plan_retire() noexcept {
  if (!plan_) return;
  if (!plan_->retiring) {
    plan_->retiring = true;
    ++stats_.num_plans_abandoned;
  }
  if (plan_->busy_slots > 0 || quiet()) return;
  try {
    plan_teardown();
  } catch (const std::exception& e) {
    note_backend_error(e);
  }
}

// Waits for the streams of the slots' last frees (their chunks may go to other streams), unmaps every slot
// and returns the plan's chunks to the pool. A failed wait changes nothing and throws.
void Allocator::plan_teardown() {
  Plan& p = *plan_;
  for (const auto& [stream, seq] : p.last_free) fence(stream, seq);
  for (PlanSlot& s : p.slots)
    for (const PlanMapping& m : s.maps) plan_unmap(m, s.reservation);
  for (const PlanColor& c : p.colors)
    if (c.held) pool_.add(c.block, c.slice, 1);
  plan_held_chunks_ = plan_idle_chunks_ = 0;
  learner_.reset(p.hits < 2 * p.slots.size() ? p.tokens.size() + 1 : 1);
  plan_.reset();
}

// The destructor's part: every slot's mappings, before the blocks go.
void Allocator::plan_unmap_all() noexcept {
  if (!plan_) return;
  for (const PlanSlot& s : plan_->slots) {
    for (const PlanMapping& m : s.maps) {
      try {
        backend_->unmap(m.addr, m.n * chunk_);
      } catch (const std::exception& e) {
        note_backend_error(e);
      }
    }
  }
}

}  // namespace vmalloc
