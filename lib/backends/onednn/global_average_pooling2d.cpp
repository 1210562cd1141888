// GlobalAveragePooling2D on oneDNN (nn/global_average_pooling2d.hpp has the semantics): an average
// pooling whose window is the whole image. The (N, C, 1, 1) result, channels last, is exactly the
// canonical (N, C) the next layer gets, so the output buffer is seen both ways; a reorder joins
// it to the layout oneDNN picked only when that differs.
//   x (N, H, W, C) any layout -> y (N, C) canonical, in the input's dtype
#include "backends/onednn/context.hpp"
#include "nn/global_average_pooling2d.hpp"
#include "nn/kernel.hpp"

namespace dtrain::backends::onednn {

namespace {

using dnnl::memory;

class GlobalAveragePooling2DKernel final : public nn::LayerKernel {
 public:
  GlobalAveragePooling2DKernel(nn::GlobalAveragePooling2D& layer, OnednnContext& ctx)
      : layer_(layer), ctx_(ctx) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src) override {
    const Shape& in = layer_.input_shape();
    const memory::dims kernel{in[0], in[1]}, strides{1, 1}, padding{0, 0};
    const memory::desc& src_md = md_of(src);
    Plan& p = plans_.create(batch);
    p.fwd_pd = dnnl::pooling_forward::primitive_desc(
        dnnl::pooling_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::pooling_avg_exclude_padding,
                                    src_md, any_md(Shape{batch, 1, 1, in[2]}, dtype_of(src_md)), strides, kernel,
                                    padding, padding),
        ctx_.engine);
    p.bwd_pd = dnnl::pooling_backward::primitive_desc(
        dnnl::pooling_backward::desc(dnnl::algorithm::pooling_avg_exclude_padding, src_md, p.fwd_pd.dst_desc(), strides,
                                     kernel, padding, padding),
        ctx_.engine, p.fwd_pd);
    p.dtype = dtype_of(src_md);
    return ctx_.canonical_layout(Shape{batch, in[2]}, p.dtype);
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    Plan& p = plans_.get(batch);
    // The canonical (N, C) buffers seen as (N, 1, 1, C) channels last.
    const memory::desc as_image = canonical_md(Shape{batch, 1, 1, layer_.input_shape()[2]}, p.dtype);
    const memory dst = layout_for(ctx_, ctx_.wrap(as_image, io.dst.data), p.fwd_pd.dst_desc(), p.dst_out, true);
    p.fwd = {dnnl::pooling_forward(p.fwd_pd), {{DNNL_ARG_SRC, ctx_.wrap(io.src)}, {DNNL_ARG_DST, dst}}};
    p.has_diff_src = static_cast<bool>(io.diff_src);
    if (p.has_diff_src) {
      const memory diff_dst =
          layout_for(ctx_, ctx_.wrap(as_image, io.diff_dst.data), p.bwd_pd.diff_dst_desc(), p.diff_dst_in, false);
      p.bwd = {dnnl::pooling_backward(p.bwd_pd), {{DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_DIFF_SRC, ctx_.wrap(io.diff_src)}}};
    }
  }

  void forward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    p.fwd.run(ctx_);
    p.dst_out.run(ctx_);
  }

  void backward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    if (!p.has_diff_src) return;
    p.diff_dst_in.run(ctx_);
    p.bwd.run(ctx_);
  }

 private:
  struct Plan {
    dnnl::pooling_forward::primitive_desc fwd_pd;
    dnnl::pooling_backward::primitive_desc bwd_pd;
    BoundPrimitive fwd, bwd;
    Reorder dst_out, diff_dst_in;
    DType dtype = DType::f32;  // the input's, kept for the output (averaging needs no dtype of its own)
    bool has_diff_src = false;
  };
  nn::GlobalAveragePooling2D& layer_;
  OnednnContext& ctx_;
  nn::PlanCache<Plan> plans_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<GlobalAveragePooling2DKernel>(static_cast<nn::GlobalAveragePooling2D&>(layer),
                                                        OnednnContext::of(ctx));
}

const nn::KernelRegistration registered(kName, nn::GlobalAveragePooling2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
