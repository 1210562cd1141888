// Activation cores (elementwise_cores.hpp): linear, relu, sigmoid, tanh elementwise (one thread
// per value, grid-stride); softmax one thread per row of `cols` values (rows are a batch of
// classes: a row fits a thread). The formulas are layer_math.hpp's.
#include <cuda_runtime_api.h>

#include "backends/cuda/check.hpp"
#include "backends/cuda/context.hpp"
#include "backends/cuda/convert.hpp"
#include "backends/cuda/launch.hpp"
#include "backends/cuda/elementwise_cores.hpp"
#include "backends/cuda/layer_math.hpp"

namespace dtrain::backends::cuda {

namespace {

namespace lm = layer_math;
using config::Activation;

constexpr unsigned kRowThreads = 128;

__global__ void activation_forward_kernel(Activation a, const float* z, float* y, std::int64_t size) {
  DTRAIN_GRID_STRIDE(i, size) { y[i] = lm::activation_element(a, z[i]); }
}

__global__ void activation_backward_kernel(Activation a, const float* __restrict__ y, const float* dy, float* dz,
                                           std::int64_t size) {
  DTRAIN_GRID_STRIDE(i, size) { dz[i] = lm::activation_gradient_element(a, y[i], dy[i]); }
}

__global__ void softmax_forward_kernel(const float* z, float* y, std::int64_t rows, std::int64_t cols) {
  DTRAIN_GRID_STRIDE(r, rows) {
    float* row = y + r * cols;
    if (z != y)
      for (std::int64_t j = 0; j < cols; ++j) row[j] = z[r * cols + j];
    lm::softmax_row(row, cols);
  }
}

__global__ void softmax_backward_kernel(const float* __restrict__ y, const float* dy, float* dz, std::int64_t rows,
                                        std::int64_t cols) {
  DTRAIN_GRID_STRIDE(r, rows) { lm::softmax_gradient_row(y + r * cols, dy + r * cols, dz + r * cols, cols); }
}

void copy(CudaContext& ctx, const float* from, float* to, std::int64_t size) {
  if (from == to) return;
  DTRAIN_CUDA_CALL(ctx.device(), cudaMemcpyAsync(to, from, static_cast<std::size_t>(size) * sizeof(float),
                                                 cudaMemcpyDeviceToDevice, ctx.stream()));
}

}  // namespace

void activation_forward(CudaContext& ctx, Activation a, const float* z, float* y, std::int64_t size,
                        std::int64_t cols) {
  if (size == 0) return;
  ctx.activate();
  if (a == Activation::linear) {
    copy(ctx, z, y, size);
  } else if (a == Activation::softmax) {
    const std::int64_t rows = size / cols;
    softmax_forward_kernel<<<elementwise_blocks(rows, kRowThreads), kRowThreads, 0,
                             ctx.stream()>>>(z, y, rows, cols);
    check_launch("softmax_forward_kernel", ctx.device());
  } else {
    activation_forward_kernel<<<elementwise_blocks(size), kThreads, 0,
                                ctx.stream()>>>(a, z, y, size);
    check_launch("activation_forward_kernel", ctx.device());
  }
}

void activation_backward(CudaContext& ctx, Activation a, const float* y, const float* dy, float* dz,
                         std::int64_t size, std::int64_t cols) {
  if (size == 0) return;
  ctx.activate();
  if (a == Activation::linear) {
    copy(ctx, dy, dz, size);
  } else if (a == Activation::softmax) {
    const std::int64_t rows = size / cols;
    softmax_backward_kernel<<<elementwise_blocks(rows, kRowThreads), kRowThreads, 0,
                              ctx.stream()>>>(y, dy, dz, rows, cols);
    check_launch("softmax_backward_kernel", ctx.device());
  } else {
    activation_backward_kernel<<<elementwise_blocks(size), kThreads, 0,
                                 ctx.stream()>>>(a, y, dy, dz, size);
    check_launch("activation_backward_kernel", ctx.device());
  }
}

}  // namespace dtrain::backends::cuda
