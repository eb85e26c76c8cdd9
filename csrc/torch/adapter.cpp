// vmalloc as torch's CUDA allocator, with torch's allocator API: a torch C++ extension, compiled against the
// installed torch (vmalloc/torch_adapter.py builds and loads it).
//
// Note [The torch adapter]
// torch's plain pluggable allocator (CUDAPluggableAllocator over two C functions) answers most of torch's
// allocator API with "does not yet support": memory_stats, reset_peak_memory_stats and cacheInfo raise (so
// cudnn.benchmark=True breaks), and an out-of-memory error reaches users as a RuntimeError, which neither
// `except torch.cuda.OutOfMemoryError` nor cuDNN's workspace fallback (it catches c10::OutOfMemoryError)
// recognises. This adapter subclasses CUDAPluggableAllocator, so it inherits an implementation of every
// virtual method whose signature changes between torch releases (IPC, peer copies, checkpoints...), and
// overrides the ones users meet:
//   - allocation: vmalloc's out-of-memory becomes c10::OutOfMemoryError (torch.cuda.OutOfMemoryError) with
//     vmalloc's explanation, which contains "CUDA out of memory." like torch's own;
//   - getDeviceStats / resetPeakStats / resetAccumulatedStats: vmalloc's own counters under torch's names, so
//     memory_stats(), memory_allocated(), max_memory_allocated(), memory_reserved() and
//     reset_peak_memory_stats() report the arena;
//   - cacheInfo: the largest allocation vmalloc could serve now (any free chunks can be stitched into one
//     range), within the capacity and the device's free memory, and within the workspace limit the swap
//     runtime sets to its budget: what cuDNN's benchmark mode sizes its workspace search with (Note
//     [Workspace offers] in allocator_inspect.cpp);
//   - snapshot / recordHistory: a clear error naming vmalloc.snapshot(), which returns the arena's state in
//     torch's snapshot format (vmalloc keeps its own history: VMALLOC_CONF=history=N);
//   - beginAllocateToPool (CUDA graph capture, torch.compile's CUDA graphs, use_mem_pool): fails before the
//     stream capture starts, naming the alternatives; vmalloc's arena has no private pools, and a capture whose
//     memory the allocator could reuse or unmap during replay would corrupt results silently. What the
//     refusal leaves behind is in Note [A refused capture];
//   - getMemoryFraction (torch >= 2.10, torch.cuda.get_per_process_memory_fraction): the arena's capacity
//     over the device's memory.
// empty_cache, set_per_process_memory_fraction and record_stream go through the base class's hooks.
//
// Note [A refused capture]
// torch's CUDAGraph::capture_begin (2.11) registers the graph with the device's default CUDA generator,
// then asks the allocator for the pool (where this adapter refuses), and only then begins the stream
// capture and puts the generator in capture mode. So the refusal leaves no capture and no generator in
// capture mode: the graph object stays registered with the generator until it is deleted (its destructor
// unregisters it), which costs two 8-byte tensors. Older torch (before the generator registry, 2.3 and
// earlier) ran the generator's capture prologue first, and random ops then failed until a capture ended;
// this adapter supports torch >= 2.4. One thing torch itself leaves: torch.cuda.graph's __enter__ has
// already made the capture stream current when capture_begin raises, and nothing restores it, so code
// that catches the error keeps running on that side stream (restore it with torch.cuda.set_stream).
//
// The adapter reaches the core only through C functions (Note [A C boundary between the core and the torch
// adapter]); the core stays torch-free. Version differences are guarded with TORCH_VERSION_MAJOR/MINOR and
// checked by tests/torch_edge/test_adapter_compiles.py against the installed torch's headers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/version.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core_api.h"

#define VMALLOC_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME vmalloc_torch_adapter
#endif

namespace vmalloc_torch {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

constexpr const char* kHistoryMessage =
    "vmalloc is torch's CUDA allocator: torch.cuda.memory._snapshot(), memory_snapshot() and "
    "_record_memory_history() read torch's own caching allocator, which is not in use. Use vmalloc.snapshot(device) "
    "(the arena's segments and blocks in torch's snapshot format; vmalloc.dump_snapshot(path, snap) writes the "
    "pickle https://pytorch.org/memory_viz opens), and record history with vmalloc.configure(history=N) or "
    "VMALLOC_CONF=history=N before the first CUDA allocation.";

constexpr const char* kPoolMessage =
    "vmalloc is torch's global CUDA allocator, and it has no private memory pools, so CUDA graph capture "
    "(torch.cuda.graph, torch.compile(mode='reduce-overhead'), CUDA graph trees) and torch.cuda.use_mem_pool "
    "cannot run on it. Either keep torch's own allocator for the process and use vmalloc where you need it through "
    "a pool (pool = vmalloc.mem_pool(); with vmalloc.use_mem_pool(pool): ...), in which case graph capture works "
    "as usual; or compile without CUDA graphs (torch.compile(mode='default' or 'max-autotune-no-cudagraphs')).";

// Every statistic the adapter reads, by the core's names (see Allocator::stats()).
enum Stat : int {
#define VMALLOC_STAT4(prefix) prefix##_current, prefix##_peak, prefix##_allocated, prefix##_freed
  VMALLOC_STAT4(allocation),
  VMALLOC_STAT4(segment),
  VMALLOC_STAT4(active),
  VMALLOC_STAT4(allocated_bytes),
  VMALLOC_STAT4(reserved_bytes),
  VMALLOC_STAT4(active_bytes),
  VMALLOC_STAT4(requested_bytes),
#undef VMALLOC_STAT4
  inactive_split_bytes_current,
  num_alloc_retries,
  num_ooms,
  num_device_alloc,
  num_device_free,
  kNumStats
};

constexpr std::array<const char*, kNumStats> kStatNames = {
#define VMALLOC_STAT4(prefix) prefix ".all.current", prefix ".all.peak", prefix ".all.allocated", prefix ".all.freed"
    VMALLOC_STAT4("allocation"),
    VMALLOC_STAT4("segment"),
    VMALLOC_STAT4("active"),
    VMALLOC_STAT4("allocated_bytes"),
    VMALLOC_STAT4("reserved_bytes"),
    VMALLOC_STAT4("active_bytes"),
    VMALLOC_STAT4("requested_bytes"),
#undef VMALLOC_STAT4
    "inactive_split_bytes.all.current",
    "num_alloc_retries",
    "num_ooms",
    "num_device_alloc",
    "num_device_free",
};

using StatValues = std::array<std::int64_t, kNumStats>;

// Returns false (values zeroed) if the device has no arena yet.
bool read_stats(c10::DeviceIndex device, StatValues& values) {
  return vmalloc_adapter_stats(device, kStatNames.data(), values.data(), kNumStats) >= 0;
}

// Runs a core hook that may throw a std::exception, as a torch error.
template <typename F>
void call_core(const char* what, F&& f) {
  try {
    f();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "vmalloc ", what, ": ", e.what());
  }
}

class VmallocAllocator final : public Base {
 public:
  VmallocAllocator()
      : Base([](size_t, int, cudaStream_t) -> void* { return nullptr; },  // replaced below: it needs `this`
             [](void* ptr, size_t size, int device, cudaStream_t stream) {
               vmalloc_free(ptr, size, device, reinterpret_cast<void*>(stream));
             }) {
    alloc_fn_ = [this](size_t size, int device, cudaStream_t stream) { return allocate_bytes(size, device, stream); };
    set_reset_fn([] { call_core("empty_cache", [] { vmalloc_empty_cache(); }); });
    set_memory_fraction_fn([](double fraction, int device) {
      call_core("set_per_process_memory_fraction", [&] { vmalloc_set_memory_fraction(fraction, device); });
    });
    set_record_stream_fn([](void* ptr, cudaStream_t stream) {
      call_core("record_stream", [&] { vmalloc_record_stream(ptr, reinterpret_cast<void*>(stream)); });
    });
    // No init hook: each device's arena is made by its first allocation (torch calls init with the device
    // count, and making every device's arena up front would reserve address space on GPUs never used).
  }

  // Whether torch's allocator calls reach this object as the process-wide allocator (global mode), as
  // opposed to a MemPool's allocator called by torch's caching allocator.
  bool is_current() const { return cca::get() == static_cast<const cca::CUDAAllocator*>(this); }

  // Note [OOM handler and torch's allocator lock]
  // In global mode torch calls us without holding any allocator lock, so the core may call its OOM handler
  // (the swap runtime's eviction, which takes the GIL), and an out-of-memory is raised as
  // c10::OutOfMemoryError. In MemPool mode torch's caching allocator calls raw_alloc while holding its own
  // device lock; taking the GIL there would invert torch's documented lock order (GIL, then allocator lock)
  // and can deadlock against a Python thread that holds the GIL and waits for that lock. So a MemPool
  // allocation never calls the handler, and an out-of-memory returns null: torch raises its own
  // torch.cuda.OutOfMemoryError. Nothing is recovered on the way: torch's retry after releasing cached
  // blocks frees only its default pools and abandoned graph pools, never the active pool's cached blocks
  // (which stay in torch's cache, not in vmalloc's), and torch <= 2.12 skips even that while an
  // allocate-to-pool scope is open (Note [What a pool scope costs] in vmalloc/torch_allocator.py).
  void* allocate_bytes(size_t size, int device, cudaStream_t stream) {
    const bool global = is_current();
    void* ptr = nullptr;
    char err[2048] = {0};
    const int rc = vmalloc_adapter_malloc(&ptr, size, device, reinterpret_cast<void*>(stream), global ? 1 : 0, err,
                                          sizeof(err));
    if (rc == 0) return ptr;
    if (rc == 1) {
      if (!global) return nullptr;
      std::string message(err);
      if (message.find("CUDA out of memory.") == std::string::npos) message = "CUDA out of memory. " + message;
      TORCH_CHECK_WITH(OutOfMemoryError, false, message);
    }
    TORCH_CHECK(false, "vmalloc: ", err);
    return nullptr;
  }

  std::string name() override { return "vmalloc"; }

  cca::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    StatValues v{};
    read_stats(device, v);
    subtract_baseline(device, v);
    cca::DeviceStats stats;
    auto fill = [&](auto& array, int first) {  // aggregate entry only: vmalloc has no small/large pools
      auto& s = array[0];
      s.current = v[first];
      s.peak = v[first + 1];
      s.allocated = v[first + 2];
      s.freed = v[first + 3];
    };
    fill(stats.allocation, allocation_current);
    fill(stats.segment, segment_current);
    fill(stats.active, active_current);
    fill(stats.allocated_bytes, allocated_bytes_current);
    fill(stats.reserved_bytes, reserved_bytes_current);
    fill(stats.active_bytes, active_bytes_current);
    fill(stats.requested_bytes, requested_bytes_current);
    stats.inactive_split_bytes[0].current = v[inactive_split_bytes_current];
    stats.num_alloc_retries = v[num_alloc_retries];
    stats.num_ooms = v[num_ooms];
    stats.num_device_alloc = v[num_device_alloc];
    stats.num_device_free = v[num_device_free];
    return stats;
  }

  void resetPeakStats(c10::DeviceIndex device) override { vmalloc_adapter_reset_peak(device); }

#if VMALLOC_TORCH_AT_LEAST(2, 10)
  // torch.cuda.get_per_process_memory_fraction: what set_per_process_memory_fraction sets, the arena's
  // capacity over the device's memory.
  double getMemoryFraction(c10::DeviceIndex device) override {
    double fraction = 0.0;
    char err[1024] = {0};
    TORCH_CHECK(vmalloc_adapter_memory_fraction(device, &fraction, err, sizeof(err)) == 0,
                "vmalloc get_per_process_memory_fraction: ", err);
    return fraction;
  }
#endif

  // The core keeps cumulative counters; torch's reset_accumulated_memory_stats is a baseline here.
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    StatValues v{};
    read_stats(device, v);
    std::lock_guard<std::mutex> lock(baseline_mu_);
    baseline_[device] = v;
  }

  // The largest allocation that can succeed now (Note [Workspace offers] in allocator_inspect.cpp).
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    size_t device_free = 0, device_total = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaMemGetInfo(&device_free, &device_total));
    }
    if (vmalloc_adapter_cache_info(device, device_free, largestBlock) != 0) *largestBlock = device_free;
  }

#if VMALLOC_TORCH_AT_LEAST(2, 11)
  cca::SnapshotInfo snapshot(c10::cuda::MempoolId_t, bool) override {
#elif VMALLOC_TORCH_AT_LEAST(2, 8)
  cca::SnapshotInfo snapshot(c10::cuda::MempoolId_t) override {
#else
  cca::SnapshotInfo snapshot() override {
#endif
    TORCH_CHECK(false, kHistoryMessage);
    return {};
  }

#if VMALLOC_TORCH_AT_LEAST(2, 11)
  void recordHistory(bool enabled, cca::CreateContextFn, size_t, cca::RecordContext, bool,
                     const std::vector<std::string>&) override {
#elif VMALLOC_TORCH_AT_LEAST(2, 8)
  void recordHistory(bool enabled, cca::CreateContextFn, size_t, cca::RecordContext, bool) override {
#else
  void recordHistory(bool enabled, cca::CreateContextFn, size_t, cca::RecordContext) override {
#endif
    // Turning history off is always fine (there is none to stop).
    TORCH_CHECK(!enabled, kHistoryMessage);
  }

  bool isHistoryEnabled() override { return false; }

  void beginAllocateToPool(c10::DeviceIndex, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>) override {
    TORCH_CHECK(false, kPoolMessage);
  }
  // Never reached with a pool of ours (beginAllocateToPool refused it); nothing to end or release.
  void endAllocateToPool(c10::DeviceIndex, c10::cuda::MempoolId_t) override {}
  void releasePool(c10::DeviceIndex, c10::cuda::MempoolId_t) override {}
  bool checkPoolLiveAllocations(c10::DeviceIndex, c10::cuda::MempoolId_t,
                                const std::unordered_set<void*>&) override {
    TORCH_CHECK(false, kPoolMessage);
    return false;
  }

 private:
  void subtract_baseline(c10::DeviceIndex device, StatValues& v) {
    std::lock_guard<std::mutex> lock(baseline_mu_);
    auto it = baseline_.find(device);
    if (it == baseline_.end()) return;
    const StatValues& b = it->second;
    for (int first : {allocation_current, segment_current, active_current, allocated_bytes_current,
                      reserved_bytes_current, active_bytes_current, requested_bytes_current}) {
      v[first + 2] -= b[first + 2];  // allocated
      v[first + 3] -= b[first + 3];  // freed
    }
    for (int counter : {num_alloc_retries, num_ooms, num_device_alloc, num_device_free}) v[counter] -= b[counter];
  }

  std::mutex baseline_mu_;
  std::unordered_map<int, StatValues> baseline_;
};

// Note [Pool scopes leave captures alone]
// vmalloc.use_mem_pool routes every stream's allocations to the pool. torch's own binding for that
// (_cuda_beginAllocateToPool) registers a filter that accepts every stream, and torch gives an allocation
// to a registered pool whose filter accepts its stream, searching oldest first in some releases (the
// templated allocator) and newest first in others. Where vmalloc's entry wins, a graph captured inside the
// scope (or a scope entered during a capture) allocates from vmalloc's pool, which torch shares with the
// eager tensors: memory the graph freed during capture is handed to eager tensors and overwritten at
// replay. This filter declines streams that are being captured, so each capture's allocations fall through
// to the capture's own private pool, whatever the order, and graphs work inside the scope.
bool not_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    // The legacy stream while another stream captures in global mode (cudaErrorStreamCaptureImplicit): not
    // capturing itself, and the error is not sticky.
    (void)cudaGetLastError();
    return true;
  }
  return status == cudaStreamCaptureStatusNone;
}

void begin_allocate_to_pool(c10::DeviceIndex device, c10::cuda::MempoolId_t pool) {
  cca::beginAllocateToPool(device, pool, [](cudaStream_t stream) { return not_capturing(stream); });
}

// One per process, never destroyed: torch may free tensors through it during interpreter shutdown.
const std::shared_ptr<VmallocAllocator>& instance() {
  static auto* a = new std::shared_ptr<VmallocAllocator>(std::make_shared<VmallocAllocator>());
  return *a;
}

}  // namespace
}  // namespace vmalloc_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vmalloc's torch adapter: a CUDAPluggableAllocator subclass with torch's stats, OOM and pool API";
  m.def(
      "allocator",
      []() -> std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> { return vmalloc_torch::instance(); },
      "The process's vmalloc allocator as a torch._C._cuda_CUDAAllocator.");
  m.def("is_current", [] { return vmalloc_torch::instance()->is_current(); },
        "Whether vmalloc's adapter is torch's current CUDA allocator.");
  m.def("begin_allocate_to_pool", &vmalloc_torch::begin_allocate_to_pool, pybind11::arg("device"),
        pybind11::arg("pool_id"),
        "Routes allocations of every stream that is not being captured, on any thread, to the pool "
        "(Note [Pool scopes leave captures alone]).");
  m.attr("torch_version") = TORCH_VERSION;
}
