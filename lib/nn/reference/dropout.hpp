// Reference Dropout (Keras inverted dropout) with an explicit keep mask: plain loops, templated on
// the element type (see layers.hpp). How the mask is drawn is the caller's business.
//
// Shapes: x, mask, y, dy, dx: any shape, size elements; mask entries are 0 (dropped) or 1 (kept),
// of any arithmetic type (bool, std::uint8_t, T).
//   y = x * mask / (1 - rate),  dx = dy * mask / (1 - rate),  0 <= rate < 1
// rate 0 is the identity whatever the mask (Keras skips dropout when rate is 0). Outside training
// Keras' Dropout is the identity too: callers just do not call these.
// Backward functions OVERWRITE their outputs (dx).
#pragma once

#include <cstdint>

namespace dtrain::nn::reference {

// As tf.nn.dropout: the scale 1 / (1 - rate) is taken in double, then x * scale * mask.
template <class T, class Mask>
void dropout_forward(const T* x, const Mask* mask, T* y, std::int64_t size, double rate) {
  const T scale = static_cast<T>(1.0 / (1.0 - rate));
  for (std::int64_t i = 0; i < size; ++i) y[i] = rate == 0.0 ? x[i] : x[i] * scale * static_cast<T>(mask[i]);
}

template <class T, class Mask>
void dropout_backward(const T* dy, const Mask* mask, T* dx, std::int64_t size, double rate) {
  const T scale = static_cast<T>(1.0 / (1.0 - rate));
  for (std::int64_t i = 0; i < size; ++i) dx[i] = rate == 0.0 ? dy[i] : dy[i] * scale * static_cast<T>(mask[i]);
}

}  // namespace dtrain::nn::reference
