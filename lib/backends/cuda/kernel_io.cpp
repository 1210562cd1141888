#include "backends/cuda/kernel_io.hpp"

#include "backends/cuda/check.hpp"
#include "backends/cuda/convert.hpp"
#include "backends/cuda/elementwise_cores.hpp"
#include "core/error.hpp"

namespace dtrain::backends::cuda {

void convert(CudaContext& ctx, const void* from, DType from_dtype, void* to, DType to_dtype, std::int64_t n) {
  if (n == 0) return;
  ctx.activate();
  const auto count = static_cast<std::size_t>(n);
  if (from_dtype == to_dtype) {
    if (from != to)
      DTRAIN_CUDA_CALL(ctx.device(), cudaMemcpyAsync(to, from, count * dtype_size(from_dtype),
                                                     cudaMemcpyDeviceToDevice, ctx.stream()));
  } else if (from_dtype == DType::f32 && to_dtype == DType::bf16) {
    f32_to_bf16(static_cast<const float*>(from), static_cast<std::uint16_t*>(to), count, ctx.stream(), ctx.device());
  } else if (from_dtype == DType::bf16 && to_dtype == DType::f32) {
    bf16_to_f32(static_cast<const std::uint16_t*>(from), static_cast<float*>(to), count, ctx.stream(), ctx.device());
  } else {
    throw InternalError(std::string("a CUDA layer kernel converts only between f32 and bf16, not ") +
                        dtype_name(from_dtype) + " to " + dtype_name(to_dtype));
  }
}

void KernelInput::bind(CudaContext& ctx, const nn::LayerIO& io, DType compute) {
  DTRAIN_CHECK(io.src.layout != nullptr, "a CUDA layer kernel bound without an input");
  ctx_ = &ctx;
  src_ = io.src;
  diff_src_ = io.diff_src;
  from_ = io.src.layout->dtype();
  compute_ = compute;
  elements_ = io.src.layout->shape().numel();
  if (from_ == compute_) return;
  const std::size_t bytes = static_cast<std::size_t>(elements_) * dtype_size(compute_);
  converted_ = ctx.allocate(bytes);
  if (diff_src_) converted_gradient_ = ctx.allocate(bytes);
}

const void* KernelInput::load() {
  DTRAIN_CHECK(ctx_ != nullptr, "a CUDA layer kernel ran before bind()");
  if (!converted_) return CudaContext::address(src_);
  convert(*ctx_, CudaContext::address(src_), from_, converted_.get(), compute_, elements_);
  return converted_.get();
}

const void* KernelInput::get() const {
  DTRAIN_CHECK(ctx_ != nullptr, "a CUDA layer kernel ran before bind()");
  return converted_ ? converted_.get() : CudaContext::address(src_);
}

void* KernelInput::gradient() const {
  if (!diff_src_) return nullptr;
  return converted_gradient_ ? converted_gradient_.get() : CudaContext::address(diff_src_);
}

void KernelInput::store_gradient() {
  if (!diff_src_ || !converted_gradient_) return;
  convert(*ctx_, converted_gradient_.get(), compute_, CudaContext::address(diff_src_), from_, elements_);
}

std::size_t activation_scratch_bytes(config::Activation a, DType dtype, std::int64_t n) {
  if (a == config::Activation::linear || dtype == DType::f32) return 0;
  return 2 * static_cast<std::size_t>(n) * sizeof(float);
}

void activation_in_place(CudaContext& ctx, config::Activation a, DType dtype, void* y, std::int64_t n,
                         std::int64_t cols, void* scratch) {
  if (a == config::Activation::linear) return;
  if (dtype == DType::f32) {
    auto* values = static_cast<float*>(y);
    activation_forward(ctx, a, values, values, n, cols);
    return;
  }
  DTRAIN_CHECK(scratch != nullptr, "a bfloat16 activation without its scratch");
  auto* z = static_cast<float*>(scratch);
  convert(ctx, y, dtype, z, DType::f32, n);
  activation_forward(ctx, a, z, z, n, cols);
  convert(ctx, z, DType::f32, y, dtype, n);
}

void activation_backward_in_place(CudaContext& ctx, config::Activation a, DType dtype, const void* y, void* dy,
                                  std::int64_t n, std::int64_t cols, void* scratch) {
  if (a == config::Activation::linear) return;
  if (dtype == DType::f32) {
    auto* g = static_cast<float*>(dy);
    activation_backward(ctx, a, static_cast<const float*>(y), g, g, n, cols);
    return;
  }
  DTRAIN_CHECK(scratch != nullptr, "a bfloat16 activation without its scratch");
  auto* y32 = static_cast<float*>(scratch);
  float* dy32 = y32 + n;
  convert(ctx, y, dtype, y32, DType::f32, n);
  convert(ctx, dy, dtype, dy32, DType::f32, n);
  activation_backward(ctx, a, y32, dy32, dy32, n, cols);
  convert(ctx, dy32, DType::f32, dy, dtype, n);
}

}  // namespace dtrain::backends::cuda
