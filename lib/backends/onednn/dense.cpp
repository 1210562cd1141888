// Dense on oneDNN's inner product (nn/dense.hpp has the semantics).
//   x (N, I)             oneDNN src (N, I), any layout
//   kernel (I, O)        oneDNN weights (O, I); the variable stays Keras (in, out), physical order io
//   y (N, O)             activation fused
// src, weights, dst and their gradients in the compute dtype (f32 or bf16); bias and the kernel's
// gradient always f32.
#include "backends/onednn/weighted_op.hpp"
#include "nn/dense.hpp"

namespace dtrain::backends::onednn {

namespace {

using dnnl::memory;

class DenseKernel final : public WeightedOpKernel {
 public:
  DenseKernel(nn::Dense& layer, OnednnContext& ctx, DType compute)
      : WeightedOpKernel(ctx, compute, layer.options().activation), layer_(layer) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr&) override {
    const auto& o = layer_.options();
    const std::int64_t in = layer_.input_shape()[0];
    const Shape out{batch, o.units};
    auto src = any_md(Shape{batch, in}, compute_);
    auto dst = any_md(out, compute_);
    // The kernel's gradient in the Keras layout of its variable, and in float32 the kernel too:
    // oneDNN's gemm-based inner product reads and writes (in, out) as it is, where its brgemm
    // kernels wanted blocked copies made every step (two reorders of the whole kernel; the seed
    // CNN's dense layer's backward took 1.3-1.8x as long with them, float32 and bf16, AVX512-BF16
    // EPYC). A bf16 kernel is a converted copy anyway: oneDNN picks its layout.
    const auto keras = memory::format_tag::io;
    auto weights = memory::desc({o.units, in}, to_dnnl(compute_), compute_ == DType::f32 ? keras : memory::format_tag::any);
    auto diff_weights = memory::desc({o.units, in}, memory::data_type::f32, keras);
    auto bias = o.use_bias ? memory::desc({o.units}, memory::data_type::f32, memory::format_tag::x) : memory::desc();

    auto fwd_pd = dnnl::inner_product_forward::primitive_desc(
        dnnl::inner_product_forward::desc(dnnl::prop_kind::forward_training, src, weights, bias, dst),
        act_.post_op_attr(), ctx_.engine);
    auto bwd_data_pd = dnnl::inner_product_backward_data::primitive_desc(
        dnnl::inner_product_backward_data::desc(src, weights, dst), ctx_.engine, fwd_pd);
    auto bwd_weights_pd = dnnl::inner_product_backward_weights::primitive_desc(
        dnnl::inner_product_backward_weights::desc(src, diff_weights, bias, dst), ctx_.engine, fwd_pd);
    return keep(batch, out, fwd_pd, bwd_data_pd, bwd_weights_pd);
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    const auto& o = layer_.options();
    auto vars = layer_.variables();
    bind_variables(batch, io, io_md(static_cast<int>(layer_.input_shape()[0]), o.units), vars[nn::Dense::kKernel],
                   o.use_bias ? &vars[nn::Dense::kBias] : nullptr);
  }

 private:
  nn::Dense& layer_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType compute) {
  return std::make_unique<DenseKernel>(static_cast<nn::Dense&>(layer), OnednnContext::of(ctx), compute);
}

const nn::KernelRegistration registered(kName, nn::Dense::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
