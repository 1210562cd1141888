// The loss formulas themselves, written once as templates on the element type so the float
// path the trainer runs and a double path used as an oracle (finite-difference gradient checks
// in tests/unit/test_losses.cpp) are the same code. Explicitly instantiated for float and double
// in loss.cpp. These functions trust their inputs: Loss (loss.hpp) validates shapes and labels.
//
// Shapes: pred (N, C) row-major; targets either dense (N, C) or integer labels (N,);
// per_example (N,); grad (N, C); weights (N,) or null (= all 1).
#pragma once

#include <cstdint>

#include "config/experiment.hpp"

namespace dtrain::losses {

// Keras' backend epsilon: probabilities are clipped to [eps, 1 - eps] before the log.
inline constexpr double probability_epsilon = 1e-7;

struct LossSpec {
  config::LossKind kind = config::LossKind::sparse_categorical_crossentropy;
  bool from_logits = false;
};

// One row's target: `dense` (C values) when set, otherwise the integer `label`. For the
// crossentropies a label means a one-hot row; for binary_crossentropy and mean_squared_error
// (C == 1 only) it is the target value itself.
template <class T>
struct RowTarget {
  const T* dense = nullptr;
  std::int32_t label = 0;
};

// Loss of one row of C predictions. When `grad` is not null, also writes d(loss)/d(pred[j]) for
// the C columns. Where Keras clips a probability, the gradient is zero on the clipped side.
template <class T>
T row_loss(const LossSpec& spec, const T* pred, std::int64_t C, RowTarget<T> target, T* grad);

// Whole batch. Exactly one of dense_targets / labels is non-null. per_example and grad may each
// be null. grad[i, :] = scale * w_i * d(loss_i)/d(pred[i, :]).
template <class T>
void batch_loss(const LossSpec& spec, std::int64_t N, std::int64_t C, const T* pred, const T* dense_targets,
                const std::int32_t* labels, const float* weights, T scale, T* per_example, T* grad);

}  // namespace dtrain::losses
