// Choosing a backend by name, and the device count each backend presents.
#include <string>

#include "backend.h"
#include "config.h"

namespace vmalloc {

std::unique_ptr<Backend> make_backend(const std::string& name, int device) {
  if (name == "cuda") return make_cuda_backend(device);
  if (name == "host") return make_host_backend();
  if (name == "sim") return make_sim_backend(std::size_t{2} << 20);  // CUDA's usual VMM granularity
  throw std::invalid_argument("unknown backend '" + name + "': choose 'cuda', 'host' or 'sim'");
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
