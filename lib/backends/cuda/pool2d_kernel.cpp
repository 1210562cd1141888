#include "backends/cuda/pool2d_kernel.hpp"

#include "backends/cuda/elementwise_cores.hpp"

namespace dtrain::backends::cuda {

LayoutPtr Pool2DKernel::plan(std::int64_t batch, const LayoutPtr&) {
  Plan& p = plans_.create(batch);
  const Shape out = layer_.output_shape().with_batch(batch);
  if (pooling_ == Pooling::max) p.argmax = ctx_.allocate(static_cast<std::size_t>(out.numel()) * sizeof(std::int32_t));
  return ctx_.canonical_layout(out, DType::f32);
}

void Pool2DKernel::bind(std::int64_t batch, const nn::LayerIO& io) {
  Plan& p = plans_.get(batch);
  p.input.bind(ctx_, io, DType::f32);
  p.dst = io.dst;
  p.diff_dst = io.diff_dst;
}

void Pool2DKernel::forward(std::int64_t batch, const nn::StepContext&) {
  Plan& p = plans_.get(batch);
  const float* x = p.input.load_as<float>();
  auto* y = static_cast<float*>(CudaContext::address(p.dst));
  if (pooling_ == Pooling::max) {
    max_pool2d_forward(ctx_, layer_.dims(batch), x, y, static_cast<std::int32_t*>(p.argmax.get()));
  } else {
    average_pool2d_forward(ctx_, layer_.dims(batch), x, y);
  }
}

void Pool2DKernel::backward(std::int64_t batch, const nn::StepContext&) {
  Plan& p = plans_.get(batch);
  float* dx = p.input.gradient_as<float>();
  if (!dx) return;  // the first layer: nothing below wants the gradient
  const auto* dy = static_cast<const float*>(CudaContext::address(p.diff_dst));
  if (pooling_ == Pooling::max) {
    max_pool2d_backward(ctx_, layer_.dims(batch), dy, static_cast<const std::int32_t*>(p.argmax.get()), dx);
  } else {
    average_pool2d_backward(ctx_, layer_.dims(batch), dy, dx);
  }
  p.input.store_gradient();
}

}  // namespace dtrain::backends::cuda
