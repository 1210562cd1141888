// Dense on the GPU (nn/dense.hpp has the semantics): the cuBLAS cores (dense_core.hpp), one per
// batch size, and the fused activation in place on the output.
//   x (N, I)          in the compute dtype (KernelInput converts the layer below's output)
//   kernel (I, O)     the variable, Keras (in, out) f32: the cores' row-major k, no transposition
//   bias (O)          f32, when use_bias
//   y (N, O)          in the compute dtype: act(x kernel + bias)
//   dk, db            f32, written whole into the variables' grads
// Compute dtype: bfloat16 under mixed_bfloat16 (DenseCoreBf16: tensor cores, float32
// accumulation; the kernel is rounded into a bfloat16 copy every forward, after the optimizer's
// update, as the CPU backend's reorder rounds it), except with a softmax, which computes in
// float32 as on the CPU backend; the model's last layer is asked for float32.
#include <memory>

#include "backends/cuda/dense_core.hpp"
#include "backends/cuda/kernel_io.hpp"
#include "nn/dense.hpp"

namespace dtrain::backends::cuda {

namespace {

class DenseKernel final : public nn::LayerKernel {
 public:
  DenseKernel(nn::Dense& layer, CudaContext& ctx, DType compute)
      : layer_(layer),
        ctx_(ctx),
        compute_(compute == DType::bf16 && layer.options().activation != config::Activation::softmax ? DType::bf16
                                                                                                     : DType::f32) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr&) override {
    const auto& o = layer_.options();
    const std::int64_t in = inputs(), out = o.units;
    Plan& p = plans_.create(batch);
    if (compute_ == DType::bf16) {
      p.core16 = std::make_unique<DenseCoreBf16>(ctx_, batch, in, out, o.use_bias);
      // One bfloat16 copy of the kernel serves every batch size (steps run one at a time).
      if (!kernel16_) kernel16_ = ctx_.allocate(static_cast<std::size_t>(in * out) * sizeof(std::uint16_t));
    } else {
      p.core = std::make_unique<DenseCore>(ctx_, batch, in, out, o.use_bias);
    }
    const std::size_t scratch = activation_scratch_bytes(o.activation, compute_, batch * out);
    if (scratch > 0) p.scratch = ctx_.allocate(scratch);
    return ctx_.canonical_layout(Shape{batch, out}, compute_);
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    plans_.get(batch).bind(ctx_, io, compute_);
  }

  void forward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    auto vars = layer_.variables();
    const float* k = value_of(vars[nn::Dense::kKernel]);
    const float* b = bias() ? value_of(vars[nn::Dense::kBias]) : nullptr;
    void* y = p.y<void>();
    if (compute_ == DType::bf16) {
      auto* k16 = static_cast<std::uint16_t*>(kernel16_.get());
      convert(ctx_, k, DType::f32, k16, DType::bf16, inputs() * units());
      p.core16->forward(p.input.load_as<std::uint16_t>(), k16, b, static_cast<std::uint16_t*>(y));
    } else {
      p.core->forward(p.input.load_as<float>(), k, b, static_cast<float*>(y));
    }
    activation_in_place(ctx_, activation(), compute_, y, batch * units(), units(), p.scratch.get());
  }

  void backward(std::int64_t batch, const nn::StepContext& step) override {
    Plan& p = plans_.get(batch);
    auto vars = layer_.variables();
    void* dy = p.dy<void>();
    // The gradient before the activation, in place: the model never reads diff_dst again.
    if (!activation_backward_elsewhere_)
      activation_backward_in_place(ctx_, activation(), compute_, p.y<const void>(), dy, batch * units(),
                                   units(), p.scratch.get());
    float* dk = grad_of(vars[nn::Dense::kKernel]);
    float* db = bias() ? grad_of(vars[nn::Dense::kBias]) : nullptr;
    if (compute_ == DType::bf16) {
      const auto* g = static_cast<const std::uint16_t*>(dy);
      p.core16->backward_weights(p.input.as<std::uint16_t>(), g, dk, db);
      if (step.backward_marks) step.backward_marks->weights_done();  // dtrain bench: weights, then data
      if (auto* dx = p.input.gradient_as<std::uint16_t>()) {
        // The bfloat16 kernel forward rounded: the same weights as the forward used.
        p.core16->backward_data(g, static_cast<const std::uint16_t*>(kernel16_.get()), dx);
        p.input.store_gradient();
      }
    } else {
      const auto* g = static_cast<const float*>(dy);
      p.core->backward_weights(p.input.as<float>(), g, dk, db);
      if (step.backward_marks) step.backward_marks->weights_done();
      if (auto* dx = p.input.gradient_as<float>()) {
        p.core->backward_data(g, value_of(vars[nn::Dense::kKernel]), dx);
        p.input.store_gradient();
      }
    }
  }

  config::Activation output_activation() const override { return activation(); }
  void skip_activation_backward() override { activation_backward_elsewhere_ = true; }

 private:
  struct Plan : LayerMemories {
    std::unique_ptr<DenseCore> core;        // float32
    std::unique_ptr<DenseCoreBf16> core16;  // bfloat16
    Buffer scratch;  // a bfloat16 output's activation in float32 (activation_in_place)
  };
  std::int64_t inputs() const { return layer_.input_shape()[0]; }
  std::int64_t units() const { return layer_.options().units; }
  bool bias() const { return layer_.options().use_bias; }
  config::Activation activation() const { return layer_.options().activation; }

  nn::Dense& layer_;
  CudaContext& ctx_;
  DType compute_;
  Buffer kernel16_;  // bfloat16 kernel (I, O), rounded every forward
  bool activation_backward_elsewhere_ = false;
  nn::PlanCache<Plan> plans_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType compute) {
  return std::make_unique<DenseKernel>(static_cast<nn::Dense&>(layer), CudaContext::of(ctx), compute);
}

const nn::KernelRegistration registered(kName, nn::Dense::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::cuda
