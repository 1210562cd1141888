#include "nn/dense.hpp"

#include <fmt/format.h>

#include "nn/initializers.hpp"

namespace dtrain::nn {

using dnnl::memory;
namespace cpu = kernels::cpu;

namespace {
constexpr std::size_t kKernel = 0, kBias = 1;
}

Dense::Dense(std::string name, const config::DenseConfig& options)
    : Layer(std::move(name)), opt_(options), act_(options.activation) {}

Shape Dense::build(const Shape& in, Rng& rng) {
  if (in.rank() != 1)
    throw ConfigError(fmt::format(
        "layer '{}': dense needs a flat input (features,), got {}; put a flatten layer before it", name(),
        in.to_string()));
  in_ = in[0];
  std::size_t k = add_variable("kernel", Shape{in_, opt_.units});
  glorot_uniform(variables()[k].value, in_, opt_.units, rng);
  if (opt_.use_bias) add_variable("bias", Shape{opt_.units});
  return Shape{opt_.units};
}

memory::desc Dense::plan(Context& ctx, const memory::desc& src_md) {
  const std::int64_t n = src_md.dims()[0];
  auto src = cpu::any_md(Shape{n, in_});
  auto dst = cpu::any_md(Shape{n, opt_.units});
  auto weights = memory::desc({opt_.units, in_}, memory::data_type::f32, memory::format_tag::any);
  auto bias = opt_.use_bias ? memory::desc({opt_.units}, memory::data_type::f32, memory::format_tag::x) : memory::desc();

  auto fwd_pd = dnnl::inner_product_forward::primitive_desc(
      dnnl::inner_product_forward::desc(dnnl::prop_kind::forward_training, src, weights, bias, dst),
      act_.post_op_attr(), ctx.engine);
  auto bwd_data_pd = dnnl::inner_product_backward_data::primitive_desc(
      dnnl::inner_product_backward_data::desc(src, weights, dst), ctx.engine, fwd_pd);
  auto bwd_weights_pd = dnnl::inner_product_backward_weights::primitive_desc(
      dnnl::inner_product_backward_weights::desc(src, weights, bias, dst), ctx.engine, fwd_pd);

  WeightedOpPlan& p = plans_.create(n);
  p.fwd_pd = fwd_pd;
  p.bwd_data_pd = bwd_data_pd;
  p.bwd_weights_pd = bwd_weights_pd;
  p.fwd_prim = dnnl::inner_product_forward(fwd_pd);
  p.bwd_data_prim = dnnl::inner_product_backward_data(bwd_data_pd);
  p.bwd_weights_prim = dnnl::inner_product_backward_weights(bwd_weights_pd);
  return fwd_pd.dst_desc();
}

void Dense::bind(Context& ctx, std::int64_t batch, const LayerIO& io) {
  auto vars = variables();
  bind_weighted_op(ctx, io, cpu::io_md(static_cast<int>(in_), opt_.units), vars[kKernel],
                   opt_.use_bias ? &vars[kBias] : nullptr, act_, plans_.get(batch));
}

void Dense::forward(Context& ctx, std::int64_t batch) { forward_weighted_op(ctx, act_, plans_.get(batch)); }

void Dense::backward(Context& ctx, std::int64_t batch) { backward_weighted_op(ctx, act_, plans_.get(batch)); }

double Dense::regularization_loss() const { return l2_penalty(variables()[kKernel].value, opt_.kernel_regularizer.l2); }

void Dense::add_regularization_gradient(float scale) {
  auto vars = variables();
  add_l2_gradient(vars[kKernel].value, opt_.kernel_regularizer.l2, scale, vars[kKernel].grad);
}

}  // namespace dtrain::nn
