// The CUDA backend's arithmetic (backends/cuda/math.hpp), compiled here by g++ for the host,
// against the CPU backend's numerics and copies on random data: the formulas the GPU kernels run
// are tested on every CPU build, and only the launches wait for a GPU (tests/gpu/). On the host
// the shared formulas repeat the CPU's operation for operation, so every result is bit-equal.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backends/cuda/math.hpp"
#include "backends/onednn/context.hpp"
#include "test_support.hpp"

using namespace dtrain;
using testing::uniform;
namespace math = dtrain::backends::cuda::math;
using config::LossKind;

namespace {

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  // memcmp must not see an empty vector's null data(), even for zero bytes.
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

constexpr std::size_t kN = 1003;

}  // namespace

TEST_CASE("CUDA math: the optimizer and axpy elements give the CPU numerics' bits") {
  device::Numerics& cpu = testing::cpu_numerics();
  const std::vector<float> w0 = uniform(kN, -1, 1, 1), g = uniform(kN, -2, 2, 2);
  const std::vector<float> m0 = uniform(kN, -0.5f, 0.5f, 3), v0 = uniform(kN, 0.1f, 0.5f, 4);
  const std::vector<float> a0 = uniform(kN, -0.1f, 0.1f, 5);

  SUBCASE("sgd: plain, momentum, nesterov") {
    for (const auto& [momentum, nesterov] : {std::pair{0.0f, false}, {0.9f, false}, {0.9f, true}}) {
      const device::SgdStep step{0.01f, momentum, nesterov};
      std::vector<float> w = w0, m = m0, ws = w0, ms = m0;
      cpu.sgd_update(step, w.data(), g.data(), m.data(), kN);
      for (std::size_t k = 0; k < kN; ++k) {
        if (momentum > 0) math::sgd_momentum_element(step.learning_rate, step.momentum, step.nesterov, ws[k], g[k], ms[k]);
        else math::sgd_element(step.learning_rate, ws[k], g[k]);
      }
      CHECK(same_bits(w, ws));
      CHECK(same_bits(m, ms));
    }
  }
  SUBCASE("adam") {
    const device::AdamStep step{0.001f * 0.3f, 0.1f, 0.001f, 1e-7f};
    std::vector<float> w = w0, m = m0, v = v0, ws = w0, ms = m0, vs = v0;
    cpu.adam_update(step, w.data(), g.data(), m.data(), v.data(), kN);
    for (std::size_t k = 0; k < kN; ++k) math::adam_element(step, ws[k], g[k], ms[k], vs[k]);
    CHECK(same_bits(w, ws));
    CHECK(same_bits(m, ms));
    CHECK(same_bits(v, vs));
  }
  SUBCASE("rmsprop: with and without momentum, centered or not") {
    for (const bool centered : {false, true}) {
      for (const float momentum : {0.0f, 0.9f}) {
        const device::RmspropStep step{0.001f, 0.9f, momentum, 1e-7f, centered};
        std::vector<float> w = w0, vel = v0, mom = m0, avg = a0, ws = w0, vels = v0, moms = m0, avgs = a0;
        cpu.rmsprop_update(step, w.data(), g.data(), vel.data(), momentum > 0 ? mom.data() : nullptr,
                           centered ? avg.data() : nullptr, kN);
        for (std::size_t k = 0; k < kN; ++k)
          math::rmsprop_element(step, 1.0f - step.rho, ws[k], g[k], vels[k], momentum > 0 ? &moms[k] : nullptr,
                                centered ? &avgs[k] : nullptr);
        CHECK(same_bits(w, ws));
        CHECK(same_bits(vel, vels));
        CHECK(same_bits(mom, moms));
        CHECK(same_bits(avg, avgs));
      }
    }
  }
  SUBCASE("axpy, axpby") {
    std::vector<float> y = w0, ys = w0;
    cpu.axpy(-0.37f, g.data(), y.data(), kN);
    for (std::size_t k = 0; k < kN; ++k) math::axpy_element(-0.37f, g[k], ys[k]);
    CHECK(same_bits(y, ys));
    cpu.axpby(0.01f, g.data(), 0.99f, y.data(), kN);
    for (std::size_t k = 0; k < kN; ++k) math::axpby_element(0.01f, g[k], 0.99f, ys[k]);
    CHECK(same_bits(y, ys));
  }
}

TEST_CASE("CUDA math: every loss row gives the CPU numerics' per-example losses and gradients") {
  device::Numerics& cpu = testing::cpu_numerics();
  const std::int64_t N = 37;
  for (const LossKind kind : {LossKind::sparse_categorical_crossentropy, LossKind::categorical_crossentropy,
                              LossKind::binary_crossentropy, LossKind::mean_squared_error}) {
    for (const bool from_logits : {false, true}) {
      for (const bool dense : {false, true}) {
        const bool crossentropy =
            kind == LossKind::sparse_categorical_crossentropy || kind == LossKind::categorical_crossentropy;
        // A label is a class for the crossentropies, the single target value otherwise (C == 1).
        const std::int64_t C = crossentropy ? 10 : (dense ? 4 : 1);
        const auto n = static_cast<std::size_t>(N * C);
        std::vector<float> pred = from_logits || kind == LossKind::mean_squared_error ? uniform(n, -6, 6, 11)
                                                                                      : uniform(n, 0, 1, 12);
        if (!from_logits && kind == LossKind::binary_crossentropy) {
          pred[0] = 0.0f;  // outside the clip range: the gradient is zero there
          pred[1] = 1.0f;
        }
        std::vector<float> targets = uniform(n, 0, 1, 13);
        std::vector<std::int32_t> labels(static_cast<std::size_t>(N));
        for (std::int64_t i = 0; i < N; ++i) labels[i] = static_cast<std::int32_t>(crossentropy ? (i * 7) % C : i % 2);
        const std::vector<float> weights = uniform(static_cast<std::size_t>(N), 0, 2, 14);
        for (const bool weighted : {false, true}) {
          CAPTURE(static_cast<int>(kind));
          CAPTURE(from_logits);
          CAPTURE(dense);
          CAPTURE(weighted);
          std::vector<float> per_example(static_cast<std::size_t>(N)), grad(n);
          device::LossBatch b;
          b.kind = kind;
          b.from_logits = from_logits;
          b.rows = N;
          b.columns = C;
          b.pred = pred.data();
          b.dense_targets = dense ? targets.data() : nullptr;
          b.labels = dense ? nullptr : labels.data();
          b.weights = weighted ? weights.data() : nullptr;
          b.scale = 1.0f / 64;
          b.per_example = per_example.data();
          b.grad = grad.data();
          cpu.loss(b);
          std::vector<float> per_example_s(static_cast<std::size_t>(N)), grad_s(n);
          for (std::int64_t i = 0; i < N; ++i) {
            math::RowTarget target;
            if (dense) target.dense = targets.data() + i * C;
            else target.label = labels[i];
            const float factor = b.scale * (weighted ? weights[i] : 1.0f);
            per_example_s[i] = math::row_loss(kind, from_logits, pred.data() + i * C, C, target, factor,
                                              grad_s.data() + i * C);
          }
          CHECK(same_bits(per_example, per_example_s));
          CHECK(same_bits(grad, grad_s));
        }
      }
    }
  }
}

TEST_CASE("CUDA math: argmax and match counts as the CPU numerics count them") {
  device::Numerics& cpu = testing::cpu_numerics();
  const std::int64_t N = 50, C = 5;
  std::vector<float> pred = uniform(N * C, 0, 1, 21);
  for (std::int64_t j = 0; j < C; ++j) pred[j] = 0.5f;  // a tie: the first maximum wins
  pred[C + 2] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::int32_t> out(N);
  cpu.argmax_rows(pred.data(), N, C, out.data());
  for (std::int64_t i = 0; i < N; ++i) CHECK(out[i] == math::argmax_row(pred.data() + i * C, C));

  std::vector<std::int32_t> targets_i32(N * C);
  std::vector<float> targets_f32(N * C);
  for (std::int64_t k = 0; k < N * C; ++k) {
    targets_i32[k] = static_cast<std::int32_t>(k % 3 == 0);
    targets_f32[k] = k % 4 == 0 ? pred[k] : static_cast<float>(k % 2);
  }
  const float threshold = 0.5f;
  for (const bool i32 : {false, true}) {
    for (const float* t : {static_cast<const float*>(nullptr), &threshold}) {
      const void* targets = i32 ? static_cast<const void*>(targets_i32.data()) : targets_f32.data();
      std::vector<std::int64_t> matches(N);
      cpu.row_matches(pred.data(), targets, i32, N, C, t, matches.data());
      for (std::int64_t i = 0; i < N; ++i)
        CHECK(matches[i] == math::row_match_count(pred.data(), targets, i32, i, C, t != nullptr, t ? *t : 0.0f));
    }
  }
}

namespace {

// The floats whose rounding to bfloat16 has cases: zeros, subnormals, infinities, NaNs (quiet,
// signalling, with payloads), halfway points with an even and an odd kept bit, the largest finite
// float (rounds to infinity), and random bits over every exponent.
std::vector<std::uint32_t> bf16_rounding_cases(std::size_t random_count) {
  std::vector<std::uint32_t> bits = {0x00000000u, 0x80000000u, 0x00000001u, 0x807FFFFFu, 0x00400000u, 0x7F800000u,
                                     0xFF800000u, 0x7FC00000u, 0xFFC00001u, 0x7F800001u, 0x7FBFFFFFu, 0xFF812345u,
                                     0x3F808000u, 0x3F818000u, 0x3F807FFFu, 0x3F808001u, 0x7F7FFFFFu, 0xFF7FFFFFu,
                                     0x00800000u, 0x3F800000u, 0x4049FFFFu, 0x00FF8000u, 0x80FFFFFFu};
  std::mt19937 rng(31);
  for (std::size_t k = 0; k < random_count; ++k) bits.push_back(static_cast<std::uint32_t>(rng()));
  return bits;
}

// The bfloat16 nearest to a float, worked out apart from the bit tricks: of the two bfloat16s
// around it (its high half, and the next one up in magnitude), the nearer in double arithmetic,
// on a tie the one with an even last bit; zeros and subnormals to a zero of their sign (the
// instruction flushes them), infinities kept, NaNs quiet with their sign and top bits.
std::uint16_t nearest_bf16(std::uint32_t bits) {
  const float x = std::bit_cast<float>(bits);
  const auto high = static_cast<std::uint16_t>(bits >> 16);
  if (std::isnan(x)) return static_cast<std::uint16_t>(high | 0x0040u);
  if (std::isinf(x) || std::fpclassify(x) == FP_ZERO || std::fpclassify(x) == FP_SUBNORMAL)
    return static_cast<std::uint16_t>(std::isinf(x) ? high : high & 0x8000u);
  const auto value = [](std::uint32_t h) { return static_cast<double>(std::bit_cast<float>(h << 16)); };
  const double below = value(high), exact = static_cast<double>(x);
  // The next bfloat16 away from zero; past the largest finite one it is the infinity.
  const double above = (high & 0x7FFFu) == 0x7F7Fu ? std::copysign(std::ldexp(1.0, 128), exact)
                                                   : value(static_cast<std::uint32_t>(high) + 1u);
  const double to_below = std::fabs(exact - below), to_above = std::fabs(above - exact);
  if (to_below < to_above || (to_below == to_above && (high & 1u) == 0)) return high;
  return static_cast<std::uint16_t>(high + 1u);
}

}  // namespace

TEST_CASE("bfloat16: the CPU backend's copies and the CUDA math round to nearest even, bit for bit on every CPU") {
  device::Context& ctx = testing::cpu();
  const std::vector<std::uint32_t> bits = bf16_rounding_cases(100000);
  const auto n = static_cast<std::int64_t>(bits.size());
  std::vector<float> f32(bits.size());
  std::memcpy(f32.data(), bits.data(), bits.size() * sizeof(float));
  std::vector<std::uint16_t> bf16(bits.size());
  const auto f32_layout = ctx.canonical_layout(Shape{n}, DType::f32);
  const auto bf16_layout = ctx.canonical_layout(Shape{n}, DType::bf16);
  ctx.make_copy(device::Memory(f32_layout, f32.data()), device::Memory(bf16_layout, bf16.data()))->run();
  ctx.synchronize();
  std::size_t mismatches = 0;
  for (std::size_t k = 0; k < bits.size(); ++k) {
    const std::uint16_t want = nearest_bf16(bits[k]);
    if ((bf16[k] != want || math::bf16_from_f32_bits(bits[k]) != want) && mismatches++ < 5)
      FAIL_CHECK("f32 bits " << std::hex << bits[k] << ": nearest " << want << ", CPU copy " << bf16[k]
                             << ", math.hpp " << math::bf16_from_f32_bits(bits[k]));
  }
  CHECK(mismatches == 0);

  std::vector<float> back(bits.size());
  ctx.make_copy(device::Memory(bf16_layout, bf16.data()), device::Memory(f32_layout, back.data()))->run();
  ctx.synchronize();
  for (std::size_t k = 0; k < bits.size(); ++k) {
    REQUIRE(std::bit_cast<std::uint32_t>(back[k]) == math::f32_bits_from_bf16(bf16[k]));
    REQUIRE(std::bit_cast<std::uint32_t>(back[k]) == std::uint32_t{bf16[k]} << 16);
  }

  // Where the CPU has bfloat16 instructions, oneDNN's own reorder (the instruction) agrees: the
  // copies' loops are that instruction's rounding, not a rounding of their own.
  if (!backends::onednn::cpu_has_bf16()) {
    MESSAGE("skipped the comparison with oneDNN's reorder: this CPU has no bfloat16 instructions "
            "(avx512_core_bf16 or avx512_core_amx), where oneDNN 2.6 emulates it and turns -0 into +0");
    return;
  }
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const dnnl::memory::desc f32_md({n}, dnnl::memory::data_type::f32, dnnl::memory::format_tag::a);
  const dnnl::memory::desc bf16_md({n}, dnnl::memory::data_type::bf16, dnnl::memory::format_tag::a);
  std::vector<std::uint16_t> by_onednn(bits.size());
  dnnl::memory from(f32_md, engine, f32.data()), to(bf16_md, engine, by_onednn.data());
  dnnl::reorder(from, to).execute(stream, from, to);
  stream.wait();
  CHECK(by_onednn == bf16);
}

TEST_CASE("CUDA math: label hits as the accuracy counts them, and the numerics' default label_hits") {
  device::Numerics& cpu = testing::cpu_numerics();
  const std::int64_t N = 40, C = 7;
  std::vector<float> pred = uniform(N * C, -1, 1, 31);
  for (std::int64_t j = 0; j < C; ++j) pred[j] = 0.25f;  // a tie: the first maximum wins
  std::vector<std::int32_t> labels(N), argmax(N);
  for (std::int64_t i = 0; i < N; ++i) labels[i] = static_cast<std::int32_t>((i * 5) % C);
  labels[3] = -1;  // out of range, both sides
  labels[4] = static_cast<std::int32_t>(C);
  cpu.argmax_rows(pred.data(), N, C, argmax.data());
  labels[5] = argmax[5];  // at least one hit
  std::vector<std::int32_t> hits(N);
  cpu.label_hits(pred.data(), labels.data(), N, C, hits.data(), true);  // deferred: the CPU writes at once
  cpu.complete_reads();
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int32_t expected = labels[i] < 0 || labels[i] >= C ? -1 : argmax[i] == labels[i] ? 1 : 0;
    CHECK(math::label_hit(pred.data() + i * C, C, labels[i]) == expected);
    CHECK(hits[i] == expected);
  }
  CHECK(hits[0] == (labels[0] == 0 ? 1 : 0));
  CHECK(hits[5] == 1);
}

TEST_CASE("Numerics: adam_update_all gives each variable's adam_update bits") {
  device::Numerics& cpu = testing::cpu_numerics();
  const device::AdamStep step{0.001f, 0.1f, 0.001f, 1e-7f};
  const std::vector<std::size_t> sizes = {kN, 0, 17, 1};
  std::vector<std::vector<float>> w, g, m, v;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    w.push_back(uniform(sizes[i], -1, 1, 40 + static_cast<unsigned>(i)));
    g.push_back(uniform(sizes[i], -2, 2, 50 + static_cast<unsigned>(i)));
    m.push_back(uniform(sizes[i], -0.5f, 0.5f, 60 + static_cast<unsigned>(i)));
    v.push_back(uniform(sizes[i], 0.1f, 0.5f, 70 + static_cast<unsigned>(i)));
  }
  auto w1 = w, m1 = m, v1 = v;
  std::vector<device::AdamVariable> all;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    cpu.adam_update(step, w1[i].data(), g[i].data(), m1[i].data(), v1[i].data(), sizes[i]);
    all.push_back({w[i].data(), g[i].data(), m[i].data(), v[i].data(), sizes[i]});
  }
  cpu.adam_update_all(step, all);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CHECK(same_bits(w[i], w1[i]));
    CHECK(same_bits(m[i], m1[i]));
    CHECK(same_bits(v[i], v1[i]));
  }
}
