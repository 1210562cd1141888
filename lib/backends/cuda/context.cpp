// The CUDA backend's place in the build, compiled when CUDA was found (CMake's DTRAIN_HAVE_CUDA),
// so that the backend seam is built against a second backend. It registers itself for gpu:N
// devices; until its layer kernels and its Numerics exist, making a context refuses the device
// and names what is missing (and whether the machine has such a device at all).
#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "device/context.hpp"
#include "config/schema.hpp"
#include "core/error.hpp"
#include "nn/kernel.hpp"

namespace dtrain::backends::cuda {

namespace {

constexpr std::string_view kName = "cuda";

std::unique_ptr<device::Context> make(Device device) {
  // What the backend lacks decides; whether the machine has the device is said too.
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  std::string machine;
  if (status != cudaSuccess)
    machine = fmt::format("; this machine has no usable CUDA device either (cudaGetDeviceCount: {})",
                          cudaGetErrorString(status));
  else if (device.index >= count)
    machine = fmt::format("; this machine has {} CUDA device{} either way", count, count == 1 ? "" : "s");
  const std::vector<std::string_view> missing = nn::kinds_without_kernel(kName);
  throw ConfigError(fmt::format("device {}: the CUDA backend of this build has no kernels yet: it lacks the layer kinds "
                                "{} and the loss, metric and optimizer loops{}; use cpu:N "
                                "devices",
                                device.to_string(), config::join(missing), machine));
}

const bool registered = (device::register_backend(Device::Kind::gpu, kName, &make), true);

}  // namespace

}  // namespace dtrain::backends::cuda
