// Conv2D on the GPU (nn/conv2d.hpp has the semantics): the cuDNN core (conv2d_core.hpp), one per
// batch size, and the fused activation in place on the output.
//   x (N, H, W, C)          f32, canonical (a bfloat16 input is converted: KernelInput)
//   kernel (KH, KW, C, F)   the variable, Keras HWIO f32; the core transposes it into cuDNN's
//                           (F, KH, KW, C) every forward, after the optimizer's update
//   bias (F)                f32, when use_bias
//   y (N, OH, OW, F)        f32, canonical: act(conv(x, kernel) + bias)
//   dk, db                  written whole into the variables' grads (Keras HWIO, (F))
// Float32 under every precision policy: the core has no bfloat16 path yet (cuDNN's FMA math, no
// TF32), as the CPU backend computes its plain-loop layers in float32.
#include <memory>

#include "backends/cuda/conv2d_core.hpp"
#include "backends/cuda/kernel_io.hpp"
#include "nn/conv2d.hpp"

namespace dtrain::backends::cuda {

namespace {

class Conv2DKernel final : public nn::LayerKernel {
 public:
  Conv2DKernel(nn::Conv2D& layer, CudaContext& ctx) : layer_(layer), ctx_(ctx) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr&) override {
    const auto& o = layer_.options();
    const Shape& in = layer_.input_shape();
    Plan& p = plans_.create(batch);
    // The core allocates its scratch (workspace, transposed filter, padded input) here, once.
    p.core = std::make_unique<Conv2dCore>(ctx_,
                                          conv2d_geometry(batch, in[0], in[1], in[2], o.filters, o.kernel_size[0],
                                                          o.kernel_size[1], o.strides[0], o.strides[1], o.padding),
                                          o.use_bias);
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
    const float* x = p.input.load_as<float>();
    auto vars = layer_.variables();
    auto* y = static_cast<float*>(CudaContext::address(p.dst));
    p.core->set_kernel(value_of(vars[nn::Conv2D::kKernel]));
    p.core->forward(x, bias() ? value_of(vars[nn::Conv2D::kBias]) : nullptr, y);
    activation_in_place(ctx_, activation(), DType::f32, y, p.core->geometry().y_elements(), layer_.options().filters,
                        nullptr);
  }

  void backward(std::int64_t batch, const nn::StepContext& step) override {
    Plan& p = plans_.get(batch);
    auto vars = layer_.variables();
    auto* dy = static_cast<float*>(CudaContext::address(p.diff_dst));
    // The gradient before the activation, in place: the model never reads diff_dst again.
    if (!activation_backward_elsewhere_)
      activation_backward_in_place(ctx_, activation(), DType::f32, CudaContext::address(p.dst), dy,
                                   p.core->geometry().y_elements(), layer_.options().filters, nullptr);
    p.core->backward_filter(p.input.as<float>(), dy, grad_of(vars[nn::Conv2D::kKernel]),
                            bias() ? grad_of(vars[nn::Conv2D::kBias]) : nullptr);
    if (step.backward_marks) step.backward_marks->weights_done();  // dtrain bench: weights, then data
    if (float* dx = p.input.gradient_as<float>()) {
      p.core->backward_data(dy, dx);
      p.input.store_gradient();
    }
  }

  config::Activation output_activation() const override { return activation(); }
  void skip_activation_backward() override { activation_backward_elsewhere_ = true; }

 private:
  struct Plan {
    std::unique_ptr<Conv2dCore> core;
    KernelInput input;
    Memory dst, diff_dst;
  };
  bool bias() const { return layer_.options().use_bias; }
  config::Activation activation() const { return layer_.options().activation; }

  nn::Conv2D& layer_;
  CudaContext& ctx_;
  // The layer above applies the activation's derivative to the gradient it hands down.
  bool activation_backward_elsewhere_ = false;
  nn::PlanCache<Plan> plans_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<Conv2DKernel>(static_cast<nn::Conv2D&>(layer), CudaContext::of(ctx));
}

const nn::KernelRegistration registered(kName, nn::Conv2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::cuda
