#include "backends/cuda/pool2d_kernel.hpp"

#include "backends/cuda/elementwise_cores.hpp"

namespace dtrain::backends::cuda {

void Pool2DKernel::prepare(std::int64_t batch, Pool2DPlan& p) {
  if (pooling_ == Pooling::max)
    p.argmax = ctx_.allocate(static_cast<std::size_t>(batch * layer_.output_shape().numel()) * sizeof(std::int32_t));
}

void Pool2DKernel::forward(std::int64_t batch, const nn::StepContext&) {
  Pool2DPlan& p = plans_.get(batch);
  const float* x = p.input.load_as<float>();
  if (pooling_ == Pooling::max) {
    max_pool2d_forward(ctx_, layer_.dims(batch), x, p.y<float>(), static_cast<std::int32_t*>(p.argmax.get()));
  } else {
    average_pool2d_forward(ctx_, layer_.dims(batch), x, p.y<float>());
  }
}

void Pool2DKernel::backward(std::int64_t batch, const nn::StepContext&) {
  Pool2DPlan& p = plans_.get(batch);
  float* dx = p.input.gradient_as<float>();
  if (!dx) return;  // the first layer: nothing below wants the gradient
  if (pooling_ == Pooling::max) {
    max_pool2d_backward(ctx_, layer_.dims(batch), p.dy<const float>(), static_cast<const std::int32_t*>(p.argmax.get()),
                        dx);
  } else {
    average_pool2d_backward(ctx_, layer_.dims(batch), p.dy<const float>(), dx);
  }
  p.input.store_gradient();
}

}  // namespace dtrain::backends::cuda
