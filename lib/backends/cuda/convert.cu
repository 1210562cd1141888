// Shapes: n elements of f32 <-> n elements of bf16 (as uint16 bits), one thread per element in a
// grid-stride loop.
#include "backends/cuda/convert.hpp"
#include "backends/cuda/launch.hpp"

#include "backends/cuda/check.hpp"
#include "backends/cuda/launch.hpp"
#include "backends/cuda/math.hpp"

namespace dtrain::backends::cuda {

namespace {


__global__ void f32_to_bf16_kernel(const float* __restrict__ from, std::uint16_t* __restrict__ to, std::size_t n) {
  DTRAIN_GRID_STRIDE(i, n) to[i] = math::bf16_from_f32_bits(__float_as_uint(from[i]));
}

__global__ void bf16_to_f32_kernel(const std::uint16_t* __restrict__ from, float* __restrict__ to, std::size_t n) {
  DTRAIN_GRID_STRIDE(i, n) to[i] = __uint_as_float(math::f32_bits_from_bf16(from[i]));
}

}  // namespace

void f32_to_bf16(const float* from, std::uint16_t* to, std::size_t n, cudaStream_t stream, Device device) {
  if (n == 0) return;
  f32_to_bf16_kernel<<<elementwise_blocks(static_cast<std::int64_t>(n)), kThreads, 0, stream>>>(from, to, n);
  check_launch("f32_to_bf16_kernel", device);
}

void bf16_to_f32(const std::uint16_t* from, float* to, std::size_t n, cudaStream_t stream, Device device) {
  if (n == 0) return;
  bf16_to_f32_kernel<<<elementwise_blocks(static_cast<std::int64_t>(n)), kThreads, 0, stream>>>(from, to, n);
  check_launch("bf16_to_f32_kernel", device);
}

}  // namespace dtrain::backends::cuda
