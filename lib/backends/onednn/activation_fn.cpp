#include "backends/onednn/activation_fn.hpp"

#include "core/error.hpp"

namespace dtrain::backends::onednn {

using dnnl::algorithm;
using dnnl::memory;
using config::Activation;

namespace {

algorithm forward_algorithm(Activation a) {
  switch (a) {
    case Activation::relu: return algorithm::eltwise_relu;
    case Activation::sigmoid: return algorithm::eltwise_logistic;
    case Activation::tanh: return algorithm::eltwise_tanh;
    default: break;
  }
  throw InternalError("not an eltwise activation");
}

algorithm dst_algorithm_of(Activation a) {
  switch (a) {
    case Activation::relu: return algorithm::eltwise_relu_use_dst_for_bwd;
    case Activation::sigmoid: return algorithm::eltwise_logistic_use_dst_for_bwd;
    case Activation::tanh: return algorithm::eltwise_tanh_use_dst_for_bwd;
    default: break;
  }
  throw InternalError("not an eltwise activation");
}

}  // namespace

algorithm ActivationFn::dst_algorithm() const { return dst_algorithm_of(kind_); }

bool ActivationFn::is_eltwise() const {
  return kind_ == Activation::relu || kind_ == Activation::sigmoid || kind_ == Activation::tanh;
}

dnnl::primitive_attr ActivationFn::post_op_attr() const {
  dnnl::primitive_attr attr;
  if (is_eltwise()) {
    dnnl::post_ops ops;
    ops.append_eltwise(1.0f, forward_algorithm(kind_), 0.0f, 0.0f);
    attr.set_post_ops(ops);
  }
  return attr;
}

BoundPrimitive ActivationFn::in_place_forward(const OnednnContext& ctx, const memory& y) const {
  DTRAIN_CHECK(is_eltwise(), "in_place_forward of an activation that is not an eltwise");
  const auto pd = dnnl::eltwise_forward::primitive_desc(
      dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_inference, forward_algorithm(kind_), y.get_desc(), 0.0f, 0.0f),
      ctx.engine);
  return {dnnl::eltwise_forward(pd), {{DNNL_ARG_SRC, y}, {DNNL_ARG_DST, y}}};
}

void ActivationFn::bind(const OnednnContext& ctx, const memory& dst, const memory& diff_dst, Plan& plan,
                        const memory* pre_grad) const {
  const memory::desc md = dst.get_desc();
  DTRAIN_CHECK(!pre_grad || pre_grad->get_desc() == diff_dst.get_desc(), "activation gradient in another layout");
  if (is_eltwise()) {
    auto fwd_pd = dnnl::eltwise_forward::primitive_desc(
        dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_training, dst_algorithm_of(kind_), md, 0.0f, 0.0f),
        ctx.engine);
    auto bwd_pd = dnnl::eltwise_backward::primitive_desc(
        dnnl::eltwise_backward::desc(dst_algorithm_of(kind_), diff_dst.get_desc(), md, 0.0f, 0.0f), ctx.engine, fwd_pd);
    plan.pre_grad = pre_grad ? *pre_grad : diff_dst;
    plan.backward = {dnnl::eltwise_backward(bwd_pd),
                     {{DNNL_ARG_DST, dst}, {DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_DIFF_SRC, plan.pre_grad}}};
  } else if (kind_ == Activation::softmax) {
    const int channel_axis = 1;  // oneDNN's logical order is (N, C, ...): C is Keras' last axis
    auto fwd_pd = dnnl::softmax_forward::primitive_desc(
        dnnl::softmax_forward::desc(dnnl::prop_kind::forward_training, md, channel_axis), ctx.engine);
    auto bwd_pd = dnnl::softmax_backward::primitive_desc(
        dnnl::softmax_backward::desc(diff_dst.get_desc(), md, channel_axis), ctx.engine, fwd_pd);
    plan.softmax_forward = {dnnl::softmax_forward(fwd_pd), {{DNNL_ARG_SRC, dst}, {DNNL_ARG_DST, dst}}};
    plan.pre_grad = pre_grad ? *pre_grad : memory(diff_dst.get_desc(), ctx.engine);
    plan.backward = {dnnl::softmax_backward(bwd_pd),
                     {{DNNL_ARG_DST, dst}, {DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_DIFF_SRC, plan.pre_grad}}};
  } else {
    plan.pre_grad = diff_dst;
  }
}

void ActivationFn::forward(OnednnContext& ctx, Plan& plan) const {
  if (kind_ == Activation::softmax) plan.softmax_forward.run(ctx);
}

void ActivationFn::backward(OnednnContext& ctx, Plan& plan) const {
  if (kind_ != Activation::linear) plan.backward.run(ctx);
}

}  // namespace dtrain::backends::onednn
