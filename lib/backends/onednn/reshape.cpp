// Reshape and Flatten on oneDNN (nn/reshape.hpp has the semantics). The layer below may have
// produced a blocked layout, so forward reorders into the canonical order of the input shape,
// written straight into the output's buffer; backward does the reverse. Where the input is already
// canonical (a pooling below writes it so when asked: nn/kernel.hpp's wants_canonical_input), the
// model gives the output the input's memory and both directions move nothing (the reorders, bound
// between one memory and itself in one layout, do not run). The seed CNN's flatten took 0.02-0.04
// ms a step each way (a reorder from channel blocks of 16; 2-core AVX512-BF16 EPYC, Zen 4).
#include "backends/onednn/context.hpp"
#include "nn/kernel.hpp"
#include "nn/reshape.hpp"

namespace dtrain::backends::onednn {

namespace {

class ReshapeKernel final : public nn::LayerKernel {
 public:
  ReshapeKernel(nn::Layer& layer, OnednnContext& ctx) : layer_(layer), ctx_(ctx) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src) override {
    plans_.create(batch).dtype = src->dtype();
    // Asked by the model right after this plan (before the next one).
    reinterprets_ = md_of(src) == canonical_md(layer_.input_shape().with_batch(batch), src->dtype());
    return ctx_.canonical_layout(layer_.output_shape().with_batch(batch), src->dtype());
  }

  bool wants_canonical_input() const override { return true; }
  bool reinterprets_input() const override { return reinterprets_; }
  bool forward_passes_through() const override { return reinterprets_; }
  bool gradient_passes_through() const override { return reinterprets_; }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    Plan& p = plans_.get(batch);
    // The output buffer seen as the input shape in canonical order: reordering into it is the
    // whole reshape.
    const dnnl::memory::desc in_canonical = canonical_md(layer_.input_shape().with_batch(batch), p.dtype);
    p.fwd.bind(ctx_.wrap(io.src), ctx_.wrap(in_canonical, io.dst.data));
    if (io.diff_src) p.bwd.bind(ctx_.wrap(in_canonical, io.diff_dst.data), ctx_.wrap(io.diff_src));
  }

  void forward(std::int64_t batch, const nn::StepContext&) override { plans_.get(batch).fwd.run(ctx_); }
  void backward(std::int64_t batch, const nn::StepContext&) override { plans_.get(batch).bwd.run(ctx_); }

 private:
  struct Plan {
    Reorder fwd, bwd;
    DType dtype = DType::f32;  // the input's: reshaping moves values, it needs no dtype of its own
  };
  nn::Layer& layer_;
  OnednnContext& ctx_;
  nn::PlanCache<Plan> plans_;
  bool reinterprets_ = false;  // the last plan's input is canonical
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<ReshapeKernel>(layer, OnednnContext::of(ctx));
}

const nn::KernelRegistration reshape_registered(kName, nn::Reshape::Options::kind, &make);
const nn::KernelRegistration flatten_registered(kName, nn::Flatten::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
