// Pooling cores (elementwise_cores.hpp): max, average and global average pooling, forward and
// backward, NHWC float32, on the context's stream.
//   forward: one thread per output element (grid-stride), a window's loop from layer_math.hpp
//   backward: one thread per input element, gathering from the windows that hold it in output
//   order: no atomics, and the same additions in the same order as the reference's scatter, so
//   the gradients are the reference's (in float) bit for bit
#include "backends/cuda/check.hpp"
#include "backends/cuda/context.hpp"
#include "backends/cuda/convert.hpp"
#include "backends/cuda/launch.hpp"
#include "backends/cuda/elementwise_cores.hpp"
#include "backends/cuda/layer_math.hpp"

namespace dtrain::backends::cuda {

namespace {

namespace lm = layer_math;


// (n, y, x, c) of flat NHWC index i over planes of h x w x c.
struct At {
  std::int64_t n, y, x, c;
};
__device__ inline At unflatten(std::int64_t i, std::int64_t h, std::int64_t w, std::int64_t c) {
  At a;
  a.c = i % c;
  i /= c;
  a.x = i % w;
  i /= w;
  a.y = i % h;
  a.n = i / h;
  return a;
}

__global__ void max_pool_forward_kernel(PoolDims d, const float* __restrict__ x, float* __restrict__ y,
                                        std::int32_t* __restrict__ argmax) {
  const std::int64_t total = d.n * d.oh * d.ow * d.c;
  DTRAIN_GRID_STRIDE(i, total) {
    const At o = unflatten(i, d.oh, d.ow, d.c);
    const lm::MaxAt best = lm::max_pool_window(x, d, o.n, o.y, o.x, o.c);
    y[i] = best.value;
    if (argmax) argmax[i] = best.position;
  }
}

__global__ void max_pool_backward_kernel(PoolDims d, const float* __restrict__ dy,
                                         const std::int32_t* __restrict__ argmax, float* __restrict__ dx) {
  const std::int64_t total = d.n * d.h * d.w * d.c;
  DTRAIN_GRID_STRIDE(i, total) {
    const At a = unflatten(i, d.h, d.w, d.c);
    dx[i] = lm::max_pool_input_gradient(dy, argmax, d, a.n, a.y, a.x, a.c);
  }
}

__global__ void average_pool_forward_kernel(PoolDims d, const float* __restrict__ x, float* __restrict__ y) {
  const std::int64_t total = d.n * d.oh * d.ow * d.c;
  DTRAIN_GRID_STRIDE(i, total) {
    const At o = unflatten(i, d.oh, d.ow, d.c);
    y[i] = lm::average_pool_window(x, d, o.n, o.y, o.x, o.c);
  }
}

__global__ void average_pool_backward_kernel(PoolDims d, const float* __restrict__ dy, float* __restrict__ dx) {
  const std::int64_t total = d.n * d.h * d.w * d.c;
  DTRAIN_GRID_STRIDE(i, total) {
    const At a = unflatten(i, d.h, d.w, d.c);
    dx[i] = lm::average_pool_input_gradient(dy, d, a.n, a.y, a.x, a.c);
  }
}

// One thread per (sample, channel), consecutive threads on consecutive channels (coalesced reads),
// each adding its h * w positions in order.
__global__ void global_average_forward_kernel(std::int64_t n, std::int64_t positions, std::int64_t c,
                                              const float* __restrict__ x, float* __restrict__ y) {
  DTRAIN_GRID_STRIDE(i, n * c) { y[i] = lm::global_average_pool(x, i / c, positions, i % c, c); }
}

__global__ void global_average_backward_kernel(std::int64_t n, std::int64_t positions, std::int64_t c,
                                               const float* __restrict__ dy, float* __restrict__ dx) {
  const float count = static_cast<float>(positions);
  DTRAIN_GRID_STRIDE(i, n * positions * c) { dx[i] = dy[(i / (positions * c)) * c + i % c] / count; }
}


}  // namespace

void max_pool2d_forward(CudaContext& ctx, const PoolDims& d, const float* x, float* y, std::int32_t* argmax) {
  const std::int64_t total = d.n * d.oh * d.ow * d.c;
  if (total == 0) return;
  ctx.activate();
  max_pool_forward_kernel<<<elementwise_blocks(total), kThreads, 0, ctx.stream()>>>(d, x, y, argmax);
  check_launch("max_pool_forward_kernel", ctx.device());
}

void max_pool2d_backward(CudaContext& ctx, const PoolDims& d, const float* dy, const std::int32_t* argmax, float* dx) {
  const std::int64_t total = d.n * d.h * d.w * d.c;
  if (total == 0) return;
  ctx.activate();
  max_pool_backward_kernel<<<elementwise_blocks(total), kThreads, 0, ctx.stream()>>>(d, dy, argmax, dx);
  check_launch("max_pool_backward_kernel", ctx.device());
}

void average_pool2d_forward(CudaContext& ctx, const PoolDims& d, const float* x, float* y) {
  const std::int64_t total = d.n * d.oh * d.ow * d.c;
  if (total == 0) return;
  ctx.activate();
  average_pool_forward_kernel<<<elementwise_blocks(total), kThreads, 0, ctx.stream()>>>(d, x, y);
  check_launch("average_pool_forward_kernel", ctx.device());
}

void average_pool2d_backward(CudaContext& ctx, const PoolDims& d, const float* dy, float* dx) {
  const std::int64_t total = d.n * d.h * d.w * d.c;
  if (total == 0) return;
  ctx.activate();
  average_pool_backward_kernel<<<elementwise_blocks(total), kThreads, 0, ctx.stream()>>>(d, dy, dx);
  check_launch("average_pool_backward_kernel", ctx.device());
}

void global_average_pool2d_forward(CudaContext& ctx, std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c,
                                   const float* x, float* y) {
  if (n * c == 0) return;
  ctx.activate();
  global_average_forward_kernel<<<elementwise_blocks(n * c), kThreads, 0, ctx.stream()>>>(n, h * w, c, x, y);
  check_launch("global_average_forward_kernel", ctx.device());
}

void global_average_pool2d_backward(CudaContext& ctx, std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c,
                                    const float* dy, float* dx) {
  if (n * h * w * c == 0) return;
  ctx.activate();
  global_average_backward_kernel<<<elementwise_blocks(n * h * w * c), kThreads, 0, ctx.stream()>>>(n, h * w, c, dy, dx);
  check_launch("global_average_backward_kernel", ctx.device());
}

}  // namespace dtrain::backends::cuda
