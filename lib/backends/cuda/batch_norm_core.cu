// Batch normalization cores (elementwise_cores.hpp) over m rows x c channels, float32 data with
// per-channel sums in double.
//
// The per-channel sums are deterministic, with no atomics: the rows are cut into `chunks` fixed
// ranges (how many depends on m alone, never on the GPU), a block of kChannelLanes x kRowLanes
// threads sums one range for kChannelLanes channels (each thread a fixed, strided set of rows, then
// a fixed tree over the row lanes in shared memory), and one thread per channel adds the ranges'
// partial sums in order. The same input therefore gives the same bits on every run.
//   workspace: partial sums (2 x chunks x c doubles), then two per-channel doubles (c each)
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

constexpr unsigned kChannelLanes = 32;  // threadIdx.x: consecutive channels (coalesced reads)
constexpr unsigned kRowLanes = 8;       // threadIdx.y: rows of a range, strided
constexpr std::int64_t kRowsPerChunk = 64;
constexpr std::int64_t kMaxChunks = 256;

std::int64_t chunks_of(std::int64_t m) {
  const std::int64_t chunks = (m + kRowsPerChunk - 1) / kRowsPerChunk;
  return chunks < 1 ? 1 : chunks > kMaxChunks ? kMaxChunks : chunks;
}

struct Workspace {
  double* partial_a;  // (chunks, c)
  double* partial_b;  // (chunks, c)
  double* channel_a;  // (c)
  double* channel_b;  // (c)
};
Workspace carve(void* workspace, std::int64_t chunks, std::int64_t c) {
  auto* p = static_cast<double*>(workspace);
  return {p, p + chunks * c, p + 2 * chunks * c, p + 2 * chunks * c + c};
}

// What the passes sum per (row, channel) into two accumulators.
struct SumX {  // x
  const float* x;
  std::int64_t c;
  __device__ void operator()(std::int64_t r, std::int64_t k, double& a, double&) const {
    a = lm::add(a, static_cast<double>(x[r * c + k]));
  }
};
struct SumSquaredDeviation {  // (x - mean)^2, mean in double
  const float* x;
  const double* mean;
  std::int64_t c;
  __device__ void operator()(std::int64_t r, std::int64_t k, double& a, double&) const {
    const double d = static_cast<double>(x[r * c + k]) - mean[k];
    a = lm::add(a, lm::mul(d, d));
  }
};
struct SumGradient {  // dy, and dy * xhat
  const float* x;
  const float* dy;
  const float* mean;
  const float* inv_std;
  std::int64_t c;
  __device__ void operator()(std::int64_t r, std::int64_t k, double& a, double& b) const {
    const float g = dy[r * c + k];
    a = lm::add(a, static_cast<double>(g));
    b = lm::add(b, lm::batch_norm_dy_xhat(x[r * c + k], g, mean[k], inv_std[k]));
  }
};

// Block (kChannelLanes, kRowLanes); grid (chunks, channel groups).
template <class Term>
__global__ void __launch_bounds__(kThreads)
    channel_partials_kernel(Term term, std::int64_t m, std::int64_t c, std::int64_t chunks,
                            double* __restrict__ partial_a, double* __restrict__ partial_b) {
  __shared__ double shared_a[kRowLanes][kChannelLanes];
  __shared__ double shared_b[kRowLanes][kChannelLanes];
  const std::int64_t chunk = blockIdx.x;
  const std::int64_t k = std::int64_t{blockIdx.y} * kChannelLanes + threadIdx.x;
  const std::int64_t begin = m * chunk / chunks, end = m * (chunk + 1) / chunks;
  double a = 0.0, b = 0.0;
  if (k < c)
    for (std::int64_t r = begin + threadIdx.y; r < end; r += kRowLanes) term(r, k, a, b);
  shared_a[threadIdx.y][threadIdx.x] = a;
  shared_b[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  for (unsigned half = kRowLanes / 2; half > 0; half /= 2) {
    if (threadIdx.y < half) {
      shared_a[threadIdx.y][threadIdx.x] = lm::add(shared_a[threadIdx.y][threadIdx.x], shared_a[threadIdx.y + half][threadIdx.x]);
      shared_b[threadIdx.y][threadIdx.x] = lm::add(shared_b[threadIdx.y][threadIdx.x], shared_b[threadIdx.y + half][threadIdx.x]);
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && k < c) {
    partial_a[chunk * c + k] = shared_a[0][threadIdx.x];
    partial_b[chunk * c + k] = shared_b[0][threadIdx.x];
  }
}

// The ranges' partial sums of channel k, added in range order.
__device__ inline double total(const double* partial, std::int64_t chunks, std::int64_t c, std::int64_t k) {
  double sum = 0.0;
  for (std::int64_t j = 0; j < chunks; ++j) sum = lm::add(sum, partial[j * c + k]);
  return sum;
}

__global__ void mean_kernel(Workspace w, std::int64_t chunks, std::int64_t m, std::int64_t c) {
  const double count = static_cast<double>(m);
  DTRAIN_GRID_STRIDE(k, c) { w.channel_a[k] = m > 0 ? total(w.partial_a, chunks, c, k) / count : 0.0; }
}

// Channel k's statistics from its mean and biased variance in double: what `out` asks for.
__device__ inline void write_statistics(const BatchNormStatistics& out, std::int64_t k, double mean, double variance,
                                        double epsilon) {
  if (out.mean) out.mean[k] = static_cast<float>(mean);
  if (out.variance) out.variance[k] = static_cast<float>(variance);
  if (out.inv_std) out.inv_std[k] = lm::batch_norm_inv_std(variance, epsilon);
  if (out.mean_contribution) out.mean_contribution[k] = static_cast<float>(lm::mul(mean, out.weight));
  if (out.variance_contribution) out.variance_contribution[k] = static_cast<float>(lm::mul(variance, out.weight));
}

__global__ void variance_kernel(Workspace w, std::int64_t chunks, std::int64_t m, std::int64_t c, double epsilon,
                                BatchNormStatistics out) {
  const double count = static_cast<double>(m);
  DTRAIN_GRID_STRIDE(k, c) {
    write_statistics(out, k, w.channel_a[k], m > 0 ? total(w.partial_a, chunks, c, k) / count : 0.0, epsilon);
  }
}

// The synchronized passes' statistics: mean and variance already summed over every replica.
__global__ void finish_statistics_kernel(const double* __restrict__ mean, const double* __restrict__ variance,
                                         std::int64_t c, double epsilon, BatchNormStatistics out) {
  DTRAIN_GRID_STRIDE(k, c) { write_statistics(out, k, mean[k], variance[k], epsilon); }
}

// sums_a (c) = the ranges' totals of partial_a; with partial_b, sums_b (c) = those of partial_b,
// and where asked the totals rounded to float (dbeta from a, dgamma from b).
__global__ void totals_kernel(Workspace w, std::int64_t chunks, std::int64_t c, bool both, double* __restrict__ sums,
                              float* __restrict__ a_as_float, float* __restrict__ b_as_float) {
  DTRAIN_GRID_STRIDE(k, c) {
    const double a = total(w.partial_a, chunks, c, k);
    sums[k] = a;
    if (a_as_float) a_as_float[k] = static_cast<float>(a);
    if (both) {
      const double b = total(w.partial_b, chunks, c, k);
      sums[c + k] = b;
      if (b_as_float) b_as_float[k] = static_cast<float>(b);
    }
  }
}

// channel_a = mean of dy, channel_b = mean of dy * xhat; dbeta and dgamma, the sums.
__global__ void gradient_sums_kernel(Workspace w, std::int64_t chunks, std::int64_t m, std::int64_t c,
                                     float* __restrict__ dgamma, float* __restrict__ dbeta) {
  const double count = static_cast<double>(m);
  DTRAIN_GRID_STRIDE(k, c) {
    const double sum_dy = total(w.partial_a, chunks, c, k), sum_dy_xhat = total(w.partial_b, chunks, c, k);
    if (dbeta) dbeta[k] = static_cast<float>(sum_dy);
    if (dgamma) dgamma[k] = static_cast<float>(sum_dy_xhat);
    w.channel_a[k] = m > 0 ? sum_dy / count : 0.0;
    w.channel_b[k] = m > 0 ? sum_dy_xhat / count : 0.0;
  }
}

__global__ void inv_std_kernel(const float* __restrict__ variance, std::int64_t c, double epsilon,
                               float* __restrict__ inv_std) {
  DTRAIN_GRID_STRIDE(k, c) { inv_std[k] = lm::batch_norm_inv_std(static_cast<double>(variance[k]), epsilon); }
}

__global__ void forward_kernel(const float* __restrict__ x, std::int64_t m, std::int64_t c,
                               const float* __restrict__ mean, const float* __restrict__ inv_std,
                               const float* __restrict__ gamma, const float* __restrict__ beta, float* __restrict__ y) {
  DTRAIN_GRID_STRIDE(i, m * c) {
    const std::int64_t k = i % c;
    const float scale = lm::batch_norm_scale(inv_std[k], gamma ? gamma[k] : 1.0f);
    const float shift = lm::batch_norm_shift(beta ? beta[k] : 0.0f, mean[k], scale);
    y[i] = lm::batch_norm_apply(x[i], scale, shift);
  }
}

// mean_dy, mean_dy_xhat (c): the means of dy and dy * xhat over the rows the statistics came from.
__global__ void backward_training_kernel(const double* __restrict__ mean_dy, const double* __restrict__ mean_dy_xhat,
                                         const float* __restrict__ x, const float* __restrict__ dy, std::int64_t m,
                                         std::int64_t c, const float* __restrict__ mean,
                                         const float* __restrict__ inv_std, const float* __restrict__ gamma,
                                         float* __restrict__ dx) {
  DTRAIN_GRID_STRIDE(i, m * c) {
    const std::int64_t k = i % c;
    const float scale = lm::batch_norm_scale(inv_std[k], gamma ? gamma[k] : 1.0f);
    dx[i] = lm::batch_norm_input_gradient(x[i], dy[i], mean[k], inv_std[k], scale, static_cast<float>(mean_dy[k]),
                                          static_cast<float>(mean_dy_xhat[k]));
  }
}

__global__ void backward_inference_kernel(const float* __restrict__ dy, std::int64_t m, std::int64_t c,
                                          const float* __restrict__ inv_std, const float* __restrict__ gamma,
                                          float* __restrict__ dx) {
  DTRAIN_GRID_STRIDE(i, m * c) {
    const std::int64_t k = i % c;
    dx[i] = lm::mul(lm::batch_norm_scale(inv_std[k], gamma ? gamma[k] : 1.0f), dy[i]);
  }
}

__global__ void moving_average_kernel(float* __restrict__ moving, const float* __restrict__ statistic, std::int64_t c,
                                      float keep, float take) {
  DTRAIN_GRID_STRIDE(k, c) { moving[k] = lm::moving_average(moving[k], statistic[k], keep, take); }
}


template <class Term>
void channel_partials(CudaContext& ctx, const Term& term, std::int64_t m, std::int64_t c, const Workspace& w) {
  const std::int64_t chunks = chunks_of(m);
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>((c + kChannelLanes - 1) / kChannelLanes));
  const dim3 block(kChannelLanes, kRowLanes);
  channel_partials_kernel<<<grid, block, 0, ctx.stream()>>>(term, m, c, chunks, w.partial_a, w.partial_b);
  check_launch("channel_partials_kernel", ctx.device());
}

}  // namespace

std::size_t batch_norm_workspace_bytes(std::int64_t m, std::int64_t c) {
  return static_cast<std::size_t>(2 * chunks_of(m) * c + 2 * c) * sizeof(double);
}

void batch_norm_statistics(CudaContext& ctx, const float* x, std::int64_t m, std::int64_t c, double epsilon,
                           const BatchNormStatistics& out, void* workspace) {
  if (c == 0) return;
  ctx.activate();
  const std::int64_t chunks = chunks_of(m);
  const Workspace w = carve(workspace, chunks, c);
  channel_partials(ctx, SumX{x, c}, m, c, w);
  mean_kernel<<<elementwise_blocks(c), kThreads, 0, ctx.stream()>>>(w, chunks, m, c);
  check_launch("mean_kernel", ctx.device());
  channel_partials(ctx, SumSquaredDeviation{x, w.channel_a, c}, m, c, w);
  variance_kernel<<<elementwise_blocks(c), kThreads, 0, ctx.stream()>>>(w, chunks, m, c, epsilon, out);
  check_launch("variance_kernel", ctx.device());
}

void batch_norm_inv_std(CudaContext& ctx, const float* variance, std::int64_t c, double epsilon, float* inv_std) {
  if (c == 0) return;
  ctx.activate();
  inv_std_kernel<<<elementwise_blocks(c), kThreads, 0, ctx.stream()>>>(variance, c, epsilon, inv_std);
  check_launch("inv_std_kernel", ctx.device());
}

void batch_norm_forward(CudaContext& ctx, const float* x, std::int64_t m, std::int64_t c, const float* mean,
                        const float* inv_std, const float* gamma, const float* beta, float* y) {
  if (m * c == 0) return;
  ctx.activate();
  forward_kernel<<<elementwise_blocks(m * c), kThreads, 0, ctx.stream()>>>(x, m, c, mean, inv_std, gamma, beta, y);
  check_launch("batch_norm forward_kernel", ctx.device());
}

void batch_norm_backward(CudaContext& ctx, bool training, const float* x, const float* dy, std::int64_t m,
                         std::int64_t c, const float* mean, const float* inv_std, const float* gamma, float* dx,
                         float* dgamma, float* dbeta, void* workspace) {
  if (c == 0) return;
  ctx.activate();
  const std::int64_t chunks = chunks_of(m);
  const Workspace w = carve(workspace, chunks, c);
  if (dgamma || dbeta || (training && dx)) {
    channel_partials(ctx, SumGradient{x, dy, mean, inv_std, c}, m, c, w);
    gradient_sums_kernel<<<elementwise_blocks(c), kThreads, 0, ctx.stream()>>>(w, chunks, m, c, dgamma, dbeta);
    check_launch("gradient_sums_kernel", ctx.device());
  }
  if (!dx || m == 0) return;
  if (training) {
    backward_training_kernel<<<elementwise_blocks(m * c), kThreads, 0, ctx.stream()>>>(w.channel_a, w.channel_b, x, dy,
                                                                                         m, c, mean, inv_std, gamma, dx);
    check_launch("backward_training_kernel", ctx.device());
  } else {
    backward_inference_kernel<<<elementwise_blocks(m * c), kThreads, 0, ctx.stream()>>>(dy, m, c, inv_std, gamma, dx);
    check_launch("backward_inference_kernel", ctx.device());
  }
}

void batch_norm_sum(CudaContext& ctx, const float* x, std::int64_t m, std::int64_t c, double* sums,
                    void* workspace) {
  if (c == 0) return;
  ctx.activate();
  const std::int64_t chunks = chunks_of(m);
  const Workspace w = carve(workspace, chunks, c);
  channel_partials(ctx, SumX{x, c}, m, c, w);
  totals_kernel<<<elementwise_blocks(c), kThreads, 0, ctx.stream()>>>(w, chunks, c, false, sums, nullptr, nullptr);
  check_launch("totals_kernel", ctx.device());
}

void batch_norm_sum_squared_deviations(CudaContext& ctx, const float* x, std::int64_t m, std::int64_t c,
                                       const double* mean, double* sums, void* workspace) {
  if (c == 0) return;
  ctx.activate();
  const std::int64_t chunks = chunks_of(m);
  const Workspace w = carve(workspace, chunks, c);
  channel_partials(ctx, SumSquaredDeviation{x, mean, c}, m, c, w);
  totals_kernel<<<elementwise_blocks(c), kThreads, 0, ctx.stream()>>>(w, chunks, c, false, sums, nullptr, nullptr);
  check_launch("totals_kernel", ctx.device());
}

void batch_norm_finish_statistics(CudaContext& ctx, const double* mean, const double* variance, std::int64_t c,
                                  double epsilon, const BatchNormStatistics& out) {
  if (c == 0) return;
  ctx.activate();
  finish_statistics_kernel<<<elementwise_blocks(c), kThreads, 0, ctx.stream()>>>(mean, variance, c, epsilon, out);
  check_launch("finish_statistics_kernel", ctx.device());
}

void batch_norm_gradient_sums(CudaContext& ctx, const float* x, const float* dy, std::int64_t m, std::int64_t c,
                              const float* mean, const float* inv_std, double* sums, float* dgamma, float* dbeta,
                              void* workspace) {
  if (c == 0) return;
  ctx.activate();
  const std::int64_t chunks = chunks_of(m);
  const Workspace w = carve(workspace, chunks, c);
  channel_partials(ctx, SumGradient{x, dy, mean, inv_std, c}, m, c, w);
  totals_kernel<<<elementwise_blocks(c), kThreads, 0, ctx.stream()>>>(w, chunks, c, true, sums, dbeta, dgamma);
  check_launch("totals_kernel", ctx.device());
}

void batch_norm_backward_from_means(CudaContext& ctx, const float* x, const float* dy, std::int64_t m, std::int64_t c,
                                    const float* mean, const float* inv_std, const float* gamma, const double* means,
                                    float* dx) {
  if (m * c == 0) return;
  ctx.activate();
  backward_training_kernel<<<elementwise_blocks(m * c), kThreads, 0, ctx.stream()>>>(means, means + c, x, dy, m, c,
                                                                                     mean, inv_std, gamma, dx);
  check_launch("backward_training_kernel", ctx.device());
}

void batch_norm_moving_average(CudaContext& ctx, float* moving, const float* statistic, std::int64_t c,
                               double momentum) {
  if (c == 0) return;
  ctx.activate();
  moving_average_kernel<<<elementwise_blocks(c), kThreads, 0, ctx.stream()>>>(moving, statistic, c, static_cast<float>(momentum),
                                                                  static_cast<float>(1.0 - momentum));
  check_launch("moving_average_kernel", ctx.device());
}

}  // namespace dtrain::backends::cuda
