// The geometry of a Conv2D on cuDNN, and the index arithmetic of the CUDA conv core's copy
// kernels, written once for the host and the device: nvcc compiles these functions into the
// kernels (conv2d_core.cu), g++ into the unit tests (tests/unit/test_cuda_conv_geometry.cpp),
// which check on every CPU build that the padding scheme and the filter transposition give the
// reference convolution's results. No CUDA header is needed here.
//
// Layouts (Keras): x (N, H, W, C), kernel (KH, KW, C, F) "HWIO", y (N, OH, OW, F).
//
// Padding: TensorFlow's SAME pads `before` rows on top and `after` = before or before + 1 at the
// bottom (the odd one at the end), and likewise for columns; cuDNN pads symmetrically. The core
// gives cuDNN the symmetric padding `before` and, where an axis has after > before, copies the
// input into a scratch buffer with (after - before) zero rows (columns) appended: cuDNN then sees
// H + after - before rows padded by `before` on each side, i.e. `before` on top and `after` at the
// bottom, and output row o reads padded-input rows from o * s - before, as TensorFlow's. The
// gradient of that padded input is cropped back to (H, W).
//
// Filter: cuDNN's filter layouts are KCRS (NCHW) and KRSC (NHWC); Keras' HWIO is RSCK, which
// cuDNN does not take, so the core transposes the kernel into KRSC = (F, KH, KW, C) ("OHWI") and
// the filter gradient back.
#pragma once

#include <cstdint>
#include <string>

#include "backends/cuda/launch.hpp"
#include "config/experiment.hpp"
#include "core/error.hpp"
#include "nn/padding.hpp"

namespace dtrain::backends::cuda {

struct Conv2dGeometry {
  std::int64_t n = 0, h = 0, w = 0, c = 0;  // input
  std::int64_t f = 0, kh = 0, kw = 0;       // filters, kernel size
  std::int64_t sh = 1, sw = 1;              // strides
  nn::Padding1D pad_h, pad_w;               // TensorFlow's output sizes and paddings
  // What cuDNN is given: symmetric padding, and the input's size after the zero rows and columns
  // appended at the end (padded_h = h + pad_h.after - pad_h.before).
  std::int64_t cudnn_pad_h = 0, cudnn_pad_w = 0;
  std::int64_t padded_h = 0, padded_w = 0;

  std::int64_t oh() const { return pad_h.out; }
  std::int64_t ow() const { return pad_w.out; }
  // Whether the input goes through the scratch buffer (an axis with asymmetric padding).
  bool pads_input() const { return padded_h != h || padded_w != w; }
  std::int64_t x_elements() const { return n * h * w * c; }
  std::int64_t padded_x_elements() const { return n * padded_h * padded_w * c; }
  std::int64_t y_elements() const { return n * oh() * ow() * f; }
  std::int64_t kernel_elements() const { return kh * kw * c * f; }
};

// The output size cuDNN computes for one axis (cudnnGetConvolution2dForwardOutputDim, dilation 1).
inline std::int64_t cudnn_output_size(std::int64_t in, std::int64_t k, std::int64_t stride, std::int64_t pad) {
  return (in + 2 * pad - k) / stride + 1;
}

// The geometry of one shape; InternalError where a size is not positive or the shape has no
// output (valid padding with a kernel larger than the input).
inline Conv2dGeometry conv2d_geometry(std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c,
                                      std::int64_t f, std::int64_t kh, std::int64_t kw, std::int64_t sh,
                                      std::int64_t sw, config::Padding padding) {
  // std::to_string, not fmt: nvcc compiles this header too, and fmt's compile-time format
  // strings are no constant expressions there.
  using std::to_string;
  if (n <= 0 || h <= 0 || w <= 0 || c <= 0 || f <= 0 || kh <= 0 || kw <= 0 || sh <= 0 || sw <= 0)
    throw InternalError("conv2d on CUDA: a size is not positive (batch " + to_string(n) + ", input " + to_string(h) +
                        "x" + to_string(w) + "x" + to_string(c) + ", " + to_string(f) + " filters, kernel " +
                        to_string(kh) + "x" + to_string(kw) + ", strides " + to_string(sh) + "x" + to_string(sw) +
                        ")");
  Conv2dGeometry g;
  g.n = n, g.h = h, g.w = w, g.c = c, g.f = f, g.kh = kh, g.kw = kw, g.sh = sh, g.sw = sw;
  g.pad_h = nn::padding_1d(h, kh, sh, padding);
  g.pad_w = nn::padding_1d(w, kw, sw, padding);
  if (g.pad_h.out <= 0 || g.pad_w.out <= 0)
    throw InternalError("conv2d on CUDA: input " + to_string(h) + "x" + to_string(w) + " with kernel " +
                        to_string(kh) + "x" + to_string(kw) + " and valid padding has no output");
  // TensorFlow's split puts the odd row at the end, never at the start.
  DTRAIN_CHECK(g.pad_h.after >= g.pad_h.before && g.pad_w.after >= g.pad_w.before,
               "conv2d on CUDA: more padding before than after");
  g.cudnn_pad_h = g.pad_h.before;
  g.cudnn_pad_w = g.pad_w.before;
  g.padded_h = h + g.pad_h.after - g.pad_h.before;
  g.padded_w = w + g.pad_w.after - g.pad_w.before;
  return g;
}

// ---- index arithmetic of the copy kernels (flat indices of dense row-major arrays)

// The element of x (N, H, W, C) that the padded input (N, padded_h, padded_w, C) holds at `i`, or
// -1 for an appended zero.
DTRAIN_HD inline std::int64_t unpadded_index(std::int64_t i, std::int64_t h, std::int64_t w, std::int64_t c,
                                             std::int64_t padded_h, std::int64_t padded_w) {
  const std::int64_t ch = i % c;
  std::int64_t t = i / c;
  const std::int64_t x = t % padded_w;
  t /= padded_w;
  const std::int64_t y = t % padded_h;
  const std::int64_t b = t / padded_h;
  if (y >= h || x >= w) return -1;
  return ((b * h + y) * w + x) * c + ch;
}

// Where x's element `i` (N, H, W, C) sits in the padded input (N, padded_h, padded_w, C).
DTRAIN_HD inline std::int64_t padded_index(std::int64_t i, std::int64_t h, std::int64_t w, std::int64_t c,
                                           std::int64_t padded_h, std::int64_t padded_w) {
  const std::int64_t ch = i % c;
  std::int64_t t = i / c;
  const std::int64_t x = t % w;
  t /= w;
  const std::int64_t y = t % h;
  const std::int64_t b = t / h;
  return ((b * padded_h + y) * padded_w + x) * c + ch;
}

// Where the kernel element at `i` of cuDNN's filter (F, KH, KW, C) sits in Keras' (KH, KW, C, F).
DTRAIN_HD inline std::int64_t hwio_index(std::int64_t i, std::int64_t kh, std::int64_t kw, std::int64_t c,
                                         std::int64_t f) {
  const std::int64_t ch = i % c;
  std::int64_t t = i / c;
  const std::int64_t x = t % kw;
  t /= kw;
  const std::int64_t y = t % kh;
  const std::int64_t o = t / kh;
  return ((y * kw + x) * c + ch) * f + o;
}

// ---- the GEMM path of the conv core (conv2d_core.hpp): the columns of x, a row-major (M, R)
// matrix with a row per output position, M = N * OH * OW in (n, oy, ox) order, and a column per
// kernel tap, R = KH * KW * C in (ky, kx, c) order: Keras' HWIO kernel read as a row-major (R, F)
// matrix then gives y (M, F) = columns k, dk (R, F) = columns^T dy in HWIO as it stands, and the
// columns' gradient dy k^T, summed back onto x.

// What the columns' index arithmetic needs of a geometry, passed to the kernels by value.
struct ColumnShape {
  std::int64_t h = 0, w = 0, c = 0, kh = 0, kw = 0, sh = 1, sw = 1;
  std::int64_t top = 0, left = 0;  // TensorFlow's padding before (the odd one is after, implicit)
  std::int64_t oh = 0, ow = 0;
  DTRAIN_HD std::int64_t taps() const { return kh * kw * c; }  // R
};

inline ColumnShape column_shape(const Conv2dGeometry& g) {
  return {g.h, g.w, g.c, g.kh, g.kw, g.sh, g.sw, g.pad_h.before, g.pad_w.before, g.oh(), g.ow()};
}

// The element of x (N, H, W, C) that the columns hold at flat index `i`, or -1 for a zero of the
// padding (before, or after: every row or column past the input).
DTRAIN_HD inline std::int64_t column_source(std::int64_t i, const ColumnShape& s) {
  const std::int64_t r = i % s.taps();
  const std::int64_t m = i / s.taps();
  const std::int64_t ch = r % s.c;
  std::int64_t t = r / s.c;
  const std::int64_t kx = t % s.kw;
  const std::int64_t ky = t / s.kw;
  const std::int64_t ox = m % s.ow;
  t = m / s.ow;
  const std::int64_t oy = t % s.oh;
  const std::int64_t b = t / s.oh;
  const std::int64_t iy = oy * s.sh + ky - s.top, ix = ox * s.sw + kx - s.left;
  if (iy < 0 || iy >= s.h || ix < 0 || ix >= s.w) return -1;
  return ((b * s.h + iy) * s.w + ix) * s.c + ch;
}

// dx's element `i` (N, H, W, C): the sum of the columns' gradients (M, R) at every place that
// holds it, in (ky, kx) order: a fixed order, so the same bits every run.
template <class T>
DTRAIN_HD inline T column_gradient_sum(std::int64_t i, const T* dcolumns, const ColumnShape& s) {
  const std::int64_t ch = i % s.c;
  std::int64_t t = i / s.c;
  const std::int64_t ix = t % s.w;
  t /= s.w;
  const std::int64_t iy = t % s.h;
  const std::int64_t b = t / s.h;
  T sum = 0;
  for (std::int64_t ky = 0; ky < s.kh; ++ky) {
    const std::int64_t y = iy + s.top - ky;  // oy * sh
    if (y < 0 || y % s.sh != 0 || y / s.sh >= s.oh) continue;
    for (std::int64_t kx = 0; kx < s.kw; ++kx) {
      const std::int64_t x = ix + s.left - kx;  // ox * sw
      if (x < 0 || x % s.sw != 0 || x / s.sw >= s.ow) continue;
      const std::int64_t m = (b * s.oh + y / s.sh) * s.ow + x / s.sw;
      sum += dcolumns[m * s.taps() + (ky * s.kw + kx) * s.c + ch];
    }
  }
  return sum;
}

// The GEMM path's bias gradient over one slice of the batch: column `f` of dy (rows, cols) summed
// over rows [begin, end) in row order (the slices' sums are then added in slice order).
template <class T>
DTRAIN_HD inline T column_sum(const T* dy, std::int64_t begin, std::int64_t end, std::int64_t cols, std::int64_t f) {
  T sum = 0;
  for (std::int64_t m = begin; m < end; ++m) sum += dy[m * cols + f];
  return sum;
}

}  // namespace dtrain::backends::cuda
