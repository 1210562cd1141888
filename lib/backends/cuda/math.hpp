// The arithmetic of the CUDA backend's numerics, per element and per row, written once for the
// host and the device: nvcc compiles these functions into the kernels (numerics.cu), g++ into the
// unit tests (tests/unit/test_cuda_math.cpp), which check them against the CPU backend's
// numerics on every CPU build. Only the launches then need a GPU to be tested.
//
// Each formula repeats the CPU backend's (backends/onednn/numerics.cpp, losses/loss.cpp) operation
// for operation, in the same order, so that with the same rounding (no fused multiply-add: the
// kernels are compiled with -fmad=false, the CPU with -ffp-contract=off; IEEE division and square
// root) the element-wise updates give the same bits, and the losses differ only by the ulps in
// which CUDA's expf/logf/log1pf differ from glibc's.
//
// No CUDA header is needed here: this header is plain C++ for g++.
#pragma once

#include <cmath>
#include <cstdint>

#include "backends/cuda/launch.hpp"
#include "core/bfloat16.hpp"
#include "device/numerics.hpp"
#include "losses/loss_math.hpp"

namespace dtrain::backends::cuda::math {

// ---- the elementary functions: CUDA's on the device, the C library's on the host (as the CPU
// backend calls them through std::).
DTRAIN_HD inline float exp_f(float x) {
#if defined(__CUDA_ARCH__)
  return ::expf(x);
#else
  return std::exp(x);
#endif
}
DTRAIN_HD inline float log_f(float x) {
#if defined(__CUDA_ARCH__)
  return ::logf(x);
#else
  return std::log(x);
#endif
}
DTRAIN_HD inline float log1p_f(float x) {
#if defined(__CUDA_ARCH__)
  return ::log1pf(x);
#else
  return std::log1p(x);
#endif
}
DTRAIN_HD inline float sqrt_f(float x) {
#if defined(__CUDA_ARCH__)
  return ::sqrtf(x);
#else
  return std::sqrt(x);
#endif
}
DTRAIN_HD inline float abs_f(float x) {
#if defined(__CUDA_ARCH__)
  return ::fabsf(x);
#else
  return std::abs(x);
#endif
}
// std::max and std::clamp exactly (which operand wins on ties and NaN), usable on the device.
DTRAIN_HD inline float max_f(float a, float b) { return (a < b) ? b : a; }
DTRAIN_HD inline float clamp_f(float v, float lo, float hi) { return (v < lo) ? lo : (hi < v) ? hi : v; }

// ---- optimizers: one element (the CPU loops' bodies)
DTRAIN_HD inline void sgd_element(float lr, float& w, float g) { w -= lr * g; }
DTRAIN_HD inline void sgd_momentum_element(float lr, float mu, bool nesterov, float& w, float g, float& m) {
  m = mu * m - lr * g;
  if (nesterov) w += mu * m - lr * g;
  else w += m;
}

DTRAIN_HD inline void adam_element(const device::AdamStep& s, float& w, float g, float& m, float& v) {
  m += (g - m) * s.one_minus_beta_1;
  v += (g * g - v) * s.one_minus_beta_2;
  w -= s.alpha * m / (sqrt_f(v) + s.epsilon);
}

// momentum and average null when absent; one_minus_rho = 1 - rho computed once, as the CPU does.
DTRAIN_HD inline void rmsprop_element(const device::RmspropStep& s, float one_minus_rho, float& w, float g,
                                      float& velocity, float* momentum, float* average) {
  velocity = s.rho * velocity + one_minus_rho * g * g;
  if (average) {
    *average = s.rho * *average + one_minus_rho * g;
    if (momentum) {
      *momentum = s.momentum * *momentum + s.learning_rate * g / sqrt_f(velocity - *average * *average + s.epsilon);
      w -= *momentum;
    } else {
      w -= s.learning_rate * g / sqrt_f(velocity - *average * *average + s.epsilon);
    }
  } else if (momentum) {
    *momentum = s.momentum * *momentum + s.learning_rate * g / sqrt_f(velocity + s.epsilon);
    w -= *momentum;
  } else {
    w -= s.learning_rate * g / sqrt_f(velocity + s.epsilon);
  }
}

DTRAIN_HD inline void axpy_element(float a, float x, float& y) { y += a * x; }
DTRAIN_HD inline void axpby_element(float a, float x, float b, float& y) { y = y * b + x * a; }

// ---- losses: one row (losses/loss.cpp for T = float)
using RowTarget = losses::RowTarget<float>;

DTRAIN_HD inline float one_hot_or_dense(const RowTarget& target, std::int64_t j) {
  if (target.dense) return target.dense[j];
  return j == target.label ? 1.0f : 0.0f;
}
DTRAIN_HD inline float value_target(const RowTarget& target, std::int64_t j) {
  return target.dense ? target.dense[j] : static_cast<float>(target.label);
}

DTRAIN_HD inline float crossentropy_from_logits(const float* x, std::int64_t C, const RowTarget& target, float* grad) {
  float max = x[0];
  for (std::int64_t j = 1; j < C; ++j) max = max_f(max, x[j]);
  float sum_exp = 0;
  for (std::int64_t j = 0; j < C; ++j) sum_exp += exp_f(x[j] - max);
  const float lse = max + log_f(sum_exp);
  float loss = 0;
  float target_sum = 0;
  for (std::int64_t j = 0; j < C; ++j) {
    const float t = one_hot_or_dense(target, j);
    loss += t * (lse - x[j]);
    target_sum += t;
  }
  if (grad) {
    for (std::int64_t j = 0; j < C; ++j) grad[j] = exp_f(x[j] - lse) * target_sum - one_hot_or_dense(target, j);
  }
  return loss;
}

DTRAIN_HD inline float crossentropy_from_probabilities(const float* p, std::int64_t C, const RowTarget& target,
                                                       float* grad) {
  const float eps = static_cast<float>(losses::probability_epsilon);
  const float hi = 1.0f - eps;
  float row_sum = 0;
  for (std::int64_t j = 0; j < C; ++j) row_sum += p[j];
  float loss = 0;
  for (std::int64_t j = 0; j < C; ++j) {
    const float t = one_hot_or_dense(target, j);
    if (t != 0.0f) loss -= t * log_f(clamp_f(p[j] / row_sum, eps, hi));
  }
  if (grad) {
    float weighted = 0;
    for (std::int64_t j = 0; j < C; ++j) {
      const float q = p[j] / row_sum;
      const float t = one_hot_or_dense(target, j);
      const bool inside = q >= eps && q <= hi;
      const float g = (inside && t != 0.0f) ? -t / q : 0.0f;
      grad[j] = g;
      weighted += g * q;
    }
    for (std::int64_t j = 0; j < C; ++j) grad[j] = (grad[j] - weighted) / row_sum;
  }
  return loss;
}

// Keras' sparse_categorical_crossentropy of probabilities: the softmax crossentropy of the logs of
// the clipped p (losses/loss.cpp, the oracle): log sum_j c_j - log c_y.
DTRAIN_HD inline float sparse_crossentropy_from_probabilities(const float* p, std::int64_t C, const RowTarget& target,
                                                              float* grad) {
  const float eps = static_cast<float>(losses::probability_epsilon);
  const float hi = 1.0f - eps;
  float clipped_sum = 0;
  for (std::int64_t j = 0; j < C; ++j) clipped_sum += clamp_f(p[j], eps, hi);
  const float label_clipped = clamp_f(p[target.label], eps, hi);
  if (grad) {
    for (std::int64_t j = 0; j < C; ++j) {
      const bool inside = p[j] >= eps && p[j] <= hi;
      grad[j] = inside ? 1.0f / clipped_sum - (j == target.label ? 1.0f / p[j] : 0.0f) : 0.0f;
    }
  }
  return log_f(clipped_sum) - log_f(label_clipped);
}

DTRAIN_HD inline float binary_crossentropy(const float* x, std::int64_t C, const RowTarget& target, bool from_logits,
                                           float* grad) {
  const float eps = static_cast<float>(losses::probability_epsilon);
  const float hi = 1.0f - eps;
  const float inv_c = 1.0f / static_cast<float>(C);
  float loss = 0;
  for (std::int64_t j = 0; j < C; ++j) {
    const float z = value_target(target, j);
    if (from_logits) {
      const float xj = x[j];
      loss += max_f(xj, 0.0f) - xj * z + log1p_f(exp_f(-abs_f(xj)));
      if (grad) {
        const float sigmoid = xj >= 0 ? 1.0f / (1.0f + exp_f(-xj)) : exp_f(xj) / (1.0f + exp_f(xj));
        grad[j] = (sigmoid - z) * inv_c;
      }
    } else {
      const float p = x[j];
      const float c = clamp_f(p, eps, hi);
      loss -= z * log_f(c) + (1.0f - z) * log_f(1.0f - c);
      if (grad) {
        const bool inside = p >= eps && p <= hi;
        grad[j] = inside ? (-z / p + (1.0f - z) / (1.0f - p)) * inv_c : 0.0f;
      }
    }
  }
  return loss * inv_c;
}

DTRAIN_HD inline float mean_squared_error(const float* p, std::int64_t C, const RowTarget& target, float* grad) {
  const float inv_c = 1.0f / static_cast<float>(C);
  float loss = 0;
  for (std::int64_t j = 0; j < C; ++j) {
    const float d = p[j] - value_target(target, j);
    loss += d * d;
    if (grad) grad[j] = 2.0f * d * inv_c;
  }
  return loss * inv_c;
}

// Loss of one row; grad (C values, or null) = scale * weight * d(loss)/d(pred), as batch_loss
// scales it: the raw gradient first, then one multiplication by the row's factor.
DTRAIN_HD inline float row_loss(config::LossKind kind, bool from_logits, const float* pred, std::int64_t C,
                                const RowTarget& target, float factor, float* grad) {
  float loss = 0;
  switch (kind) {
    case config::LossKind::sparse_categorical_crossentropy:
      if (!target.dense && !from_logits) {
        loss = sparse_crossentropy_from_probabilities(pred, C, target, grad);
        break;
      }
      [[fallthrough]];
    case config::LossKind::categorical_crossentropy:
      loss = from_logits ? crossentropy_from_logits(pred, C, target, grad)
                         : crossentropy_from_probabilities(pred, C, target, grad);
      break;
    case config::LossKind::binary_crossentropy: loss = binary_crossentropy(pred, C, target, from_logits, grad); break;
    case config::LossKind::mean_squared_error: loss = mean_squared_error(pred, C, target, grad); break;
  }
  if (grad) {
    for (std::int64_t j = 0; j < C; ++j) grad[j] *= factor;
  }
  return loss;
}

// ---- metrics: one row
// The first maximum, as the CPU's argmax.
DTRAIN_HD inline std::int32_t argmax_row(const float* row, std::int64_t C) {
  std::int64_t best = 0;
  for (std::int64_t j = 1; j < C; ++j)
    if (row[j] > row[best]) best = j;
  return static_cast<std::int32_t>(best);
}

// Sparse categorical accuracy of one row: 1 when its first maximum is at `label`, 0 when not,
// -1 for a label outside [0, C) (the host raises the metric's error for it).
DTRAIN_HD inline std::int32_t label_hit(const float* row, std::int64_t C, std::int32_t label) {
  if (label < 0 || label >= C) return -1;
  return argmax_row(row, C) == label ? 1 : 0;
}

// How many of the row's C columns equal the target, compared in double as the CPU does.
DTRAIN_HD inline std::int64_t row_match_count(const float* pred, const void* targets, bool targets_are_i32,
                                              std::int64_t row, std::int64_t C, bool thresholded, float threshold) {
  std::int64_t count = 0;
  for (std::int64_t j = 0; j < C; ++j) {
    const std::int64_t k = row * C + j;
    const double target = targets_are_i32 ? static_cast<double>(static_cast<const std::int32_t*>(targets)[k])
                                          : static_cast<double>(static_cast<const float*>(targets)[k]);
    const double predicted = thresholded ? (pred[k] > threshold ? 1.0 : 0.0) : static_cast<double>(pred[k]);
    count += predicted == target ? 1 : 0;
  }
  return count;
}

// ---- bfloat16: core/bfloat16.hpp's conversions, which the CPU backend's copies use too.
using dtrain::bf16_from_f32_bits;
using dtrain::f32_bits_from_bf16;

}  // namespace dtrain::backends::cuda::math
