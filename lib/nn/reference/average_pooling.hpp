// Reference AveragePooling2D and GlobalAveragePooling2D (TensorFlow semantics): plain loops over
// canonical (channels-last) arrays, templated on the element type (see layers.hpp).
//
// Shapes (Keras layouts):
//   avg pool         x (N, H, W, C), y (N, OH, OW, C); PoolDims as for max pooling (output size
//                    and padding split from nn/padding.hpp: 'same' puts the odd padding after)
//   global avg pool  x (N, H, W, C), y (N, C)
// Like tf.nn.avg_pool, a window's average counts only its real input positions: padding adds
// nothing to the sum and nothing to the divisor. With TensorFlow's padding every window holds at
// least one real position, so the divisor is never 0.
// Backward functions OVERWRITE their outputs (dx).
#pragma once

#include <algorithm>
#include <cstdint>

#include "nn/reference/layers.hpp"

namespace dtrain::nn::reference {

// The divisor of output (oy, ox): how many real input positions its window covers.
inline std::int64_t average_pool_count(const PoolDims& d, std::int64_t oy, std::int64_t ox) {
  const std::int64_t y0 = oy * d.sh - d.pad_top, x0 = ox * d.sw - d.pad_left;
  const std::int64_t rows = std::min(y0 + d.ph, d.h) - std::max(y0, std::int64_t{0});
  const std::int64_t cols = std::min(x0 + d.pw, d.w) - std::max(x0, std::int64_t{0});
  return std::max(rows, std::int64_t{0}) * std::max(cols, std::int64_t{0});
}

template <class T>
void average_pool2d_forward(const T* x, T* y, const PoolDims& d) {
  for (std::int64_t n = 0; n < d.n; ++n)
    for (std::int64_t oy = 0; oy < d.oh; ++oy)
      for (std::int64_t ox = 0; ox < d.ow; ++ox) {
        const T count = static_cast<T>(average_pool_count(d, oy, ox));
        for (std::int64_t c = 0; c < d.c; ++c) {
          T acc = 0;
          for (std::int64_t py = 0; py < d.ph; ++py)
            for (std::int64_t px = 0; px < d.pw; ++px) {
              const std::int64_t iy = oy * d.sh + py - d.pad_top, ix = ox * d.sw + px - d.pad_left;
              if (iy < 0 || iy >= d.h || ix < 0 || ix >= d.w) continue;
              acc += x[((n * d.h + iy) * d.w + ix) * d.c + c];
            }
          y[((n * d.oh + oy) * d.ow + ox) * d.c + c] = acc / count;
        }
      }
}

// Each output's gradient is shared equally by the real positions of its window.
template <class T>
void average_pool2d_backward(const T* dy, T* dx, const PoolDims& d) {
  std::fill(dx, dx + d.n * d.h * d.w * d.c, T(0));
  for (std::int64_t n = 0; n < d.n; ++n)
    for (std::int64_t oy = 0; oy < d.oh; ++oy)
      for (std::int64_t ox = 0; ox < d.ow; ++ox) {
        const T count = static_cast<T>(average_pool_count(d, oy, ox));
        for (std::int64_t c = 0; c < d.c; ++c) {
          const T g = dy[((n * d.oh + oy) * d.ow + ox) * d.c + c] / count;
          for (std::int64_t py = 0; py < d.ph; ++py)
            for (std::int64_t px = 0; px < d.pw; ++px) {
              const std::int64_t iy = oy * d.sh + py - d.pad_top, ix = ox * d.sw + px - d.pad_left;
              if (iy < 0 || iy >= d.h || ix < 0 || ix >= d.w) continue;
              dx[((n * d.h + iy) * d.w + ix) * d.c + c] += g;
            }
        }
      }
}

template <class T>
void global_average_pool2d_forward(const T* x, T* y, std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c) {
  for (std::int64_t b = 0; b < n; ++b)
    for (std::int64_t ch = 0; ch < c; ++ch) {
      T acc = 0;
      for (std::int64_t p = 0; p < h * w; ++p) acc += x[(b * h * w + p) * c + ch];
      y[b * c + ch] = acc / static_cast<T>(h * w);
    }
}

template <class T>
void global_average_pool2d_backward(const T* dy, T* dx, std::int64_t n, std::int64_t h, std::int64_t w,
                                    std::int64_t c) {
  for (std::int64_t b = 0; b < n; ++b)
    for (std::int64_t p = 0; p < h * w; ++p)
      for (std::int64_t ch = 0; ch < c; ++ch) dx[(b * h * w + p) * c + ch] = dy[b * c + ch] / static_cast<T>(h * w);
}

}  // namespace dtrain::nn::reference
