// Conv2D on oneDNN (nn/conv2d.hpp has the semantics).
//   x (N, H, W, C)            oneDNN src     (N, C, H, W), any layout
//   kernel (KH, KW, C, F)     oneDNN weights (F, C, KH, KW); the variable stays Keras HWIO
//   y (N, OH, OW, F)          oneDNN dst     (N, F, OH, OW), any layout; activation fused
// src, weights, dst and their gradients in the compute dtype (f32 or bf16); bias and the kernel's
// gradient always f32.
#include "backends/onednn/weighted_op.hpp"
#include "nn/conv2d.hpp"

namespace dtrain::backends::onednn {

namespace {

using dnnl::memory;

class Conv2DKernel final : public WeightedOpKernel {
 public:
  Conv2DKernel(nn::Conv2D& layer, OnednnContext& ctx, DType compute)
      : WeightedOpKernel(ctx, compute, layer.options().activation), layer_(layer) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr&) override {
    const auto& o = layer_.options();
    const Shape& in = layer_.input_shape();
    const Shape out = layer_.output_shape().with_batch(batch);
    const memory::dims strides{o.strides[0], o.strides[1]};
    const memory::dims pad_before{layer_.padding_h().before, layer_.padding_w().before};
    const memory::dims pad_after{layer_.padding_h().after, layer_.padding_w().after};
    auto src = any_md(in.with_batch(batch), compute_);
    auto dst = any_md(out, compute_);
    auto weights = memory::desc({o.filters, in[2], o.kernel_size[0], o.kernel_size[1]}, to_dnnl(compute_),
                                memory::format_tag::any);
    auto bias = o.use_bias ? memory::desc({o.filters}, memory::data_type::f32, memory::format_tag::x) : memory::desc();
    const auto algo = dnnl::algorithm::convolution_direct;

    auto fwd_pd = dnnl::convolution_forward::primitive_desc(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, algo, src, weights, bias, dst, strides,
                                        pad_before, pad_after),
        act_.post_op_attr(), ctx_.engine);
    auto bwd_data_pd = dnnl::convolution_backward_data::primitive_desc(
        dnnl::convolution_backward_data::desc(algo, src, weights, dst, strides, pad_before, pad_after), ctx_.engine,
        fwd_pd);
    auto bwd_weights_pd = dnnl::convolution_backward_weights::primitive_desc(
        dnnl::convolution_backward_weights::desc(algo, src, diff_weights_md(weights), bias, dst, strides, pad_before,
                                                 pad_after),
        ctx_.engine, fwd_pd);
    return keep(batch, out, fwd_pd, bwd_data_pd, bwd_weights_pd);
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    const auto& o = layer_.options();
    auto vars = layer_.variables();
    bind_variables(batch, io,
                   hwio_md(o.kernel_size[0], o.kernel_size[1], static_cast<int>(layer_.input_shape()[2]), o.filters),
                   vars[nn::Conv2D::kKernel], o.use_bias ? &vars[nn::Conv2D::kBias] : nullptr);
  }

 private:
  nn::Conv2D& layer_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType compute) {
  return std::make_unique<Conv2DKernel>(static_cast<nn::Conv2D&>(layer), OnednnContext::of(ctx), compute);
}

const nn::KernelRegistration registered(kName, nn::Conv2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
