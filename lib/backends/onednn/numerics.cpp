// Shapes: each optimizer update reads and writes n floats of w, g and every slot; loss and metric
// shapes as in device/numerics.hpp.
#include "backends/onednn/numerics.hpp"

#include <cmath>
#include <cstring>

#include "losses/loss_math.hpp"

namespace dtrain::backends::onednn {

namespace {

// The optimizer updates and the element-wise sums run over every parameter each step. They are
// compiled for AVX-512, AVX2 and plain x86-64, and the loader picks the version this CPU runs
// (GCC's target_clones, an ifunc), so one binary uses the wide registers where they exist. The
// file is built with -fno-math-errno (so sqrt vectorizes) and -ffp-contract=off (no fused
// multiply-add): every version rounds exactly as the plain loop does, and the numbers a run
// prints do not depend on the CPU.
// ThreadSanitizer instruments the clones' resolver, which the loader runs before the TSan runtime
// exists (a crash at start), so a TSan build keeps the one default version.
#if defined(__SANITIZE_THREAD__)
#define DTRAIN_VECTOR_CLONES
#else
#define DTRAIN_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

DTRAIN_VECTOR_CLONES void sgd_update_loops(const SgdStep& step, float* __restrict w, const float* __restrict g,
                             float* __restrict m, std::size_t n) {
  const float lr = step.learning_rate;
  if (step.momentum <= 0.0f) {
    for (std::size_t k = 0; k < n; ++k) w[k] -= lr * g[k];
    return;
  }
  const float mu = step.momentum;
  if (step.nesterov) {
    for (std::size_t k = 0; k < n; ++k) {
      m[k] = mu * m[k] - lr * g[k];
      w[k] += mu * m[k] - lr * g[k];
    }
  } else {
    for (std::size_t k = 0; k < n; ++k) {
      m[k] = mu * m[k] - lr * g[k];
      w[k] += m[k];
    }
  }
}

DTRAIN_VECTOR_CLONES void adam_update_loops(const AdamStep& step, float* __restrict w, const float* __restrict g,
                              float* __restrict m, float* __restrict v, std::size_t n) {
  const float one_minus_b1 = step.one_minus_beta_1;
  const float one_minus_b2 = step.one_minus_beta_2;
  const float alpha = step.alpha;
  const float eps = step.epsilon;
  for (std::size_t k = 0; k < n; ++k) {
    m[k] += (g[k] - m[k]) * one_minus_b1;
    v[k] += (g[k] * g[k] - v[k]) * one_minus_b2;
    w[k] -= alpha * m[k] / (std::sqrt(v[k]) + eps);
  }
}

DTRAIN_VECTOR_CLONES void rmsprop_update_loops(const RmspropStep& step, float* __restrict w, const float* __restrict g,
                                 float* __restrict velocity, float* __restrict mom, float* __restrict average,
                                 std::size_t n) {
  const float rho = step.rho;
  const float one_minus_rho = 1.0f - step.rho;
  const float lr = step.learning_rate;
  const float eps = step.epsilon;
  const float mu = step.momentum;
  const bool centered = average != nullptr;
  // Four loop variants so each one stays branch-free and vectorizable.
  for (std::size_t k = 0; k < n; ++k) velocity[k] = rho * velocity[k] + one_minus_rho * g[k] * g[k];
  if (centered) {
    for (std::size_t k = 0; k < n; ++k) average[k] = rho * average[k] + one_minus_rho * g[k];
  }
  if (centered && mom) {
    for (std::size_t k = 0; k < n; ++k) {
      mom[k] = mu * mom[k] + lr * g[k] / std::sqrt(velocity[k] - average[k] * average[k] + eps);
      w[k] -= mom[k];
    }
  } else if (centered) {
    for (std::size_t k = 0; k < n; ++k) w[k] -= lr * g[k] / std::sqrt(velocity[k] - average[k] * average[k] + eps);
  } else if (mom) {
    for (std::size_t k = 0; k < n; ++k) {
      mom[k] = mu * mom[k] + lr * g[k] / std::sqrt(velocity[k] + eps);
      w[k] -= mom[k];
    }
  } else {
    for (std::size_t k = 0; k < n; ++k) w[k] -= lr * g[k] / std::sqrt(velocity[k] + eps);
  }
}

DTRAIN_VECTOR_CLONES void axpy_loops(float a, const float* __restrict x, float* __restrict y, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) y[i] += a * x[i];
}

DTRAIN_VECTOR_CLONES void axpby_loops(float a, const float* __restrict x, float b, float* __restrict y, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) y[i] = y[i] * b + x[i] * a;
}

}  // namespace

void CpuNumerics::sgd_update(const SgdStep& step, float* __restrict w, const float* __restrict g,
                             float* __restrict m, std::size_t n) {
  sgd_update_loops(step, w, g, m, n);
}

void CpuNumerics::adam_update(const AdamStep& step, float* __restrict w, const float* __restrict g,
                              float* __restrict m, float* __restrict v, std::size_t n) {
  adam_update_loops(step, w, g, m, v, n);
}

void CpuNumerics::rmsprop_update(const RmspropStep& step, float* __restrict w, const float* __restrict g,
                                 float* __restrict velocity, float* __restrict mom, float* __restrict average,
                                 std::size_t n) {
  rmsprop_update_loops(step, w, g, velocity, mom, average, n);
}

void CpuNumerics::loss(const LossBatch& b) {
  losses::batch_loss<float>(losses::LossSpec{b.kind, b.from_logits}, b.rows, b.columns, b.pred, b.dense_targets,
                            b.labels, b.weights, b.scale, b.per_example, b.grad);
}

void CpuNumerics::argmax_rows(const float* values, std::int64_t rows, std::int64_t columns, std::int32_t* out) {
  for (std::int64_t i = 0; i < rows; ++i) {
    const float* row = values + i * columns;
    std::int64_t best = 0;  // the first maximum, as argmax does
    for (std::int64_t j = 1; j < columns; ++j)
      if (row[j] > row[best]) best = j;
    out[i] = static_cast<std::int32_t>(best);
  }
}

void CpuNumerics::row_matches(const float* pred, const void* targets, bool targets_are_i32, std::int64_t rows,
                              std::int64_t columns, const float* threshold, std::int64_t* matches) {
  for (std::int64_t i = 0; i < rows; ++i) {
    std::int64_t count = 0;
    for (std::int64_t j = 0; j < columns; ++j) {
      const std::int64_t k = i * columns + j;
      const double target = targets_are_i32 ? static_cast<double>(static_cast<const std::int32_t*>(targets)[k])
                                            : static_cast<double>(static_cast<const float*>(targets)[k]);
      const double predicted = threshold ? (pred[k] > *threshold ? 1.0 : 0.0) : static_cast<double>(pred[k]);
      count += predicted == target ? 1 : 0;
    }
    matches[i] = count;
  }
}

void CpuNumerics::to_host(const void* src, void* host, std::size_t bytes) {
  if (bytes) std::memcpy(host, src, bytes);
}

double CpuNumerics::sum_of_squares(const float* x, std::size_t n) {
  double sum = 0.0;
  for (std::size_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return sum;
}

void CpuNumerics::axpy(float a, const float* __restrict x, float* __restrict y, std::size_t n) {
  axpy_loops(a, x, y, n);
}

void CpuNumerics::axpby(float a, const float* __restrict x, float b, float* __restrict y, std::size_t n) {
  axpby_loops(a, x, b, y, n);
}

}  // namespace dtrain::backends::onednn
