// Dropout on the CPU backend (nn/dropout.hpp has the semantics and the masks). The masks key on
// each element's canonical (channels-last) position, so the kernel works on canonical memory: the
// input is reordered into it when the layer below produced a blocked layout, and the gradient
// back out of it.
//   x, y, dy, dx (N, ...) f32 canonical; mask (N, ...) uint8, kept from forward for backward
#include <cstring>

#include "backends/onednn/canonical_io.hpp"
#include "core/error.hpp"
#include "nn/dropout.hpp"
#include "nn/kernel.hpp"

namespace dtrain::backends::onednn {

namespace {


class DropoutKernel final : public nn::LayerKernel {
 public:
  // f32 under every precision policy: masking only moves values, and the loops are written for f32.
  DropoutKernel(nn::Dropout& layer, OnednnContext& ctx) : layer_(layer), ctx_(ctx) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr&) override {
    Plan& p = plans_.create(batch);
    p.mask.resize(static_cast<std::size_t>(batch * layer_.output_shape().numel()));
    return ctx_.canonical_layout(layer_.output_shape().with_batch(batch), DType::f32);
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    plans_.get(batch).io.bind(ctx_, batch, layer_.input_shape(), io);
  }

  void forward(std::int64_t batch, const nn::StepContext& step) override {
    Plan& p = plans_.get(batch);
    p.io.load_input(ctx_);
    const float* x = p.io.input();
    const std::int64_t n = batch * layer_.output_shape().numel();
    if (!step.training() || layer_.rate() == 0.0) {
      std::memcpy(p.io.y, x, static_cast<std::size_t>(n) * sizeof(float));
      return;
    }
    const std::int64_t elements = layer_.output_shape().numel();
    const float scale = static_cast<float>(1.0 / (1.0 - layer_.rate()));
    const auto layer = static_cast<std::uint32_t>(layer_.position());
    std::uint8_t* keep = p.mask.data();
    float* y = p.io.y;
    // Each sample's mask is its own counter range: samples split over threads draw the same bits.
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < batch; ++i) {
      std::uint8_t* k = keep + i * elements;
      nn::dropout_mask(step.seed, step.global_step, nn::sample_id(step, i), layer, layer_.rate(), elements, k);
      for (std::int64_t e = 0; e < elements; ++e)
        y[i * elements + e] = x[i * elements + e] * scale * static_cast<float>(k[e]);
    }
  }

  void backward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    float* dx = p.io.input_gradient();
    if (!dx) return;
    const std::int64_t n = batch * layer_.output_shape().numel();
    if (layer_.rate() == 0.0) {
      std::memcpy(dx, p.io.dy, static_cast<std::size_t>(n) * sizeof(float));
    } else {
      const float scale = static_cast<float>(1.0 / (1.0 - layer_.rate()));
      const std::uint8_t* keep = p.mask.data();
      const float* dy = p.io.dy;
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < n; ++i) dx[i] = dy[i] * scale * static_cast<float>(keep[i]);
    }
    p.io.store_input_gradient(ctx_);
  }

 private:
  struct Plan {
    std::vector<std::uint8_t> mask;
    CanonicalIO io;
  };
  nn::Dropout& layer_;
  OnednnContext& ctx_;
  nn::PlanCache<Plan> plans_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<DropoutKernel>(static_cast<nn::Dropout&>(layer), OnednnContext::of(ctx));
}

const nn::KernelRegistration registered(kName, nn::Dropout::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
