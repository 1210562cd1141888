#include "nn/activation_layer.hpp"

namespace dtrain::nn {

using dnnl::memory;

ActivationLayer::ActivationLayer(std::string name, const config::ActivationConfig& options)
    : Layer(std::move(name)), act_(options.activation) {}

Shape ActivationLayer::build(const Shape& in, Rng&) { return in; }

memory::desc ActivationLayer::plan(Context&, const memory::desc& src_md) {
  plans_.create(src_md.dims()[0]);
  return src_md;
}

void ActivationLayer::bind(Context& ctx, std::int64_t batch, const LayerIO& io) {
  Plan& p = plans_.get(batch);
  if (act_.is_eltwise()) {
    // Out of place: y = f(x) with the same forward algorithm the fused post-op uses, so the
    // backward (computed from y) is the same code as for Conv2D/Dense activations.
    auto pd = dnnl::eltwise_forward::primitive_desc(
        dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_training, act_.dst_algorithm(), io.src.get_desc(), 0.0f, 0.0f),
        ctx.engine);
    p.fwd = {dnnl::eltwise_forward(pd), {{DNNL_ARG_SRC, io.src}, {DNNL_ARG_DST, io.dst}}};
  } else {
    p.copy_in.bind(ctx, io.src, io.dst);
  }
  act_.bind(ctx, io.dst, io.diff_dst, p.act);
  p.has_diff_src = static_cast<bool>(io.diff_src);
  if (p.has_diff_src) p.copy_out.bind(ctx, p.act.pre_grad, io.diff_src);
}

void ActivationLayer::forward(Context& ctx, std::int64_t batch) {
  Plan& p = plans_.get(batch);
  if (act_.is_eltwise()) {
    p.fwd.run(ctx);
  } else {
    p.copy_in.run(ctx);
    act_.forward(ctx, p.act);
  }
}

void ActivationLayer::backward(Context& ctx, std::int64_t batch) {
  Plan& p = plans_.get(batch);
  act_.backward(ctx, p.act);
  if (p.has_diff_src) p.copy_out.run(ctx);
}

}  // namespace dtrain::nn
