// Every CUDA, cuBLAS and cuDNN call of the backend goes through these checks: a failed call
// becomes an exception (core/error.hpp) that names the call, the device and what to do.
//   a device the machine lacks, a driver too old, memory exhausted -> ConfigError (the experiment
//   asks for what this machine cannot give); anything else -> InternalError (a dtrain bug or a
//   device fault).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include "core/tensor.hpp"

namespace dtrain::backends::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, Device device);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, Device device);
[[noreturn]] void throw_cudnn_error(cudnnStatus_t status, const char* call, Device device);

// After a kernel launch: a launch error (bad configuration, no kernel image for this GPU) names
// the kernel.
void check_launch(const char* kernel, Device device);

}  // namespace dtrain::backends::cuda

#define DTRAIN_CUDA_CALL(device, call)                                                   \
  do {                                                                                   \
    const cudaError_t dtrain_status_ = (call);                                           \
    if (dtrain_status_ != cudaSuccess)                                                   \
      ::dtrain::backends::cuda::throw_cuda_error(dtrain_status_, #call, (device));       \
  } while (0)
#define DTRAIN_CUBLAS_CALL(device, call)                                                 \
  do {                                                                                   \
    const cublasStatus_t dtrain_status_ = (call);                                        \
    if (dtrain_status_ != CUBLAS_STATUS_SUCCESS)                                         \
      ::dtrain::backends::cuda::throw_cublas_error(dtrain_status_, #call, (device));     \
  } while (0)
#define DTRAIN_CUDNN_CALL(device, call)                                                  \
  do {                                                                                   \
    const cudnnStatus_t dtrain_status_ = (call);                                         \
    if (dtrain_status_ != CUDNN_STATUS_SUCCESS)                                          \
      ::dtrain::backends::cuda::throw_cudnn_error(dtrain_status_, #call, (device));      \
  } while (0)
