// What every file of the CUDA backend shares about compiling for both sides and launching
// one-thread-per-element kernels; written once here so the kernels agree on it.
//   DTRAIN_HD               marks a function for host and device under nvcc, for the host alone
//                           under g++ (the arithmetic headers: math.hpp, layer_math.hpp,
//                           conv2d_geometry.hpp, tested on the CPU by the unit tests)
//   kThreads                threads per block of an element-wise kernel
//   elementwise_blocks(n)   its grid: enough blocks to fill an H200 several times over, few enough
//                           that a huge n costs no launch overhead
//   DTRAIN_GRID_STRIDE(i,n) the grid-stride loop over [0, n) with 64-bit indices (in .cu files)
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define DTRAIN_HD __host__ __device__
#else
#define DTRAIN_HD
#endif

namespace dtrain::backends::cuda {

inline constexpr unsigned kThreads = 256;

inline unsigned elementwise_blocks(std::int64_t n, unsigned threads = kThreads) {
  constexpr std::int64_t max_blocks = 8192;
  const std::int64_t blocks = n > 0 ? (n + threads - 1) / threads : 0;
  return static_cast<unsigned>(blocks < max_blocks ? blocks : max_blocks);
}

}  // namespace dtrain::backends::cuda

#define DTRAIN_GRID_STRIDE(i, n)                                                                           \
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < static_cast<std::int64_t>(n); \
       i += std::int64_t{gridDim.x} * blockDim.x)
