// Dropout on the CPU backend (nn/dropout.hpp has the semantics and the masks). The masks key on
// each element's canonical (channels-last) position, so the kernel works on canonical memory: the
// input is reordered into it when the layer below produced a blocked layout, and the gradient
// back out of it.
//   x, y, dy, dx (N, ...) f32 canonical; mask (N, ...) uint8, kept from forward for backward
//
// The masks are nn::dropout_mask's bits, drawn here B blocks of Philox4x32-10 at a time in vector
// registers (B 64-bit lanes of the context's loop_isa(): its 32x32->64 multiplies), since drawing
// them one block at a time took forward to 4-7 times its bytes' bound; test_layers compares them
// with nn::dropout_mask on every level.
#include <cstring>

#include "backends/onednn/canonical_io.hpp"
#include "backends/onednn/lanes.hpp"
#include "core/rng.hpp"
#include "core/error.hpp"
#include "nn/dropout.hpp"
#include "nn/kernel.hpp"

namespace dtrain::backends::onednn {

namespace {

// keep[e] = nn::dropout_mask's for e < elements, one sample: B blocks (4B elements) per step.
template <LoopIsa I>
void draw_mask(const PhiloxInput& in, std::uint32_t threshold, std::int64_t elements, std::uint8_t* __restrict keep) {
  // Each 32-bit word lives in a 64-bit lane (high half zero): the multiplies are then the CPU's
  // 32x32->64 (vpmuludq) and nothing converts between widths inside the rounds.
  constexpr int B = float_lanes(I) / 2;
  using U64 = Vec<std::uint64_t, B>;
  constexpr std::uint64_t low = 0xFFFFFFFFu;
  U64 first;
  for (int j = 0; j < B; ++j) first[j] = static_cast<std::uint64_t>(j);
  const std::int64_t blocks = (elements + 3) / 4;
  for (std::int64_t b0 = 0; b0 < blocks; b0 += B) {
    U64 c0 = (first + static_cast<std::uint64_t>(b0)) & low, c1 = U64{} + in.counter[1], c2 = U64{} + in.counter[2],
        c3 = U64{} + in.counter[3];
    std::uint64_t k0 = in.key[0], k1 = in.key[1];
    for (int round = 0; round < kPhiloxRounds; ++round) {
      const U64 p0 = (c0 & low) * std::uint64_t{kPhiloxMul0};
      const U64 p1 = (c2 & low) * std::uint64_t{kPhiloxMul1};
      c0 = (p1 >> 32) ^ c1 ^ k0;
      c1 = p1 & low;
      c2 = (p0 >> 32) ^ c3 ^ k1;
      c3 = p0 & low;
      k0 = (k0 + kPhiloxWeyl0) & low;
      k1 = (k1 + kPhiloxWeyl1) & low;
    }
    // Block j's four keep bytes (elements 4j .. 4j + 3) as one little-endian 32-bit value: the
    // transposition of the four words' lanes into element order, in vector operations.
    const U64 one = U64{} + 1u, t = U64{} + threshold;
    const U64 packed = (static_cast<U64>(c0 >= t) & one) | (static_cast<U64>(c1 >= t) & one) << 8 |
                       (static_cast<U64>(c2 >= t) & one) << 16 | (static_cast<U64>(c3 >= t) & one) << 24;
    std::uint8_t* out = keep + 4 * b0;
    if (4 * (b0 + B) <= elements) {
      store(out, __builtin_convertvector(packed, Vec<std::uint32_t, B>));
    } else {
      for (std::int64_t e = 0; e < elements - 4 * b0; ++e) out[e] = static_cast<std::uint8_t>(packed[e / 4] >> (8 * (e % 4)));
    }
  }
}

// y = x * scale * keep over one sample's elements, L lanes at a time (the byte to float conversion
// in two steps: lanes.hpp's widen_mask).
template <LoopIsa I>
void apply_mask(const float* __restrict x, const std::uint8_t* __restrict keep, float scale, std::int64_t elements,
                float* __restrict y) {
  constexpr int L = float_lanes(I);
  using F = Vec<float, L>;
  std::int64_t e = 0;
  for (; e + L <= elements; e += L) {
    const F k = __builtin_convertvector(widen_mask<Vec<std::int32_t, L>, L>(load<Vec<std::int8_t, L>>(keep + e)), F);
    store(y + e, load<F>(x + e) * scale * k);
  }
  for (; e < elements; ++e) y[e] = x[e] * scale * static_cast<float>(keep[e]);
}


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
    const std::uint32_t threshold = nn::dropout_threshold(layer_.rate());
    const LoopIsa isa = ctx_.loop_isa();
    std::uint8_t* keep = p.mask.data();
    float* y = p.io.y;
    // Each sample's mask is its own counter range: samples split over threads draw the same bits.
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < batch; ++i) {
      std::uint8_t* k = keep + i * elements;
      const PhiloxInput in = sample_philox_input(step.seed, RngStream::dropout, static_cast<std::uint64_t>(step.global_step),
                                                 static_cast<std::uint64_t>(nn::sample_id(step, i)), layer);
      run_for(isa, [&]<LoopIsa I>() {
        draw_mask<I>(in, threshold, elements, k);
        apply_mask<I>(x + i * elements, k, scale, elements, y + i * elements);
      });
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
