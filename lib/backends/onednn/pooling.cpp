#include "backends/onednn/pooling.hpp"

namespace dtrain::backends::onednn {

using dnnl::memory;

LayoutPtr Pool2DKernel::plan(std::int64_t batch, const LayoutPtr& src) {
  const auto& params = layer_.params();
  const memory::dims strides{layer_.strides()[0], layer_.strides()[1]};
  const memory::dims kernel{params.pool_size[0], params.pool_size[1]};
  const memory::dims pad_before{layer_.padding_h().before, layer_.padding_w().before};
  const memory::dims pad_after{layer_.padding_h().after, layer_.padding_w().after};
  const Shape out = layer_.output_shape().with_batch(batch);
  const memory::desc& src_md = md_of(src);
  Plan& p = plans_.create(batch);
  p.fwd_pd = dnnl::pooling_forward::primitive_desc(
      dnnl::pooling_forward::desc(dnnl::prop_kind::forward_training, algorithm_, src_md, any_md(out, dtype_of(src_md)),
                                  strides, kernel, pad_before, pad_after),
      ctx_.engine);
  p.bwd_pd = dnnl::pooling_backward::primitive_desc(
      dnnl::pooling_backward::desc(algorithm_, src_md, p.fwd_pd.dst_desc(), strides, kernel, pad_before, pad_after),
      ctx_.engine, p.fwd_pd);
  return make_layout(out, dtype_of(src_md), p.fwd_pd.dst_desc());
}

void Pool2DKernel::bind(std::int64_t batch, const nn::LayerIO& io) {
  Plan& p = plans_.get(batch);
  p.fwd = {dnnl::pooling_forward(p.fwd_pd), {{DNNL_ARG_SRC, ctx_.wrap(io.src)}, {DNNL_ARG_DST, ctx_.wrap(io.dst)}}};
  p.has_diff_src = static_cast<bool>(io.diff_src);
  if (p.has_diff_src)
    p.bwd = {dnnl::pooling_backward(p.bwd_pd),
             {{DNNL_ARG_DIFF_DST, ctx_.wrap(io.diff_dst)}, {DNNL_ARG_DIFF_SRC, ctx_.wrap(io.diff_src)}}};
  if (algorithm_ == dnnl::algorithm::pooling_max) {
    p.workspace = memory(p.fwd_pd.workspace_desc(), ctx_.engine);
    p.fwd.args.emplace(DNNL_ARG_WORKSPACE, p.workspace);
    if (p.has_diff_src) p.bwd.args.emplace(DNNL_ARG_WORKSPACE, p.workspace);
  }
}

void Pool2DKernel::backward(std::int64_t batch, const nn::StepContext&) {
  Plan& p = plans_.get(batch);
  if (p.has_diff_src) p.bwd.run(ctx_);
}

}  // namespace dtrain::backends::onednn
