// Dropout cores (elementwise_cores.hpp). One thread per block of four elements of one sample: a
// Philox block gives the four keep decisions (layer_math.hpp's generator, the CPU's bits for the
// same key); the grid strides over (sample, block) pairs.
//   x, y, keep (batch, elements); dy, dx, keep (size)
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


// x and y null: the mask alone.
__global__ void dropout_kernel(DropoutKey key, std::uint32_t threshold, float scale,
                               const std::int64_t* __restrict__ sample_ids, std::int64_t batch, std::int64_t elements,
                               const float* x, float* y, std::uint8_t* __restrict__ keep) {
  const std::int64_t blocks_per_sample = (elements + 3) / 4;
  DTRAIN_GRID_STRIDE(t, batch * blocks_per_sample) {
    const std::int64_t sample = t / blocks_per_sample, block = t % blocks_per_sample;
    const std::int64_t id = sample_ids ? sample_ids[sample] : sample;
    const lm::Bits4 k =
        lm::dropout_keep_block(key.seed, key.global_step, id, key.layer, threshold, static_cast<std::uint32_t>(block));
    for (std::int64_t j = 0; j < 4; ++j) {
      const std::int64_t e = block * 4 + j;
      if (e >= elements) break;
      const std::int64_t i = sample * elements + e;
      const auto kept = static_cast<std::uint8_t>(k.v[j]);
      if (keep) keep[i] = kept;
      if (y) y[i] = lm::dropout_apply(x[i], scale, kept);
    }
  }
}

__global__ void dropout_backward_kernel(float scale, const std::uint8_t* __restrict__ keep, const float* dy, float* dx,
                                        std::int64_t size) {
  DTRAIN_GRID_STRIDE(i, size) { dx[i] = lm::dropout_apply(dy[i], scale, keep[i]); }
}

void launch(CudaContext& ctx, const DropoutKey& key, const std::int64_t* sample_ids, std::int64_t batch,
            std::int64_t elements, const float* x, float* y, std::uint8_t* keep) {
  const std::int64_t threads = batch * ((elements + 3) / 4);
  if (threads == 0) return;
  dropout_kernel<<<elementwise_blocks(threads), kThreads, 0, ctx.stream()>>>(
      key, lm::dropout_threshold(key.rate), lm::dropout_scale(key.rate), sample_ids, batch, elements, x, y, keep);
  check_launch("dropout_kernel", ctx.device());
}

void copy(CudaContext& ctx, const float* from, float* to, std::int64_t size) {
  if (from == to || size == 0) return;
  DTRAIN_CUDA_CALL(ctx.device(), cudaMemcpyAsync(to, from, static_cast<std::size_t>(size) * sizeof(float),
                                                 cudaMemcpyDeviceToDevice, ctx.stream()));
}

}  // namespace

void dropout_mask(CudaContext& ctx, const DropoutKey& key, const std::int64_t* sample_ids, std::int64_t batch,
                  std::int64_t elements, std::uint8_t* keep) {
  ctx.activate();
  launch(ctx, key, sample_ids, batch, elements, nullptr, nullptr, keep);
}

void dropout_forward(CudaContext& ctx, const DropoutKey& key, bool training, const std::int64_t* sample_ids,
                     std::int64_t batch, std::int64_t elements, const float* x, float* y, std::uint8_t* keep) {
  ctx.activate();
  if (!training || key.rate == 0.0) {
    copy(ctx, x, y, batch * elements);
    return;
  }
  launch(ctx, key, sample_ids, batch, elements, x, y, keep);
}

void dropout_backward(CudaContext& ctx, double rate, const std::uint8_t* keep, const float* dy, float* dx,
                      std::int64_t size) {
  ctx.activate();
  if (rate == 0.0) {
    copy(ctx, dy, dx, size);
    return;
  }
  if (size == 0) return;
  dropout_backward_kernel<<<elementwise_blocks(size), kThreads, 0,
                            ctx.stream()>>>(lm::dropout_scale(rate), keep, dy, dx, size);
  check_launch("dropout_backward_kernel", ctx.device());
}

}  // namespace dtrain::backends::cuda
