// CUDA backend: the driver's virtual memory management (cuMemAddressReserve / cuMemCreate / cuMemMap /
// cuMemSetAccess / cuMemUnmap / cuMemRelease / cuMemAddressFree).
//
// Note [libcuda at run time]
// libcuda is never linked. It is dlopen'ed the first time a cuda backend is made, and every entry point is
// looked up through cuGetProcAddress, so `import vmalloc` and the host/sim backends work on machines with no
// GPU or driver; only cuda.h (types and signatures) is needed to build. VMALLOC_LIBCUDA=<path> loads that
// file instead of libcuda.so.1: the test suite points it at an emulated driver (tests/fakecuda), so the
// cuda backend runs in CI without a GPU.
#include <cuda.h>
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "backend.h"

namespace vmalloc {
namespace {

struct Driver {
#define VMALLOC_CU_FN(name) decltype(&::name) name = nullptr;
  VMALLOC_CU_FN(cuInit)
  VMALLOC_CU_FN(cuGetErrorString)
  VMALLOC_CU_FN(cuGetErrorName)
  VMALLOC_CU_FN(cuDeviceGet)
  VMALLOC_CU_FN(cuDeviceGetCount)
  VMALLOC_CU_FN(cuDeviceTotalMem)
  VMALLOC_CU_FN(cuDevicePrimaryCtxRetain)
  VMALLOC_CU_FN(cuDevicePrimaryCtxRelease)
  VMALLOC_CU_FN(cuCtxGetCurrent)
  VMALLOC_CU_FN(cuCtxPushCurrent)
  VMALLOC_CU_FN(cuCtxPopCurrent)
  VMALLOC_CU_FN(cuMemGetAllocationGranularity)
  VMALLOC_CU_FN(cuMemAddressReserve)
  VMALLOC_CU_FN(cuMemAddressFree)
  VMALLOC_CU_FN(cuMemCreate)
  VMALLOC_CU_FN(cuMemRelease)
  VMALLOC_CU_FN(cuMemMap)
  VMALLOC_CU_FN(cuMemUnmap)
  VMALLOC_CU_FN(cuMemSetAccess)
  VMALLOC_CU_FN(cuEventCreate)
  VMALLOC_CU_FN(cuEventDestroy)
  VMALLOC_CU_FN(cuEventRecord)
  VMALLOC_CU_FN(cuEventQuery)
  VMALLOC_CU_FN(cuEventSynchronize)
  VMALLOC_CU_FN(cuStreamWaitEvent)
  VMALLOC_CU_FN(cuStreamIsCapturing)
  VMALLOC_CU_FN(cuCtxSynchronize)
#undef VMALLOC_CU_FN
};

using GetProcAddressV2 = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
using GetProcAddressV1 = CUresult (*)(const char*, void**, int, cuuint64_t);

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    const char* override_path = std::getenv("VMALLOC_LIBCUDA");
    const bool overridden = override_path && *override_path;
    const std::string path = overridden ? override_path : "libcuda.so.1";
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* why = dlerror();
      error = overridden ? "cannot load " + path + " (named by VMALLOC_LIBCUDA): " + (why ? why : "?")
                         : "cannot load libcuda.so.1 (is an NVIDIA driver installed?): " + std::string(why ? why : "?");
      return;
    }
    auto v2 = reinterpret_cast<GetProcAddressV2>(dlsym(lib, "cuGetProcAddress_v2"));
    auto v1 = reinterpret_cast<GetProcAddressV1>(dlsym(lib, "cuGetProcAddress"));
    if (!v2 && !v1) {
      error = path + " has no cuGetProcAddress: the driver is too old for vmalloc (CUDA 11.3+ needed)";
      return;
    }
    auto lookup = [&](const char* symbol, void** fn) {
      // 12000: ask for the CUDA 12 ABI of each symbol (e.g. cuMemGetInfo_v2), whatever the driver's version.
      CUresult r = v2 ? v2(symbol, fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, nullptr)
                      : v1(symbol, fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT);
      if ((r != CUDA_SUCCESS || *fn == nullptr) && error.empty()) error = path + " does not provide " + symbol;
    };
#define VMALLOC_CU_LOOKUP(name) lookup(#name, reinterpret_cast<void**>(&d.name));
    VMALLOC_CU_LOOKUP(cuInit)
    VMALLOC_CU_LOOKUP(cuGetErrorString)
    VMALLOC_CU_LOOKUP(cuGetErrorName)
    VMALLOC_CU_LOOKUP(cuDeviceGet)
    VMALLOC_CU_LOOKUP(cuDeviceGetCount)
    VMALLOC_CU_LOOKUP(cuDeviceTotalMem)
    VMALLOC_CU_LOOKUP(cuDevicePrimaryCtxRetain)
    VMALLOC_CU_LOOKUP(cuDevicePrimaryCtxRelease)
    VMALLOC_CU_LOOKUP(cuCtxGetCurrent)
    VMALLOC_CU_LOOKUP(cuCtxPushCurrent)
    VMALLOC_CU_LOOKUP(cuCtxPopCurrent)
    VMALLOC_CU_LOOKUP(cuMemGetAllocationGranularity)
    VMALLOC_CU_LOOKUP(cuMemAddressReserve)
    VMALLOC_CU_LOOKUP(cuMemAddressFree)
    VMALLOC_CU_LOOKUP(cuMemCreate)
    VMALLOC_CU_LOOKUP(cuMemRelease)
    VMALLOC_CU_LOOKUP(cuMemMap)
    VMALLOC_CU_LOOKUP(cuMemUnmap)
    VMALLOC_CU_LOOKUP(cuMemSetAccess)
    VMALLOC_CU_LOOKUP(cuEventCreate)
    VMALLOC_CU_LOOKUP(cuEventDestroy)
    VMALLOC_CU_LOOKUP(cuEventRecord)
    VMALLOC_CU_LOOKUP(cuEventQuery)
    VMALLOC_CU_LOOKUP(cuEventSynchronize)
    VMALLOC_CU_LOOKUP(cuStreamWaitEvent)
    VMALLOC_CU_LOOKUP(cuStreamIsCapturing)
    VMALLOC_CU_LOOKUP(cuCtxSynchronize)
#undef VMALLOC_CU_LOOKUP
  });
  if (!error.empty()) throw std::runtime_error("vmalloc cuda backend: " + error);
  return d;
}

// Throws BackendError naming the entry point and the CUresult (name, text and number).
void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* msg = nullptr;
  if (driver().cuGetErrorName) driver().cuGetErrorName(r, &name);
  if (driver().cuGetErrorString) driver().cuGetErrorString(r, &msg);
  const std::string text = std::string("vmalloc cuda backend: ") + what + " failed: " + (name ? name : "CUresult") +
                           " (" + (msg ? msg : "unknown error") + ", CUresult " + std::to_string(static_cast<int>(r)) + ")";
  if (r == CUDA_ERROR_OUT_OF_MEMORY) throw BackendOutOfMemory(what, text);
  throw BackendError(what, text);
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : d_(driver()), device_(device) {
    check(d_.cuInit(0), "cuInit");
    check(d_.cuDeviceGet(&dev_, device), "cuDeviceGet");
    check(d_.cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device;
    try {
      ContextGuard guard(*this);
      check(d_.cuMemGetAllocationGranularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity");
      check(d_.cuDeviceTotalMem(&total_, dev_), "cuDeviceTotalMem");
    } catch (...) {
      d_.cuDevicePrimaryCtxRelease(dev_);  // the destructor does not run for a half-made backend
      throw;
    }
  }

  ~CudaBackend() override {
    try {  // destructors never throw (Note [Failure guarantees]); at worst the events leak with the context
      ContextGuard guard(*this);
      for (CUevent e : idle_events_) d_.cuEventDestroy(e);
    } catch (...) {
    }
    d_.cuDevicePrimaryCtxRelease(dev_);
  }

  const char* name() const override { return "cuda"; }
  std::size_t granularity() const override { return granularity_; }
  std::size_t total_memory() const override { return total_; }

  std::uintptr_t reserve(std::size_t bytes) override {
    ContextGuard guard(*this);
    CUdeviceptr p = 0;
    check(d_.cuMemAddressReserve(&p, bytes, 0, 0, 0), "cuMemAddressReserve");
    return static_cast<std::uintptr_t>(p);
  }
  void release_reservation(std::uintptr_t base, std::size_t bytes) override {
    ContextGuard guard(*this);
    check(d_.cuMemAddressFree(static_cast<CUdeviceptr>(base), bytes), "cuMemAddressFree");
  }
  ChunkHandle create_chunk(std::size_t bytes) override {
    ContextGuard guard(*this);
    CUmemGenericAllocationHandle h = 0;
    check(d_.cuMemCreate(&h, bytes, &prop_, 0), "cuMemCreate");
    return static_cast<ChunkHandle>(h);
  }
  void release_chunk(ChunkHandle chunk, std::size_t) override {
    ContextGuard guard(*this);
    check(d_.cuMemRelease(static_cast<CUmemGenericAllocationHandle>(chunk)), "cuMemRelease");
  }
  void map(std::uintptr_t addr, std::size_t bytes, ChunkHandle chunk, std::size_t offset) override {
    ContextGuard guard(*this);
    check(d_.cuMemMap(static_cast<CUdeviceptr>(addr), bytes, offset, static_cast<CUmemGenericAllocationHandle>(chunk),
                      0),
          "cuMemMap");
  }
  bool maps_at_offsets() override {
    if (offsets_ < 0) offsets_ = probe_offsets() ? 1 : 0;
    return offsets_ == 1;
  }
  void unmap(std::uintptr_t addr, std::size_t bytes) override {
    ContextGuard guard(*this);
    check(d_.cuMemUnmap(static_cast<CUdeviceptr>(addr), bytes), "cuMemUnmap");
  }
  void set_access(std::uintptr_t addr, std::size_t bytes) override {
    ContextGuard guard(*this);
    CUmemAccessDesc desc{};
    desc.location = prop_.location;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(d_.cuMemSetAccess(static_cast<CUdeviceptr>(addr), bytes, &desc, 1), "cuMemSetAccess");
  }

  Event record_event(Stream stream) override {
    ContextGuard guard(*this);
    CUevent e = nullptr;
    {
      std::lock_guard<std::mutex> lock(events_mu_);
      if (!idle_events_.empty()) {
        e = idle_events_.back();
        idle_events_.pop_back();
      }
    }
    if (!e) check(d_.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    const CUresult r = d_.cuEventRecord(e, reinterpret_cast<CUstream>(stream));
    if (r != CUDA_SUCCESS) release_event(reinterpret_cast<Event>(e));  // back to the idle list, not leaked
    check(r, "cuEventRecord");
    return reinterpret_cast<Event>(e);
  }
  bool event_done(Event event) override {
    ContextGuard guard(*this);
    CUresult r = d_.cuEventQuery(reinterpret_cast<CUevent>(event));
    if (r == CUDA_ERROR_NOT_READY) return false;
    check(r, "cuEventQuery");
    return true;
  }
  void event_synchronize(Event event) override {
    ContextGuard guard(*this);
    check(d_.cuEventSynchronize(reinterpret_cast<CUevent>(event)), "cuEventSynchronize");
  }
  void stream_wait(Stream stream, Event event) override {
    ContextGuard guard(*this);
    check(d_.cuStreamWaitEvent(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUevent>(event), 0),
          "cuStreamWaitEvent");
  }
  void synchronize() override {
    ContextGuard guard(*this);
    check(d_.cuCtxSynchronize(), "cuCtxSynchronize");
  }
  void release_event(Event event) noexcept override {
    try {
      std::lock_guard<std::mutex> lock(events_mu_);
      idle_events_.push_back(reinterpret_cast<CUevent>(event));
    } catch (...) {  // out of memory for the idle list: the event leaks, nothing else
    }
  }
  bool capturing(Stream stream) override {
    ContextGuard guard(*this);
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    const CUresult r = d_.cuStreamIsCapturing(reinterpret_cast<CUstream>(stream), &status);
    // The legacy stream cannot be used while another stream captures in global mode: treat it as capturing.
    if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return true;
    check(r, "cuStreamIsCapturing");
    return status != CU_STREAM_CAPTURE_STATUS_NONE;
  }

 private:
  // Makes this device's primary context current for the scope, if another (or none) is.
  class ContextGuard {
   public:
    explicit ContextGuard(CudaBackend& b) : b_(b) {
      CUcontext cur = nullptr;
      b_.d_.cuCtxGetCurrent(&cur);
      if (cur != b_.ctx_) {
        check(b_.d_.cuCtxPushCurrent(b_.ctx_), "cuCtxPushCurrent");
        pushed_ = true;
      }
    }
    ~ContextGuard() {
      if (pushed_) {
        CUcontext ignored = nullptr;
        b_.d_.cuCtxPopCurrent(&ignored);
      }
    }
    ContextGuard(const ContextGuard&) = delete;
    ContextGuard& operator=(const ContextGuard&) = delete;

   private:
    CudaBackend& b_;
    bool pushed_ = false;
  };

  // Note [Probing map offsets]
  // cuda.h documents cuMemMap's offset ("maps bytes of memory represented by handle starting from byte
  // offset", with offset + size within the allocation) and, in the parameter's note, says it "currently must
  // be zero". Blocks of several chunks (Note [Blocks and slices] in allocator.cpp) need offsets, so the
  // backend asks the driver once, when the allocator first wants to know: a two-granule allocation, its
  // second granule mapped at offset one granule into a fresh reservation, then everything undone. Any
  // failure on the way means "no": the allocator then makes every block one chunk, which needs no offset.
  bool probe_offsets() noexcept {
    try {
      ContextGuard guard(*this);
      auto twice = [](auto&& call) { return call() == CUDA_SUCCESS || call() == CUDA_SUCCESS; };  // cleanup
      const std::size_t g = granularity_;
      CUdeviceptr va = 0;
      if (d_.cuMemAddressReserve(&va, g, 0, 0, 0) != CUDA_SUCCESS) return false;
      CUmemGenericAllocationHandle h = 0;
      bool mapped = false, unmapped = true;
      if (d_.cuMemCreate(&h, 2 * g, &prop_, 0) == CUDA_SUCCESS) {
        mapped = d_.cuMemMap(va, g, g, h, 0) == CUDA_SUCCESS;
        if (mapped) unmapped = twice([&] { return d_.cuMemUnmap(va, g); });
        twice([&] { return d_.cuMemRelease(h); });
      }
      if (unmapped) twice([&] { return d_.cuMemAddressFree(va, g); });  // else the address stays reserved
      return mapped && unmapped;
    } catch (...) {
      return false;
    }
  }

  const Driver& d_;
  int offsets_ = -1;  // maps_at_offsets(): -1 not asked yet
  int device_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  CUmemAllocationProp prop_{};
  std::size_t granularity_ = 0;
  std::size_t total_ = 0;
  std::mutex events_mu_;
  std::vector<CUevent> idle_events_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) { return std::make_unique<CudaBackend>(device); }

int cuda_device_count() {
  const Driver& d = driver();
  check(d.cuInit(0), "cuInit");
  int count = 0;
  check(d.cuDeviceGetCount(&count), "cuDeviceGetCount");
  return count;
}

}  // namespace vmalloc
