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
  // Each 32-bit word lives in a 64-bit lane: the multiplies are then the CPU's 32x32->64
  // (vpmuludq: lanes.hpp's mul_low32), which read only a lane's low half, so inside the rounds the
  // high halves may hold anything and the words are masked once, after the last round.
  constexpr int B = float_lanes(I) / 2;
  using U64 = Vec<std::uint64_t, B>;
  using S64 = Vec<std::int64_t, B>;
  constexpr std::uint64_t low = 0xFFFFFFFFu;
  const U64 mul0 = U64{} + kPhiloxMul0, mul1 = U64{} + kPhiloxMul1;
  // Every round's keys as vectors, once per call (a scalar key broadcast in each round cost as
  // much as the round's arithmetic).
  U64 key0[kPhiloxRounds], key1[kPhiloxRounds];
  for (std::uint64_t round = 0, k0 = in.key[0], k1 = in.key[1]; round < kPhiloxRounds; ++round) {
    key0[round] = U64{} + k0;
    key1[round] = U64{} + k1;
    k0 = (k0 + kPhiloxWeyl0) & low;
    k1 = (k1 + kPhiloxWeyl1) & low;
  }
  U64 first;
  for (int j = 0; j < B; ++j) first[j] = static_cast<std::uint64_t>(j);
  const S64 t = S64{} + static_cast<std::int64_t>(threshold);
  const std::int64_t blocks = (elements + 3) / 4;
  // V vectors of B blocks from block b0, their rounds interleaved: a round waits on the last one
  // (multiply, shift, xors), so a single vector's chain leaves the multipliers idle most cycles.
  const auto draw = [&]<int V>(std::int64_t b0) {
    U64 c0[V], c1[V], c2[V], c3[V];
    for (int v = 0; v < V; ++v) {
      c0[v] = (first + static_cast<std::uint64_t>(b0 + v * B)) & low;
      c1[v] = U64{} + in.counter[1];
      c2[v] = U64{} + in.counter[2];
      c3[v] = U64{} + in.counter[3];
    }
    for (int round = 0; round < kPhiloxRounds; ++round) {
      for (int v = 0; v < V; ++v) {
        const U64 p0 = mul_low32<B>(c0[v], mul0);
        const U64 p1 = mul_low32<B>(c2[v], mul1);
        c0[v] = (p1 >> 32) ^ c1[v] ^ key0[round];
        c1[v] = p1;
        c2[v] = (p0 >> 32) ^ c3[v] ^ key1[round];
        c3[v] = p0;
      }
    }
    // Block j's four keep bytes (elements 4j .. 4j + 3) as one little-endian 32-bit value: the
    // transposition of the four words' lanes into element order, in vector operations. The words
    // are below 2^32 once masked: signed 64-bit compares (one instruction on AVX2) order them.
    const auto kept = [&](const U64& w) { return static_cast<U64>(std::bit_cast<S64>(w & low) >= t) & 1u; };
    for (int v = 0; v < V; ++v) {
      const U64 packed = kept(c0[v]) | kept(c1[v]) << 8 | kept(c2[v]) << 16 | kept(c3[v]) << 24;
      const std::int64_t first_block = b0 + v * B;
      std::uint8_t* out = keep + 4 * first_block;
      if (4 * (first_block + B) <= elements) {
        store(out, __builtin_convertvector(packed, Vec<std::uint32_t, B>));
      } else {
        for (std::int64_t e = 0; e < elements - 4 * first_block; ++e) {
          out[e] = static_cast<std::uint8_t>(packed[e / 4] >> (8 * (e % 4)));
        }
      }
    }
  };
  // Two vectors in flight: 1.4x the masks a second of one on a 2-core AVX2 EPYC; four were slower
  // (the states and keys no longer fit the 16 registers).
  constexpr int kInFlight = 2;
  std::int64_t b0 = 0;
  for (; b0 + kInFlight * B <= blocks; b0 += kInFlight * B) draw.template operator()<kInFlight>(b0);
  for (; b0 < blocks; b0 += B) draw.template operator()<1>(b0);
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
    for_each_item(batch, [&](std::int64_t i) {
      std::uint8_t* k = keep + i * elements;
      const PhiloxInput in = sample_philox_input(step.seed, RngStream::dropout, static_cast<std::uint64_t>(step.global_step),
                                                 static_cast<std::uint64_t>(nn::sample_id(step, i)), layer);
      run_for(isa, [&]<LoopIsa I>() {
        draw_mask<I>(in, threshold, elements, k);
        apply_mask<I>(x + i * elements, k, scale, elements, y + i * elements);
      });
    });
  }

  // Backward reads the mask and dy: a layer above may write dy over y (writes_input_gradient_over_input).
  bool backward_reads_output() const override { return false; }

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
      for_each_item(n, [&](std::int64_t i) { dx[i] = dy[i] * scale * static_cast<float>(keep[i]); });
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
