#include "nn/conv2d.hpp"

#include <fmt/format.h>

#include "nn/initializers.hpp"
#include "nn/padding.hpp"

namespace dtrain::nn {

using dnnl::memory;
namespace cpu = kernels::cpu;

namespace {
constexpr std::size_t kKernel = 0, kBias = 1;
}

Conv2D::Conv2D(std::string name, const config::Conv2DConfig& options)
    : Layer(std::move(name)), opt_(options), act_(options.activation) {}

Shape Conv2D::build(const Shape& in, Rng& rng) {
  if (in.rank() != 3)
    throw ConfigError(fmt::format("layer '{}': conv2d needs an input of shape (height, width, channels), got {}", name(),
                                  in.to_string()));
  in_h_ = in[0];
  in_w_ = in[1];
  in_c_ = in[2];
  const auto [kh, kw] = opt_.kernel_size;
  const auto [sh, sw] = opt_.strides;
  Padding1D ph = padding_1d(in_h_, kh, sh, opt_.padding), pw = padding_1d(in_w_, kw, sw, opt_.padding);
  if (ph.out < 1 || pw.out < 1)
    throw ConfigError(fmt::format("layer '{}': kernel {}x{} does not fit the input {} with padding valid", name(), kh,
                                  kw, in.to_string()));
  out_h_ = ph.out;
  out_w_ = pw.out;
  pad_before_ = {ph.before, pw.before};
  pad_after_ = {ph.after, pw.after};

  std::size_t k = add_variable("kernel", Shape{kh, kw, in_c_, opt_.filters});
  glorot_uniform(variables()[k].value, kh * kw * in_c_, kh * kw * opt_.filters, rng);
  if (opt_.use_bias) add_variable("bias", Shape{opt_.filters});
  return Shape{out_h_, out_w_, opt_.filters};
}

memory::desc Conv2D::plan(Context& ctx, const memory::desc& src_md) {
  const std::int64_t n = src_md.dims()[0];
  const auto [kh, kw] = opt_.kernel_size;
  const memory::dims strides{opt_.strides[0], opt_.strides[1]};
  auto src = cpu::any_md(Shape{n, in_h_, in_w_, in_c_});
  auto dst = cpu::any_md(Shape{n, out_h_, out_w_, opt_.filters});
  auto weights = memory::desc({opt_.filters, in_c_, kh, kw}, memory::data_type::f32, memory::format_tag::any);
  auto bias = opt_.use_bias ? memory::desc({opt_.filters}, memory::data_type::f32, memory::format_tag::x) : memory::desc();
  const auto algo = dnnl::algorithm::convolution_direct;

  auto fwd_pd = dnnl::convolution_forward::primitive_desc(
      dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, algo, src, weights, bias, dst, strides,
                                      pad_before_, pad_after_),
      act_.post_op_attr(), ctx.engine);
  auto bwd_data_pd = dnnl::convolution_backward_data::primitive_desc(
      dnnl::convolution_backward_data::desc(algo, src, weights, dst, strides, pad_before_, pad_after_), ctx.engine,
      fwd_pd);
  auto bwd_weights_pd = dnnl::convolution_backward_weights::primitive_desc(
      dnnl::convolution_backward_weights::desc(algo, src, weights, bias, dst, strides, pad_before_, pad_after_),
      ctx.engine, fwd_pd);

  WeightedOpPlan& p = plans_.create(n);
  p.fwd_pd = fwd_pd;
  p.bwd_data_pd = bwd_data_pd;
  p.bwd_weights_pd = bwd_weights_pd;
  p.fwd_prim = dnnl::convolution_forward(fwd_pd);
  p.bwd_data_prim = dnnl::convolution_backward_data(bwd_data_pd);
  p.bwd_weights_prim = dnnl::convolution_backward_weights(bwd_weights_pd);
  return fwd_pd.dst_desc();
}

void Conv2D::bind(Context& ctx, std::int64_t batch, const LayerIO& io) {
  auto vars = variables();
  bind_weighted_op(ctx, io, cpu::hwio_md(static_cast<int>(opt_.kernel_size[0]), static_cast<int>(opt_.kernel_size[1]),
                                         static_cast<int>(in_c_), opt_.filters),
                   vars[kKernel], opt_.use_bias ? &vars[kBias] : nullptr, act_, plans_.get(batch));
}

void Conv2D::forward(Context& ctx, std::int64_t batch) { forward_weighted_op(ctx, act_, plans_.get(batch)); }

void Conv2D::backward(Context& ctx, std::int64_t batch) { backward_weighted_op(ctx, act_, plans_.get(batch)); }

double Conv2D::regularization_loss() const {
  return l2_penalty(variables()[kKernel].value, opt_.kernel_regularizer.l2);
}

void Conv2D::add_regularization_gradient(float scale) {
  auto vars = variables();
  add_l2_gradient(vars[kKernel].value, opt_.kernel_regularizer.l2, scale, vars[kKernel].grad);
}

}  // namespace dtrain::nn
