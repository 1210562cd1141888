// Conv2D on the GPU (nn/conv2d.hpp has the semantics): the cuDNN core (conv2d_core.hpp), one per
// batch size, and the fused activation in place on the output.
//   x (N, H, W, C)          f32, canonical (a bfloat16 input is converted: KernelInput)
//   kernel (KH, KW, C, F)   the variable, Keras HWIO f32: read in place as a (KH*KW*C, F) matrix
//                           by the core's GEMM path, or transposed into cuDNN's (F, KH, KW, C)
//                           every forward (after the optimizer's update) where the core uses cuDNN
//   bias (F)                f32, when use_bias
//   y (N, OH, OW, F)        f32, canonical: act(conv(x, kernel) + bias)
//   dk, db                  written whole into the variables' grads (Keras HWIO, (F))
// Float32 under every precision policy: the core has no bfloat16 path yet (cuBLAS's and cuDNN's
// FMA math, no TF32). This differs from the CPU backend, whose oneDNN convolution computes in bfloat16 under
// mixed_bfloat16; a bfloat16 Dense below or above converts at the boundary (KernelInput).
#include <memory>

#include "backends/cuda/conv2d_core.hpp"
#include "backends/cuda/kernel_io.hpp"
#include "nn/conv2d.hpp"

namespace dtrain::backends::cuda {

namespace {

struct Conv2DPlan : LayerMemories {
  std::unique_ptr<Conv2dCore> core;
};

class Conv2DKernel final : public Float32Kernel<nn::Conv2D, Conv2DPlan> {
 public:
  using Float32Kernel::Float32Kernel;

  void forward(std::int64_t batch, const nn::StepContext&) override {
    Conv2DPlan& p = plans_.get(batch);
    const float* x = p.input.load_as<float>();
    auto vars = layer_.variables();
    p.core->set_kernel(value_of(vars[nn::Conv2D::kKernel]));
    p.core->forward(x, bias() ? value_of(vars[nn::Conv2D::kBias]) : nullptr, p.y<float>());
    activation_in_place(ctx_, activation(), DType::f32, p.y<float>(), p.core->geometry().y_elements(),
                        layer_.options().filters, nullptr);
  }

  void backward(std::int64_t batch, const nn::StepContext& step) override {
    Conv2DPlan& p = plans_.get(batch);
    auto vars = layer_.variables();
    float* dy = p.dy<float>();
    // The gradient before the activation, in place: the model never reads diff_dst again.
    if (!activation_backward_elsewhere_)
      activation_backward_in_place(ctx_, activation(), DType::f32, p.y<const float>(), dy,
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
  // The core allocates its scratch (workspace, transposed filter, padded input) here, once.
  void prepare(std::int64_t batch, Conv2DPlan& p) override {
    const auto& o = layer_.options();
    const Shape& in = layer_.input_shape();
    p.core = std::make_unique<Conv2dCore>(ctx_,
                                          conv2d_geometry(batch, in[0], in[1], in[2], o.filters, o.kernel_size[0],
                                                          o.kernel_size[1], o.strides[0], o.strides[1], o.padding),
                                          o.use_bias);
  }
  bool bias() const { return layer_.options().use_bias; }
  config::Activation activation() const { return layer_.options().activation; }

  // The layer above applies the activation's derivative to the gradient it hands down.
  bool activation_backward_elsewhere_ = false;
};

const nn::KernelRegistration registered(kName, nn::Conv2D::Options::kind, &make_kernel<Conv2DKernel, nn::Conv2D>);

}  // namespace

}  // namespace dtrain::backends::cuda
