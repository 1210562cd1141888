#include "backends/cuda/dense_core.hpp"

#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include "backends/cuda/check.hpp"
#include "backends/cuda/convert.hpp"
#include "backends/cuda/core_kernels.hpp"
#include "core/error.hpp"

namespace dtrain::backends::cuda {

namespace {

// cuBLAS takes int sizes and leading dimensions.
int blas_int(std::int64_t v, const char* what) {
  if (v < 0 || v > std::numeric_limits<int>::max())
    throw InternalError(fmt::format("dense on CUDA: {} = {} does not fit cuBLAS's int", what, v));
  return static_cast<int>(v);
}

// The handle is the context's: set what this core relies on before each use (host scalars, no
// TF32; see dense_core.hpp).
cublasHandle_t prepared_cublas(CudaContext& ctx) {
  ctx.activate();
  cublasHandle_t h = ctx.cublas();
  DTRAIN_CUBLAS_CALL(ctx.device(), cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  DTRAIN_CUBLAS_CALL(ctx.device(), cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  return h;
}

}  // namespace

void column_sums(CudaContext& ctx, const float* dy, const float* ones, std::int64_t rows, std::int64_t cols,
                 float* db) {
  cublasHandle_t h = prepared_cublas(ctx);
  const float one = 1.0f, zero = 0.0f;
  // dy row-major (rows, cols) is column-major A (cols, rows), lda cols: db = A ones.
  const int m = blas_int(cols, "columns"), n = blas_int(rows, "rows");
  DTRAIN_CUBLAS_CALL(ctx.device(), cublasSgemv(h, CUBLAS_OP_N, m, n, &one, dy, m, ones, 1, &zero, db, 1));
}

Buffer device_ones(CudaContext& ctx, std::int64_t n) {
  ctx.activate();
  Buffer b = ctx.allocate(static_cast<std::size_t>(n) * sizeof(float));
  fill(static_cast<float*>(b.get()), n, 1.0f, ctx.stream(), ctx.device());
  return b;
}

void sliced_weight_gradient(CudaContext& ctx, const float* x, const float* dy, std::int64_t slices, std::int64_t rows,
                            std::int64_t in, std::int64_t out, float* partials, std::int64_t stride) {
  cublasHandle_t h = prepared_cublas(ctx);
  const float one = 1.0f, zero = 0.0f;
  const int i = blas_int(in, "in"), o = blas_int(out, "out"), n = blas_int(rows, "rows per slice");
  // As DenseCore::backward_weights, per slice: partial_s^T (O, I) = dy_s^T (O, n) x_s (n, I).
  DTRAIN_CUBLAS_CALL(ctx.device(), cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_T, o, i, n, &one, dy, o,
                                                             static_cast<long long>(rows) * out, x, i,
                                                             static_cast<long long>(rows) * in, &zero, partials, o,
                                                             static_cast<long long>(stride),
                                                             blas_int(slices, "slices")));
}

DenseCore::DenseCore(CudaContext& ctx, std::int64_t batch, std::int64_t in, std::int64_t out, bool bias)
    : ctx_(ctx), batch_(batch), in_(in), out_(out), bias_(bias) {
  if (batch <= 0 || in <= 0 || out <= 0)
    throw InternalError(fmt::format("dense on CUDA: batch {}, in {}, out {}: sizes must be positive", batch, in, out));
  (void)blas_int(batch * in, "batch * in");
  (void)blas_int(batch * out, "batch * out");
  (void)blas_int(in * out, "in * out");
  if (bias_) ones_ = device_ones(ctx_, batch_);
}

void DenseCore::forward(const float* x, const float* k, const float* b, float* y) {
  cublasHandle_t h = prepared_cublas(ctx_);
  const float one = 1.0f, zero = 0.0f;
  const int n = static_cast<int>(batch_), i = static_cast<int>(in_), o = static_cast<int>(out_);
  // y^T (O, N) = k^T (O, I) x^T (I, N): column-major views of k (ld O) and x (ld I).
  DTRAIN_CUBLAS_CALL(ctx_.device(), cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, o, n, i, &one, k, o, x, i, &zero, y, o));
  if (bias_) {
    DTRAIN_CHECK(b != nullptr, "dense on CUDA: a layer with a bias needs b");
    add_bias_rows(y, b, batch_, out_, ctx_.stream(), ctx_.device());
  }
}

void DenseCore::backward_data(const float* dy, const float* k, float* dx) {
  cublasHandle_t h = prepared_cublas(ctx_);
  const float one = 1.0f, zero = 0.0f;
  const int n = static_cast<int>(batch_), i = static_cast<int>(in_), o = static_cast<int>(out_);
  // dx^T (I, N) = k (I, O) dy^T (O, N): k's column-major view is k^T (O, I), ld O, transposed.
  DTRAIN_CUBLAS_CALL(ctx_.device(),
                     cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, i, n, o, &one, k, o, dy, o, &zero, dx, i));
}

void DenseCore::backward_weights(const float* x, const float* dy, float* dk, float* db) {
  cublasHandle_t h = prepared_cublas(ctx_);
  const float one = 1.0f, zero = 0.0f;
  const int n = static_cast<int>(batch_), i = static_cast<int>(in_), o = static_cast<int>(out_);
  // dk^T (O, I) = dy^T (O, N) x (N, I): x's column-major view is x^T (I, N), ld I, transposed.
  DTRAIN_CUBLAS_CALL(ctx_.device(),
                     cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, o, i, n, &one, dy, o, x, i, &zero, dk, o));
  if (bias_) {
    DTRAIN_CHECK(db != nullptr, "dense on CUDA: a layer with a bias needs db");
    column_sums(ctx_, dy, static_cast<const float*>(ones_.get()), batch_, out_, db);
  }
}

DenseCoreBf16::DenseCoreBf16(CudaContext& ctx, std::int64_t batch, std::int64_t in, std::int64_t out, bool bias)
    : ctx_(ctx), batch_(batch), in_(in), out_(out), bias_(bias) {
  if (batch <= 0 || in <= 0 || out <= 0)
    throw InternalError(fmt::format("dense on CUDA: batch {}, in {}, out {}: sizes must be positive", batch, in, out));
  const std::string cannot = ctx_.cannot_compute_in(DType::bf16);
  if (!cannot.empty()) throw InternalError("dense on CUDA in bfloat16: " + cannot);
  (void)blas_int(batch * std::max(in, out), "batch * max(in, out)");
  (void)blas_int(in * out, "in * out");
  accumulator_ = ctx_.allocate(static_cast<std::size_t>(batch_ * std::max(in_, out_)) * sizeof(float));
  if (bias_) {
    // The ones in float32 (the accumulator is free now), rounded to bfloat16 (exactly 1).
    ones_ = ctx_.allocate(static_cast<std::size_t>(batch_) * sizeof(std::uint16_t));
    auto* acc = static_cast<float*>(accumulator_.get());
    fill(acc, batch_, 1.0f, ctx_.stream(), ctx_.device());
    f32_to_bf16(acc, static_cast<std::uint16_t*>(ones_.get()), static_cast<std::size_t>(batch_), ctx_.stream(),
                ctx_.device());
  }
}

void DenseCoreBf16::forward(const std::uint16_t* x, const std::uint16_t* k, const float* b, std::uint16_t* y) {
  cublasHandle_t h = prepared_cublas(ctx_);
  const float one = 1.0f, zero = 0.0f;
  const int n = static_cast<int>(batch_), i = static_cast<int>(in_), o = static_cast<int>(out_);
  auto* acc = static_cast<float*>(accumulator_.get());
  DTRAIN_CUBLAS_CALL(ctx_.device(), cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, o, n, i, &one, k, CUDA_R_16BF, o, x,
                                                 CUDA_R_16BF, i, &zero, acc, CUDA_R_32F, o, CUBLAS_COMPUTE_32F,
                                                 CUBLAS_GEMM_DEFAULT));
  if (bias_) DTRAIN_CHECK(b != nullptr, "dense on CUDA: a layer with a bias needs b");
  add_bias_to_bf16(acc, bias_ ? b : nullptr, y, batch_, out_, ctx_.stream(), ctx_.device());
}

void DenseCoreBf16::backward_data(const std::uint16_t* dy, const std::uint16_t* k, std::uint16_t* dx) {
  cublasHandle_t h = prepared_cublas(ctx_);
  const float one = 1.0f, zero = 0.0f;
  const int n = static_cast<int>(batch_), i = static_cast<int>(in_), o = static_cast<int>(out_);
  auto* acc = static_cast<float*>(accumulator_.get());
  DTRAIN_CUBLAS_CALL(ctx_.device(), cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, i, n, o, &one, k, CUDA_R_16BF, o, dy,
                                                 CUDA_R_16BF, o, &zero, acc, CUDA_R_32F, i, CUBLAS_COMPUTE_32F,
                                                 CUBLAS_GEMM_DEFAULT));
  f32_to_bf16(acc, dx, static_cast<std::size_t>(batch_ * in_), ctx_.stream(), ctx_.device());
}

void DenseCoreBf16::backward_weights(const std::uint16_t* x, const std::uint16_t* dy, float* dk, float* db) {
  cublasHandle_t h = prepared_cublas(ctx_);
  const float one = 1.0f, zero = 0.0f;
  const int n = static_cast<int>(batch_), i = static_cast<int>(in_), o = static_cast<int>(out_);
  DTRAIN_CUBLAS_CALL(ctx_.device(), cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, o, i, n, &one, dy, CUDA_R_16BF, o, x,
                                                 CUDA_R_16BF, i, &zero, dk, CUDA_R_32F, o, CUBLAS_COMPUTE_32F,
                                                 CUBLAS_GEMM_DEFAULT));
  if (bias_) {
    DTRAIN_CHECK(db != nullptr, "dense on CUDA: a layer with a bias needs db");
    // db (O, 1) = dy^T (O, N) ones (N, 1).
    DTRAIN_CUBLAS_CALL(ctx_.device(), cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, o, 1, n, &one, dy, CUDA_R_16BF, o,
                                                   ones_.get(), CUDA_R_16BF, n, &zero, db, CUDA_R_32F, o,
                                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

}  // namespace dtrain::backends::cuda
