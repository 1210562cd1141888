// The Activation layer on the GPU (nn/activation.hpp has the semantics): the activation cores,
// the backward from the output as for Conv2D's and Dense's fused activations.
//   x, dx (N, ...)  f32, canonical (a bfloat16 input is converted: KernelInput)
//   y, dy (N, ...)  f32, canonical; softmax over the last axis
// Float32 under every precision policy: the cores are float32 only (the CPU backend keeps a
// bfloat16 input in bfloat16 except for the last layer and softmax).
#include <memory>

#include "backends/cuda/elementwise_cores.hpp"
#include "backends/cuda/kernel_io.hpp"
#include "nn/activation.hpp"

namespace dtrain::backends::cuda {

namespace {

class ActivationKernel final : public nn::LayerKernel {
 public:
  ActivationKernel(nn::ActivationLayer& layer, CudaContext& ctx) : layer_(layer), ctx_(ctx) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr&) override {
    plans_.create(batch);
    return ctx_.canonical_layout(layer_.output_shape().with_batch(batch), DType::f32);
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    Plan& p = plans_.get(batch);
    p.input.bind(ctx_, io, DType::f32);
    p.dst = io.dst;
    p.diff_dst = io.diff_dst;
  }

  void forward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    activation_forward(ctx_, layer_.activation(), p.input.load_as<float>(),
                       static_cast<float*>(CudaContext::address(p.dst)), size(batch), columns());
  }

  void backward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    float* dx = p.input.gradient_as<float>();
    if (!dx) return;
    activation_backward(ctx_, layer_.activation(), static_cast<const float*>(CudaContext::address(p.dst)),
                        static_cast<const float*>(CudaContext::address(p.diff_dst)), dx, size(batch), columns());
    p.input.store_gradient();
  }

 private:
  struct Plan {
    KernelInput input;
    Memory dst, diff_dst;
  };
  std::int64_t size(std::int64_t batch) const { return batch * layer_.output_shape().numel(); }
  // softmax's rows: the last axis.
  std::int64_t columns() const {
    const Shape& s = layer_.output_shape();
    return s[s.rank() - 1];
  }

  nn::ActivationLayer& layer_;
  CudaContext& ctx_;
  nn::PlanCache<Plan> plans_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<ActivationKernel>(static_cast<nn::ActivationLayer&>(layer), CudaContext::of(ctx));
}

const nn::KernelRegistration registered(kName, nn::ActivationLayer::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::cuda
