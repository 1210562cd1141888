// Reference layers: plain loops over canonical (channels-last) arrays, no oneDNN, templated on the
// element type so tests can run them in double as the oracle for the oneDNN layers and for
// finite-difference gradient checks. Obviously correct beats fast here.
//
// Shapes (Keras layouts):
//   conv2d   x (N, H, W, C), k (KH, KW, C, F), b (F), y (N, OH, OW, F)
//   pool     x (N, H, W, C), y (N, OH, OW, C)
//   dense    x (N, I), k (I, O), b (O), y (N, O)
//   act      y = f(z) elementwise on any shape; softmax over the last axis of (rows, cols)
// Backward functions OVERWRITE their outputs (dx, dk, db).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "config/experiment.hpp"

namespace dtrain::nn::reference {

struct ConvDims {
  std::int64_t n, h, w, c, f, kh, kw, sh, sw, oh, ow, pad_top, pad_left;
};

template <class T>
void conv2d_forward(const T* x, const T* k, const T* b, T* y, const ConvDims& d) {
  for (std::int64_t n = 0; n < d.n; ++n)
    for (std::int64_t oy = 0; oy < d.oh; ++oy)
      for (std::int64_t ox = 0; ox < d.ow; ++ox)
        for (std::int64_t f = 0; f < d.f; ++f) {
          T acc = b ? b[f] : T(0);
          for (std::int64_t ky = 0; ky < d.kh; ++ky)
            for (std::int64_t kx = 0; kx < d.kw; ++kx) {
              const std::int64_t iy = oy * d.sh + ky - d.pad_top, ix = ox * d.sw + kx - d.pad_left;
              if (iy < 0 || iy >= d.h || ix < 0 || ix >= d.w) continue;
              for (std::int64_t c = 0; c < d.c; ++c)
                acc += x[((n * d.h + iy) * d.w + ix) * d.c + c] * k[((ky * d.kw + kx) * d.c + c) * d.f + f];
            }
          y[((n * d.oh + oy) * d.ow + ox) * d.f + f] = acc;
        }
}

// dy: gradient wrt the pre-activation output. dx may be null.
template <class T>
void conv2d_backward(const T* x, const T* k, const T* dy, T* dx, T* dk, T* db, const ConvDims& d) {
  if (dx) std::fill(dx, dx + d.n * d.h * d.w * d.c, T(0));
  std::fill(dk, dk + d.kh * d.kw * d.c * d.f, T(0));
  if (db) std::fill(db, db + d.f, T(0));
  for (std::int64_t n = 0; n < d.n; ++n)
    for (std::int64_t oy = 0; oy < d.oh; ++oy)
      for (std::int64_t ox = 0; ox < d.ow; ++ox)
        for (std::int64_t f = 0; f < d.f; ++f) {
          const T g = dy[((n * d.oh + oy) * d.ow + ox) * d.f + f];
          if (db) db[f] += g;
          for (std::int64_t ky = 0; ky < d.kh; ++ky)
            for (std::int64_t kx = 0; kx < d.kw; ++kx) {
              const std::int64_t iy = oy * d.sh + ky - d.pad_top, ix = ox * d.sw + kx - d.pad_left;
              if (iy < 0 || iy >= d.h || ix < 0 || ix >= d.w) continue;
              for (std::int64_t c = 0; c < d.c; ++c) {
                const std::int64_t xi = ((n * d.h + iy) * d.w + ix) * d.c + c;
                const std::int64_t ki = ((ky * d.kw + kx) * d.c + c) * d.f + f;
                dk[ki] += g * x[xi];
                if (dx) dx[xi] += g * k[ki];
              }
            }
        }
}

struct PoolDims {
  std::int64_t n, h, w, c, ph, pw, sh, sw, oh, ow, pad_top, pad_left;
};

// Padding never wins: windows only look at real input positions. Ties: the first maximum.
template <class T>
std::int64_t pool_argmax(const T* x, const PoolDims& d, std::int64_t n, std::int64_t oy, std::int64_t ox, std::int64_t c) {
  std::int64_t best = -1;
  for (std::int64_t py = 0; py < d.ph; ++py)
    for (std::int64_t px = 0; px < d.pw; ++px) {
      const std::int64_t iy = oy * d.sh + py - d.pad_top, ix = ox * d.sw + px - d.pad_left;
      if (iy < 0 || iy >= d.h || ix < 0 || ix >= d.w) continue;
      const std::int64_t i = ((n * d.h + iy) * d.w + ix) * d.c + c;
      if (best < 0 || x[i] > x[best]) best = i;
    }
  return best;
}

template <class T>
void max_pool2d_forward(const T* x, T* y, const PoolDims& d) {
  for (std::int64_t n = 0; n < d.n; ++n)
    for (std::int64_t oy = 0; oy < d.oh; ++oy)
      for (std::int64_t ox = 0; ox < d.ow; ++ox)
        for (std::int64_t c = 0; c < d.c; ++c)
          y[((n * d.oh + oy) * d.ow + ox) * d.c + c] = x[pool_argmax(x, d, n, oy, ox, c)];
}

template <class T>
void max_pool2d_backward(const T* x, const T* dy, T* dx, const PoolDims& d) {
  std::fill(dx, dx + d.n * d.h * d.w * d.c, T(0));
  for (std::int64_t n = 0; n < d.n; ++n)
    for (std::int64_t oy = 0; oy < d.oh; ++oy)
      for (std::int64_t ox = 0; ox < d.ow; ++ox)
        for (std::int64_t c = 0; c < d.c; ++c)
          dx[pool_argmax(x, d, n, oy, ox, c)] += dy[((n * d.oh + oy) * d.ow + ox) * d.c + c];
}

template <class T>
void dense_forward(const T* x, const T* k, const T* b, T* y, std::int64_t n, std::int64_t in, std::int64_t out) {
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t o = 0; o < out; ++o) {
      T acc = b ? b[o] : T(0);
      for (std::int64_t i = 0; i < in; ++i) acc += x[r * in + i] * k[i * out + o];
      y[r * out + o] = acc;
    }
}

template <class T>
void dense_backward(const T* x, const T* k, const T* dy, T* dx, T* dk, T* db, std::int64_t n, std::int64_t in,
                    std::int64_t out) {
  for (std::int64_t i = 0; i < in; ++i)
    for (std::int64_t o = 0; o < out; ++o) {
      T acc = 0;
      for (std::int64_t r = 0; r < n; ++r) acc += x[r * in + i] * dy[r * out + o];
      dk[i * out + o] = acc;
    }
  if (db)
    for (std::int64_t o = 0; o < out; ++o) {
      T acc = 0;
      for (std::int64_t r = 0; r < n; ++r) acc += dy[r * out + o];
      db[o] = acc;
    }
  if (dx)
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t i = 0; i < in; ++i) {
        T acc = 0;
        for (std::int64_t o = 0; o < out; ++o) acc += dy[r * out + o] * k[i * out + o];
        dx[r * in + i] = acc;
      }
}

// In place: z -> f(z). softmax treats the data as (size / cols, cols) rows.
template <class T>
void activation_forward(config::Activation a, T* z, std::int64_t size, std::int64_t cols) {
  switch (a) {
    case config::Activation::linear: return;
    case config::Activation::relu:
      for (std::int64_t i = 0; i < size; ++i) z[i] = z[i] > T(0) ? z[i] : T(0);
      return;
    case config::Activation::sigmoid:
      for (std::int64_t i = 0; i < size; ++i) z[i] = T(1) / (T(1) + std::exp(-z[i]));
      return;
    case config::Activation::tanh:
      for (std::int64_t i = 0; i < size; ++i) z[i] = std::tanh(z[i]);
      return;
    case config::Activation::softmax:
      for (std::int64_t r = 0; r < size / cols; ++r) {
        T* row = z + r * cols;
        const T m = *std::max_element(row, row + cols);
        T sum = 0;
        for (std::int64_t j = 0; j < cols; ++j) sum += (row[j] = std::exp(row[j] - m));
        for (std::int64_t j = 0; j < cols; ++j) row[j] /= sum;
      }
      return;
  }
}

// dz = dy * f'(z), written from the output y = f(z).
template <class T>
void activation_backward(config::Activation a, const T* y, const T* dy, T* dz, std::int64_t size, std::int64_t cols) {
  switch (a) {
    case config::Activation::linear:
      std::copy(dy, dy + size, dz);
      return;
    case config::Activation::relu:
      for (std::int64_t i = 0; i < size; ++i) dz[i] = y[i] > T(0) ? dy[i] : T(0);
      return;
    case config::Activation::sigmoid:
      for (std::int64_t i = 0; i < size; ++i) dz[i] = dy[i] * y[i] * (T(1) - y[i]);
      return;
    case config::Activation::tanh:
      for (std::int64_t i = 0; i < size; ++i) dz[i] = dy[i] * (T(1) - y[i] * y[i]);
      return;
    case config::Activation::softmax:
      for (std::int64_t r = 0; r < size / cols; ++r) {
        const T* yr = y + r * cols;
        const T* gr = dy + r * cols;
        T dot = 0;
        for (std::int64_t j = 0; j < cols; ++j) dot += yr[j] * gr[j];
        for (std::int64_t j = 0; j < cols; ++j) dz[r * cols + j] = yr[j] * (gr[j] - dot);
      }
      return;
  }
}

}  // namespace dtrain::nn::reference
