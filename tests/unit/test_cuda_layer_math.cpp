// The CUDA layer cores' arithmetic (backends/cuda/layer_math.hpp), compiled here by g++ for the
// host, against what the CPU computes: the dropout masks of nn::dropout_mask (the CPU backend's),
// the reference oracle's pooling and activations instantiated in float (the same operations in
// the same order: bit for bit), and the CPU backend's batch normalization kernel run through a
// model (its statistics summed in the same order on one thread: bit for bit). The GPU kernels run
// these same functions; tests/gpu/ checks their launches.
#include <doctest/doctest.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "backends/cuda/layer_math.hpp"
#include "core/rng.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/dropout.hpp"
#include "nn/model.hpp"
#include "nn/padding.hpp"
#include "nn/reference/average_pooling.hpp"
#include "nn/reference/batch_normalization.hpp"
#include "nn/reference/dropout.hpp"
#include "nn/reference/layers.hpp"
#include "nn/registry.hpp"
#include "test_support.hpp"

using namespace dtrain;
using testing::uniform;
namespace lm = dtrain::backends::cuda::layer_math;
using config::Activation;
using config::Padding;
using nn::reference::PoolDims;

namespace {

// Small integers: many ties inside pooling windows.
std::vector<float> with_ties(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(-3, 3);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(d(rng));
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

PoolDims pool_dims(std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c, std::int64_t p, std::int64_t s,
                   Padding padding) {
  const nn::Padding1D ph = nn::padding_1d(h, p, s, padding), pw = nn::padding_1d(w, p + 1, s, padding);
  return {n, h, w, c, p, p + 1, s, s, ph.out, pw.out, ph.before, pw.before};
}

// Every geometry of the tests: pools 1x2, 2x3 and 3x4 (never square, so rows and columns cannot be
// swapped unnoticed), strides 1, 2 and 3, valid and same, on 7 x 9 inputs.
std::vector<PoolDims> geometries(std::int64_t n, std::int64_t c) {
  std::vector<PoolDims> all;
  for (const Padding padding : {Padding::valid, Padding::same})
    for (std::int64_t p = 1; p <= 3; ++p)
      for (std::int64_t s = 1; s <= 3; ++s) all.push_back(pool_dims(n, 7, 9, c, p, s, padding));
  return all;
}

}  // namespace

TEST_CASE("CUDA layer math: dropout's generator and keep decisions give nn::dropout_mask's bits") {
  CHECK(lm::kDropoutStream == static_cast<std::uint32_t>(RngStream::dropout));
  SUBCASE("sample_bits, high halves of step and sample folded in") {
    for (const std::uint64_t seed : {0ull, 7ull, 0x123456789abcdefull})
      for (const std::uint64_t step : {0ull, 1ull, 99999ull, (1ull << 32) + 5})
        for (const std::uint64_t sample : {0ull, 3ull, (3ull << 33) + 1})
          for (const std::uint32_t layer : {0u, 4u, 0x1234567u})
            for (const std::uint32_t block : {0u, 1u, 250u}) {
              const auto cpu = sample_bits(seed, RngStream::dropout, step, sample, layer, block);
              const lm::Bits4 gpu = lm::sample_bits(seed, lm::kDropoutStream, step, sample, layer, block);
              for (int k = 0; k < 4; ++k) CHECK(gpu.v[k] == cpu[static_cast<std::size_t>(k)]);
            }
  }
  SUBCASE("masks of odd lengths at several rates") {
    for (const double rate : {0.0, 0.1, 0.5, 0.9, 0.999999})
      for (const std::int64_t elements : {1, 7, 1003})
        for (const std::int64_t sample : {0, 5, 1234567}) {
          CAPTURE(rate);
          CAPTURE(elements);
          std::vector<std::uint8_t> cpu(static_cast<std::size_t>(elements));
          nn::dropout_mask(42, 17, sample, 3, rate, elements, cpu.data());
          const std::uint32_t threshold = lm::dropout_threshold(rate);
          std::size_t differ = 0;
          for (std::int64_t e = 0; e < elements; ++e)
            differ += lm::dropout_keep(42, 17, sample, 3, threshold, e) != cpu[static_cast<std::size_t>(e)];
          CHECK(differ == 0);
        }
  }
  SUBCASE("y = x * scale * keep, the reference's bits") {
    const std::int64_t n = 1003;
    const std::vector<float> x = uniform(n, -2, 2, 1);
    std::vector<std::uint8_t> keep(n);
    nn::dropout_mask(1, 2, 3, 4, 0.3, n, keep.data());
    std::vector<float> ref(n), mine(n);
    nn::reference::dropout_forward(x.data(), keep.data(), ref.data(), n, 0.3);
    const float scale = lm::dropout_scale(0.3);
    for (std::int64_t i = 0; i < n; ++i) mine[static_cast<std::size_t>(i)] = lm::dropout_apply(x[static_cast<std::size_t>(i)], scale, keep[static_cast<std::size_t>(i)]);
    CHECK(same_bits(mine, ref));
  }
}

TEST_CASE("CUDA layer math: pooling windows, TensorFlow's padding, the reference's maxima, averages and gradients") {
  const std::int64_t N = 2, C = 3;
  for (const PoolDims& d : geometries(N, C)) {
    CAPTURE(fmt::format("pool {}x{} stride {} pad_top {} pad_left {} out {}x{}", d.ph, d.pw, d.sh, d.pad_top,
                        d.pad_left, d.oh, d.ow));
    // The windows' bounds and counts, and which windows hold each input position.
    for (std::int64_t oy = 0; oy < d.oh; ++oy)
      for (std::int64_t ox = 0; ox < d.ow; ++ox) {
        const lm::Window w = lm::pool_window(d, oy, ox);
        CHECK(lm::pool_count(w) == nn::reference::average_pool_count(d, oy, ox));
        CHECK(lm::pool_count(w) > 0);
        for (std::int64_t iy = 0; iy < d.h; ++iy) {
          const bool inside = iy >= oy * d.sh - d.pad_top && iy < oy * d.sh - d.pad_top + d.ph;
          CHECK(inside == (iy >= w.y0 && iy < w.y1));
          const lm::Range r = lm::windows_holding(iy, d.ph, d.sh, d.pad_top, d.oh);
          CHECK(inside == (oy >= r.o0 && oy < r.o1));
        }
        for (std::int64_t ix = 0; ix < d.w; ++ix) {
          const bool inside = ix >= ox * d.sw - d.pad_left && ix < ox * d.sw - d.pad_left + d.pw;
          CHECK(inside == (ix >= w.x0 && ix < w.x1));
          const lm::Range r = lm::windows_holding(ix, d.pw, d.sw, d.pad_left, d.ow);
          CHECK(inside == (ox >= r.o0 && ox < r.o1));
        }
      }
    const std::size_t in = static_cast<std::size_t>(d.n * d.h * d.w * d.c);
    const std::size_t out = static_cast<std::size_t>(d.n * d.oh * d.ow * d.c);
    const std::vector<float> x = with_ties(in, 3), dy = uniform(out, -1, 1, 4);
    // Max pooling: values, argmax positions, gradients.
    std::vector<float> y_ref(out), y(out), dx_ref(in), dx(in);
    std::vector<std::int32_t> argmax(out);
    nn::reference::max_pool2d_forward(x.data(), y_ref.data(), d);
    nn::reference::max_pool2d_backward(x.data(), dy.data(), dx_ref.data(), d);
    std::size_t wrong_argmax = 0;
    for (std::int64_t n = 0; n < d.n; ++n)
      for (std::int64_t oy = 0; oy < d.oh; ++oy)
        for (std::int64_t ox = 0; ox < d.ow; ++ox)
          for (std::int64_t c = 0; c < d.c; ++c) {
            const std::size_t o = static_cast<std::size_t>(lm::nhwc(n, oy, ox, c, d.oh, d.ow, d.c));
            const lm::MaxAt m = lm::max_pool_window(x.data(), d, n, oy, ox, c);
            y[o] = m.value;
            argmax[o] = m.position;
            const std::int64_t iy = oy * d.sh - d.pad_top + m.position / d.pw;
            const std::int64_t ix = ox * d.sw - d.pad_left + m.position % d.pw;
            wrong_argmax += lm::nhwc(n, iy, ix, c, d.h, d.w, d.c) != nn::reference::pool_argmax(x.data(), d, n, oy, ox, c);
          }
    CHECK(wrong_argmax == 0);
    for (std::int64_t n = 0; n < d.n; ++n)
      for (std::int64_t iy = 0; iy < d.h; ++iy)
        for (std::int64_t ix = 0; ix < d.w; ++ix)
          for (std::int64_t c = 0; c < d.c; ++c)
            dx[static_cast<std::size_t>(lm::nhwc(n, iy, ix, c, d.h, d.w, d.c))] =
                lm::max_pool_input_gradient(dy.data(), argmax.data(), d, n, iy, ix, c);
    CHECK(same_bits(y, y_ref));
    CHECK(same_bits(dx, dx_ref));
    // Average pooling.
    const std::vector<float> xa = uniform(in, -1, 1, 5);
    nn::reference::average_pool2d_forward(xa.data(), y_ref.data(), d);
    nn::reference::average_pool2d_backward(dy.data(), dx_ref.data(), d);
    for (std::int64_t n = 0; n < d.n; ++n)
      for (std::int64_t oy = 0; oy < d.oh; ++oy)
        for (std::int64_t ox = 0; ox < d.ow; ++ox)
          for (std::int64_t c = 0; c < d.c; ++c)
            y[static_cast<std::size_t>(lm::nhwc(n, oy, ox, c, d.oh, d.ow, d.c))] =
                lm::average_pool_window(xa.data(), d, n, oy, ox, c);
    for (std::int64_t n = 0; n < d.n; ++n)
      for (std::int64_t iy = 0; iy < d.h; ++iy)
        for (std::int64_t ix = 0; ix < d.w; ++ix)
          for (std::int64_t c = 0; c < d.c; ++c)
            dx[static_cast<std::size_t>(lm::nhwc(n, iy, ix, c, d.h, d.w, d.c))] =
                lm::average_pool_input_gradient(dy.data(), d, n, iy, ix, c);
    CHECK(same_bits(y, y_ref));
    CHECK(same_bits(dx, dx_ref));
  }
  SUBCASE("global average pooling") {
    const std::int64_t n = 3, h = 7, w = 9, c = 5;
    const std::vector<float> x = uniform(static_cast<std::size_t>(n * h * w * c), -1, 1, 6);
    std::vector<float> ref(static_cast<std::size_t>(n * c)), mine(ref.size());
    nn::reference::global_average_pool2d_forward(x.data(), ref.data(), n, h, w, c);
    for (std::int64_t i = 0; i < n * c; ++i)
      mine[static_cast<std::size_t>(i)] = lm::global_average_pool(x.data(), i / c, h * w, i % c, c);
    CHECK(same_bits(mine, ref));
  }
}

TEST_CASE("CUDA layer math: every activation and its derivative from the output, the reference's bits") {
  const std::int64_t rows = 37, cols = 11, size = rows * cols;
  const std::vector<float> z = uniform(static_cast<std::size_t>(size), -6, 6, 7);
  const std::vector<float> dy = uniform(static_cast<std::size_t>(size), -1, 1, 8);
  for (const Activation a :
       {Activation::linear, Activation::relu, Activation::sigmoid, Activation::tanh, Activation::softmax}) {
    CAPTURE(static_cast<int>(a));
    std::vector<float> y_ref = z, y = z, dz_ref(z.size()), dz(z.size());
    nn::reference::activation_forward(a, y_ref.data(), size, cols);
    nn::reference::activation_backward(a, y_ref.data(), dy.data(), dz_ref.data(), size, cols);
    if (a == Activation::softmax) {
      for (std::int64_t r = 0; r < rows; ++r) {
        lm::softmax_row(y.data() + r * cols, cols);
        lm::softmax_gradient_row(y.data() + r * cols, dy.data() + r * cols, dz.data() + r * cols, cols);
      }
    } else {
      for (std::size_t i = 0; i < z.size(); ++i) {
        y[i] = lm::activation_element(a, z[i]);
        dz[i] = lm::activation_gradient_element(a, y[i], dy[i]);
      }
    }
    CHECK(same_bits(y, y_ref));
    CHECK(same_bits(dz, dz_ref));
  }
}

TEST_CASE("CUDA layer math: batch normalization's per-channel formulas give the CPU backend's bits") {
  // The CPU kernel sums its statistics per sample (one plane of h * w rows, in row order) and adds
  // the samples' sums in order, on any number of threads: the order `in_kernel_order` adds here.
  const int threads = omp_get_max_threads();
  omp_set_num_threads(2);
  const std::int64_t batch = 3, h = 7, w = 9, c = 5, m = batch * h * w;
  for (const nn::Mode mode : {nn::Mode::training, nn::Mode::inference}) {
    CAPTURE(mode == nn::Mode::training);
    config::ModelConfig mc;
    mc.input_shape = {h, w, c};
    nn::BatchNormalizationOptions options;
    options.momentum = 0.9;
    mc.layers.push_back(nn::layer_config("bn", options));
    nn::Sequential model(mc, 7, testing::cpu(), nn::ModelOptions{.compute = DType::f32, .input_gradient = true});
    auto& layer = static_cast<nn::BatchNormalization&>(model.layer(0));
    auto vars = layer.variables();
    const std::vector<float> gamma = uniform(c, 0.5f, 1.5f, 9), beta = uniform(c, -1, 1, 10);
    const std::vector<float> moving_mean = uniform(c, -0.5f, 0.5f, 11), moving_var = uniform(c, 0.5f, 1.5f, 12);
    std::memcpy(vars[0].value.data<float>(), gamma.data(), c * sizeof(float));
    std::memcpy(vars[1].value.data<float>(), beta.data(), c * sizeof(float));
    std::memcpy(vars[layer.moving_mean_index()].value.data<float>(), moving_mean.data(), c * sizeof(float));
    std::memcpy(vars[layer.moving_variance_index()].value.data<float>(), moving_var.data(), c * sizeof(float));
    const nn::StepContext step = testing::step_of(mode, batch);
    Tensor x(Shape{batch, h, w, c});
    const std::vector<float> xs = uniform(static_cast<std::size_t>(m * c), -2, 3, 13);
    std::memcpy(x.data<float>(), xs.data(), xs.size() * sizeof(float));
    const Tensor& y_cpu = model.forward(x, step);
    const std::vector<float> dys = uniform(static_cast<std::size_t>(m * c), -1, 1, 14);
    std::memcpy(model.output_gradient().data<float>(), dys.data(), dys.size() * sizeof(float));
    if (mode == nn::Mode::training) model.backward(step);

    // The same with layer_math: statistics, then y; then backward's sums and dx.
    const auto in_kernel_order = [&](const auto& term) {
      double total = 0;
      for (std::int64_t n = 0; n < batch; ++n) {
        double sample = 0;
        for (std::int64_t r = n * h * w; r < (n + 1) * h * w; ++r) sample = lm::add(sample, term(r));
        total = lm::add(total, sample);
      }
      return total;
    };
    std::vector<float> mean(c), inv_std(c), y(static_cast<std::size_t>(m * c)), dx(y.size()), dgamma(c), dbeta(c);
    std::vector<double> mean_d(c), var_d(c);
    for (std::int64_t k = 0; k < c; ++k) {
      const auto K = static_cast<std::size_t>(k);
      if (mode == nn::Mode::training) {
        const double sum = in_kernel_order(
            [&](std::int64_t r) { return static_cast<double>(xs[static_cast<std::size_t>(r * c + k)]); });
        mean_d[K] = sum / static_cast<double>(m);
        const double sq = in_kernel_order([&](std::int64_t r) {
          const double dev = static_cast<double>(xs[static_cast<std::size_t>(r * c + k)]) - mean_d[K];
          return lm::mul(dev, dev);
        });
        var_d[K] = sq / static_cast<double>(m);
        mean[K] = static_cast<float>(mean_d[K]);
        inv_std[K] = lm::batch_norm_inv_std(var_d[K], options.epsilon);
      } else {
        mean[K] = moving_mean[K];
        inv_std[K] = lm::batch_norm_inv_std(static_cast<double>(moving_var[K]), options.epsilon);
      }
      const float scale = lm::batch_norm_scale(inv_std[K], gamma[K]);
      const float shift = lm::batch_norm_shift(beta[K], mean[K], scale);
      for (std::int64_t r = 0; r < m; ++r) {
        const auto i = static_cast<std::size_t>(r * c + k);
        y[i] = lm::batch_norm_apply(xs[i], scale, shift);
      }
      const double sum_dy =
          in_kernel_order([&](std::int64_t r) { return static_cast<double>(dys[static_cast<std::size_t>(r * c + k)]); });
      const double sum_dy_xhat = in_kernel_order([&](std::int64_t r) {
        const auto i = static_cast<std::size_t>(r * c + k);
        return lm::batch_norm_dy_xhat(xs[i], dys[i], mean[K], inv_std[K]);
      });
      dgamma[K] = static_cast<float>(sum_dy_xhat);
      dbeta[K] = static_cast<float>(sum_dy);
      const auto mean_dy = static_cast<float>(sum_dy / static_cast<double>(m));
      const auto mean_dy_xhat = static_cast<float>(sum_dy_xhat / static_cast<double>(m));
      for (std::int64_t r = 0; r < m; ++r) {
        const auto i = static_cast<std::size_t>(r * c + k);
        dx[i] = lm::batch_norm_input_gradient(xs[i], dys[i], mean[K], inv_std[K], scale, mean_dy, mean_dy_xhat);
      }
    }
    const auto as_vector = [](const Tensor& t) {
      const auto s = t.span<float>();
      return std::vector<float>(s.begin(), s.end());
    };
    CHECK(same_bits(y, as_vector(y_cpu)));
    if (mode == nn::Mode::inference) continue;
    CHECK(same_bits(dx, as_vector(model.input_gradient())));
    CHECK(same_bits(dgamma, as_vector(vars[0].grad)));
    CHECK(same_bits(dbeta, as_vector(vars[1].grad)));
    // The moving statistics' contributions (weight 1: one replica), then their update as
    // apply_updates makes it through the CPU numerics.
    std::vector<float> mean_contribution(c), var_contribution(c);
    for (std::size_t k = 0; k < static_cast<std::size_t>(c); ++k) {
      mean_contribution[k] = static_cast<float>(lm::mul(mean_d[k], layer.contribution_weight(step, batch)));
      var_contribution[k] = static_cast<float>(lm::mul(var_d[k], layer.contribution_weight(step, batch)));
    }
    CHECK(same_bits(mean_contribution, as_vector(vars[layer.moving_mean_index()].grad)));
    CHECK(same_bits(var_contribution, as_vector(vars[layer.moving_variance_index()].grad)));
    std::vector<float> moving = moving_var, moving_ref = moving_var;
    layer.apply_updates(testing::cpu_numerics());
    nn::reference::moving_average_update(moving_ref.data(), var_contribution.data(), c, options.momentum);
    const auto keep = static_cast<float>(options.momentum), take = static_cast<float>(1.0 - options.momentum);
    for (std::size_t k = 0; k < static_cast<std::size_t>(c); ++k)
      moving[k] = lm::moving_average(moving[k], var_contribution[k], keep, take);
    CHECK(same_bits(moving, as_vector(vars[layer.moving_variance_index()].value)));
    CHECK(same_bits(moving, moving_ref));
  }
  omp_set_num_threads(threads);
}
