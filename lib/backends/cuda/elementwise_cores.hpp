// The compute cores of the CUDA layer kernels that work per element, per window or per channel:
// pooling (pooling_core.cu), activations (activation_core.cu), dropout (dropout_core.cu) and batch
// normalization (batch_norm_core.cu). Each launches its kernels on the context's stream and
// returns without waiting; every pointer is device memory of that context, float32, in Keras'
// channels-last layout (NHWC, or (M, C) rows for batch normalization). Their arithmetic is
// layer_math.hpp's (tested on the CPU by tests/unit/test_cuda_layer_math.cpp), their launches by
// tests/gpu/test_gpu_layers_elementwise.cpp against the reference oracle (nn/reference/).
//
// Nothing here allocates: what a core needs besides its inputs and outputs (batch normalization's
// partial sums) is a workspace the caller sizes with the matching *_workspace_bytes().
// Gradients are written whole (overwritten, never accumulated), and no result depends on the GPU,
// the grid or the timing: reductions run in a fixed order (no atomics), so a run repeats its bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "config/experiment.hpp"
#include "nn/reference/layers.hpp"

namespace dtrain::backends::cuda {

class CudaContext;

using nn::reference::PoolDims;

// ---- pooling (PoolDims as Pool2DLayer::dims() gives it: TensorFlow's 'valid' or 'same', padding
// never part of a window)
//   x, dx (N, H, W, C); y, dy, argmax (N, OH, OW, C)
// Max pooling: the first maximum of a window wins (rows, then columns); argmax (may be null in
// forward) keeps its position py * pw + px in the window for backward, which adds each dy to the
// input that won (exactly the reference's sums, overlapping windows included).
void max_pool2d_forward(CudaContext& ctx, const PoolDims& d, const float* x, float* y, std::int32_t* argmax);
void max_pool2d_backward(CudaContext& ctx, const PoolDims& d, const float* dy, const std::int32_t* argmax, float* dx);
// Average pooling: the mean of a window's real positions (padding counts neither in the sum nor
// in the divisor, as tf.nn.avg_pool).
void average_pool2d_forward(CudaContext& ctx, const PoolDims& d, const float* x, float* y);
void average_pool2d_backward(CudaContext& ctx, const PoolDims& d, const float* dy, float* dx);
// Global average pooling: x, dx (N, H, W, C); y, dy (N, C).
void global_average_pool2d_forward(CudaContext& ctx, std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c,
                                   const float* x, float* y);
void global_average_pool2d_backward(CudaContext& ctx, std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c,
                                    const float* dy, float* dx);

// ---- activations: `size` values; softmax over rows of `cols` (the last axis), one thread per row.
// y may be z (in place); backward computes dz = dy * f'(z) from the output y, and dz may be dy.
void activation_forward(CudaContext& ctx, config::Activation a, const float* z, float* y, std::int64_t size,
                        std::int64_t cols);
void activation_backward(CudaContext& ctx, config::Activation a, const float* y, const float* dy, float* dz,
                         std::int64_t size, std::int64_t cols);

// ---- dropout: a step's masks, keyed as nn::dropout_mask keys them (the same bits as the CPU).
struct DropoutKey {
  std::uint64_t seed = 0;        // the experiment's seed
  std::int64_t global_step = 0;  // StepContext::global_step
  std::uint32_t layer = 0;       // the layer's position in the model
  double rate = 0.0;             // in [0, 1)
};
// keep (batch, elements): 1 keeps, 0 drops. sample_ids: `batch` ids in device memory, or null for
// 0 .. batch - 1 (nn::sample_id without the pipeline's ids).
void dropout_mask(CudaContext& ctx, const DropoutKey& key, const std::int64_t* sample_ids, std::int64_t batch,
                  std::int64_t elements, std::uint8_t* keep);
// Training: y = x * mask / (1 - rate), and the mask into keep (when not null) for backward;
// inference, or rate 0: y = x (keep untouched). y may be x.
void dropout_forward(CudaContext& ctx, const DropoutKey& key, bool training, const std::int64_t* sample_ids,
                     std::int64_t batch, std::int64_t elements, const float* x, float* y, std::uint8_t* keep);
// dx = dy * keep / (1 - rate); rate 0: dx = dy. dx may be dy.
void dropout_backward(CudaContext& ctx, double rate, const std::uint8_t* keep, const float* dy, float* dx,
                      std::int64_t size);

// ---- batch normalization: x, y, dy, dx (m, c); every per-channel array (c). gamma null = 1,
// beta null = 0.
// Device memory the statistics and the backward need for m rows of c channels.
std::size_t batch_norm_workspace_bytes(std::int64_t m, std::int64_t c);
// Training: the batch's per-channel mean and biased variance, summed in double in a fixed order
// (two passes: the mean, then the squared deviations from it), and inv_std = 1 / sqrt(variance +
// epsilon). mean_contribution and variance_contribution (may be null): the statistics times
// `weight` (the replica's share of the moving statistics' update, nn/batch_normalization.hpp),
// rounded once from double as the CPU backend does. m 0 gives a mean and variance of 0.
struct BatchNormStatistics {
  float* mean = nullptr;
  float* variance = nullptr;
  float* inv_std = nullptr;
  float* mean_contribution = nullptr;
  float* variance_contribution = nullptr;
  double weight = 1.0;
};
void batch_norm_statistics(CudaContext& ctx, const float* x, std::int64_t m, std::int64_t c, double epsilon,
                           const BatchNormStatistics& out, void* workspace);
// Inference: inv_std = 1 / sqrt(variance + epsilon) of the moving variance.
void batch_norm_inv_std(CudaContext& ctx, const float* variance, std::int64_t c, double epsilon, float* inv_std);
// y = gamma (x - mean) inv_std + beta, as x * scale + shift per channel.
void batch_norm_forward(CudaContext& ctx, const float* x, std::int64_t m, std::int64_t c, const float* mean,
                        const float* inv_std, const float* gamma, const float* beta, float* y);
// dgamma = sum(dy xhat), dbeta = sum(dy) (summed in double in a fixed order); training: dx =
// gamma inv_std (dy - mean(dy) - xhat mean(dy xhat)), the gradient through the batch statistics
// (mean and inv_std must be the batch's); inference (training false): dx = gamma inv_std dy, the
// statistics being constants. dx, dgamma and dbeta may each be null.
void batch_norm_backward(CudaContext& ctx, bool training, const float* x, const float* dy, std::int64_t m,
                         std::int64_t c, const float* mean, const float* inv_std, const float* gamma, float* dx,
                         float* dgamma, float* dbeta, void* workspace);

// Synchronized batch normalization: the same passes, with the per-channel sums crossing the
// replicas through the host between them (the layer kernel sums them with
// StepContext::cross_replica, which sums host doubles). Each sum is in double, in the fixed order
// of the passes above; workspace as batch_norm_workspace_bytes(m, c). m may be 0 (x unread).
// sums (c, device) = per-channel sums of x.
void batch_norm_sum(CudaContext& ctx, const float* x, std::int64_t m, std::int64_t c, double* sums, void* workspace);
// sums (c, device) = per-channel sums of (x - mean)^2; mean (c, device): the mean over every replica.
void batch_norm_sum_squared_deviations(CudaContext& ctx, const float* x, std::int64_t m, std::int64_t c,
                                       const double* mean, double* sums, void* workspace);
// What batch_norm_statistics writes into `out`, from the mean and biased variance (c each, device,
// double) over every replica.
void batch_norm_finish_statistics(CudaContext& ctx, const double* mean, const double* variance, std::int64_t c,
                                  double epsilon, const BatchNormStatistics& out);
// sums (2c, device) = per-channel sums of dy, then of dy * xhat (this replica's rows); dbeta and
// dgamma (may be null) the same rounded to float, as batch_norm_backward writes them.
void batch_norm_gradient_sums(CudaContext& ctx, const float* x, const float* dy, std::int64_t m, std::int64_t c,
                              const float* mean, const float* inv_std, double* sums, float* dgamma, float* dbeta,
                              void* workspace);
// Training dx from means (2c, device): the means of dy, then of dy * xhat, over every replica.
void batch_norm_backward_from_means(CudaContext& ctx, const float* x, const float* dy, std::int64_t m, std::int64_t c,
                                    const float* mean, const float* inv_std, const float* gamma, const double* means,
                                    float* dx);

// moving = moving * momentum + statistic * (1 - momentum), 1 - momentum taken in double.
void batch_norm_moving_average(CudaContext& ctx, float* moving, const float* statistic, std::int64_t c,
                               double momentum);

}  // namespace dtrain::backends::cuda
