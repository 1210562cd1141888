// The Activation layer on oneDNN (nn/activation.hpp has the semantics): same shape, same layout
// and dtype as the layer below produced, except that it converts a bf16 input to f32 when it
// computes in f32 (the model's last layer) or is a softmax (which wants float32).
//
// Backward writes the input gradient straight into diff_src (not in place on diff_dst and then a
// copy). A relu's derivative can go to the layer above instead (nn/kernel.hpp: a max pooling applies
// it while it writes its gradient): backward is then the identity, and the model gives this layer
// one memory as diff_dst and diff_src, so it moves nothing at all. Likewise forward, when the
// layer below applies the activation to its output (batch normalization does, for relu).
#include "backends/onednn/activation_fn.hpp"
#include "backends/onednn/context.hpp"
#include "nn/activation.hpp"
#include "nn/kernel.hpp"

namespace dtrain::backends::onednn {

namespace {

using config::Activation;

class ActivationKernel final : public nn::LayerKernel {
 public:
  ActivationKernel(nn::ActivationLayer& layer, OnednnContext& ctx, DType compute)
      : layer_(layer), ctx_(ctx), compute_(compute), act_(layer.activation()) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src) override {
    plans_.create(batch);
    const bool to_f32 = src->dtype() != DType::f32 && (compute_ == DType::f32 || act_.kind() == Activation::softmax);
    if (!to_f32) return src;
    return ctx_.canonical_layout(layer_.output_shape().with_batch(batch), DType::f32);
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    Plan& p = plans_.get(batch);
    const dnnl::memory src = ctx_.wrap(io.src), dst = ctx_.wrap(io.dst), diff_dst = ctx_.wrap(io.diff_dst);
    const bool converts = src.get_desc().data_type() != dst.get_desc().data_type();
    if (converts || !act_.is_eltwise() || skip_forward_) p.copy_in.bind(src, dst);
    if (act_.is_eltwise()) {
      // y = f(x) with the same forward algorithm the fused post-op uses, so the backward
      // (computed from y) is the same code as for Conv2D/Dense activations. Out of place, or in
      // place on y after the conversion.
      const dnnl::memory& x = converts ? dst : src;
      auto pd = dnnl::eltwise_forward::primitive_desc(
          dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_training, act_.dst_algorithm(), x.get_desc(), 0.0f, 0.0f),
          ctx_.engine);
      p.fwd = {dnnl::eltwise_forward(pd), {{DNNL_ARG_SRC, x}, {DNNL_ARG_DST, dst}}};
    }
    p.has_diff_src = static_cast<bool>(io.diff_src);
    if (skip_backward_) {
      // The layer above applied the derivative: the gradient as it came (no copy when the model
      // gave one memory for both; a conversion when this layer converted).
      if (p.has_diff_src) p.copy_out.bind(diff_dst, ctx_.wrap(io.diff_src));
      return;
    }
    // The gradient straight into diff_src when it is laid out as diff_dst (no conversion): one
    // pass instead of the activation's in place and a copy (copy_out is then nothing).
    const dnnl::memory diff_src = p.has_diff_src ? ctx_.wrap(io.diff_src) : dnnl::memory();
    const bool direct = p.has_diff_src && act_.kind() != Activation::linear && diff_src.get_desc() == diff_dst.get_desc();
    act_.bind(ctx_, dst, diff_dst, p.act, direct ? &diff_src : nullptr);
    if (p.has_diff_src) p.copy_out.bind(p.act.pre_grad, diff_src);
  }

  void forward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    p.copy_in.run(ctx_);
    if (skip_forward_) return;  // the layer below applied it: x as it came (no copy in one memory)
    if (act_.is_eltwise()) {
      p.fwd.run(ctx_);
    } else {
      act_.forward(ctx_, p.act);
    }
  }

  config::Activation output_activation() const override {
    return act_.is_eltwise() ? act_.kind() : config::Activation::linear;
  }
  void skip_activation_backward() override { skip_backward_ = true; }
  bool gradient_passes_through() const override { return skip_backward_; }
  // relu only: what a layer below can apply as it writes (the model offers it).
  config::Activation standalone_activation() const override {
    return act_.kind() == Activation::relu ? Activation::relu : Activation::linear;
  }
  void skip_activation_forward() override { skip_forward_ = true; }
  bool forward_passes_through() const override { return skip_forward_; }

  void backward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    if (!skip_backward_) act_.backward(ctx_, p.act);
    if (p.has_diff_src) p.copy_out.run(ctx_);
  }

 private:
  struct Plan {
    BoundPrimitive fwd;        // eltwise kinds; softmax runs inside act
    Reorder copy_in, copy_out;  // linear, softmax and conversions: x -> y, grad -> diff_src
    ActivationFn::Plan act;
    bool has_diff_src = false;
  };
  nn::ActivationLayer& layer_;
  OnednnContext& ctx_;
  DType compute_;
  ActivationFn act_;
  bool skip_backward_ = false;  // the layer above applies the derivative (skip_activation_backward)
  bool skip_forward_ = false;   // the layer below applies the activation (skip_activation_forward)
  nn::PlanCache<Plan> plans_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType compute) {
  return std::make_unique<ActivationKernel>(static_cast<nn::ActivationLayer&>(layer), OnednnContext::of(ctx), compute);
}

const nn::KernelRegistration registered(kName, nn::ActivationLayer::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
