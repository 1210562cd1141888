// The reference AveragePooling2D, GlobalAveragePooling2D, BatchNormalization and Dropout
// (lib/nn/reference) against hand-computed values and, in double, against central finite
// differences of L = sum(r * y) with random r. Pooling shapes cover odd sizes, strides other than
// the pool size and both paddings ('same' on odd sizes pads asymmetrically); batch norm covers
// row counts that are not multiples of anything nice, a channel whose variance is near epsilon,
// and scale/center off.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "nn/padding.hpp"
#include "nn/reference/average_pooling.hpp"
#include "nn/reference/batch_normalization.hpp"
#include "nn/reference/dropout.hpp"

using namespace dtrain;
namespace ref = dtrain::nn::reference;
using config::Padding;

namespace {

using Vec = std::vector<double>;

double rel_err(const Vec& a, const Vec& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

Vec random_vec(std::size_t n, Rng& rng, double scale = 1.0) {
  Vec v(n);
  for (auto& x : v) x = scale * rng.uniform(-1.0f, 1.0f);
  return v;
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of loss() wrt every entry of p (perturbed in place) against analytic.
void fd_check(Vec& p, const Vec& analytic, const std::function<double()>& loss, const std::string& what) {
  CAPTURE(what);
  REQUIRE(analytic.size() == p.size());
  const double h = 1e-6;
  Vec fd(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double saved = p[i];
    p[i] = saved + h;
    const double up = loss();
    p[i] = saved - h;
    const double down = loss();
    p[i] = saved;
    fd[i] = (up - down) / (2 * h);
  }
  CHECK(rel_err(analytic, fd) < 1e-6);
}

ref::PoolDims pool_dims(std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c, std::int64_t ph,
                        std::int64_t pw, std::int64_t sh, std::int64_t sw, Padding p) {
  const auto py = nn::padding_1d(h, ph, sh, p), px = nn::padding_1d(w, pw, sw, p);
  return {n, h, w, c, ph, pw, sh, sw, py.out, px.out, py.before, px.before};
}

std::size_t in_size(const ref::PoolDims& d) { return static_cast<std::size_t>(d.n * d.h * d.w * d.c); }
std::size_t out_size(const ref::PoolDims& d) { return static_cast<std::size_t>(d.n * d.oh * d.ow * d.c); }

Vec avg_pool(const Vec& x, const ref::PoolDims& d) {
  Vec y(out_size(d));
  ref::average_pool2d_forward(x.data(), y.data(), d);
  return y;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// AveragePooling2D

TEST_CASE("average_pool2d: 3x3 input, pool 2, stride 2, same: windows of 4, 2, 2 and 1") {
  // One pad row/column after, none before: the divisors are the real positions only.
  const auto d = pool_dims(1, 3, 3, 1, 2, 2, 2, 2, Padding::same);
  REQUIRE(d.oh == 2);
  REQUIRE(d.ow == 2);
  CHECK(d.pad_top == 0);
  CHECK(d.pad_left == 0);
  CHECK(ref::average_pool_count(d, 0, 0) == 4);
  CHECK(ref::average_pool_count(d, 0, 1) == 2);
  CHECK(ref::average_pool_count(d, 1, 0) == 2);
  CHECK(ref::average_pool_count(d, 1, 1) == 1);
  const Vec x{1, 2, 3,  //
              4, 5, 6,  //
              7, 8, 9};
  CHECK(avg_pool(x, d) == Vec{3, 4.5, 7.5, 9});
  const Vec dy{1, 2, 3, 4};
  Vec dx(9, -7.0);  // overwritten
  ref::average_pool2d_backward(dy.data(), dx.data(), d);
  CHECK(dx == Vec{0.25, 0.25, 1,  //
                  0.25, 0.25, 1,  //
                  1.5, 1.5, 4});
}

TEST_CASE("average_pool2d: 3x3 input, pool 3, stride 2, same: padding before and after, overlapping windows") {
  const auto d = pool_dims(1, 3, 3, 1, 3, 3, 2, 2, Padding::same);
  REQUIRE(d.oh == 2);
  CHECK(d.pad_top == 1);
  CHECK(d.pad_left == 1);
  for (std::int64_t oy = 0; oy < 2; ++oy)
    for (std::int64_t ox = 0; ox < 2; ++ox) CHECK(ref::average_pool_count(d, oy, ox) == 4);
  const Vec x{1, 2, 3, 4, 5, 6, 7, 8, 9};
  CHECK(avg_pool(x, d) == Vec{3, 4, 6, 7});
  const Vec dy{1, 1, 1, 1};
  Vec dx(9);
  ref::average_pool2d_backward(dy.data(), dx.data(), d);
  CHECK(dx == Vec{0.25, 0.5, 0.25, 0.5, 1, 0.5, 0.25, 0.5, 0.25});
}

TEST_CASE("average_pool2d: 4x5 input, pool 3, stride 2, same: divisors 9, 6 and 4") {
  // Rows: out 2, total pad 1 (after): windows {0,1,2}, {2,3}. Columns: out 3, total pad 2 (1, 1):
  // windows {0,1}, {1,2,3}, {3,4}.
  const auto d = pool_dims(1, 4, 5, 1, 3, 3, 2, 2, Padding::same);
  REQUIRE(d.oh == 2);
  REQUIRE(d.ow == 3);
  CHECK(d.pad_top == 0);
  CHECK(d.pad_left == 1);
  const std::int64_t want[2][3] = {{6, 9, 6}, {4, 6, 4}};
  for (std::int64_t oy = 0; oy < 2; ++oy)
    for (std::int64_t ox = 0; ox < 3; ++ox) CHECK(ref::average_pool_count(d, oy, ox) == want[oy][ox]);
}

TEST_CASE("average_pool2d: channels and examples are pooled independently") {
  // Channel 1 = 10 x channel 0; example 1 = example 0 + 100. Averages follow exactly.
  const auto d = pool_dims(2, 3, 3, 2, 2, 2, 2, 2, Padding::same);
  Vec x(in_size(d));
  for (std::int64_t n = 0; n < 2; ++n)
    for (std::int64_t p = 0; p < 9; ++p) {
      x[static_cast<std::size_t>((n * 9 + p) * 2)] = p + 1 + 100 * n;
      x[static_cast<std::size_t>((n * 9 + p) * 2 + 1)] = 10 * (p + 1) + 100 * n;
    }
  CHECK(avg_pool(x, d) == Vec{3, 30, 4.5, 45, 7.5, 75, 9, 90, 103, 130, 104.5, 145, 107.5, 175, 109, 190});
}

TEST_CASE("average_pool2d: valid padding, strides larger than the pool skip positions") {
  // 5x5, pool 2, stride 3: out 2x2, windows rows/cols {0,1}, {3,4}; row/column 2 is never read.
  const auto d = pool_dims(1, 5, 5, 1, 2, 2, 3, 3, Padding::valid);
  REQUIRE(d.oh == 2);
  REQUIRE(d.ow == 2);
  Vec x(25);
  for (std::size_t i = 0; i < 25; ++i) x[i] = static_cast<double>(i);
  CHECK(avg_pool(x, d) == Vec{3, 6, 18, 21});
  Vec dx(25);
  ref::average_pool2d_backward(Vec{4, 4, 4, 4}.data(), dx.data(), d);
  for (std::size_t i = 0; i < 25; ++i) {
    const std::size_t r = i / 5, c = i % 5;
    CHECK(dx[i] == (r != 2 && c != 2 ? 1.0 : 0.0));
  }
}

TEST_CASE("average_pool2d against finite differences; a constant input stays constant") {
  struct Case {
    const char* label;
    std::int64_t n, h, w, c, ph, pw, sh, sw;
    Padding padding;
  };
  const Case cases[] = {
      {"2x2 valid, odd input", 2, 7, 5, 3, 2, 2, 2, 2, Padding::valid},
      {"2x2 valid, stride 1 (overlapping)", 1, 5, 4, 2, 2, 2, 1, 1, Padding::valid},
      {"3x2 pool, strides 2x1, same", 2, 7, 5, 3, 3, 2, 2, 1, Padding::same},
      {"3x3 stride 2 same, even input", 1, 8, 6, 2, 3, 3, 2, 2, Padding::same},
      {"2x2 stride 3 valid (gaps)", 1, 7, 8, 2, 2, 2, 3, 3, Padding::valid},
      {"2x2 stride 3 same", 2, 7, 7, 1, 2, 2, 3, 3, Padding::same},
      {"4x4 stride 1 same (1 before, 2 after)", 1, 5, 6, 2, 4, 4, 1, 1, Padding::same},
      {"5x5 pool over a 3x3 input, same", 2, 3, 3, 2, 5, 5, 1, 1, Padding::same},
      {"1x1 pool: the identity", 1, 3, 4, 2, 1, 1, 1, 1, Padding::valid},
  };
  Rng rng(5, RngStream::test);
  for (const Case& c : cases) {
    CAPTURE(c.label);
    const auto d = pool_dims(c.n, c.h, c.w, c.c, c.ph, c.pw, c.sh, c.sw, c.padding);
    REQUIRE(d.oh > 0);
    REQUIRE(d.ow > 0);
    Vec x = random_vec(in_size(d), rng);
    const Vec r = random_vec(out_size(d), rng);
    Vec dx(in_size(d));
    ref::average_pool2d_backward(r.data(), dx.data(), d);
    fd_check(x, dx, [&] { return dot(avg_pool(x, d), r); }, "dx");

    // Every window averages its real positions only, so a constant stays that constant (a
    // divisor counting padding would shrink the border outputs).
    for (double v : avg_pool(Vec(in_size(d), 2.5), d)) CHECK(v == doctest::Approx(2.5).epsilon(1e-15));
    if (c.ph == 1 && c.pw == 1) CHECK(avg_pool(x, d) == x);
  }
}

// ---------------------------------------------------------------------------------------------
// GlobalAveragePooling2D

TEST_CASE("global_average_pool2d: hand-computed, backward spreads dy / (H W)") {
  // x (2, 2, 2, 2): example 0 channel 0 = 1..4, channel 1 = -(1..4); example 1 = 10 x example 0.
  const Vec x{1, -1, 2, -2, 3, -3, 4, -4, 10, -10, 20, -20, 30, -30, 40, -40};
  Vec y(4);
  ref::global_average_pool2d_forward(x.data(), y.data(), 2, 2, 2, 2);
  CHECK(y == Vec{2.5, -2.5, 25, -25});
  Vec dx(16, -7.0);
  ref::global_average_pool2d_backward(Vec{4, 8, -2, 1}.data(), dx.data(), 2, 2, 2, 2);
  CHECK(dx == Vec{1, 2, 1, 2, 1, 2, 1, 2, -0.5, 0.25, -0.5, 0.25, -0.5, 0.25, -0.5, 0.25});
}

TEST_CASE("global_average_pool2d against finite differences and a whole-input average pool") {
  struct Case {
    std::int64_t n, h, w, c;
  };
  Rng rng(6, RngStream::test);
  for (const Case& s : {Case{2, 3, 5, 3}, Case{1, 7, 1, 4}, Case{3, 1, 1, 2}}) {
    CAPTURE(s.h);
    CAPTURE(s.w);
    const auto size = static_cast<std::size_t>(s.n * s.h * s.w * s.c);
    Vec x = random_vec(size, rng);
    const Vec r = random_vec(static_cast<std::size_t>(s.n * s.c), rng);
    auto forward = [&] {
      Vec y(r.size());
      ref::global_average_pool2d_forward(x.data(), y.data(), s.n, s.h, s.w, s.c);
      return y;
    };
    Vec dx(size);
    ref::global_average_pool2d_backward(r.data(), dx.data(), s.n, s.h, s.w, s.c);
    fd_check(x, dx, [&] { return dot(forward(), r); }, "dx");

    // The same as AveragePooling2D with pool_size (H, W), valid, whose output is (N, 1, 1, C).
    const auto d = pool_dims(s.n, s.h, s.w, s.c, s.h, s.w, 1, 1, Padding::valid);
    CHECK(rel_err(forward(), avg_pool(x, d)) < 1e-15);
  }
}

// ---------------------------------------------------------------------------------------------
// BatchNormalization

TEST_CASE("batch_norm_statistics: per-channel mean and biased variance") {
  // M = 4 rows, C = 2: channel 0 = 1, 2, 3, 4; channel 1 = 0, 0, 0, 8.
  const Vec x{1, 0, 2, 0, 3, 0, 4, 8};
  Vec mean(2), var(2);
  ref::batch_norm_statistics(x.data(), 4, 2, mean.data(), var.data());
  CHECK(mean == Vec{2.5, 2});
  CHECK(var == Vec{1.25, 12});  // divided by M = 4, not M - 1
}

TEST_CASE("batch_norm_forward: hand-computed with given statistics; null gamma/beta are 1/0") {
  // sqrt(variance + epsilon) = 2 and 0.5.
  const Vec x{1, -2, 5, 0, -3, -1};  // M = 3, C = 2
  const Vec mean{1, -2}, var{3.75, 0}, gamma{2, -1}, beta{0.5, 3};
  Vec y(6, -7.0);
  ref::batch_norm_forward(x.data(), 3, 2, mean.data(), var.data(), gamma.data(), beta.data(), 0.25, y.data());
  // channel 0: 2 * (x - 1) / 2 + 0.5; channel 1: -(x + 2) / 0.5 + 3.
  CHECK(y == Vec{0.5, 3, 4.5, -1, -3.5, 1});
  ref::batch_norm_forward(x.data(), 3, 2, mean.data(), var.data(), static_cast<const double*>(nullptr),
                          static_cast<const double*>(nullptr), 0.25, y.data());
  CHECK(y == Vec{0, 0, 2, 4, -2, 2});
  const Vec ones{1, 1}, zeros{0, 0};
  Vec y1(6);
  ref::batch_norm_forward(x.data(), 3, 2, mean.data(), var.data(), ones.data(), zeros.data(), 0.25, y1.data());
  CHECK(y1 == y);
}

TEST_CASE("batch_norm_forward with the batch statistics: per channel mean beta, variance gamma^2 var / (var + eps)") {
  Rng rng(7, RngStream::test);
  const std::int64_t m = 23, c = 3;
  const Vec x = random_vec(static_cast<std::size_t>(m * c), rng), gamma{1.5, -0.5, 2}, beta{0.25, -1, 0};
  Vec mean(3), var(3), y(x.size()), ym(3), yv(3);
  ref::batch_norm_statistics(x.data(), m, c, mean.data(), var.data());
  ref::batch_norm_forward(x.data(), m, c, mean.data(), var.data(), gamma.data(), beta.data(), 1e-3, y.data());
  ref::batch_norm_statistics(y.data(), m, c, ym.data(), yv.data());
  for (std::size_t ch = 0; ch < 3; ++ch) {
    CHECK(ym[ch] == doctest::Approx(beta[ch]).epsilon(1e-12));
    CHECK(yv[ch] == doctest::Approx(gamma[ch] * gamma[ch] * var[ch] / (var[ch] + 1e-3)).epsilon(1e-12));
  }
}

namespace {

struct BnCase {
  const char* label;
  std::int64_t m, c;
  bool scale, center;
  double epsilon;
};

// Channel ch of x is scaled by 0.03 when ch == 1 so its variance (~3e-4) is comparable to the
// default epsilon: epsilon's place inside the square root matters there.
Vec bn_input(const BnCase& b, Rng& rng) {
  Vec x = random_vec(static_cast<std::size_t>(b.m * b.c), rng);
  for (std::int64_t r = 0; r < b.m; ++r)
    for (std::int64_t ch = 0; ch < b.c; ++ch) {
      auto& v = x[static_cast<std::size_t>(r * b.c + ch)];
      v = ch == 1 ? 0.03 * v : v + 0.5 * static_cast<double>(ch);
    }
  return x;
}

const BnCase kBnCases[] = {
    {"(N, H, W, C) = (2, 3, 5, 3), M = 30", 30, 3, true, true, 1e-3},
    {"M = 13, C = 2", 13, 2, true, true, 1e-3},
    {"(N, C) input, M = N = 5, C = 4, scale and center off", 5, 4, false, false, 1e-3},
    {"M = 7, C = 3, scale only, epsilon 0.1", 7, 3, true, false, 0.1},
    {"M = 2, C = 3, center only", 2, 3, false, true, 1e-3},
    {"M = 1 (x - mean is 0)", 1, 2, true, true, 1e-3},
};

}  // namespace

TEST_CASE("batch_norm_backward_training equals finite differences of statistics-then-forward") {
  Rng rng(8, RngStream::test);
  for (const BnCase& b : kBnCases) {
    CAPTURE(b.label);
    const auto mc = static_cast<std::size_t>(b.m * b.c), cs = static_cast<std::size_t>(b.c);
    Vec x = bn_input(b, rng), gamma = random_vec(cs, rng), beta = random_vec(cs, rng);
    const Vec r = random_vec(mc, rng);
    const double* g = b.scale ? gamma.data() : nullptr;
    const double* bt = b.center ? beta.data() : nullptr;
    auto loss = [&] {
      Vec mean(cs), var(cs), y(mc);
      ref::batch_norm_statistics(x.data(), b.m, b.c, mean.data(), var.data());
      ref::batch_norm_forward(x.data(), b.m, b.c, mean.data(), var.data(), g, bt, b.epsilon, y.data());
      return dot(y, r);
    };
    Vec mean(cs), var(cs), dx(mc, -7.0), dgamma(cs, -7.0), dbeta(cs, -7.0);
    ref::batch_norm_statistics(x.data(), b.m, b.c, mean.data(), var.data());
    ref::batch_norm_backward_training(x.data(), r.data(), b.m, b.c, mean.data(), var.data(), g, b.epsilon, dx.data(),
                                      b.scale ? dgamma.data() : nullptr, b.center ? dbeta.data() : nullptr);
    fd_check(x, dx, loss, "dx");
    if (b.scale) fd_check(gamma, dgamma, loss, "dgamma");
    if (b.center) fd_check(beta, dbeta, loss, "dbeta");
    // Null outputs are left alone.
    if (!b.scale) CHECK(dgamma == Vec(cs, -7.0));
    if (!b.center) CHECK(dbeta == Vec(cs, -7.0));
    if (b.m == 1)
      for (double v : dx) CHECK(v == 0.0);

    // A null dx (or dgamma, dbeta) is skipped without changing the rest.
    Vec dx2(mc);
    ref::batch_norm_backward_training(x.data(), r.data(), b.m, b.c, mean.data(), var.data(), g, b.epsilon, dx2.data(),
                                      static_cast<double*>(nullptr), static_cast<double*>(nullptr));
    CHECK(dx2 == dx);
    Vec dgamma2(cs);
    ref::batch_norm_backward_training(x.data(), r.data(), b.m, b.c, mean.data(), var.data(), g, b.epsilon,
                                      static_cast<double*>(nullptr), dgamma2.data(), static_cast<double*>(nullptr));
    if (b.scale) CHECK(dgamma2 == dgamma);
  }
}

TEST_CASE("batch_norm_backward_inference equals finite differences with the statistics held constant") {
  Rng rng(9, RngStream::test);
  for (const BnCase& b : kBnCases) {
    CAPTURE(b.label);
    const auto mc = static_cast<std::size_t>(b.m * b.c), cs = static_cast<std::size_t>(b.c);
    Vec x = bn_input(b, rng), gamma = random_vec(cs, rng), beta = random_vec(cs, rng);
    const Vec r = random_vec(mc, rng), mean = random_vec(cs, rng);
    Vec var = random_vec(cs, rng);
    for (auto& v : var) v = v * v + 0.01;  // moving variances: any positive values
    const double* g = b.scale ? gamma.data() : nullptr;
    const double* bt = b.center ? beta.data() : nullptr;
    auto loss = [&] {
      Vec y(mc);
      ref::batch_norm_forward(x.data(), b.m, b.c, mean.data(), var.data(), g, bt, b.epsilon, y.data());
      return dot(y, r);
    };
    Vec dx(mc, -7.0), dgamma(cs, -7.0), dbeta(cs, -7.0);
    ref::batch_norm_backward_inference(x.data(), r.data(), b.m, b.c, mean.data(), var.data(), g, b.epsilon, dx.data(),
                                       b.scale ? dgamma.data() : nullptr, b.center ? dbeta.data() : nullptr);
    fd_check(x, dx, loss, "dx");
    if (b.scale) fd_check(gamma, dgamma, loss, "dgamma");
    if (b.center) fd_check(beta, dbeta, loss, "dbeta");
    if (!b.scale) CHECK(dgamma == Vec(cs, -7.0));
    if (!b.center) CHECK(dbeta == Vec(cs, -7.0));
  }
}

TEST_CASE("batch norm: the inference backward differs from the training one on the same statistics") {
  Rng rng(10, RngStream::test);
  const std::int64_t m = 17, c = 3;
  const BnCase b{"", m, c, true, true, 1e-3};
  const Vec x = bn_input(b, rng), dy = random_vec(static_cast<std::size_t>(m * c), rng), gamma{0.5, 2, -1};
  Vec mean(3), var(3);
  ref::batch_norm_statistics(x.data(), m, c, mean.data(), var.data());
  Vec dx_t(x.size()), dg_t(3), db_t(3), dx_i(x.size()), dg_i(3), db_i(3);
  ref::batch_norm_backward_training(x.data(), dy.data(), m, c, mean.data(), var.data(), gamma.data(), 1e-3,
                                    dx_t.data(), dg_t.data(), db_t.data());
  ref::batch_norm_backward_inference(x.data(), dy.data(), m, c, mean.data(), var.data(), gamma.data(), 1e-3,
                                     dx_i.data(), dg_i.data(), db_i.data());
  CHECK(rel_err(dx_t, dx_i) > 0.1);
  CHECK(dg_t == dg_i);  // dgamma and dbeta do not see the statistics' dependence on x
  CHECK(db_t == db_i);

  // Per channel, the training dx sums to 0 (the batch mean absorbs a shift of x), and
  // sum(dx * xhat) = gamma / sqrt(var + eps) * dgamma * eps / (var + eps): the batch variance
  // absorbs a scaling of x but for epsilon. The inference dx sums to gamma / sqrt(var + eps) * dbeta.
  for (std::int64_t ch = 0; ch < c; ++ch) {
    const double inv = 1 / std::sqrt(var[ch] + 1e-3);
    double sum_t = 0, sum_i = 0, dot_t = 0, scale = 0;
    for (std::int64_t r = 0; r < m; ++r) {
      const auto i = static_cast<std::size_t>(r * c + ch);
      sum_t += dx_t[i];
      sum_i += dx_i[i];
      dot_t += dx_t[i] * (x[i] - mean[ch]) * inv;
      scale += std::abs(dx_i[i]);
    }
    CHECK(std::abs(sum_t) < 1e-12 * scale);
    CHECK(dot_t == doctest::Approx(gamma[ch] * inv * dg_t[ch] * 1e-3 / (var[ch] + 1e-3)).epsilon(1e-10));
    CHECK(sum_i == doctest::Approx(gamma[ch] * inv * db_i[ch]).epsilon(1e-12));
  }
}

TEST_CASE("combine_statistics: hand-computed, clamped at 0, count 0") {
  const Vec sum{10, 8}, sum_sq{30, 64};  // the statistics test's data: count 4
  Vec mean(2), var(2);
  ref::combine_statistics(sum.data(), sum_sq.data(), 4, 2, mean.data(), var.data());
  CHECK(mean == Vec{2.5, 2});
  CHECK(var == Vec{1.25, 12});
  // E[x^2] - mean^2 below 0 (rounding on a near-constant channel) is clamped to 0.
  ref::combine_statistics(Vec{3}.data(), Vec{2.9}.data(), 3, 1, mean.data(), var.data());
  CHECK(mean[0] == 1);
  CHECK(var[0] == 0);
  ref::combine_statistics(Vec{0}.data(), Vec{0}.data(), 0, 1, mean.data(), var.data());
  CHECK(mean[0] == 0);
  CHECK(var[0] == 0);
}

TEST_CASE("combine_statistics of per-shard sums equals the statistics of the whole batch") {
  // Synchronized batch norm: shards of unequal sizes, one of them empty, sums added as an
  // all-reduce would.
  Rng rng(11, RngStream::test);
  const std::int64_t c = 3;
  for (const std::vector<std::int64_t>& rows : {std::vector<std::int64_t>{6, 7}, std::vector<std::int64_t>{4, 0, 9},
                                                std::vector<std::int64_t>{1, 1, 1, 2}}) {
    std::int64_t m = 0;
    for (auto r : rows) m += r;
    CAPTURE(m);
    const BnCase b{"", m, c, true, true, 1e-3};
    const Vec x = bn_input(b, rng);
    Vec sum(3, 0.0), sum_sq(3, 0.0), part(3), part_sq(3);
    std::int64_t first = 0;
    for (auto r : rows) {
      ref::batch_norm_sums(x.data() + first * c, r, c, part.data(), part_sq.data());
      for (std::size_t ch = 0; ch < 3; ++ch) {
        sum[ch] += part[ch];
        sum_sq[ch] += part_sq[ch];
      }
      first += r;
    }
    Vec mean(3), var(3), want_mean(3), want_var(3);
    ref::combine_statistics(sum.data(), sum_sq.data(), m, c, mean.data(), var.data());
    ref::batch_norm_statistics(x.data(), m, c, want_mean.data(), want_var.data());
    CHECK(rel_err(mean, want_mean) < 1e-12);
    CHECK(rel_err(var, want_var) < 1e-12);
  }
}

TEST_CASE("moving_average_update: moving * momentum + batch * (1 - momentum)") {
  Vec moving{1, 2};
  ref::moving_average_update(moving.data(), Vec{3, -2}.data(), 2, 0.75);
  CHECK(moving == Vec{1.5, 1});
  ref::moving_average_update(moving.data(), Vec{101.5, 1}.data(), 2, 0.99);  // Keras' default momentum
  CHECK(moving[0] == doctest::Approx(2.5).epsilon(1e-14));
  CHECK(moving[1] == 1);
  // In float, 1 - momentum is taken in double first, as Keras' Python float is.
  std::vector<float> mf{0.0f};
  ref::moving_average_update(mf.data(), std::vector<float>{1.0f}.data(), 1, 0.99);
  CHECK(mf[0] == static_cast<float>(1.0 - 0.99));
}

// ---------------------------------------------------------------------------------------------
// Dropout

TEST_CASE("dropout: hand-computed forward and backward; rate 0 is the identity") {
  const Vec x{1, -2, 3, 4};
  const std::vector<std::uint8_t> mask{1, 0, 1, 1};
  Vec y(4, -7.0), dx(4, -7.0);
  ref::dropout_forward(x.data(), mask.data(), y.data(), 4, 0.5);
  CHECK(y == Vec{2, 0, 6, 8});
  ref::dropout_backward(Vec{0.5, 9, -1, 2}.data(), mask.data(), dx.data(), 4, 0.5);
  CHECK(dx == Vec{1, 0, -2, 4});
  ref::dropout_forward(x.data(), mask.data(), y.data(), 4, 0.0);
  CHECK(y == x);
  ref::dropout_backward(x.data(), mask.data(), dx.data(), 4, 0.0);
  CHECK(dx == x);

  // Any mask type with 0/1 entries; float scale 1 / (1 - 0.2) = 1.25 exactly.
  const std::vector<float> xf{1, -2, 3, 4};
  std::vector<float> a(4), b(4), c(4);
  ref::dropout_forward(xf.data(), mask.data(), a.data(), 4, 0.2);
  const bool mask_b[] = {true, false, true, true};
  ref::dropout_forward(xf.data(), mask_b, b.data(), 4, 0.2);
  ref::dropout_forward(xf.data(), std::vector<float>{1, 0, 1, 1}.data(), c.data(), 4, 0.2);
  CHECK(a == std::vector<float>{1.25f, 0, 3.75f, 5});
  CHECK(b == a);
  CHECK(c == a);
}

TEST_CASE("dropout_backward against finite differences") {
  Rng rng(12, RngStream::test);
  for (double rate : {0.0, 0.3, 0.75}) {
    CAPTURE(rate);
    const std::size_t size = 2 * 3 * 5 * 2;
    Vec x = random_vec(size, rng);
    const Vec r = random_vec(size, rng);
    std::vector<std::uint8_t> mask(size);
    for (auto& k : mask) k = rng.uniform() >= rate ? 1 : 0;
    auto loss = [&] {
      Vec y(size);
      ref::dropout_forward(x.data(), mask.data(), y.data(), static_cast<std::int64_t>(size), rate);
      return dot(y, r);
    };
    Vec dx(size);
    ref::dropout_backward(r.data(), mask.data(), dx.data(), static_cast<std::int64_t>(size), rate);
    fd_check(x, dx, loss, "dx");
  }
}
