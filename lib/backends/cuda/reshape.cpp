// Reshape and Flatten on the GPU (nn/reshape.hpp has the semantics). Every memory of this backend
// is canonical (row-major), so reshaping is a copy of the bytes into the output's buffer, and
// backward the copy of the gradient back; the dtype is the input's (values only move).
//   x, dx (N, input shape...) -> y, dy (N, target shape...), same bytes
#include <memory>

#include "backends/cuda/kernel_io.hpp"
#include "nn/kernel.hpp"
#include "nn/reshape.hpp"

namespace dtrain::backends::cuda {

namespace {

class ReshapeKernel final : public nn::LayerKernel {
 public:
  ReshapeKernel(nn::Layer& layer, CudaContext& ctx) : layer_(layer), ctx_(ctx) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src) override {
    plans_.create(batch).dtype = src->dtype();
    return ctx_.canonical_layout(layer_.output_shape().with_batch(batch), src->dtype());
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    Plan& p = plans_.get(batch);
    p.bind(ctx_, io, p.dtype);  // in its own dtype: no conversion, a plain copy
    p.elements = batch * layer_.output_shape().numel();
  }

  void forward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    convert(ctx_, p.input.load(), p.dtype, p.y<void>(), p.dtype, p.elements);
  }

  void backward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    if (void* dx = p.input.gradient()) convert(ctx_, p.dy<const void>(), p.dtype, dx, p.dtype, p.elements);
  }

 private:
  struct Plan : LayerMemories {
    DType dtype = DType::f32;
    std::int64_t elements = 0;
  };
  nn::Layer& layer_;
  CudaContext& ctx_;
  nn::PlanCache<Plan> plans_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<ReshapeKernel>(layer, CudaContext::of(ctx));
}

const nn::KernelRegistration reshape_registered(kName, nn::Reshape::Options::kind, &make);
const nn::KernelRegistration flatten_registered(kName, nn::Flatten::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::cuda
