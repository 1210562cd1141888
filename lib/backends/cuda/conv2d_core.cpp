#include "backends/cuda/conv2d_core.hpp"

#include <algorithm>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "backends/cuda/check.hpp"
#include "backends/cuda/core_kernels.hpp"
#include "backends/cuda/dense_core.hpp"
#include "core/error.hpp"

namespace dtrain::backends::cuda {

namespace {

// cuDNN's 4-d descriptors take int sizes.
int dnn_int(std::int64_t v, const char* what) {
  if (v < 0 || v > std::numeric_limits<int>::max())
    throw InternalError(fmt::format("conv2d on CUDA: {} = {} does not fit cuDNN's int", what, v));
  return static_cast<int>(v);
}

// FFT and Winograd transform the data: their float32 results err by up to about 1e-4 relative,
// where a direct or GEMM-based convolution (and the CPU backend) stays near float32's rounding.
bool transforms(cudnnConvolutionFwdAlgo_t a) {
  return a == CUDNN_CONVOLUTION_FWD_ALGO_FFT || a == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD || a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED;
}
bool transforms(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED;
}
bool transforms(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED;
}

// The first of cuDNN's candidates (best first) that ran its heuristics successfully, is not a
// tensor-op (TF32) variant nor an FFT or Winograd one, whose workspace cuDNN can size for this descriptor and which fits the
// limit; deterministic ones first. workspace_of(algo, &bytes) returns cuDNN's status.
template <class Perf, class WorkspaceOf>
bool choose(const std::vector<Perf>& candidates, std::size_t limit, WorkspaceOf workspace_of, bool deterministic,
            Perf& chosen, std::size_t& bytes) {
  for (const Perf& p : candidates) {
    if (p.status != CUDNN_STATUS_SUCCESS) continue;
    if (deterministic && p.determinism != CUDNN_DETERMINISTIC) continue;
    if (p.mathType == CUDNN_TENSOR_OP_MATH || p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
    if (transforms(p.algo)) continue;
    std::size_t need = 0;
    if (workspace_of(p.algo, &need) != CUDNN_STATUS_SUCCESS || need > limit) continue;
    chosen = p;
    bytes = need;
    return true;
  }
  return false;
}

template <class Perf, class WorkspaceOf>
Perf choose_algorithm(const char* pass, const std::vector<Perf>& candidates, std::size_t limit,
                      WorkspaceOf workspace_of, const Conv2dGeometry& g, bool& deterministic, std::size_t& bytes) {
  Perf chosen{};
  if (choose(candidates, limit, workspace_of, true, chosen, bytes)) return chosen;
  if (choose(candidates, limit, workspace_of, false, chosen, bytes)) {
    deterministic = false;
    return chosen;
  }
  throw InternalError(fmt::format("conv2d on CUDA: cuDNN offers no float32 {} algorithm for input {}x{}x{}x{}, "
                                  "{} filters {}x{}, strides {}x{} within a workspace of {} bytes ({} candidates)",
                                  pass, g.n, g.padded_h, g.padded_w, g.c, g.f, g.kh, g.kw, g.sh, g.sw, limit,
                                  candidates.size()));
}

}  // namespace

Conv2dCore::Conv2dCore(CudaContext& ctx, const Conv2dGeometry& geometry, bool bias, std::size_t workspace_limit,
                       Method method)
    : ctx_(ctx), g_(geometry), bias_(bias) {
  ctx_.activate();
  const Device dev = ctx_.device();
  // The GEMM path: x's columns and their gradient, (M, R) floats each, within the limit, and
  // sizes cuBLAS's int takes (the dense core checks M * R, M * F and R * F).
  const std::int64_t rows = g_.n * g_.oh() * g_.ow(), taps = g_.kh * g_.kw * g_.c;
  const double column_bytes = 2.0 * static_cast<double>(rows) * static_cast<double>(taps) * sizeof(float);
  const bool fits = column_bytes <= static_cast<double>(workspace_limit) &&
                    static_cast<double>(rows) * static_cast<double>(std::max(taps, g_.f)) < 2147483647.0;
  if (method == Method::gemm && !fits)
    throw InternalError(fmt::format("conv2d on CUDA: the GEMM path's columns take {} bytes, more than the limit of {}",
                                    column_bytes, workspace_limit));
  if (method != Method::cudnn && fits) {
    gemm_ = std::make_unique<DenseCore>(ctx_, rows, taps, g_.f, bias_);
    columns_ = ctx_.allocate(static_cast<std::size_t>(rows * taps) * sizeof(float));
    columns_gradient_ = ctx_.allocate(static_cast<std::size_t>(rows * taps) * sizeof(float));
    fwd_algo_ = bwd_data_algo_ = bwd_filter_algo_ = -1;
    // Slices of whole samples for the kernel gradient where it is small: the most that divide
    // the batch (up to 64) with at least 256 rows each. Each slice's partial dk, and db after it,
    // takes (taps + 1) * F floats of scratch.
    constexpr std::int64_t kMostSlices = 64, kLeastRows = 256, kSmallKernel = std::int64_t{1} << 16;
    if (taps * g_.f <= kSmallKernel)
      for (std::int64_t s = std::min(kMostSlices, g_.n); s > 1; --s)
        if (g_.n % s == 0 && rows / s >= kLeastRows) {
          slices_ = s;
          break;
        }
    if (slices_ > 1)
      partials_ = ctx_.allocate(static_cast<std::size_t>(slices_ * partial_stride()) * sizeof(float));
    return;
  }
  (void)ctx_.cudnn();  // made on first use
  try {
    DTRAIN_CUDNN_CALL(dev, cudnnCreateTensorDescriptor(&x_desc_));
    DTRAIN_CUDNN_CALL(dev, cudnnCreateTensorDescriptor(&y_desc_));
    DTRAIN_CUDNN_CALL(dev, cudnnCreateFilterDescriptor(&w_desc_));
    DTRAIN_CUDNN_CALL(dev, cudnnCreateConvolutionDescriptor(&conv_desc_));
    // cudnnSetTensor4dDescriptor takes the sizes as (n, c, h, w) whatever the format.
    DTRAIN_CUDNN_CALL(dev, cudnnSetTensor4dDescriptor(x_desc_, CUDNN_TENSOR_NHWC, CUDNN_DATA_FLOAT,
                                                      dnn_int(g_.n, "batch"), dnn_int(g_.c, "channels"),
                                                      dnn_int(g_.padded_h, "height"), dnn_int(g_.padded_w, "width")));
    DTRAIN_CUDNN_CALL(dev, cudnnSetTensor4dDescriptor(y_desc_, CUDNN_TENSOR_NHWC, CUDNN_DATA_FLOAT,
                                                      dnn_int(g_.n, "batch"), dnn_int(g_.f, "filters"),
                                                      dnn_int(g_.oh(), "output height"),
                                                      dnn_int(g_.ow(), "output width")));
    // (k, c, h, w) in the NHWC format: stored as (F, KH, KW, C).
    DTRAIN_CUDNN_CALL(dev, cudnnSetFilter4dDescriptor(w_desc_, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NHWC,
                                                      dnn_int(g_.f, "filters"), dnn_int(g_.c, "channels"),
                                                      dnn_int(g_.kh, "kernel height"),
                                                      dnn_int(g_.kw, "kernel width")));
    // Keras' convolution is a cross-correlation (the kernel is not flipped).
    DTRAIN_CUDNN_CALL(dev, cudnnSetConvolution2dDescriptor(conv_desc_, dnn_int(g_.cudnn_pad_h, "padding"),
                                                           dnn_int(g_.cudnn_pad_w, "padding"),
                                                           dnn_int(g_.sh, "stride"), dnn_int(g_.sw, "stride"), 1, 1,
                                                           CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    DTRAIN_CUDNN_CALL(dev, cudnnSetConvolutionMathType(conv_desc_, CUDNN_FMA_MATH));

    int n = 0, c = 0, h = 0, w = 0;
    DTRAIN_CUDNN_CALL(dev, cudnnGetConvolution2dForwardOutputDim(conv_desc_, x_desc_, w_desc_, &n, &c, &h, &w));
    if (n != g_.n || c != g_.f || h != g_.oh() || w != g_.ow())
      throw InternalError(fmt::format("conv2d on CUDA: cuDNN's output {}x{}x{}x{} differs from Keras' {}x{}x{}x{}",
                                      n, h, w, c, g_.n, g_.oh(), g_.ow(), g_.f));
    choose_algorithms(workspace_limit);

    if (workspace_bytes_ > 0) workspace_ = ctx_.allocate(workspace_bytes_);
    filter_ = ctx_.allocate(static_cast<std::size_t>(g_.kernel_elements()) * sizeof(float));
    filter_grad_ = ctx_.allocate(static_cast<std::size_t>(g_.kernel_elements()) * sizeof(float));
    if (g_.pads_input()) padded_x_ = ctx_.allocate(static_cast<std::size_t>(g_.padded_x_elements()) * sizeof(float));
    if (bias_) ones_ = device_ones(ctx_, g_.n * g_.oh() * g_.ow());
  } catch (...) {
    destroy_descriptors();  // the destructor does not run for a constructor that throws
    throw;
  }
}

// Work in flight needs the descriptors no more (cuDNN reads them when it launches); the buffers
// go back to the allocator, whose stream orders their reuse.
Conv2dCore::~Conv2dCore() { destroy_descriptors(); }

void Conv2dCore::destroy_descriptors() noexcept {
  if (conv_desc_) cudnnDestroyConvolutionDescriptor(conv_desc_);
  if (w_desc_) cudnnDestroyFilterDescriptor(w_desc_);
  if (y_desc_) cudnnDestroyTensorDescriptor(y_desc_);
  if (x_desc_) cudnnDestroyTensorDescriptor(x_desc_);
  conv_desc_ = nullptr;
  w_desc_ = nullptr;
  y_desc_ = nullptr;
  x_desc_ = nullptr;
}

void Conv2dCore::choose_algorithms(std::size_t limit) {
  const Device dev = ctx_.device();
  cudnnHandle_t handle = ctx_.cudnn();
  std::size_t fwd_bytes = 0, data_bytes = 0, filter_bytes = 0;
  {
    int max = 0, returned = 0;
    DTRAIN_CUDNN_CALL(dev, cudnnGetConvolutionForwardAlgorithmMaxCount(handle, &max));
    std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(static_cast<std::size_t>(max));
    DTRAIN_CUDNN_CALL(dev, cudnnGetConvolutionForwardAlgorithm_v7(handle, x_desc_, w_desc_, conv_desc_, y_desc_, max,
                                                                  &returned, perf.data()));
    perf.resize(static_cast<std::size_t>(returned));
    auto workspace_of = [&](cudnnConvolutionFwdAlgo_t algo, std::size_t* bytes) {
      return cudnnGetConvolutionForwardWorkspaceSize(handle, x_desc_, w_desc_, conv_desc_, y_desc_, algo, bytes);
    };
    fwd_algo_ = choose_algorithm("forward", perf, limit, workspace_of, g_, deterministic_, fwd_bytes).algo;
  }
  {
    int max = 0, returned = 0;
    DTRAIN_CUDNN_CALL(dev, cudnnGetConvolutionBackwardDataAlgorithmMaxCount(handle, &max));
    std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perf(static_cast<std::size_t>(max));
    DTRAIN_CUDNN_CALL(dev, cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, w_desc_, y_desc_, conv_desc_, x_desc_,
                                                                       max, &returned, perf.data()));
    perf.resize(static_cast<std::size_t>(returned));
    auto workspace_of = [&](cudnnConvolutionBwdDataAlgo_t algo, std::size_t* bytes) {
      return cudnnGetConvolutionBackwardDataWorkspaceSize(handle, w_desc_, y_desc_, conv_desc_, x_desc_, algo, bytes);
    };
    bwd_data_algo_ =
        choose_algorithm("backward data", perf, limit, workspace_of, g_, deterministic_, data_bytes).algo;
  }
  {
    int max = 0, returned = 0;
    DTRAIN_CUDNN_CALL(dev, cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(handle, &max));
    std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perf(static_cast<std::size_t>(max));
    DTRAIN_CUDNN_CALL(dev, cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, x_desc_, y_desc_, conv_desc_,
                                                                         w_desc_, max, &returned, perf.data()));
    perf.resize(static_cast<std::size_t>(returned));
    auto workspace_of = [&](cudnnConvolutionBwdFilterAlgo_t algo, std::size_t* bytes) {
      return cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, x_desc_, y_desc_, conv_desc_, w_desc_, algo,
                                                            bytes);
    };
    bwd_filter_algo_ =
        choose_algorithm("backward filter", perf, limit, workspace_of, g_, deterministic_, filter_bytes).algo;
  }
  workspace_bytes_ = std::max({fwd_bytes, data_bytes, filter_bytes});
}

const float* Conv2dCore::cudnn_input(const float* x) {
  if (!g_.pads_input()) return x;
  auto* padded = static_cast<float*>(padded_x_.get());
  pad_conv_input(g_, x, padded, ctx_.stream(), ctx_.device());
  return padded;
}

const float* Conv2dCore::columns_of(const float* x) {
  auto* columns = static_cast<float*>(columns_.get());
  if (x != columns_input_) {
    conv_columns(g_, x, columns, ctx_.stream(), ctx_.device());
    columns_input_ = x;
  }
  return columns;
}

void Conv2dCore::set_kernel(const float* k) {
  ctx_.activate();
  // The GEMM path reads Keras' HWIO kernel as it is (the variable keeps its values until the
  // optimizer's update, after backward).
  if (gemm_) kernel_ = k;
  else hwio_to_ohwi(g_, k, static_cast<float*>(filter_.get()), ctx_.stream(), ctx_.device());
}

void Conv2dCore::forward(const float* x, const float* b, float* y) {
  ctx_.activate();
  if (gemm_) {
    DTRAIN_CHECK(kernel_ != nullptr, "conv2d on CUDA: forward before set_kernel");
    DTRAIN_CHECK(!bias_ || b != nullptr, "conv2d on CUDA: a layer with a bias needs b");
    columns_input_ = nullptr;  // a new step's x, whatever its address
    gemm_->forward(columns_of(x), kernel_, b, y);
    return;
  }
  const float one = 1.0f, zero = 0.0f;
  const float* input = cudnn_input(x);
  DTRAIN_CUDNN_CALL(ctx_.device(),
                    cudnnConvolutionForward(ctx_.cudnn(), &one, x_desc_, input, w_desc_, filter_.get(), conv_desc_,
                                            static_cast<cudnnConvolutionFwdAlgo_t>(fwd_algo_), workspace_.get(),
                                            workspace_bytes_, &zero, y_desc_, y));
  if (bias_) {
    DTRAIN_CHECK(b != nullptr, "conv2d on CUDA: a layer with a bias needs b");
    add_bias_rows(y, b, g_.n * g_.oh() * g_.ow(), g_.f, ctx_.stream(), ctx_.device());
  }
}

void Conv2dCore::backward_data(const float* dy, float* dx) {
  ctx_.activate();
  if (gemm_) {
    DTRAIN_CHECK(kernel_ != nullptr, "conv2d on CUDA: backward before set_kernel");
    auto* dcolumns = static_cast<float*>(columns_gradient_.get());
    gemm_->backward_data(dy, kernel_, dcolumns);
    conv_columns_gradient(g_, dcolumns, dx, ctx_.stream(), ctx_.device());
    return;
  }
  const float one = 1.0f, zero = 0.0f;
  float* grad = g_.pads_input() ? static_cast<float*>(padded_x_.get()) : dx;
  DTRAIN_CUDNN_CALL(ctx_.device(),
                    cudnnConvolutionBackwardData(ctx_.cudnn(), &one, w_desc_, filter_.get(), y_desc_, dy, conv_desc_,
                                                 static_cast<cudnnConvolutionBwdDataAlgo_t>(bwd_data_algo_),
                                                 workspace_.get(), workspace_bytes_, &zero, x_desc_, grad));
  if (g_.pads_input()) crop_conv_gradient(g_, grad, dx, ctx_.stream(), ctx_.device());
}

void Conv2dCore::backward_filter(const float* x, const float* dy, float* dk, float* db) {
  ctx_.activate();
  if (gemm_) {
    DTRAIN_CHECK(!bias_ || db != nullptr, "conv2d on CUDA: a layer with a bias needs db");
    // dk (R, F) is Keras' HWIO kernel gradient as it stands.
    if (slices_ == 1) return gemm_->backward_weights(columns_of(x), dy, dk, db);
    // Each slice's dk and db side by side, then both summed over the slices in one pass.
    const std::int64_t rows = g_.n * g_.oh() * g_.ow() / slices_, taps = g_.kh * g_.kw * g_.c;
    auto* partials = static_cast<float*>(partials_.get());
    sliced_weight_gradient(ctx_, columns_of(x), dy, slices_, rows, taps, g_.f, partials, partial_stride());
    if (bias_) slice_column_sums(dy, slices_, rows, g_.f, partials + taps * g_.f, partial_stride(), ctx_.stream(),
                                 ctx_.device());
    sum_slices(partials, slices_, partial_stride(), dk, taps * g_.f, db, bias_ ? g_.f : 0, ctx_.stream(),
               ctx_.device());
    return;
  }
  const float one = 1.0f, zero = 0.0f;
  const float* input = cudnn_input(x);
  auto* grad = static_cast<float*>(filter_grad_.get());
  DTRAIN_CUDNN_CALL(ctx_.device(),
                    cudnnConvolutionBackwardFilter(ctx_.cudnn(), &one, x_desc_, input, y_desc_, dy, conv_desc_,
                                                   static_cast<cudnnConvolutionBwdFilterAlgo_t>(bwd_filter_algo_),
                                                   workspace_.get(), workspace_bytes_, &zero, w_desc_, grad));
  ohwi_to_hwio(g_, grad, dk, ctx_.stream(), ctx_.device());
  if (bias_) {
    DTRAIN_CHECK(db != nullptr, "conv2d on CUDA: a layer with a bias needs db");
    column_sums(ctx_, dy, static_cast<const float*>(ones_.get()), g_.n * g_.oh() * g_.ow(), g_.f, db);
  }
}

std::string Conv2dCore::describe() const {
  if (gemm_)
    return fmt::format("gemm: columns {}x{} and cuBLAS SGEMMs (deterministic), {} bytes of columns, kernel "
                       "gradient over {} slice(s) of the batch",
                       g_.n * g_.oh() * g_.ow(), g_.kh * g_.kw * g_.c,
                       2 * g_.n * g_.oh() * g_.ow() * g_.kh * g_.kw * g_.c * static_cast<std::int64_t>(sizeof(float)),
                       slices_);
  std::string s = fmt::format("fwd {}, bwd data {}, bwd filter {} ({}), workspace {} bytes", fwd_algo_,
                              bwd_data_algo_, bwd_filter_algo_, deterministic_ ? "deterministic" : "NOT deterministic",
                              workspace_bytes_);
  if (g_.pads_input()) s += fmt::format(", input padded to {}x{}", g_.padded_h, g_.padded_w);
  return s;
}

}  // namespace dtrain::backends::cuda
