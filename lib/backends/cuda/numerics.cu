// Shapes: each optimizer update reads and writes n floats of w, g and every slot (one thread per
// element, grid-stride); a loss reads pred (N, C) and its targets and writes per_example (N,) and
// grad (N, C) with one thread per row; argmax and matches: one thread per row of (N, C);
// sum_of_squares: n floats to one double.
//
// The arithmetic is math.hpp's, the CPU backend's formulas operation for operation. This file is
// compiled with -fmad=false (backend.cmake): no multiply-add is fused, as on the CPU, so the
// element-wise updates round as the CPU's do.
#include "backends/cuda/numerics.hpp"

#include <algorithm>
#include <cstring>

#include "backends/cuda/check.hpp"
#include "backends/cuda/context.hpp"
#include "backends/cuda/convert.hpp"
#include "backends/cuda/launch.hpp"
#include "backends/cuda/math.hpp"
#include "core/error.hpp"

namespace dtrain::backends::cuda {

namespace {

constexpr unsigned kRowThreads = 128;
// sum_of_squares always uses this many blocks of kThreads, whatever the GPU: the order of the
// additions, and so the bits of the result, depend on n alone.
constexpr unsigned kSumBlocks = 256;

__global__ void sgd_kernel(float lr, float w_momentum, bool nesterov, float* __restrict__ w,
                           const float* __restrict__ g, float* __restrict__ m, std::size_t n) {
  DTRAIN_GRID_STRIDE(i, n) {
    if (m) math::sgd_momentum_element(lr, w_momentum, nesterov, w[i], g[i], m[i]);
    else math::sgd_element(lr, w[i], g[i]);
  }
}

__global__ void adam_kernel(device::AdamStep step, float* __restrict__ w, const float* __restrict__ g,
                            float* __restrict__ m, float* __restrict__ v, std::size_t n) {
  DTRAIN_GRID_STRIDE(i, n) { math::adam_element(step, w[i], g[i], m[i], v[i]); }
}

// Up to kAdamBatch variables of one step, passed by value: blockIdx.y picks the variable, and
// each block strides over it as adam_kernel does. One launch for a model's every variable.
constexpr int kAdamBatch = 16;
struct AdamBatch {
  float* w[kAdamBatch];
  const float* g[kAdamBatch];
  float* m[kAdamBatch];
  float* v[kAdamBatch];
  std::size_t n[kAdamBatch];
};

__global__ void adam_all_kernel(device::AdamStep step, AdamBatch b) {
  const unsigned t = blockIdx.y;
  float* __restrict__ w = b.w[t];
  const float* __restrict__ g = b.g[t];
  float* __restrict__ m = b.m[t];
  float* __restrict__ v = b.v[t];
  DTRAIN_GRID_STRIDE(i, b.n[t]) { math::adam_element(step, w[i], g[i], m[i], v[i]); }
}

__global__ void rmsprop_kernel(device::RmspropStep step, float one_minus_rho, float* __restrict__ w,
                               const float* __restrict__ g, float* __restrict__ velocity, float* __restrict__ mom,
                               float* __restrict__ average, std::size_t n) {
  DTRAIN_GRID_STRIDE(i, n) {
    math::rmsprop_element(step, one_minus_rho, w[i], g[i], velocity[i], mom ? mom + i : nullptr,
                          average ? average + i : nullptr);
  }
}

__global__ void axpy_kernel(float a, const float* __restrict__ x, float* __restrict__ y, std::size_t n) {
  DTRAIN_GRID_STRIDE(i, n) { math::axpy_element(a, x[i], y[i]); }
}

__global__ void axpby_kernel(float a, const float* __restrict__ x, float b, float* __restrict__ y, std::size_t n) {
  DTRAIN_GRID_STRIDE(i, n) { math::axpby_element(a, x[i], b, y[i]); }
}

// One thread per row: rows are a batch (tens to thousands) and C is small (classes), so the
// per-row loops of the CPU's formulas fit one thread.
__global__ void loss_kernel(config::LossKind kind, bool from_logits, std::int64_t rows, std::int64_t C,
                            const float* __restrict__ pred, const float* __restrict__ dense_targets,
                            const std::int32_t* __restrict__ labels, const float* __restrict__ weights, float scale,
                            float* __restrict__ per_example, float* __restrict__ grad) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i >= rows) return;
  math::RowTarget target;
  if (dense_targets) target.dense = dense_targets + i * C;
  else target.label = labels[i];
  const float factor = scale * (weights ? weights[i] : 1.0f);
  const float loss = math::row_loss(kind, from_logits, pred + i * C, C, target, factor, grad ? grad + i * C : nullptr);
  if (per_example) per_example[i] = loss;
}

__global__ void argmax_kernel(const float* __restrict__ values, std::int64_t rows, std::int64_t C,
                              std::int32_t* __restrict__ out) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i < rows) out[i] = math::argmax_row(values + i * C, C);
}

__global__ void label_hits_kernel(const float* __restrict__ pred, const std::int32_t* __restrict__ labels,
                                  std::int64_t rows, std::int64_t C, std::int32_t* __restrict__ hits) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i < rows) hits[i] = math::label_hit(pred + i * C, C, labels[i]);
}

__global__ void matches_kernel(const float* __restrict__ pred, const void* __restrict__ targets, bool targets_are_i32,
                               std::int64_t rows, std::int64_t C, bool thresholded, float threshold,
                               std::int64_t* __restrict__ matches) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i < rows) matches[i] = math::row_match_count(pred, targets, targets_are_i32, i, C, thresholded, threshold);
}

// Sums kThreads doubles of shared memory in a fixed tree; thread 0 gets the total.
__device__ double block_sum(double* shared, double value) {
  shared[threadIdx.x] = value;
  __syncthreads();
  for (unsigned half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  return shared[0];
}

// Stage 1: kSumBlocks partial sums, each over a fixed, strided set of elements.
__global__ void __launch_bounds__(kThreads) sum_squares_kernel(const float* __restrict__ x, std::size_t n,
                                                               double* __restrict__ partials) {
  __shared__ double shared[kThreads];
  double sum = 0.0;
  DTRAIN_GRID_STRIDE(i, n) {
    const double v = x[i];
    sum += v * v;
  }
  const double total = block_sum(shared, sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// Stage 2: one block adds the kSumBlocks partials (kSumBlocks == kThreads).
__global__ void __launch_bounds__(kThreads) sum_partials_kernel(const double* __restrict__ partials,
                                                                double* __restrict__ result) {
  __shared__ double shared[kThreads];
  const double total = block_sum(shared, partials[threadIdx.x]);
  if (threadIdx.x == 0) *result = total;
}
static_assert(kSumBlocks == kThreads, "stage 2 reads one partial per thread");

unsigned row_blocks(std::int64_t rows) {
  return static_cast<unsigned>((rows + kRowThreads - 1) / kRowThreads);
}

}  // namespace

void* CudaNumerics::scratch(std::size_t bytes) {
  if (bytes > scratch_bytes_) {
    scratch_ = ctx_.allocate(bytes);
    scratch_bytes_ = bytes;
  }
  return scratch_.get();
}

CudaNumerics::~CudaNumerics() {
  // The context waited for its stream before destroying its numerics; errors are ignored (a
  // destructor must not throw).
  if (pinned_) (void)cudaFreeHost(pinned_);
  if (reads_queued_) (void)cudaEventDestroy(reads_queued_);
}

void CudaNumerics::read_back(void* host, std::size_t bytes) {
  DTRAIN_CUDA_CALL(ctx_.device(),
                   cudaMemcpyAsync(host, scratch_.get(), bytes, cudaMemcpyDeviceToHost, ctx_.stream()));
  DTRAIN_CUDA_CALL(ctx_.device(), cudaStreamSynchronize(ctx_.stream()));
}

void CudaNumerics::read_scratch(void* host, std::size_t bytes, bool deferred) {
  if (!deferred) return read_back(host, bytes);
  // 256-byte slots keep every result aligned for any element type.
  const std::size_t slot = (bytes + 255) / 256 * 256;
  if (pinned_used_ + slot > pinned_bytes_) {
    // Full: what is pending lands first, then a larger buffer (a step's first calls only).
    complete_reads();
    if (slot > pinned_bytes_) {
      if (pinned_) DTRAIN_CUDA_CALL(ctx_.device(), cudaFreeHost(pinned_));
      pinned_ = nullptr;
      pinned_bytes_ = 0;
      const std::size_t size = std::max<std::size_t>(std::size_t{64} << 10, 4 * slot);
      DTRAIN_CUDA_CALL(ctx_.device(), cudaMallocHost(&pinned_, size));
      pinned_bytes_ = size;
    }
  }
  if (!reads_queued_) DTRAIN_CUDA_CALL(ctx_.device(), cudaEventCreateWithFlags(&reads_queued_, cudaEventDisableTiming));
  char* into = static_cast<char*>(pinned_) + pinned_used_;
  DTRAIN_CUDA_CALL(ctx_.device(), cudaMemcpyAsync(into, scratch_.get(), bytes, cudaMemcpyDeviceToHost, ctx_.stream()));
  DTRAIN_CUDA_CALL(ctx_.device(), cudaEventRecord(reads_queued_, ctx_.stream()));
  pending_.push_back(PendingRead{pinned_used_, bytes, host});
  pinned_used_ += slot;
}

void CudaNumerics::complete_reads() {
  if (pending_.empty()) return;
  ctx_.activate();
  // Only as far as the last deferred copy: the work queued after it goes on.
  DTRAIN_CUDA_CALL(ctx_.device(), cudaEventSynchronize(reads_queued_));
  for (const PendingRead& r : pending_) std::memcpy(r.host, static_cast<const char*>(pinned_) + r.offset, r.bytes);
  pending_.clear();
  pinned_used_ = 0;
}

void CudaNumerics::sgd_update(const device::SgdStep& step, float* w, const float* g, float* momentum, std::size_t n) {
  if (n == 0) return;
  ctx_.activate();
  // Momentum 0 is plain SGD, which has no slot, as on the CPU.
  float* m = step.momentum <= 0.0f ? nullptr : momentum;
  sgd_kernel<<<elementwise_blocks(static_cast<std::int64_t>(n)), kThreads, 0, ctx_.stream()>>>(step.learning_rate, step.momentum,
                                                                              step.nesterov, w, g, m, n);
  check_launch("sgd_kernel", ctx_.device());
}

void CudaNumerics::adam_update(const device::AdamStep& step, float* w, const float* g, float* m, float* v,
                               std::size_t n) {
  if (n == 0) return;
  ctx_.activate();
  adam_kernel<<<elementwise_blocks(static_cast<std::int64_t>(n)), kThreads, 0, ctx_.stream()>>>(step, w, g, m, v, n);
  check_launch("adam_kernel", ctx_.device());
}

void CudaNumerics::adam_update_all(const device::AdamStep& step, std::span<const device::AdamVariable> variables) {
  ctx_.activate();
  AdamBatch b{};
  unsigned count = 0;
  std::size_t largest = 0;
  const auto launch = [&] {
    const dim3 grid(elementwise_blocks(static_cast<std::int64_t>(largest)), count);
    adam_all_kernel<<<grid, kThreads, 0, ctx_.stream()>>>(step, b);
    check_launch("adam_all_kernel", ctx_.device());
    count = 0;
    largest = 0;
  };
  for (const device::AdamVariable& var : variables) {
    if (var.n == 0) continue;
    b.w[count] = var.w;
    b.g[count] = var.g;
    b.m[count] = var.m;
    b.v[count] = var.v;
    b.n[count] = var.n;
    largest = std::max(largest, var.n);
    if (++count == kAdamBatch) launch();
  }
  if (count > 0) launch();
}

void CudaNumerics::rmsprop_update(const device::RmspropStep& step, float* w, const float* g, float* velocity,
                                  float* momentum, float* average, std::size_t n) {
  if (n == 0) return;
  ctx_.activate();
  rmsprop_kernel<<<elementwise_blocks(static_cast<std::int64_t>(n)), kThreads, 0, ctx_.stream()>>>(step, 1.0f - step.rho, w, g,
                                                                                  velocity, momentum, average, n);
  check_launch("rmsprop_kernel", ctx_.device());
}

void CudaNumerics::loss(const device::LossBatch& b) {
  DTRAIN_CHECK((b.dense_targets == nullptr) != (b.labels == nullptr), "exactly one of dense targets and labels");
  if (b.rows == 0) return;
  ctx_.activate();
  const std::size_t per_example_bytes = static_cast<std::size_t>(b.rows) * sizeof(float);
  float* per_example = b.per_example ? static_cast<float*>(scratch(per_example_bytes)) : nullptr;
  loss_kernel<<<row_blocks(b.rows), kRowThreads, 0, ctx_.stream()>>>(b.kind, b.from_logits, b.rows, b.columns,
                                                                    b.pred, b.dense_targets, b.labels, b.weights,
                                                                    b.scale, per_example, b.grad);
  check_launch("loss_kernel", ctx_.device());
  if (b.per_example) read_scratch(b.per_example, per_example_bytes, b.deferred);
}

void CudaNumerics::label_hits(const float* pred, const std::int32_t* labels, std::int64_t rows, std::int64_t columns,
                              std::int32_t* hits, bool deferred) {
  if (rows == 0) return;
  ctx_.activate();
  const std::size_t bytes = static_cast<std::size_t>(rows) * sizeof(std::int32_t);
  auto* staged = static_cast<std::int32_t*>(scratch(bytes));
  label_hits_kernel<<<row_blocks(rows), kRowThreads, 0, ctx_.stream()>>>(pred, labels, rows, columns, staged);
  check_launch("label_hits_kernel", ctx_.device());
  read_scratch(hits, bytes, deferred);
}

void CudaNumerics::argmax_rows(const float* values, std::int64_t rows, std::int64_t columns, std::int32_t* out) {
  if (rows == 0) return;
  ctx_.activate();
  const std::size_t bytes = static_cast<std::size_t>(rows) * sizeof(std::int32_t);
  auto* staged = static_cast<std::int32_t*>(scratch(bytes));
  argmax_kernel<<<row_blocks(rows), kRowThreads, 0, ctx_.stream()>>>(values, rows, columns, staged);
  check_launch("argmax_kernel", ctx_.device());
  read_back(out, bytes);
}

void CudaNumerics::row_matches(const float* pred, const void* targets, bool targets_are_i32, std::int64_t rows,
                               std::int64_t columns, const float* threshold, std::int64_t* matches) {
  if (rows == 0) return;
  ctx_.activate();
  const std::size_t bytes = static_cast<std::size_t>(rows) * sizeof(std::int64_t);
  auto* staged = static_cast<std::int64_t*>(scratch(bytes));
  // The threshold is a metric's option, a host scalar: passed by value.
  matches_kernel<<<row_blocks(rows), kRowThreads, 0, ctx_.stream()>>>(
      pred, targets, targets_are_i32, rows, columns, threshold != nullptr, threshold ? *threshold : 0.0f, staged);
  check_launch("matches_kernel", ctx_.device());
  read_back(matches, bytes);
}

void CudaNumerics::to_host(const void* src, void* host, std::size_t bytes) { ctx_.copy_to_host(src, host, bytes); }

double CudaNumerics::sum_of_squares(const float* x, std::size_t n) {
  if (n == 0) return 0.0;
  ctx_.activate();
  // The result first, so that read_back() copies it from the start of the scratch.
  auto* result = static_cast<double*>(scratch((kSumBlocks + 1) * sizeof(double)));
  double* partials = result + 1;
  sum_squares_kernel<<<kSumBlocks, kThreads, 0, ctx_.stream()>>>(x, n, partials);
  check_launch("sum_squares_kernel", ctx_.device());
  sum_partials_kernel<<<1, kThreads, 0, ctx_.stream()>>>(partials, result);
  check_launch("sum_partials_kernel", ctx_.device());
  double sum = 0.0;
  read_back(&sum, sizeof(sum));
  return sum;
}

void CudaNumerics::axpy(float a, const float* x, float* y, std::size_t n) {
  if (n == 0) return;
  ctx_.activate();
  axpy_kernel<<<elementwise_blocks(static_cast<std::int64_t>(n)), kThreads, 0, ctx_.stream()>>>(a, x, y, n);
  check_launch("axpy_kernel", ctx_.device());
}

void CudaNumerics::axpby(float a, const float* x, float b, float* y, std::size_t n) {
  if (n == 0) return;
  ctx_.activate();
  axpby_kernel<<<elementwise_blocks(static_cast<std::int64_t>(n)), kThreads, 0, ctx_.stream()>>>(a, x, b, y, n);
  check_launch("axpby_kernel", ctx_.device());
}

}  // namespace dtrain::backends::cuda
