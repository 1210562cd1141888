// MaxPooling2D on oneDNN (nn/max_pool2d.hpp has the semantics). Works in whatever layout the layer
// below produced (pooling is layout-agnostic), and keeps oneDNN's workspace (argmax positions)
// from forward for backward.
#include "backends/onednn/context.hpp"
#include "nn/kernel.hpp"
#include "nn/max_pool2d.hpp"

namespace dtrain::backends::onednn {

namespace {

using dnnl::memory;

class MaxPool2DKernel final : public nn::LayerKernel {
 public:
  MaxPool2DKernel(nn::MaxPool2D& layer, OnednnContext& ctx, DType compute)
      : layer_(layer), ctx_(ctx), compute_(compute) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src) override {
    const auto& params = layer_.params();
    const memory::dims strides{layer_.strides()[0], layer_.strides()[1]};
    const memory::dims kernel{params.pool_size[0], params.pool_size[1]};
    const memory::dims pad_before{layer_.padding_h().before, layer_.padding_w().before};
    const memory::dims pad_after{layer_.padding_h().after, layer_.padding_w().after};
    const Shape out = layer_.output_shape().with_batch(batch);
    const memory::desc& src_md = md_of(src);
    Plan& p = plans_.create(batch);
    p.fwd_pd = dnnl::pooling_forward::primitive_desc(
        dnnl::pooling_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::pooling_max, src_md,
                                    any_md(out, compute_), strides, kernel, pad_before, pad_after),
        ctx_.engine);
    p.bwd_pd = dnnl::pooling_backward::primitive_desc(
        dnnl::pooling_backward::desc(dnnl::algorithm::pooling_max, src_md, p.fwd_pd.dst_desc(), strides, kernel,
                                     pad_before, pad_after),
        ctx_.engine, p.fwd_pd);
    return make_layout(out, compute_, p.fwd_pd.dst_desc());
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    Plan& p = plans_.get(batch);
    p.workspace = memory(p.fwd_pd.workspace_desc(), ctx_.engine);
    p.fwd = {dnnl::pooling_forward(p.fwd_pd),
             {{DNNL_ARG_SRC, ctx_.wrap(io.src)}, {DNNL_ARG_DST, ctx_.wrap(io.dst)}, {DNNL_ARG_WORKSPACE, p.workspace}}};
    p.has_diff_src = static_cast<bool>(io.diff_src);
    if (p.has_diff_src)
      p.bwd = {dnnl::pooling_backward(p.bwd_pd),
               {{DNNL_ARG_DIFF_DST, ctx_.wrap(io.diff_dst)},
                {DNNL_ARG_DIFF_SRC, ctx_.wrap(io.diff_src)},
                {DNNL_ARG_WORKSPACE, p.workspace}}};
  }

  void forward(std::int64_t batch, const nn::StepContext&) override { plans_.get(batch).fwd.run(ctx_); }

  void backward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    if (p.has_diff_src) p.bwd.run(ctx_);
  }

 private:
  struct Plan {
    dnnl::pooling_forward::primitive_desc fwd_pd;
    dnnl::pooling_backward::primitive_desc bwd_pd;
    memory workspace;
    BoundPrimitive fwd, bwd;
    bool has_diff_src = false;
  };
  nn::MaxPool2D& layer_;
  OnednnContext& ctx_;
  DType compute_;
  nn::PlanCache<Plan> plans_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType compute) {
  return std::make_unique<MaxPool2DKernel>(static_cast<nn::MaxPool2D&>(layer), OnednnContext::of(ctx), compute);
}

const nn::KernelRegistration registered(kName, nn::MaxPool2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
