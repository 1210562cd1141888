// The compute core of Conv2D on the GPU (nn/conv2d.hpp has the semantics), on device pointers and
// the context's stream, for one shape made once: the method (below), its scratch memory allocated
// once (after the constructor, a step allocates nothing) and, for cuDNN, its descriptors (NHWC
// tensors, the filter in cuDNN's NHWC filter layout KRSC) and the three passes' algorithms.
//
//   set_kernel        k (KH, KW, C, F) Keras HWIO, once per step, after the optimizer has updated
//                     k (forward and backward_data read it): kept as it is for the GEMM path,
//                     transposed into cuDNN's (F, KH, KW, C) for cuDNN
//   forward           y (N, OH, OW, F) = conv(x, k) + b
//   backward_data     dx (N, H, W, C) from dy (N, OH, OW, F)
//   backward_filter   dk (KH, KW, C, F) Keras HWIO, db (F) = sums of dy over N, OH, OW; x is the
//                     forward's (the GEMM path reuses its columns when x is the same pointer)
// Every output is overwritten. conv2d_geometry.hpp says how TensorFlow's asymmetric SAME padding
// is given to cuDNN (which pads symmetrically) and why the filter is transposed.
//
// Float32 with cuDNN's FMA math (CUDNN_FMA_MATH): CUDNN_DEFAULT_MATH lets cuDNN use TF32 tensor
// cores for float32 on Ampere and newer, whose 10-bit mantissas give errors near 1e-3 where the
// CPU backend and the reference compute in float32.
//
// Two ways to compute, chosen once per shape by a rule (never by timing, so that every run of a
// shape computes the same way and gives the same bits):
//
// GEMM (the default wherever its columns fit the workspace limit): x's columns (conv2d_geometry.hpp:
// one row per output position, one column per kernel tap, TensorFlow's padding as zeros) and the
// dense core's cuBLAS SGEMMs on them, Keras' HWIO kernel read in place as a (KH*KW*C, F) matrix:
// y = columns k + b; dk = columns^T dy and db in HWIO as they stand (no filter transposition, no
// padded copy), summed over slices of the batch where dk is small (sliced_weight_gradient); dx =
// dy k^T summed back onto x in a fixed order. cuBLAS's SGEMMs are deterministic and, at the small
// shapes of a CNN like the seed's, several times faster on an H100 than cuDNN's deterministic
// float32 NHWC algorithms (conv1's filter gradient, one input channel, took 0.3 ms of a 0.8 ms
// step there).
//
// cuDNN (where the columns would not fit): the algorithms from cuDNN's heuristics
// (cudnnGet*Algorithm_v7, no benchmarking), the first one that cuDNN says is deterministic, that
// is not FFT or Winograd (less accurate in float32) and whose workspace fits the limit; only if
// none is, the first that fits (deterministic() then says false). The workspace is one buffer,
// the largest of the three passes'.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "backends/cuda/context.hpp"
#include "backends/cuda/conv2d_geometry.hpp"
#include "backends/cuda/dense_core.hpp"

namespace dtrain::backends::cuda {

class Conv2dCore {
 public:
  static constexpr std::size_t kDefaultWorkspaceLimit = std::size_t{256} << 20;  // 256 MiB

  enum class Method {
    automatic,  // gemm where its columns (and their gradient) fit the workspace limit, else cudnn
    gemm,       // refused (InternalError) where the columns do not fit
    cudnn,
  };

  // `bias`: whether the layer has one (forward adds b, backward_filter computes db).
  Conv2dCore(CudaContext& ctx, const Conv2dGeometry& geometry, bool bias,
             std::size_t workspace_limit = kDefaultWorkspaceLimit, Method method = Method::automatic);
  ~Conv2dCore();
  Conv2dCore(const Conv2dCore&) = delete;
  Conv2dCore& operator=(const Conv2dCore&) = delete;

  const Conv2dGeometry& geometry() const { return g_; }

  void set_kernel(const float* k);
  // b is ignored where the core has no bias.
  void forward(const float* x, const float* b, float* y);
  void backward_data(const float* dy, float* dx);
  // db is ignored (may be null) where the core has no bias.
  void backward_filter(const float* x, const float* dy, float* dk, float* db);

  // Whether the core computes on x's columns with cuBLAS (else with cuDNN).
  bool gemm() const { return gemm_ != nullptr; }
  // The chosen algorithms (cuDNN's enum values; -1 on the GEMM path), for logs and tests.
  int forward_algorithm() const { return fwd_algo_; }
  int backward_data_algorithm() const { return bwd_data_algo_; }
  int backward_filter_algorithm() const { return bwd_filter_algo_; }
  // Whether cuDNN says all three are deterministic (the same bits on every run).
  bool deterministic() const { return deterministic_; }
  std::size_t workspace_bytes() const { return workspace_bytes_; }
  // "fwd 1, bwd data 1, bwd filter 1 (deterministic), workspace 0 bytes, input padded to 8x10"
  std::string describe() const;

 private:
  void choose_algorithms(std::size_t workspace_limit);
  void destroy_descriptors() noexcept;
  // x, or its padded copy where the geometry pads the input.
  const float* cudnn_input(const float* x);
  // The GEMM path's columns of x, made again only where x is not the input of the last forward
  // (backward_filter right after forward reads the columns forward made).
  const float* columns_of(const float* x);

  CudaContext& ctx_;
  Conv2dGeometry g_;
  bool bias_;
  cudnnTensorDescriptor_t x_desc_ = nullptr, y_desc_ = nullptr;
  cudnnFilterDescriptor_t w_desc_ = nullptr;
  cudnnConvolutionDescriptor_t conv_desc_ = nullptr;
  int fwd_algo_ = 0, bwd_data_algo_ = 0, bwd_filter_algo_ = 0;
  bool deterministic_ = true;
  std::size_t workspace_bytes_ = 0;
  Buffer workspace_;
  Buffer filter_;       // k in cuDNN's layout (F, KH, KW, C)
  Buffer filter_grad_;  // dk in cuDNN's layout
  Buffer padded_x_;     // where the geometry pads the input: x padded, then (backward_data) dx padded
  Buffer ones_;         // N * OH * OW ones, for db
  // The GEMM path: the dense core on (M, R) x (R, F), x's columns and their gradient, the kernel
  // set_kernel() gave (Keras HWIO, read in place) and the input whose columns are made.
  std::unique_ptr<DenseCore> gemm_;
  Buffer columns_, columns_gradient_;
  // dk (and db) over `slices_` slices of the batch's samples, each slice's part summed in order
  // (sliced_weight_gradient, slice_column_sums, sum_slices): a small dk over a long batch runs on
  // many thread blocks. A slice's partial dk, then its db, every partial_stride() floats.
  std::int64_t slices_ = 1;
  Buffer partials_;
  std::int64_t partial_stride() const { return (g_.kh * g_.kw * g_.c + (bias_ ? 1 : 0)) * g_.f; }
  const float* kernel_ = nullptr;
  const float* columns_input_ = nullptr;
};

}  // namespace dtrain::backends::cuda
