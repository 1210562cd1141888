// The dtype changes of the CUDA backend's copies, launched on a stream. Shapes: `n` elements in,
// `n` out, both device memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "core/tensor.hpp"

namespace dtrain::backends::cuda {

// bits of bfloat16 from float, rounded as core/bfloat16.hpp rounds (as the CPU backend and AVX512-BF16 do).
void f32_to_bf16(const float* from, std::uint16_t* to, std::size_t n, cudaStream_t stream, Device device);
// Exact.
void bf16_to_f32(const std::uint16_t* from, float* to, std::size_t n, cudaStream_t stream, Device device);

}  // namespace dtrain::backends::cuda
