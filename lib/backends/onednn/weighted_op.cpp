#include "backends/onednn/weighted_op.hpp"

namespace dtrain::backends::onednn {

using dnnl::memory;

DnnlIO wrap_io(const OnednnContext& ctx, const nn::LayerIO& io) {
  DnnlIO out;
  out.src = ctx.wrap(io.src);
  out.dst = ctx.wrap(io.dst);
  out.diff_dst = ctx.wrap(io.diff_dst);
  if (io.diff_src) out.diff_src = ctx.wrap(io.diff_src);
  return out;
}

void bind_weighted_op(OnednnContext& ctx, const DnnlIO& io, const memory::desc& kernel_md, Variable& kernel, Variable* bias,
                      const ActivationFn& act, WeightedOpPlan& p) {
  // Forward: src and kernel into the layouts the forward primitive chose; dst is the model's
  // memory, which the model allocated with exactly the primitive's dst layout.
  memory src = layout_for(ctx, io.src, p.fwd_pd.src_desc(0), p.src_in, false);
  memory w_user = ctx.wrap(kernel_md, kernel.value.raw());
  memory w = layout_for(ctx, w_user, p.fwd_pd.weights_desc(0), p.weights_in, false);
  p.fwd = {p.fwd_prim, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, io.dst}}};
  memory bias_mem, dbias_mem;
  if (bias) {
    bias_mem = ctx.wrap(p.fwd_pd.weights_desc(1), bias->value.raw());
    dbias_mem = ctx.wrap(p.bwd_weights_pd.diff_weights_desc(1), bias->grad.raw());
    p.fwd.args.emplace(DNNL_ARG_BIAS, bias_mem);
  }
  act.bind(ctx, io.dst, io.diff_dst, p.act);

  // Backward weights: reads the forward's src and the gradient before the activation.
  memory bw_src = layout_for(ctx, src, p.bwd_weights_pd.src_desc(0), p.bw_src_in, false);
  memory bw_ddst = layout_for(ctx, p.act.pre_grad, p.bwd_weights_pd.diff_dst_desc(0), p.bw_diff_dst_in, false);
  memory dw_user = ctx.wrap(kernel_md, kernel.grad.raw());
  memory dw = layout_for(ctx, dw_user, p.bwd_weights_pd.diff_weights_desc(0), p.dw_out, true);
  p.bwd_weights = {p.bwd_weights_prim, {{DNNL_ARG_SRC, bw_src}, {DNNL_ARG_DIFF_DST, bw_ddst}, {DNNL_ARG_DIFF_WEIGHTS, dw}}};
  if (bias) p.bwd_weights.args.emplace(DNNL_ARG_DIFF_BIAS, dbias_mem);

  // Backward data, only when a layer below wants the gradient.
  p.has_diff_src = static_cast<bool>(io.diff_src);
  if (p.has_diff_src) {
    memory bd_w = layout_for(ctx, w, p.bwd_data_pd.weights_desc(0), p.bd_weights_in, false);
    memory bd_ddst = layout_for(ctx, p.act.pre_grad, p.bwd_data_pd.diff_dst_desc(0), p.bd_diff_dst_in, false);
    memory bd_dsrc = layout_for(ctx, io.diff_src, p.bwd_data_pd.diff_src_desc(0), p.bd_diff_src_out, true);
    p.bwd_data = {p.bwd_data_prim, {{DNNL_ARG_WEIGHTS, bd_w}, {DNNL_ARG_DIFF_DST, bd_ddst}, {DNNL_ARG_DIFF_SRC, bd_dsrc}}};
  }
}

LayoutPtr WeightedOpKernel::keep(std::int64_t batch, const Shape& out, const dnnl::primitive_desc& fwd,
                                 const dnnl::primitive_desc& bwd_data, const dnnl::primitive_desc& bwd_weights) {
  WeightedOpPlan& p = plans_.create(batch);
  p.fwd_pd = fwd;
  p.bwd_data_pd = bwd_data;
  p.bwd_weights_pd = bwd_weights;
  p.fwd_prim = dnnl::primitive(fwd);
  p.bwd_data_prim = dnnl::primitive(bwd_data);
  p.bwd_weights_prim = dnnl::primitive(bwd_weights);
  return make_layout(out, compute_, fwd.dst_desc());
}

void WeightedOpKernel::bind_variables(std::int64_t batch, const nn::LayerIO& io, const memory::desc& kernel_md,
                                      Variable& kernel, Variable* bias) {
  bind_weighted_op(ctx_, wrap_io(ctx_, io), kernel_md, kernel, bias, act_, plans_.get(batch));
}

void WeightedOpKernel::forward(std::int64_t batch, const nn::StepContext&) {
  WeightedOpPlan& p = plans_.get(batch);
  p.src_in.run(ctx_);
  p.weights_in.run(ctx_);
  p.fwd.run(ctx_);
  act_.forward(ctx_, p.act);
}

void WeightedOpKernel::backward(std::int64_t batch, const nn::StepContext& step) {
  WeightedOpPlan& p = plans_.get(batch);
  if (!activation_backward_elsewhere_) act_.backward(ctx_, p.act);
  // A layer's own weight loops come last: where the lanes share their items (nn::StepContext::
  // shared_work), the lanes leave them together, and the later in the step that is, the less
  // time is left for them to drift apart again before their gradients are summed.
  if (own_weight_gradients(batch)) {
    input_gradient(p);
    if (step.backward_marks) step.backward_marks->input_done();  // dtrain bench: data, then weights
    weight_gradients(batch, p.act.pre_grad, step);
    return;
  }
  p.bw_src_in.run(ctx_);
  p.bw_diff_dst_in.run(ctx_);
  p.bwd_weights.run(ctx_);
  p.dw_out.run(ctx_);
  if (step.backward_marks) step.backward_marks->weights_done();  // dtrain bench: weights, then data
  input_gradient(p);
}

void WeightedOpKernel::input_gradient(WeightedOpPlan& p) {
  if (!p.has_diff_src) return;
  p.bd_weights_in.run(ctx_);
  p.bd_diff_dst_in.run(ctx_);
  p.bwd_data.run(ctx_);
  p.bd_diff_src_out.run(ctx_);
}

}  // namespace dtrain::backends::onednn
