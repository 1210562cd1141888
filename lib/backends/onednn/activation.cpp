// The Activation layer on oneDNN (nn/activation.hpp has the semantics): same shape, same layout
// as the layer below produced.
#include "backends/onednn/activation_fn.hpp"
#include "backends/onednn/context.hpp"
#include "nn/activation.hpp"
#include "nn/kernel.hpp"

namespace dtrain::backends::onednn {

namespace {

class ActivationKernel final : public nn::LayerKernel {
 public:
  ActivationKernel(nn::ActivationLayer& layer, OnednnContext& ctx) : ctx_(ctx), act_(layer.activation()) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src) override {
    plans_.create(batch);
    return src;
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    Plan& p = plans_.get(batch);
    const dnnl::memory src = ctx_.wrap(io.src), dst = ctx_.wrap(io.dst), diff_dst = ctx_.wrap(io.diff_dst);
    if (act_.is_eltwise()) {
      // Out of place: y = f(x) with the same forward algorithm the fused post-op uses, so the
      // backward (computed from y) is the same code as for Conv2D/Dense activations.
      auto pd = dnnl::eltwise_forward::primitive_desc(
          dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_training, act_.dst_algorithm(), src.get_desc(), 0.0f,
                                      0.0f),
          ctx_.engine);
      p.fwd = {dnnl::eltwise_forward(pd), {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}}};
    } else {
      p.copy_in.bind(src, dst);
    }
    act_.bind(ctx_, dst, diff_dst, p.act);
    p.has_diff_src = static_cast<bool>(io.diff_src);
    if (p.has_diff_src) p.copy_out.bind(p.act.pre_grad, ctx_.wrap(io.diff_src));
  }

  void forward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    if (act_.is_eltwise()) {
      p.fwd.run(ctx_);
    } else {
      p.copy_in.run(ctx_);
      act_.forward(ctx_, p.act);
    }
  }

  void backward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    act_.backward(ctx_, p.act);
    if (p.has_diff_src) p.copy_out.run(ctx_);
  }

 private:
  struct Plan {
    BoundPrimitive fwd;        // eltwise kinds; softmax runs inside act
    Reorder copy_in, copy_out;  // linear and softmax: x -> y, grad -> diff_src
    ActivationFn::Plan act;
    bool has_diff_src = false;
  };
  OnednnContext& ctx_;
  ActivationFn act_;
  nn::PlanCache<Plan> plans_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<ActivationKernel>(static_cast<nn::ActivationLayer&>(layer), OnednnContext::of(ctx));
}

const nn::KernelRegistration registered(kName, nn::ActivationLayer::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
