// CUresult names and descriptions (cuGetErrorName / cuGetErrorString, and FAKECUDA_FAIL's result names).
// The table lists every CUresult of CUDA 13's cuda.h, by value so that older headers build it too. The codes
// an allocator meets carry the real driver's texts; the others a text made from the name.
#include "errors.h"

#include <cstring>

namespace fakecuda {
namespace {

struct ErrorInfo {
  CUresult code;
  const char* name;
  const char* text;
};

constexpr ErrorInfo kErrors[] = {
    {CUresult(0), "CUDA_SUCCESS", "no error"},
    {CUresult(1), "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUresult(2), "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUresult(3), "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUresult(4), "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUresult(5), "CUDA_ERROR_PROFILER_DISABLED", "profiler disabled"},
    {CUresult(6), "CUDA_ERROR_PROFILER_NOT_INITIALIZED", "profiler not initialized"},
    {CUresult(7), "CUDA_ERROR_PROFILER_ALREADY_STARTED", "profiler already started"},
    {CUresult(8), "CUDA_ERROR_PROFILER_ALREADY_STOPPED", "profiler already stopped"},
    {CUresult(34), "CUDA_ERROR_STUB_LIBRARY", "stub library"},
    {CUresult(36), "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER", "call requires newer driver"},
    {CUresult(46), "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
    {CUresult(100), "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUresult(101), "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUresult(102), "CUDA_ERROR_DEVICE_NOT_LICENSED", "device not licensed"},
    {CUresult(200), "CUDA_ERROR_INVALID_IMAGE", "invalid image"},
    {CUresult(201), "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUresult(202), "CUDA_ERROR_CONTEXT_ALREADY_CURRENT", "context already current"},
    {CUresult(205), "CUDA_ERROR_MAP_FAILED", "map failed"},
    {CUresult(206), "CUDA_ERROR_UNMAP_FAILED", "unmap failed"},
    {CUresult(207), "CUDA_ERROR_ARRAY_IS_MAPPED", "array is mapped"},
    {CUresult(208), "CUDA_ERROR_ALREADY_MAPPED", "already mapped"},
    {CUresult(209), "CUDA_ERROR_NO_BINARY_FOR_GPU", "no binary for gpu"},
    {CUresult(210), "CUDA_ERROR_ALREADY_ACQUIRED", "already acquired"},
    {CUresult(211), "CUDA_ERROR_NOT_MAPPED", "not mapped"},
    {CUresult(212), "CUDA_ERROR_NOT_MAPPED_AS_ARRAY", "not mapped as array"},
    {CUresult(213), "CUDA_ERROR_NOT_MAPPED_AS_POINTER", "not mapped as pointer"},
    {CUresult(214), "CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"},
    {CUresult(215), "CUDA_ERROR_UNSUPPORTED_LIMIT", "unsupported limit"},
    {CUresult(216), "CUDA_ERROR_CONTEXT_ALREADY_IN_USE", "context already in use"},
    {CUresult(217), "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access unsupported"},
    {CUresult(218), "CUDA_ERROR_INVALID_PTX", "invalid ptx"},
    {CUresult(219), "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT", "invalid graphics context"},
    {CUresult(220), "CUDA_ERROR_NVLINK_UNCORRECTABLE", "nvlink uncorrectable"},
    {CUresult(221), "CUDA_ERROR_JIT_COMPILER_NOT_FOUND", "jit compiler not found"},
    {CUresult(222), "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "unsupported ptx version"},
    {CUresult(223), "CUDA_ERROR_JIT_COMPILATION_DISABLED", "jit compilation disabled"},
    {CUresult(224), "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY", "unsupported exec affinity"},
    {CUresult(225), "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC", "unsupported devside sync"},
    {CUresult(226), "CUDA_ERROR_CONTAINED", "contained"},
    {CUresult(300), "CUDA_ERROR_INVALID_SOURCE", "invalid source"},
    {CUresult(301), "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {CUresult(302), "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND", "shared object symbol not found"},
    {CUresult(303), "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED", "shared object init failed"},
    {CUresult(304), "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {CUresult(400), "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUresult(401), "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {CUresult(402), "CUDA_ERROR_LOSSY_QUERY", "lossy query"},
    {CUresult(500), "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUresult(600), "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUresult(700), "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUresult(701), "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "launch out of resources"},
    {CUresult(702), "CUDA_ERROR_LAUNCH_TIMEOUT", "launch timeout"},
    {CUresult(703), "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING", "launch incompatible texturing"},
    {CUresult(704), "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access already enabled"},
    {CUresult(705), "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access not enabled"},
    {CUresult(708), "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "primary context active"},
    {CUresult(709), "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUresult(710), "CUDA_ERROR_ASSERT", "assert"},
    {CUresult(711), "CUDA_ERROR_TOO_MANY_PEERS", "too many peers"},
    {CUresult(712), "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "host memory already registered"},
    {CUresult(713), "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "host memory not registered"},
    {CUresult(714), "CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error"},
    {CUresult(715), "CUDA_ERROR_ILLEGAL_INSTRUCTION", "illegal instruction"},
    {CUresult(716), "CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"},
    {CUresult(717), "CUDA_ERROR_INVALID_ADDRESS_SPACE", "invalid address space"},
    {CUresult(718), "CUDA_ERROR_INVALID_PC", "invalid pc"},
    {CUresult(719), "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUresult(720), "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", "cooperative launch too large"},
    {CUresult(721), "CUDA_ERROR_TENSOR_MEMORY_LEAK", "tensor memory leak"},
    {CUresult(800), "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUresult(801), "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUresult(802), "CUDA_ERROR_SYSTEM_NOT_READY", "system not ready"},
    {CUresult(803), "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system driver mismatch"},
    {CUresult(804), "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", "compat not supported on device"},
    {CUresult(805), "CUDA_ERROR_MPS_CONNECTION_FAILED", "mps connection failed"},
    {CUresult(806), "CUDA_ERROR_MPS_RPC_FAILURE", "mps rpc failure"},
    {CUresult(807), "CUDA_ERROR_MPS_SERVER_NOT_READY", "mps server not ready"},
    {CUresult(808), "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED", "mps max clients reached"},
    {CUresult(809), "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED", "mps max connections reached"},
    {CUresult(810), "CUDA_ERROR_MPS_CLIENT_TERMINATED", "mps client terminated"},
    {CUresult(811), "CUDA_ERROR_CDP_NOT_SUPPORTED", "cdp not supported"},
    {CUresult(812), "CUDA_ERROR_CDP_VERSION_MISMATCH", "cdp version mismatch"},
    {CUresult(900), "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {CUresult(901), "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {CUresult(902), "CUDA_ERROR_STREAM_CAPTURE_MERGE", "stream capture merge"},
    {CUresult(903), "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "stream capture unmatched"},
    {CUresult(904), "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "stream capture unjoined"},
    {CUresult(905), "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "stream capture isolation"},
    {CUresult(906), "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "operation would make the legacy stream depend on a capturing blocking stream"},
    {CUresult(907), "CUDA_ERROR_CAPTURED_EVENT", "captured event"},
    {CUresult(908), "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "stream capture wrong thread"},
    {CUresult(909), "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {CUresult(910), "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", "graph exec update failure"},
    {CUresult(911), "CUDA_ERROR_EXTERNAL_DEVICE", "external device"},
    {CUresult(912), "CUDA_ERROR_INVALID_CLUSTER_SIZE", "invalid cluster size"},
    {CUresult(913), "CUDA_ERROR_FUNCTION_NOT_LOADED", "function not loaded"},
    {CUresult(914), "CUDA_ERROR_INVALID_RESOURCE_TYPE", "invalid resource type"},
    {CUresult(915), "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION", "invalid resource configuration"},
    {CUresult(916), "CUDA_ERROR_KEY_ROTATION", "key rotation"},
    {CUresult(999), "CUDA_ERROR_UNKNOWN", "unknown error"},
};

}  // namespace

const char* error_name(CUresult code) {
  for (const auto& e : kErrors)
    if (e.code == code) return e.name;
  return nullptr;
}

const char* error_text(CUresult code) {
  for (const auto& e : kErrors)
    if (e.code == code) return e.text;
  return nullptr;
}

bool error_from_name(const char* name, CUresult& out) {
  for (const auto& e : kErrors) {
    if (std::strcmp(e.name, name) == 0) {
      out = e.code;
      return true;
    }
  }
  return false;
}

}  // namespace fakecuda
