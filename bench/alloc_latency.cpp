// Cached-path latency of malloc+free pairs: vmalloc (host backend) against the system malloc.
//
// Each sample times a batch of pairs of one size (so the clock's own cost is spread out) and reports ns per
// pair; the output is one JSON object per (allocator, size) with p50/p90/p99 over the samples.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "allocator.h"

namespace {

constexpr int kBatch = 100;

template <typename Alloc, typename Free>
std::vector<double> sample(int samples, Alloc&& alloc, Free&& free) {
  std::vector<double> ns;
  ns.reserve(samples);
  for (int s = 0; s < samples; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kBatch; ++i) free(alloc());
    const auto t1 = std::chrono::steady_clock::now();
    ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / kBatch);
  }
  std::sort(ns.begin(), ns.end());
  return ns;
}

void report(const char* allocator, std::size_t size, const std::vector<double>& ns) {
  auto q = [&](double p) { return ns[static_cast<std::size_t>(p * (ns.size() - 1))]; };
  std::printf("{\"allocator\": \"%s\", \"size\": %zu, \"pairs\": %zu, \"p50_ns\": %.1f, \"p90_ns\": %.1f, \"p99_ns\": %.1f}\n",
              allocator, size, ns.size() * kBatch, q(0.5), q(0.9), q(0.99));
}

}  // namespace

int main(int argc, char** argv) {
  const int samples = argc > 1 ? std::atoi(argv[1]) : 20000;
  vmalloc::Config config;
  config.backend = "host";
  config.capacity = std::size_t{256} << 20;
  vmalloc::Allocator arena(config);
  for (std::size_t size : {std::size_t{4096}, std::size_t{256} << 10, std::size_t{8} << 20}) {
    arena.free(arena.malloc(size, 0));  // warm: the first call maps; the rest hit the cache
    report("vmalloc", size, sample(samples, [&] { return arena.malloc(size, 0); }, [&](std::uintptr_t p) { arena.free(p); }));
    report("system_malloc", size, sample(samples, [&] {
      void* p = std::malloc(size);
      // Touch one byte so the compiler cannot elide the pair.
      static_cast<volatile char*>(p)[0] = 1;
      return p;
    }, [](void* p) { std::free(p); }));
  }
  return 0;
}
