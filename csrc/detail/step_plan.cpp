#include "detail/step_plan.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <set>
#include <utility>

namespace vmalloc::detail {
namespace {

constexpr std::uint64_t kBase = 0x100000001b3ULL;

std::uint64_t mix(std::uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::uint64_t token_hash(const StepToken& t) { return mix(mix(t.size) ^ static_cast<std::uint64_t>(t.stream)); }

std::uint64_t power(std::uint64_t b, std::uint64_t e) {
  std::uint64_t r = 1;
  for (; e; e >>= 1, b *= b)
    if (e & 1) r *= b;
  return r;
}

}  // namespace

std::vector<std::vector<std::uint32_t>> color_period(const std::vector<PeriodAlloc>& period, std::uint32_t* num_colors,
                                                     std::size_t* peak_chunks) {
  const std::size_t L = period.size();
  std::vector<std::vector<std::uint32_t>> out(L);
  std::vector<std::size_t> limit;  // per color: the phase by which it must be free again (a wrapping allocation's)
  // Planned chunks live per phase, for peak_chunks: +chunks where a lifetime starts, -chunks where it ends.
  std::vector<std::int64_t> delta(L + 1, 0);
  std::vector<std::uintptr_t> streams;
  for (const PeriodAlloc& a : period)
    if (a.chunks && std::find(streams.begin(), streams.end(), a.stream) == streams.end()) streams.push_back(a.stream);
  for (std::uintptr_t s : streams) {
    using Release = std::pair<std::size_t, std::uint32_t>;  // (phase, color)
    std::priority_queue<Release, std::vector<Release>, std::greater<>> releases;
    std::set<std::uint32_t> avail;
    auto fresh = [&](std::size_t lim) {
      limit.push_back(lim);
      return static_cast<std::uint32_t>(limit.size() - 1);
    };
    // Lifetimes that wrap: the previous period's copy holds the colors from phase 0 until it ends.
    for (std::size_t j = 0; j < L; ++j) {
      const PeriodAlloc& a = period[j];
      if (!a.chunks || a.stream != s || j + a.life <= L) continue;
      for (std::size_t c = 0; c < a.chunks; ++c) {
        const std::uint32_t color = fresh(j);
        out[j].push_back(color);
        releases.push({j + a.life - L, color});
      }
      delta[0] += static_cast<std::int64_t>(a.chunks);
      delta[j + a.life - L] -= static_cast<std::int64_t>(a.chunks);
      delta[j] += static_cast<std::int64_t>(a.chunks);
    }
    for (std::size_t j = 0; j < L; ++j) {
      while (!releases.empty() && releases.top().first <= j) {
        avail.insert(releases.top().second);
        releases.pop();
      }
      const PeriodAlloc& a = period[j];
      if (!a.chunks || a.stream != s) continue;
      if (j + a.life > L) {  // a wrapping one takes back its colors, free again by construction
        for (std::uint32_t c : out[j]) avail.erase(c);
        continue;
      }
      const std::size_t end = j + a.life;
      delta[j] += static_cast<std::int64_t>(a.chunks);
      delta[end] -= static_cast<std::int64_t>(a.chunks);
      for (auto it = avail.begin(); it != avail.end() && out[j].size() < a.chunks;) {
        if (limit[*it] >= end) {
          out[j].push_back(*it);
          it = avail.erase(it);
        } else {
          ++it;
        }
      }
      while (out[j].size() < a.chunks) out[j].push_back(fresh(L));
      for (std::uint32_t c : out[j]) releases.push({end, c});
    }
  }
  std::int64_t load = 0, peak = 0;
  for (std::size_t j = 0; j < L; ++j) peak = std::max(peak, load += delta[j]);
  *num_colors = static_cast<std::uint32_t>(limit.size());
  *peak_chunks = static_cast<std::size_t>(peak);
  return out;
}

std::uint64_t StepLearner::on_malloc(const StepToken& token, bool large, std::int64_t allocated_after) {
  const std::uint64_t prev = recs_.empty() ? 0 : recs_.back().prefix;
  recs_.push_back(Rec{token, large, allocated_after, prev * kBase + token_hash(token)});
  if (recs_.size() > history_) {
    recs_.pop_front();
    ++base_;
  }
  if (last_.size() > 2 * history_) last_.clear();  // stale keys: they only propose periods that fail
  return next_++;
}

void StepLearner::on_free(std::uint64_t index) {
  if (index < base_ || index >= next_) return;
  recs_[index - base_].free_at = next_;
}

std::uint64_t StepLearner::window_hash(std::uint64_t from, std::uint64_t to) const {
  return at(to).prefix - at(from).prefix * power(kBase, to - from);
}

void StepLearner::reset(std::size_t min_period) {
  recs_.clear();
  last_.clear();
  base_ = next_;
  min_period_ = std::max(min_period, kMinPeriod);
}

std::optional<StepLayout> StepLearner::detect() {
  if (recs_.size() <= kContext) return std::nullopt;
  const std::uint64_t n = next_ - 1;
  const std::uint64_t key = mix(window_hash(n - kContext, n) ^ mix(static_cast<std::uint64_t>(at(n).allocated)));
  auto [slot, fresh] = last_.try_emplace(key, n);
  if (fresh) return std::nullopt;
  const std::uint64_t L = n - slot->second;
  slot->second = n;
  // Three whole periods remembered, and the prefix before them (window_hash reads the one before `from`):
  // two copies let a loop inside a step (swapped traces' layers) pass for the step too often.
  if (L < min_period_ || n < base_ + 3 * L) return std::nullopt;
  if (at(n - L).allocated != at(n).allocated || at(n - 2 * L).allocated != at(n).allocated) return std::nullopt;
  const std::uint64_t h = window_hash(n - L, n);
  if (window_hash(n - 2 * L, n - L) != h || window_hash(n - 3 * L, n - 2 * L) != h) return std::nullopt;
  for (std::uint64_t i = n - 2 * L + 1; i <= n; ++i)
    if (at(i).token != at(i - L).token) return std::nullopt;
  // Malloc n - L + 1 + j repeats at phase j. Its lifetime is its newest copy's if that was freed (the older
  // copy may come from a first iteration that differs), else the older copy's, at least until now; one with
  // neither copy freed has outlived a period and is not planned.
  std::vector<PeriodAlloc> period(L);
  for (std::uint64_t j = 0; j < L; ++j) {
    const std::uint64_t i = n - L + 1 + j;
    const Rec& now = at(i);
    const Rec& before = at(i - L);
    if (!now.large) continue;
    std::uint64_t life = 0;
    if (now.free_at != kNone) life = now.free_at - i;
    else if (before.free_at != kNone) life = std::max(before.free_at - (i - L), next_ - i);
    if (life == 0 || life > L) continue;
    period[j] = PeriodAlloc{now.token.size / chunk_, static_cast<std::size_t>(life), now.token.stream};
  }
  // The plan's phase 0 is where the fewest planned chunks are live, so that few lifetimes wrap past its end
  // (those need colors of their own); the next malloc is at phase next_phase.
  std::vector<std::int64_t> delta(2 * L + 1, 0);
  for (std::uint64_t j = 0; j < L; ++j) {
    const auto c = static_cast<std::int64_t>(period[j].chunks);
    delta[j] += c;
    delta[j + period[j].life] -= c;
  }
  std::vector<std::int64_t> load(L, 0);
  std::int64_t live = 0;
  for (std::uint64_t x = 0; x < 2 * L; ++x) load[x % L] += live += delta[x];
  const std::uint64_t r = static_cast<std::uint64_t>(std::min_element(load.begin(), load.end()) - load.begin());
  StepLayout layout;
  std::vector<PeriodAlloc> rotated(L);
  layout.tokens.reserve(L);
  for (std::uint64_t k = 0; k < L; ++k) {
    rotated[k] = period[(k + r) % L];
    layout.tokens.push_back(at(n - L + 1 + (k + r) % L).token);
  }
  layout.next_phase = static_cast<std::size_t>((L - r) % L);
  layout.colors = color_period(rotated, &layout.num_colors, &layout.peak_chunks);
  return layout;
}

}  // namespace vmalloc::detail
