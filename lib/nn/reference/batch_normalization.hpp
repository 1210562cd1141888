// Reference BatchNormalization (Keras 3, axis=-1): plain loops, templated on the element type
// (see layers.hpp).
//
// Shapes: the data is seen as m rows x c channels (channels-last), m = N*H*W for (N, H, W, C) or
// m = N for (N, C).
//   x, dy, y, dx (m, c); mean, variance, gamma, beta, dgamma, dbeta, sums (c)
// gamma null = 1 (scale=False), beta null = 0 (center=False).
//   y = gamma (x - mean) / sqrt(variance + epsilon) + beta
// Training normalizes with the batch statistics (biased variance, divided by m) and the gradient
// flows through them; inference normalizes with the moving statistics, which are constants.
// Keras defaults: epsilon 1e-3, momentum 0.99.
// Backward functions OVERWRITE their outputs (dx, dgamma, dbeta); each of them may be null.
#pragma once

#include <cmath>
#include <cstdint>

namespace dtrain::nn::reference {

// Per-channel mean and biased variance, two passes.
template <class T>
void batch_norm_statistics(const T* x, std::int64_t m, std::int64_t c, T* mean, T* variance) {
  for (std::int64_t ch = 0; ch < c; ++ch) {
    T sum = 0;
    for (std::int64_t r = 0; r < m; ++r) sum += x[r * c + ch];
    mean[ch] = sum / static_cast<T>(m);
    T sq = 0;
    for (std::int64_t r = 0; r < m; ++r) sq += (x[r * c + ch] - mean[ch]) * (x[r * c + ch] - mean[ch]);
    variance[ch] = sq / static_cast<T>(m);
  }
}

// Synchronized batch norm: each replica contributes per-channel sums of x and x^2 and its row
// count; the statistics come from the sums added over replicas.
template <class T>
void batch_norm_sums(const T* x, std::int64_t m, std::int64_t c, T* sum, T* sum_sq) {
  for (std::int64_t ch = 0; ch < c; ++ch) {
    T s = 0, s2 = 0;
    for (std::int64_t r = 0; r < m; ++r) {
      s += x[r * c + ch];
      s2 += x[r * c + ch] * x[r * c + ch];
    }
    sum[ch] = s;
    sum_sq[ch] = s2;
  }
}

// As Keras' synchronized moments: mean = sum / count, variance = max(sum_sq / count - mean^2, 0);
// count 0 gives 0 and 0 (divide_no_nan).
template <class T>
void combine_statistics(const T* sum, const T* sum_sq, std::int64_t count, std::int64_t c, T* mean, T* variance) {
  for (std::int64_t ch = 0; ch < c; ++ch) {
    mean[ch] = count ? sum[ch] / static_cast<T>(count) : T(0);
    const T sq_mean = count ? sum_sq[ch] / static_cast<T>(count) : T(0);
    const T v = sq_mean - mean[ch] * mean[ch];
    variance[ch] = v > T(0) ? v : T(0);
  }
}

template <class T>
void batch_norm_forward(const T* x, std::int64_t m, std::int64_t c, const T* mean, const T* variance, const T* gamma,
                        const T* beta, double epsilon, T* y) {
  for (std::int64_t ch = 0; ch < c; ++ch) {
    const T inv = T(1) / std::sqrt(variance[ch] + static_cast<T>(epsilon));
    const T g = gamma ? gamma[ch] : T(1), b = beta ? beta[ch] : T(0);
    for (std::int64_t r = 0; r < m; ++r) y[r * c + ch] = g * (x[r * c + ch] - mean[ch]) * inv + b;
  }
}

// mean and variance must be batch_norm_statistics(x): the gradient of "statistics from x, then
// forward". With xhat = (x - mean) / sqrt(variance + epsilon), per channel:
//   dx = gamma / sqrt(variance + epsilon) * (dy - mean(dy) - xhat * mean(dy * xhat))
//   dgamma = sum(dy * xhat), dbeta = sum(dy)
template <class T>
void batch_norm_backward_training(const T* x, const T* dy, std::int64_t m, std::int64_t c, const T* mean,
                                  const T* variance, const T* gamma, double epsilon, T* dx, T* dgamma, T* dbeta) {
  for (std::int64_t ch = 0; ch < c; ++ch) {
    const T inv = T(1) / std::sqrt(variance[ch] + static_cast<T>(epsilon));
    T sum_dy = 0, sum_dy_xhat = 0;
    for (std::int64_t r = 0; r < m; ++r) {
      sum_dy += dy[r * c + ch];
      sum_dy_xhat += dy[r * c + ch] * (x[r * c + ch] - mean[ch]) * inv;
    }
    if (dgamma) dgamma[ch] = sum_dy_xhat;
    if (dbeta) dbeta[ch] = sum_dy;
    if (!dx) continue;
    const T g = gamma ? gamma[ch] : T(1);
    const T mean_dy = sum_dy / static_cast<T>(m), mean_dy_xhat = sum_dy_xhat / static_cast<T>(m);
    for (std::int64_t r = 0; r < m; ++r) {
      const T xhat = (x[r * c + ch] - mean[ch]) * inv;
      dx[r * c + ch] = g * inv * (dy[r * c + ch] - mean_dy - xhat * mean_dy_xhat);
    }
  }
}

// The statistics are constants (inference, or training=False): dx = gamma / sqrt(variance +
// epsilon) * dy; dgamma and dbeta as in training, with xhat from the given statistics.
template <class T>
void batch_norm_backward_inference(const T* x, const T* dy, std::int64_t m, std::int64_t c, const T* mean,
                                   const T* variance, const T* gamma, double epsilon, T* dx, T* dgamma, T* dbeta) {
  for (std::int64_t ch = 0; ch < c; ++ch) {
    const T inv = T(1) / std::sqrt(variance[ch] + static_cast<T>(epsilon));
    const T g = gamma ? gamma[ch] : T(1);
    T sum_dy = 0, sum_dy_xhat = 0;
    for (std::int64_t r = 0; r < m; ++r) {
      sum_dy += dy[r * c + ch];
      sum_dy_xhat += dy[r * c + ch] * (x[r * c + ch] - mean[ch]) * inv;
      if (dx) dx[r * c + ch] = g * inv * dy[r * c + ch];
    }
    if (dgamma) dgamma[ch] = sum_dy_xhat;
    if (dbeta) dbeta[ch] = sum_dy;
  }
}

// moving = moving * momentum + batch_stat * (1 - momentum), for the moving mean and the moving
// variance alike (Keras 3 feeds the biased batch variance). 1 - momentum is taken in double, as
// Keras does with its Python float.
template <class T>
void moving_average_update(T* moving, const T* batch_stat, std::int64_t c, double momentum) {
  const T keep = static_cast<T>(momentum), take = static_cast<T>(1.0 - momentum);
  for (std::int64_t ch = 0; ch < c; ++ch) moving[ch] = moving[ch] * keep + batch_stat[ch] * take;
}

}  // namespace dtrain::nn::reference
