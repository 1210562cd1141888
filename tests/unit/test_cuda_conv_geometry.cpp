// The CUDA conv core's host arithmetic (backends/cuda/conv2d_geometry.hpp), compiled here by g++:
// the geometry handed to cuDNN (symmetric padding plus zero rows and columns appended to the
// input) and the index arithmetic of its padding, crop and filter-transposition kernels. The
// convolution cuDNN computes is emulated with the reference oracle, so that on every CPU build the
// scheme is shown to give TensorFlow's SAME and VALID results, exactly; only the launches wait for
// a GPU (tests/gpu/test_gpu_conv_dense.cpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <iterator>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "backends/cuda/conv2d_geometry.hpp"
#include "core/error.hpp"
#include "nn/reference/layers.hpp"

using namespace dtrain;
namespace cuda = dtrain::backends::cuda;
using config::Padding;
using nn::reference::ConvDims;

namespace {

std::vector<double> random_values(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> d(-1.0, 1.0);
  std::vector<double> v(n);
  for (double& x : v) x = d(rng);
  return v;
}

// Convolutions over odd and even sizes, strides, kernel shapes and both paddings.
struct GeometryCase {
  std::int64_t n, h, w, c, f, kh, kw, sh, sw;
  Padding padding;
};
constexpr GeometryCase kGeometries[] = {
    {1, 7, 9, 3, 4, 3, 3, 1, 1, Padding::valid}, {2, 7, 9, 3, 4, 3, 3, 1, 1, Padding::same},
    {2, 7, 9, 3, 4, 4, 4, 1, 1, Padding::same},  {2, 8, 9, 3, 4, 3, 3, 2, 2, Padding::same},
    {2, 7, 9, 2, 3, 4, 3, 2, 1, Padding::same},  {1, 7, 9, 2, 3, 4, 4, 2, 2, Padding::valid},
    {1, 6, 6, 2, 2, 1, 1, 2, 2, Padding::same},  {1, 5, 4, 2, 3, 2, 5, 3, 1, Padding::same},
};

std::string describe(const GeometryCase& t) {
  return "n " + std::to_string(t.n) + " h " + std::to_string(t.h) + " w " + std::to_string(t.w) + " c " +
         std::to_string(t.c) + " f " + std::to_string(t.f) + " kernel " + std::to_string(t.kh) + "x" +
         std::to_string(t.kw) + " strides " + std::to_string(t.sh) + "x" + std::to_string(t.sw) +
         (t.padding == Padding::same ? " same" : " valid");
}

// A case's geometry and random x, kernel and dy, each from its own seed (`seed` moves on by 3).
struct CaseData {
  cuda::Conv2dGeometry g;
  std::vector<double> x, k, dy;
};
CaseData case_data(const GeometryCase& t, std::uint32_t& seed) {
  CaseData d{cuda::conv2d_geometry(t.n, t.h, t.w, t.c, t.f, t.kh, t.kw, t.sh, t.sw, t.padding), {}, {}, {}};
  d.x = random_values(static_cast<std::size_t>(d.g.x_elements()), seed++);
  d.k = random_values(static_cast<std::size_t>(d.g.kernel_elements()), seed++);
  d.dy = random_values(static_cast<std::size_t>(d.g.y_elements()), seed++);
  return d;
}

// check(g, x, kernel, dy) on each case with its random data (seeds from `seed` on), the case
// named in any failure.
template <class Check>
void for_each_case(std::span<const GeometryCase> cases, std::uint32_t seed, const Check& check) {
  for (const GeometryCase& t : cases) {
    const CaseData d = case_data(t, seed);
    INFO("geometry ", describe(t));
    check(d.g, d.x, d.k, d.dy);
  }
}

// Keras' convolution: TensorFlow's padding, on the unpadded input.
ConvDims keras_dims(const cuda::Conv2dGeometry& g) {
  return {g.n, g.h, g.w, g.c, g.f, g.kh, g.kw, g.sh, g.sw, g.oh(), g.ow(), g.pad_h.before, g.pad_w.before};
}
// What cuDNN is given: the padded input, symmetric padding, cuDNN's output size.
ConvDims cudnn_dims(const cuda::Conv2dGeometry& g) {
  return {g.n,
          g.padded_h,
          g.padded_w,
          g.c,
          g.f,
          g.kh,
          g.kw,
          g.sh,
          g.sw,
          cuda::cudnn_output_size(g.padded_h, g.kh, g.sh, g.cudnn_pad_h),
          cuda::cudnn_output_size(g.padded_w, g.kw, g.sw, g.cudnn_pad_w),
          g.cudnn_pad_h,
          g.cudnn_pad_w};
}

std::vector<double> pad(const cuda::Conv2dGeometry& g, const std::vector<double>& x) {
  std::vector<double> p(static_cast<std::size_t>(g.padded_x_elements()));
  for (std::int64_t i = 0; i < g.padded_x_elements(); ++i) {
    const std::int64_t from = cuda::unpadded_index(i, g.h, g.w, g.c, g.padded_h, g.padded_w);
    p[static_cast<std::size_t>(i)] = from < 0 ? 0.0 : x[static_cast<std::size_t>(from)];
  }
  return p;
}

std::vector<double> crop(const cuda::Conv2dGeometry& g, const std::vector<double>& padded) {
  std::vector<double> x(static_cast<std::size_t>(g.x_elements()));
  for (std::int64_t i = 0; i < g.x_elements(); ++i)
    x[static_cast<std::size_t>(i)] =
        padded[static_cast<std::size_t>(cuda::padded_index(i, g.h, g.w, g.c, g.padded_h, g.padded_w))];
  return x;
}

std::vector<double> to_ohwi(const cuda::Conv2dGeometry& g, const std::vector<double>& hwio) {
  std::vector<double> o(hwio.size());
  for (std::int64_t i = 0; i < g.kernel_elements(); ++i)
    o[static_cast<std::size_t>(i)] = hwio[static_cast<std::size_t>(cuda::hwio_index(i, g.kh, g.kw, g.c, g.f))];
  return o;
}

// A cross-correlation as cuDNN defines it for NHWC data and an NHWC (KRSC) filter
// w[f][ky][kx][c], symmetric padding: the index formulas of its documentation, written out.
std::vector<double> cudnn_like_forward(const cuda::Conv2dGeometry& g, const std::vector<double>& xp,
                                       const std::vector<double>& w_krsc) {
  const ConvDims d = cudnn_dims(g);
  std::vector<double> y(static_cast<std::size_t>(d.n * d.oh * d.ow * d.f));
  for (std::int64_t n = 0; n < d.n; ++n)
    for (std::int64_t oy = 0; oy < d.oh; ++oy)
      for (std::int64_t ox = 0; ox < d.ow; ++ox)
        for (std::int64_t f = 0; f < d.f; ++f) {
          double acc = 0;
          for (std::int64_t ky = 0; ky < d.kh; ++ky)
            for (std::int64_t kx = 0; kx < d.kw; ++kx) {
              const std::int64_t iy = oy * d.sh + ky - d.pad_top, ix = ox * d.sw + kx - d.pad_left;
              if (iy < 0 || iy >= d.h || ix < 0 || ix >= d.w) continue;
              for (std::int64_t c = 0; c < d.c; ++c)
                acc += xp[static_cast<std::size_t>(((n * d.h + iy) * d.w + ix) * d.c + c)] *
                       w_krsc[static_cast<std::size_t>(((f * d.kh + ky) * d.kw + kx) * d.c + c)];
            }
          y[static_cast<std::size_t>(((n * d.oh + oy) * d.ow + ox) * d.f + f)] = acc;
        }
  return y;
}

}  // namespace

TEST_CASE("CUDA conv geometry: symmetric padding plus appended zeros gives TensorFlow's output size and padding") {
  int asymmetric = 0;
  for (std::int64_t in = 1; in <= 13; ++in)
    for (std::int64_t k = 1; k <= 5; ++k)
      for (std::int64_t s = 1; s <= 3; ++s)
        for (Padding mode : {Padding::valid, Padding::same}) {
          if (mode == Padding::valid && in < k) continue;
          CAPTURE(in);
          CAPTURE(k);
          CAPTURE(s);
          CAPTURE(static_cast<int>(mode));
          const cuda::Conv2dGeometry g = cuda::conv2d_geometry(2, in, in + 1, 3, 4, k, k, s, s, mode);
          const nn::Padding1D tf = nn::padding_1d(in, k, s, mode);
          CHECK(g.oh() == tf.out);
          CHECK(g.pad_h.before == tf.before);
          CHECK(g.pad_h.after == tf.after);
          CHECK(g.cudnn_pad_h == tf.before);
          CHECK(g.padded_h == in + tf.after - tf.before);
          // cuDNN's output size on what it is given is Keras' output size.
          CHECK(cuda::cudnn_output_size(g.padded_h, k, s, g.cudnn_pad_h) == tf.out);
          CHECK(cuda::cudnn_output_size(g.padded_w, k, s, g.cudnn_pad_w) == g.ow());
          // Padding on each side as TensorFlow's: before at the top, after at the bottom.
          CHECK(g.padded_h + g.cudnn_pad_h == in + tf.after);
          if (mode == Padding::valid) CHECK_FALSE(g.pads_input());
          if (tf.after != tf.before) ++asymmetric;
        }
  CHECK(asymmetric > 0);

  // The cases the GPU tests run, by hand: 7x9 with a 4x4 kernel, SAME: 3 rows and columns of
  // padding, 1 before and 2 after; cuDNN gets padding 1 and an 8x10 input.
  const cuda::Conv2dGeometry g = cuda::conv2d_geometry(5, 7, 9, 3, 4, 4, 4, 1, 1, Padding::same);
  CHECK(g.oh() == 7);
  CHECK(g.ow() == 9);
  CHECK(g.pad_h.before == 1);
  CHECK(g.pad_h.after == 2);
  CHECK(g.cudnn_pad_h == 1);
  CHECK(g.padded_h == 8);
  CHECK(g.padded_w == 10);
  CHECK(g.pads_input());
  // 8 rows, kernel 3, stride 2, SAME: output 4, one row of padding, after.
  const cuda::Conv2dGeometry s2 = cuda::conv2d_geometry(1, 8, 9, 1, 1, 3, 3, 2, 2, Padding::same);
  CHECK(s2.oh() == 4);
  CHECK(s2.pad_h.before == 0);
  CHECK(s2.pad_h.after == 1);
  CHECK(s2.padded_h == 9);
  CHECK(s2.ow() == 5);
  CHECK(s2.padded_w == 9);  // 9 columns: 1 before, 1 after, symmetric
  // A 1x1 kernel with stride 2 needs no padding at all (TensorFlow's total is clamped at 0).
  const cuda::Conv2dGeometry one = cuda::conv2d_geometry(1, 6, 6, 1, 1, 1, 1, 2, 2, Padding::same);
  CHECK(one.oh() == 3);
  CHECK_FALSE(one.pads_input());

  CHECK_THROWS_AS(cuda::conv2d_geometry(1, 2, 2, 1, 1, 3, 3, 1, 1, Padding::valid), InternalError);
  CHECK_THROWS_AS(cuda::conv2d_geometry(0, 7, 7, 1, 1, 3, 3, 1, 1, Padding::same), InternalError);
}

TEST_CASE("CUDA conv geometry: the filter transposition HWIO -> cuDNN's KRSC is a permutation that keeps each weight") {
  const cuda::Conv2dGeometry g = cuda::conv2d_geometry(1, 7, 9, 3, 5, 4, 2, 1, 1, Padding::same);
  std::set<std::int64_t> seen;
  for (std::int64_t i = 0; i < g.kernel_elements(); ++i) seen.insert(cuda::hwio_index(i, g.kh, g.kw, g.c, g.f));
  CHECK(static_cast<std::int64_t>(seen.size()) == g.kernel_elements());
  CHECK(*seen.begin() == 0);
  CHECK(*seen.rbegin() == g.kernel_elements() - 1);
  for (std::int64_t o = 0; o < g.f; ++o)
    for (std::int64_t y = 0; y < g.kh; ++y)
      for (std::int64_t x = 0; x < g.kw; ++x)
        for (std::int64_t c = 0; c < g.c; ++c)
          CHECK(cuda::hwio_index(((o * g.kh + y) * g.kw + x) * g.c + c, g.kh, g.kw, g.c, g.f) ==
                ((y * g.kw + x) * g.c + c) * g.f + o);
}

TEST_CASE("CUDA conv geometry: padding, cuDNN's convolution and the crop give Keras' forward and gradients exactly") {
  for_each_case(kGeometries, 1, [&](const cuda::Conv2dGeometry& g, const std::vector<double>& x,
                                const std::vector<double>& k, const std::vector<double>& dy) {
    const ConvDims keras = keras_dims(g), given = cudnn_dims(g);
    REQUIRE(given.oh == keras.oh);
    REQUIRE(given.ow == keras.ow);

    std::vector<double> y(dy.size()), y_padded(dy.size());
    nn::reference::conv2d_forward(x.data(), k.data(), static_cast<const double*>(nullptr), y.data(), keras);
    const auto xp = pad(g, x);
    nn::reference::conv2d_forward(xp.data(), k.data(), static_cast<const double*>(nullptr), y_padded.data(), given);
    CHECK(y_padded == y);
    // The filter as cuDNN reads it (KRSC) after the transposition gives the same output.
    const auto y_cudnn = cudnn_like_forward(g, xp, to_ohwi(g, k));
    CHECK(y_cudnn == y);

    std::vector<double> dx(x.size()), dk(k.size()), dxp(xp.size()), dkp(k.size());
    nn::reference::conv2d_backward(x.data(), k.data(), dy.data(), dx.data(), dk.data(), static_cast<double*>(nullptr),
                                   keras);
    nn::reference::conv2d_backward(xp.data(), k.data(), dy.data(), dxp.data(), dkp.data(),
                                   static_cast<double*>(nullptr), given);
    CHECK(crop(g, dxp) == dx);
    CHECK(dkp == dk);
    // The filter gradient in cuDNN's layout comes back to HWIO through the inverse scatter.
    const auto dk_krsc = to_ohwi(g, dk);
    std::vector<double> back(dk.size());
    for (std::int64_t i = 0; i < g.kernel_elements(); ++i)
      back[static_cast<std::size_t>(cuda::hwio_index(i, g.kh, g.kw, g.c, g.f))] = dk_krsc[static_cast<std::size_t>(i)];
    CHECK(back == dk);
  });
}

TEST_CASE("CUDA conv geometry: the GEMM path's columns give Keras' forward, kernel gradient and input gradient") {
  // The geometries above, and the seed CNN's first layer: one input channel.
  std::vector<GeometryCase> cases(std::begin(kGeometries), std::end(kGeometries));
  cases.push_back({2, 10, 10, 1, 5, 3, 3, 1, 1, Padding::valid});
  for_each_case(cases, 500, [&](const cuda::Conv2dGeometry& g, const std::vector<double>& x,
                                const std::vector<double>& k, const std::vector<double>& dy) {
    const ConvDims keras = keras_dims(g);
    std::vector<double> y_ref(static_cast<std::size_t>(g.y_elements())), dx_ref(x.size()), dk_ref(k.size()),
        db_ref(static_cast<std::size_t>(g.f));
    nn::reference::conv2d_forward<double>(x.data(), k.data(), nullptr, y_ref.data(), keras);
    nn::reference::conv2d_backward<double>(x.data(), k.data(), dy.data(), dx_ref.data(), dk_ref.data(), db_ref.data(),
                                           keras);

    const cuda::ColumnShape s = cuda::column_shape(g);
    const std::int64_t M = g.n * g.oh() * g.ow(), R = s.taps(), F = g.f;
    std::vector<double> columns(static_cast<std::size_t>(M * R));
    for (std::int64_t i = 0; i < M * R; ++i) {
      const std::int64_t from = cuda::column_source(i, s);
      columns[static_cast<std::size_t>(i)] = from < 0 ? 0.0 : x[static_cast<std::size_t>(from)];
    }
    // y = columns k, dk = columns^T dy, dcolumns = dy k^T: the dense core's three GEMMs, in double.
    std::vector<double> y(static_cast<std::size_t>(M * F), 0.0), dk(k.size(), 0.0), dcolumns(columns.size(), 0.0);
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t r = 0; r < R; ++r)
        for (std::int64_t f = 0; f < F; ++f) {
          const auto mr = static_cast<std::size_t>(m * R + r), rf = static_cast<std::size_t>(r * F + f),
                     mf = static_cast<std::size_t>(m * F + f);
          y[mf] += columns[mr] * k[rf];
          dk[rf] += columns[mr] * dy[mf];
          dcolumns[mr] += dy[mf] * k[rf];
        }
    std::vector<double> dx(x.size());
    for (std::int64_t i = 0; i < g.x_elements(); ++i)
      dx[static_cast<std::size_t>(i)] = cuda::column_gradient_sum(i, dcolumns.data(), s);
    auto close = [](const std::vector<double>& a, const std::vector<double>& b) {
      if (a.size() != b.size()) return false;
      for (std::size_t i = 0; i < a.size(); ++i)
        if (std::abs(a[i] - b[i]) > 1e-12 * (1.0 + std::abs(b[i]))) return false;
      return true;
    };
    CHECK(close(y, y_ref));
    CHECK(close(dk, dk_ref));
    CHECK(close(dx, dx_ref));
    // db: the column sums of dy over each slice of whole samples, the slices added in order.
    for (const std::int64_t slices : {std::int64_t{1}, g.n}) {
      const std::int64_t rows = M / slices;
      std::vector<double> db(static_cast<std::size_t>(F), 0.0);
      for (std::int64_t sl = 0; sl < slices; ++sl)
        for (std::int64_t f = 0; f < F; ++f)
          db[static_cast<std::size_t>(f)] += cuda::column_sum(dy.data(), sl * rows, (sl + 1) * rows, F, f);
      CHECK(close(db, db_ref));
    }
  });
}
