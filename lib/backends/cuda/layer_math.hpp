// The per-element and per-window arithmetic of the CUDA layer cores (pooling_core.cu,
// activation_core.cu, dropout_core.cu, batch_norm_core.cu), written once for the host and the
// device like math.hpp: nvcc compiles these functions into the kernels, g++ into the unit test
// tests/unit/test_cuda_layer_math.cpp, which checks them on every CPU build against the reference
// oracle (nn/reference/) and the CPU backend where it computes the same formula:
//   dropout       the counter-based generator (core/rng.cpp's Philox4x32-10 keyed by seed, stream,
//                 global step, sample id and layer) and the keep decision of nn::dropout_mask:
//                 the same mask bits as the CPU for the same key
//   pooling       a window's real input positions (TensorFlow's padding, as PoolDims carries it:
//                 nn/padding.hpp's split), the max with the reference's tie rule, the average's
//                 divisor without the padding (reference::average_pool_count)
//   activations   linear, relu, sigmoid, tanh, softmax and their derivatives from the output, as
//                 the reference's formulas
//   batch norm    the CPU backend's per-channel inverse standard deviation, scale and shift, its
//                 y = x * scale + shift and its backward's formula; the moving-average update
//
// Every multiply whose product is added goes through mul()/add() so that the device never fuses
// it into a multiply-add (the CPU is compiled with -ffp-contract=off): with IEEE division and
// square root the device then gives the host's bits whatever -fmad the file is compiled with.
// Only expf and tanhf differ (CUDA's from glibc's, by an ulp or so).
//
// No CUDA header is needed here: this header is plain C++ for g++.
#pragma once

#include <cmath>
#include <cstdint>

#include "backends/cuda/launch.hpp"
#include "config/experiment.hpp"
#include "nn/reference/layers.hpp"

namespace dtrain::backends::cuda::layer_math {

// ---- rounding exactly as written (no contraction into fused multiply-adds on the device)
DTRAIN_HD inline float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
DTRAIN_HD inline float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DTRAIN_HD inline float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
DTRAIN_HD inline double mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
DTRAIN_HD inline double add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
DTRAIN_HD inline float exp_f(float x) {
#if defined(__CUDA_ARCH__)
  return ::expf(x);
#else
  return std::exp(x);
#endif
}
DTRAIN_HD inline float tanh_f(float x) {
#if defined(__CUDA_ARCH__)
  return ::tanhf(x);
#else
  return std::tanh(x);
#endif
}
DTRAIN_HD inline double sqrt_d(double x) {
#if defined(__CUDA_ARCH__)
  return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

// ---- dropout: core/rng.cpp's Philox4x32-10 and sample_bits(), nn/dropout.cpp's keep decision.
struct Bits4 {
  std::uint32_t v[4];
};

DTRAIN_HD inline Bits4 philox4x32_10(Bits4 c, std::uint32_t k0, std::uint32_t k1) {
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t{kMul0} * c.v[0];
    const std::uint64_t p1 = std::uint64_t{kMul1} * c.v[2];
    const auto hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const auto hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    c = Bits4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return c;
}

// The stream id of dropout masks (RngStream::dropout in core/rng.hpp; the unit test checks the
// value).
inline constexpr std::uint32_t kDropoutStream = 5;

// Block `block` (four 32-bit words) of the stream keyed by (seed, stream, step, sample, layer):
// sample_bits() of core/rng.cpp.
DTRAIN_HD inline Bits4 sample_bits(std::uint64_t seed, std::uint32_t stream, std::uint64_t step, std::uint64_t sample,
                                    std::uint32_t layer, std::uint32_t block) {
  const Bits4 counter{{block, (stream << 24) | (layer & 0xFFFFFFu), static_cast<std::uint32_t>(sample),
                       static_cast<std::uint32_t>(step)}};
  return philox4x32_10(counter, static_cast<std::uint32_t>(seed) ^ static_cast<std::uint32_t>(sample >> 32),
                       static_cast<std::uint32_t>(seed >> 32) ^ static_cast<std::uint32_t>(step >> 32));
}

// An element is dropped when its 32 bits fall below this: P(keep) = 1 - threshold / 2^32.
DTRAIN_HD inline std::uint32_t dropout_threshold(double rate) {
  const double t = rate * 4294967296.0;
  return static_cast<std::uint32_t>(t < 4294967295.0 ? t : 4294967295.0);
}
// 1 / (1 - rate) in double, then rounded, as tf.nn.dropout and the CPU backend take it.
DTRAIN_HD inline float dropout_scale(double rate) { return static_cast<float>(1.0 / (1.0 - rate)); }

// The keep decisions of elements 4 * block .. 4 * block + 3 of one sample's mask.
DTRAIN_HD inline Bits4 dropout_keep_block(std::uint64_t seed, std::int64_t global_step, std::int64_t sample_id,
                                           std::uint32_t layer, std::uint32_t threshold, std::uint32_t block) {
  Bits4 b = sample_bits(seed, kDropoutStream, static_cast<std::uint64_t>(global_step),
                        static_cast<std::uint64_t>(sample_id), layer, block);
  for (int k = 0; k < 4; ++k) b.v[k] = b.v[k] >= threshold ? 1u : 0u;
  return b;
}
// Element e of one sample's mask: 1 keeps, 0 drops.
DTRAIN_HD inline std::uint8_t dropout_keep(std::uint64_t seed, std::int64_t global_step, std::int64_t sample_id,
                                            std::uint32_t layer, std::uint32_t threshold, std::int64_t e) {
  const Bits4 b = dropout_keep_block(seed, global_step, sample_id, layer, threshold, static_cast<std::uint32_t>(e / 4));
  return static_cast<std::uint8_t>(b.v[e % 4]);
}
// y = x * scale * keep (x * mask / (1 - rate)); the same for dx from dy.
DTRAIN_HD inline float dropout_apply(float x, float scale, std::uint8_t keep) {
  return mul(mul(x, scale), static_cast<float>(keep));
}

// ---- pooling windows (NHWC). PoolDims holds the output size and the padding before (nn/padding.hpp:
// 'same' puts the odd padding after); padding positions are never part of a window.
using nn::reference::PoolDims;

// The real input rows [y0, y1) and columns [x0, x1) of output (oy, ox)'s window.
struct Window {
  std::int64_t y0, y1, x0, x1;
};
DTRAIN_HD inline Window pool_window(const PoolDims& d, std::int64_t oy, std::int64_t ox) {
  const std::int64_t ys = oy * d.sh - d.pad_top, xs = ox * d.sw - d.pad_left;
  Window w;
  w.y0 = ys > 0 ? ys : 0;
  w.y1 = ys + d.ph < d.h ? ys + d.ph : d.h;
  w.x0 = xs > 0 ? xs : 0;
  w.x1 = xs + d.pw < d.w ? xs + d.pw : d.w;
  return w;
}
// How many real input positions the window holds: average pooling's divisor (never 0 with
// TensorFlow's padding).
DTRAIN_HD inline std::int64_t pool_count(const Window& w) {
  const std::int64_t rows = w.y1 - w.y0, cols = w.x1 - w.x0;
  return (rows > 0 ? rows : 0) * (cols > 0 ? cols : 0);
}

// The outputs whose windows hold input row iy (or column): [o0, o1) along one axis of input size
// `in`, window k, stride s, padding before p, outputs `out`.
struct Range {
  std::int64_t o0, o1;
};
DTRAIN_HD inline Range windows_holding(std::int64_t i, std::int64_t k, std::int64_t s, std::int64_t p,
                                        std::int64_t out) {
  // o * s - p <= i < o * s - p + k  <=>  (i + p - k) / s < o <= (i + p) / s
  const std::int64_t hi = (i + p) / s;  // i + p >= 0
  const std::int64_t lo_num = i + p - k + 1;
  const std::int64_t lo = lo_num <= 0 ? 0 : (lo_num + s - 1) / s;
  Range r;
  r.o0 = lo;
  r.o1 = hi + 1 < out ? hi + 1 : out;
  return r;
}

// Index (n, y, x, c) of an NHWC tensor of h x w x c planes.
DTRAIN_HD inline std::int64_t nhwc(std::int64_t n, std::int64_t y, std::int64_t x, std::int64_t c, std::int64_t h,
                                    std::int64_t w, std::int64_t channels) {
  return ((n * h + y) * w + x) * channels + c;
}

// The window's maximum and where it is (its position py * pw + px in the ph x pw window):
// rows first, then columns, strictly greater, so the first maximum wins (reference::pool_argmax).
struct MaxAt {
  float value;
  std::int32_t position;
};
DTRAIN_HD inline MaxAt max_pool_window(const float* x, const PoolDims& d, std::int64_t n, std::int64_t oy,
                                        std::int64_t ox, std::int64_t c) {
  const Window w = pool_window(d, oy, ox);
  const std::int64_t ys = oy * d.sh - d.pad_top, xs = ox * d.sw - d.pad_left;
  MaxAt best{x[nhwc(n, w.y0, w.x0, c, d.h, d.w, d.c)], static_cast<std::int32_t>((w.y0 - ys) * d.pw + (w.x0 - xs))};
  for (std::int64_t iy = w.y0; iy < w.y1; ++iy)
    for (std::int64_t ix = w.x0; ix < w.x1; ++ix) {
      const float v = x[nhwc(n, iy, ix, c, d.h, d.w, d.c)];
      if (v > best.value) best = MaxAt{v, static_cast<std::int32_t>((iy - ys) * d.pw + (ix - xs))};
    }
  return best;
}

// The average over the window's real positions: summed rows first, then columns, from 0, divided
// by the count (reference::average_pool2d_forward).
DTRAIN_HD inline float average_pool_window(const float* x, const PoolDims& d, std::int64_t n, std::int64_t oy,
                                            std::int64_t ox, std::int64_t c) {
  const Window w = pool_window(d, oy, ox);
  float acc = 0.0f;
  for (std::int64_t iy = w.y0; iy < w.y1; ++iy)
    for (std::int64_t ix = w.x0; ix < w.x1; ++ix) acc = add(acc, x[nhwc(n, iy, ix, c, d.h, d.w, d.c)]);
  return acc / static_cast<float>(pool_count(w));
}

// Gradient of one input element (n, iy, ix, c) of max pooling: the sum, over the windows holding
// it in output order, of dy where that window's maximum was this element (argmax: positions from
// forward). Added from 0 in the order reference::max_pool2d_backward adds them.
DTRAIN_HD inline float max_pool_input_gradient(const float* dy, const std::int32_t* argmax, const PoolDims& d,
                                                std::int64_t n, std::int64_t iy, std::int64_t ix, std::int64_t c) {
  const Range ry = windows_holding(iy, d.ph, d.sh, d.pad_top, d.oh);
  const Range rx = windows_holding(ix, d.pw, d.sw, d.pad_left, d.ow);
  float acc = 0.0f;
  for (std::int64_t oy = ry.o0; oy < ry.o1; ++oy)
    for (std::int64_t ox = rx.o0; ox < rx.o1; ++ox) {
      const std::int64_t o = nhwc(n, oy, ox, c, d.oh, d.ow, d.c);
      const std::int64_t position = (iy - (oy * d.sh - d.pad_top)) * d.pw + (ix - (ox * d.sw - d.pad_left));
      if (argmax[o] == position) acc = add(acc, dy[o]);
    }
  return acc;
}

// Gradient of one input element of average pooling: the sum, over the windows holding it in
// output order, of dy / count (reference::average_pool2d_backward's order).
DTRAIN_HD inline float average_pool_input_gradient(const float* dy, const PoolDims& d, std::int64_t n, std::int64_t iy,
                                                    std::int64_t ix, std::int64_t c) {
  const Range ry = windows_holding(iy, d.ph, d.sh, d.pad_top, d.oh);
  const Range rx = windows_holding(ix, d.pw, d.sw, d.pad_left, d.ow);
  float acc = 0.0f;
  for (std::int64_t oy = ry.o0; oy < ry.o1; ++oy)
    for (std::int64_t ox = rx.o0; ox < rx.o1; ++ox) {
      const float count = static_cast<float>(pool_count(pool_window(d, oy, ox)));
      acc = add(acc, dy[nhwc(n, oy, ox, c, d.oh, d.ow, d.c)] / count);
    }
  return acc;
}

// Global average pooling of channel c of sample n over h * w positions, in position order.
DTRAIN_HD inline float global_average_pool(const float* x, std::int64_t n, std::int64_t positions, std::int64_t c,
                                            std::int64_t channels) {
  float acc = 0.0f;
  for (std::int64_t p = 0; p < positions; ++p) acc = add(acc, x[(n * positions + p) * channels + c]);
  return acc / static_cast<float>(positions);
}

// ---- activations (config::Activation): forward z -> f(z), backward dz = dy * f'(z) from y = f(z)
using config::Activation;

// Every activation but softmax, which works on rows (softmax_row).
DTRAIN_HD inline float activation_element(Activation a, float z) {
  switch (a) {
    case Activation::relu: return z > 0.0f ? z : 0.0f;
    case Activation::sigmoid: return 1.0f / add(1.0f, exp_f(-z));
    case Activation::tanh: return tanh_f(z);
    default: return z;  // linear
  }
}
DTRAIN_HD inline float activation_gradient_element(Activation a, float y, float dy) {
  switch (a) {
    case Activation::relu: return y > 0.0f ? dy : 0.0f;
    case Activation::sigmoid: return mul(mul(dy, y), sub(1.0f, y));
    case Activation::tanh: return mul(dy, sub(1.0f, mul(y, y)));
    default: return dy;  // linear
  }
}
// In place over one row of `cols` values: exp(z - max) / sum.
DTRAIN_HD inline void softmax_row(float* row, std::int64_t cols) {
  float m = row[0];
  for (std::int64_t j = 1; j < cols; ++j)
    if (m < row[j]) m = row[j];  // std::max_element: the first largest
  float sum = 0.0f;
  for (std::int64_t j = 0; j < cols; ++j) {
    row[j] = exp_f(row[j] - m);
    sum = add(sum, row[j]);
  }
  for (std::int64_t j = 0; j < cols; ++j) row[j] /= sum;
}
// dz = y * (dy - sum(y * dy)) over one row.
DTRAIN_HD inline void softmax_gradient_row(const float* y, const float* dy, float* dz, std::int64_t cols) {
  float dot = 0.0f;
  for (std::int64_t j = 0; j < cols; ++j) dot = add(dot, mul(y[j], dy[j]));
  for (std::int64_t j = 0; j < cols; ++j) dz[j] = mul(y[j], sub(dy[j], dot));
}

// ---- batch normalization, per channel (the CPU backend's batch_normalization.cpp)
// 1 / sqrt(variance + epsilon) in double, rounded to float (variance: the batch's in double, or
// the moving variance widened).
DTRAIN_HD inline float batch_norm_inv_std(double variance, double epsilon) {
  return static_cast<float>(1.0 / sqrt_d(variance + epsilon));
}
// y = (x - mean) * inv_std * gamma + beta = x * scale + shift.
DTRAIN_HD inline float batch_norm_scale(float inv_std, float gamma) { return mul(inv_std, gamma); }
DTRAIN_HD inline float batch_norm_shift(float beta, float mean, float scale) { return sub(beta, mul(mean, scale)); }
DTRAIN_HD inline float batch_norm_apply(float x, float scale, float shift) { return add(mul(x, scale), shift); }
// The terms backward sums per channel, in double: dy and dy * xhat.
DTRAIN_HD inline double batch_norm_dy_xhat(float x, float dy, float mean, float inv_std) {
  return mul(mul(static_cast<double>(dy), static_cast<double>(x) - static_cast<double>(mean)),
             static_cast<double>(inv_std));
}
// Training: dx = scale * (dy - mean(dy) - xhat * mean(dy xhat)), scale = gamma * inv_std,
// xhat = (x - mean) * inv_std.
DTRAIN_HD inline float batch_norm_input_gradient(float x, float dy, float mean, float inv_std, float scale,
                                                  float mean_dy, float mean_dy_xhat) {
  const float xhat = mul(sub(x, mean), inv_std);
  return mul(scale, sub(sub(dy, mean_dy), mul(xhat, mean_dy_xhat)));
}
// moving = moving * momentum + statistic * (1 - momentum): the CPU numerics' axpby(take, statistic,
// keep, moving) (math::axpby_element's order), which BatchNormalization::apply_updates calls.
DTRAIN_HD inline float moving_average(float moving, float statistic, float keep, float take) {
  return add(mul(moving, keep), mul(statistic, take));
}

}  // namespace dtrain::backends::cuda::layer_math
