// The compute core of Dense on the GPU (nn/dense.hpp has the semantics), on device pointers and
// the context's stream, for one shape (batch, in, out) made once:
//   forward          y (N, O) = x (N, I) k (I, O) + b (O)       cuBLAS SGEMM, then a bias kernel
//   backward_data    dx (N, I) = dy (N, O) k^T                   cuBLAS SGEMM
//   backward_weights dk (I, O) = x^T dy, db (O) = column sums of dy   SGEMM, SGEMV with ones
// Every output is overwritten. Row-major arrays go to column-major cuBLAS as their transposes: a
// row-major (r, c) array is the column-major (c, r) one, so C = A B is computed as C^T = B^T A^T.
//
// Float32 throughout with cuBLAS's default math (CUBLAS_DEFAULT_MATH, compute type 32F): on
// Ampere and newer, CUBLAS_TF32_TENSOR_OP_MATH would round the operands to TF32 (10 bits of
// mantissa), errors of about 1e-3 relative where the CPU backend and the reference compute in
// float32; the math mode is set on every call because the handle is the context's, shared.
// cuBLAS gives the same bits on every run on GPUs of one architecture and SM count.
#pragma once

#include <cstdint>

#include "backends/cuda/context.hpp"

namespace dtrain::backends::cuda {

// db (cols) = the column sums of dy (rows, cols), as cuBLAS SGEMV of dy^T with `ones` (at least
// `rows` ones on the device): deterministic, no atomics. Overwrites db.
void column_sums(CudaContext& ctx, const float* dy, const float* ones, std::int64_t rows, std::int64_t cols,
                 float* db);
// A device vector of n ones (for column_sums), filled on the context's stream.
Buffer device_ones(CudaContext& ctx, std::int64_t n);
// The partial products x_s^T dy_s (in, out) of x (slices * rows, in) and dy (slices * rows, out)
// over `slices` consecutive slices of `rows` rows, by one strided-batched SGEMM, slice s's at
// partials + s * stride (stride >= in * out): summed in slice order (sum_slices), they are x^T dy,
// computed on many thread blocks where dk is small and the batch long (a convolution's kernel
// gradient over its columns), and deterministic (no atomics).
void sliced_weight_gradient(CudaContext& ctx, const float* x, const float* dy, std::int64_t slices, std::int64_t rows,
                            std::int64_t in, std::int64_t out, float* partials, std::int64_t stride);

class DenseCore {
 public:
  // `bias`: whether the layer has one (db is then computed, and forward adds b).
  DenseCore(CudaContext& ctx, std::int64_t batch, std::int64_t in, std::int64_t out, bool bias);

  std::int64_t batch() const { return batch_; }
  std::int64_t in() const { return in_; }
  std::int64_t out() const { return out_; }

  // y = x k (+ b where the core has a bias; b is ignored otherwise).
  void forward(const float* x, const float* k, const float* b, float* y);
  void backward_data(const float* dy, const float* k, float* dx);
  // dk = x^T dy; db = column sums of dy where the core has a bias (db may be null otherwise).
  void backward_weights(const float* x, const float* dy, float* dk, float* db);

 private:
  CudaContext& ctx_;
  std::int64_t batch_, in_, out_;
  bool bias_;
  Buffer ones_;  // batch ones, for db
};

// Dense in mixed_bfloat16, as the CPU backend's (backends/onednn/dense.cpp): x, k, y, dy and dx
// in bfloat16 (uint16 bits), the bias and the kernel's gradient dk in float32. cuBLAS GEMMs on
// tensor cores with float32 accumulation (cublasGemmEx, compute type 32F); y and dx are
// accumulated into a float32 scratch (the bias added there) and then rounded to bfloat16 as the
// CPU backend's reorders round, so that the rounding is the CPU's; dk and db are float32
// outputs of the GEMMs (db: dy^T times a bfloat16 vector of ones). Needs sm_80 or newer.
class DenseCoreBf16 {
 public:
  DenseCoreBf16(CudaContext& ctx, std::int64_t batch, std::int64_t in, std::int64_t out, bool bias);

  void forward(const std::uint16_t* x, const std::uint16_t* k, const float* b, std::uint16_t* y);
  void backward_data(const std::uint16_t* dy, const std::uint16_t* k, std::uint16_t* dx);
  void backward_weights(const std::uint16_t* x, const std::uint16_t* dy, float* dk, float* db);

 private:
  CudaContext& ctx_;
  std::int64_t batch_, in_, out_;
  bool bias_;
  Buffer accumulator_;  // float32, batch * max(in, out)
  Buffer ones_;         // batch bfloat16 ones, for db
};

}  // namespace dtrain::backends::cuda
