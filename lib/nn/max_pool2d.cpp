#include "nn/max_pool2d.hpp"

#include <fmt/format.h>

#include "nn/padding.hpp"

namespace dtrain::nn {

using dnnl::memory;
namespace cpu = kernels::cpu;

MaxPool2D::MaxPool2D(std::string name, const config::MaxPool2DConfig& options)
    : Layer(std::move(name)), opt_(options), strides_(options.strides.value_or(options.pool_size)) {}

Shape MaxPool2D::build(const Shape& in, Rng&) {
  if (in.rank() != 3)
    throw ConfigError(fmt::format("layer '{}': max_pool2d needs an input of shape (height, width, channels), got {}",
                                  name(), in.to_string()));
  in_h_ = in[0];
  in_w_ = in[1];
  c_ = in[2];
  Padding1D ph = padding_1d(in_h_, opt_.pool_size[0], strides_[0], opt_.padding);
  Padding1D pw = padding_1d(in_w_, opt_.pool_size[1], strides_[1], opt_.padding);
  if (ph.out < 1 || pw.out < 1)
    throw ConfigError(fmt::format("layer '{}': pool {}x{} does not fit the input {} with padding valid", name(),
                                  opt_.pool_size[0], opt_.pool_size[1], in.to_string()));
  out_h_ = ph.out;
  out_w_ = pw.out;
  pad_before_ = {ph.before, pw.before};
  pad_after_ = {ph.after, pw.after};
  return Shape{out_h_, out_w_, c_};
}

memory::desc MaxPool2D::plan(Context& ctx, const memory::desc& src_md) {
  const std::int64_t n = src_md.dims()[0];
  const memory::dims strides{strides_[0], strides_[1]};
  const memory::dims kernel{opt_.pool_size[0], opt_.pool_size[1]};
  auto dst = cpu::any_md(Shape{n, out_h_, out_w_, c_});
  Plan& p = plans_.create(n);
  p.fwd_pd = dnnl::pooling_forward::primitive_desc(
      dnnl::pooling_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::pooling_max, src_md, dst,
                                  strides, kernel, pad_before_, pad_after_),
      ctx.engine);
  p.bwd_pd = dnnl::pooling_backward::primitive_desc(
      dnnl::pooling_backward::desc(dnnl::algorithm::pooling_max, src_md, p.fwd_pd.dst_desc(), strides, kernel,
                                   pad_before_, pad_after_),
      ctx.engine, p.fwd_pd);
  return p.fwd_pd.dst_desc();
}

void MaxPool2D::bind(Context& ctx, std::int64_t batch, const LayerIO& io) {
  Plan& p = plans_.get(batch);
  p.workspace = memory(p.fwd_pd.workspace_desc(), ctx.engine);
  p.fwd = {dnnl::pooling_forward(p.fwd_pd), {{DNNL_ARG_SRC, io.src}, {DNNL_ARG_DST, io.dst}, {DNNL_ARG_WORKSPACE, p.workspace}}};
  p.has_diff_src = static_cast<bool>(io.diff_src);
  if (p.has_diff_src)
    p.bwd = {dnnl::pooling_backward(p.bwd_pd),
             {{DNNL_ARG_DIFF_DST, io.diff_dst}, {DNNL_ARG_DIFF_SRC, io.diff_src}, {DNNL_ARG_WORKSPACE, p.workspace}}};
}

void MaxPool2D::forward(Context& ctx, std::int64_t batch) { plans_.get(batch).fwd.run(ctx); }

void MaxPool2D::backward(Context& ctx, std::int64_t batch) {
  Plan& p = plans_.get(batch);
  if (p.has_diff_src) p.bwd.run(ctx);
}

}  // namespace dtrain::nn
