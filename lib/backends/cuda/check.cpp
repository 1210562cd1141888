#include "backends/cuda/check.hpp"

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::backends::cuda {

void throw_cuda_error(cudaError_t status, const char* call, Device device) {
  // A non-sticky error stays pending for the next cudaGetLastError(); clear it so that a later,
  // unrelated check does not report it again.
  (void)cudaGetLastError();
  const std::string what = fmt::format("device {}: {} failed: {} ({})", device.to_string(), call,
                                       cudaGetErrorString(status), cudaGetErrorName(status));
  switch (status) {
    case cudaErrorInvalidDevice:
    case cudaErrorNoDevice: {
      int count = 0;
      if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
      (void)cudaGetLastError();
      throw ConfigError(fmt::format("{}; this machine has {} CUDA device{}: use gpu:0 to gpu:{} or cpu:N devices",
                                    what, count, count == 1 ? "" : "s", count > 0 ? count - 1 : 0));
    }
    case cudaErrorInsufficientDriver:
      throw ConfigError(fmt::format("{}; the NVIDIA driver is older than the CUDA runtime dtrain was built with "
                                    "(CUDA {}.{}): update the driver, or use cpu:N devices",
                                    what, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10));
    case cudaErrorMemoryAllocation:
      throw ConfigError(fmt::format("{}; the GPU is out of memory: use a smaller batch_size_per_replica or model, "
                                    "or fewer replicas per GPU",
                                    what));
    default:
      throw InternalError(fmt::format("{}; the GPU reported a fault or dtrain misused CUDA: please report it with "
                                      "this message (CUDA_LAUNCH_BLOCKING=1 names the failing kernel)",
                                      what));
  }
}

void throw_cublas_error(cublasStatus_t status, const char* call, Device device) {
  const std::string what = fmt::format("device {}: {} failed: {} ({})", device.to_string(), call,
                                       cublasGetStatusString(status), cublasGetStatusName(status));
  if (status == CUBLAS_STATUS_ALLOC_FAILED)
    throw ConfigError(what + "; the GPU is out of memory: use a smaller batch_size_per_replica or model");
  throw InternalError(what + "; please report it with this message");
}

void throw_cudnn_error(cudnnStatus_t status, const char* call, Device device) {
  const std::string what =
      fmt::format("device {}: {} failed: {}", device.to_string(), call, cudnnGetErrorString(status));
  if (status == CUDNN_STATUS_ALLOC_FAILED)
    throw ConfigError(what + "; the GPU is out of memory: use a smaller batch_size_per_replica or model");
  throw InternalError(what + "; please report it with this message (is cuDNN 9 for this CUDA installed?)");
}

void check_launch(const char* kernel, Device device) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) throw_cuda_error(status, kernel, device);
}

}  // namespace dtrain::backends::cuda
