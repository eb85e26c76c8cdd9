// Choosing a backend by name, and the device count each backend presents.
#include <unistd.h>

#include <string>
#include <utility>

#include "backend.h"
#include "config.h"

namespace vmalloc {

namespace {
constexpr std::size_t kCudaGranularity = std::size_t{2} << 20;  // cuMemGetAllocationGranularity on NVIDIA GPUs
}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& name, int device) {
  if (name == "cuda") return make_cuda_backend(device);
  if (name == "host") return make_host_backend();
  if (name == "sim") return make_sim_backend(kCudaGranularity);  // it simulates a GPU
  throw std::invalid_argument("unknown backend '" + name + "': choose 'cuda', 'host' or 'sim'");
}

std::size_t expected_granularity(const std::string& backend) {
  if (backend == "host") return static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  if (backend == "cuda" || backend == "sim") return kCudaGranularity;
  return 0;
}

void check_chunk_size(std::size_t chunk_size, std::size_t g, const std::string& backend) {
  if (chunk_size != 0 && chunk_size % g == 0) return;
  const std::size_t below = chunk_size / g * g, above = below + g;
  auto named = [](std::size_t n) {  // as the user would write it: "2MiB", "192KiB" (n is a page multiple)
    for (const auto& [unit, name] : {std::pair{std::size_t{1} << 30, "GiB"}, {std::size_t{1} << 20, "MiB"}})
      if (n % unit == 0) return std::to_string(n / unit) + name;
    return std::to_string(n >> 10) + "KiB";
  };
  const bool decimal = chunk_size != 0 && chunk_size % 1000 == 0;
  throw std::invalid_argument("chunk_size " + format_size(chunk_size) + " (" + std::to_string(chunk_size) +
                              " bytes) is not a multiple of the " + backend + " backend's granularity (" +
                              format_size(g) + " = " + std::to_string(g) + " bytes): " +
                              (below ? "the nearest multiples are " + named(below) + " and " : "the nearest multiple is ") +
                              named(above) +
                              (decimal ? " (MB and GB are decimal units; MiB and GiB are binary)" : ""));
}

// Note [Device count]
// The cuda backend has the devices the driver reports (cuDeviceGetCount, after CUDA_VISIBLE_DEVICES). The
// host and sim backends present `devices` devices (VMALLOC_CONF devices=N, configure(devices=N)), 1 by
// default, so that code written for several GPUs can run its device logic on a machine without one, and a
// wrong index fails there exactly as it would on a GPU.
int device_count(const Config& config) {
  if (config.backend == "cuda") return cuda_device_count();
  return config.devices;
}

void check_device(const Config& config, int device) {
  const int count = device_count(config);
  if (device >= 0 && device < count) return;
  std::string how = config.backend == "cuda"
                        ? "the CUDA driver reports " + std::to_string(count) + " device(s)"
                        : "the " + config.backend + " backend presents " + std::to_string(count) +
                              " device(s) (set devices=N in VMALLOC_CONF, or configure(devices=N), for more)";
  throw std::invalid_argument("vmalloc: device " + std::to_string(device) + " does not exist: " + how +
                              (count > 0 ? ", so valid indices are 0 to " + std::to_string(count - 1) : ""));
}

}  // namespace vmalloc
