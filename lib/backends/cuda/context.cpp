// The CUDA backend's place in the build, compiled when CUDA was found (CMake's DTRAIN_HAVE_CUDA),
// so that the backend seam is built against a second backend. It registers itself for gpu:N
// devices; until its layer kernels and its Numerics exist, making a context refuses the device
// and names what is missing (and first whether the device exists at all).
#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "backends/context.hpp"
#include "config/schema.hpp"
#include "core/error.hpp"
#include "nn/kernel.hpp"

namespace dtrain::backends::cuda {

namespace {

constexpr std::string_view kName = "cuda";

std::unique_ptr<Context> make(Device device) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess)
    throw ConfigError(fmt::format("device {}: no CUDA device is usable on this machine (cudaGetDeviceCount: {}); use "
                                  "cpu:N devices",
                                  device.to_string(), cudaGetErrorString(status)));
  if (device.index >= count)
    throw ConfigError(fmt::format("device {}: this machine has {} CUDA device{} (gpu:0 to gpu:{})", device.to_string(),
                                  count, count == 1 ? "" : "s", count - 1));
  const std::vector<std::string_view> missing = nn::kinds_without_kernel(kName);
  throw ConfigError(fmt::format("device {}: the CUDA backend of this build has no kernels yet: it lacks the layer kinds "
                                "{} and the loss, metric and optimizer loops (backends/numerics.hpp); use cpu:N "
                                "devices",
                                device.to_string(), config::join(missing)));
}

const bool registered = (register_backend(Device::Kind::gpu, kName, &make), true);

}  // namespace

}  // namespace dtrain::backends::cuda
