// Shapes: pred (N, C); targets dense (N, C) or labels (N,); per_example (N,); grad (N, C).
#include "losses/loss.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::losses {

using config::LossKind;

namespace {

// The crossentropies read a label as a one-hot row.
template <class T>
T one_hot_or_dense(const RowTarget<T>& target, std::int64_t j) {
  if (target.dense) return target.dense[j];
  return j == target.label ? T(1) : T(0);
}

// binary_crossentropy and mean_squared_error read a label as the target value of their single column.
template <class T>
T value_target(const RowTarget<T>& target, std::int64_t j) {
  return target.dense ? target.dense[j] : static_cast<T>(target.label);
}

template <class T>
T crossentropy_from_logits(const T* x, std::int64_t C, const RowTarget<T>& target, T* grad) {
  // Log-sum-exp shifted by the max so exp never overflows.
  T max = x[0];
  for (std::int64_t j = 1; j < C; ++j) max = std::max(max, x[j]);
  T sum_exp = 0;
  for (std::int64_t j = 0; j < C; ++j) sum_exp += std::exp(x[j] - max);
  const T lse = max + std::log(sum_exp);

  T loss = 0;
  T target_sum = 0;
  for (std::int64_t j = 0; j < C; ++j) {
    const T t = one_hot_or_dense(target, j);
    loss += t * (lse - x[j]);
    target_sum += t;
  }
  if (grad) {
    // d/dx_j of sum_k t_k (lse - x_k) = softmax_j * sum(t) - t_j (targets need not sum to 1).
    for (std::int64_t j = 0; j < C; ++j) grad[j] = std::exp(x[j] - lse) * target_sum - one_hot_or_dense(target, j);
  }
  return loss;
}

template <class T>
T crossentropy_from_probabilities(const T* p, std::int64_t C, const RowTarget<T>& target, T* grad) {
  // Keras: renormalize the row to sum 1, clip to [eps, 1 - eps], then -sum t log q.
  const T eps = static_cast<T>(probability_epsilon);
  const T hi = T(1) - eps;
  T row_sum = 0;
  for (std::int64_t j = 0; j < C; ++j) row_sum += p[j];
  T loss = 0;
  for (std::int64_t j = 0; j < C; ++j) {
    const T t = one_hot_or_dense(target, j);
    if (t != T(0)) loss -= t * std::log(std::clamp(p[j] / row_sum, eps, hi));
  }
  if (grad) {
    // With q = p / s and g_j = dL/dq_j: dL/dp_k = (g_k - sum_j g_j q_j) / s. g_j = -t_j / q_j
    // where q_j is inside the clip range and 0 where clipping holds it constant.
    T weighted = 0;  // sum_j g_j q_j
    for (std::int64_t j = 0; j < C; ++j) {
      const T q = p[j] / row_sum;
      const T t = one_hot_or_dense(target, j);
      const bool inside = q >= eps && q <= hi;
      const T g = (inside && t != T(0)) ? -t / q : T(0);
      grad[j] = g;
      weighted += g * q;
    }
    for (std::int64_t j = 0; j < C; ++j) grad[j] = (grad[j] - weighted) / row_sum;
  }
  return loss;
}

template <class T>
T sparse_crossentropy_from_probabilities(const T* p, std::int64_t C, const RowTarget<T>& target, T* grad) {
  // Keras' sparse_categorical_crossentropy: clip each p to [eps, 1 - eps], take the log as
  // logits, and the softmax crossentropy of those: log sum_j c_j - log c_y (c = the clipped p).
  // Not the categorical formula (renormalize, then clip) where the row does not sum to 1.
  const T eps = static_cast<T>(probability_epsilon);
  const T hi = T(1) - eps;
  T clipped_sum = 0;
  for (std::int64_t j = 0; j < C; ++j) clipped_sum += std::clamp(p[j], eps, hi);
  const T label_clipped = std::clamp(p[target.label], eps, hi);
  if (grad) {
    // d/dp_j = (c_j / S - [j == y]) / c_j where p_j is inside the clip range, 0 where clipping
    // holds it constant.
    for (std::int64_t j = 0; j < C; ++j) {
      const bool inside = p[j] >= eps && p[j] <= hi;
      grad[j] = inside ? T(1) / clipped_sum - (j == target.label ? T(1) / p[j] : T(0)) : T(0);
    }
  }
  return std::log(clipped_sum) - std::log(label_clipped);
}

template <class T>
T binary_crossentropy(const T* x, std::int64_t C, const RowTarget<T>& target, bool from_logits, T* grad) {
  const T eps = static_cast<T>(probability_epsilon);
  const T hi = T(1) - eps;
  const T inv_c = T(1) / static_cast<T>(C);
  T loss = 0;
  for (std::int64_t j = 0; j < C; ++j) {
    const T z = value_target(target, j);
    if (from_logits) {
      // max(x, 0) - x z + log(1 + exp(-|x|)): the same value as -z log s - (1-z) log(1-s) with
      // s = sigmoid(x), without overflow for large |x|.
      const T xj = x[j];
      loss += std::max(xj, T(0)) - xj * z + std::log1p(std::exp(-std::abs(xj)));
      if (grad) {
        const T sigmoid = xj >= 0 ? T(1) / (T(1) + std::exp(-xj)) : std::exp(xj) / (T(1) + std::exp(xj));
        grad[j] = (sigmoid - z) * inv_c;
      }
    } else {
      const T p = x[j];
      const T c = std::clamp(p, eps, hi);
      loss -= z * std::log(c) + (T(1) - z) * std::log(T(1) - c);
      if (grad) {
        const bool inside = p >= eps && p <= hi;
        grad[j] = inside ? (-z / p + (T(1) - z) / (T(1) - p)) * inv_c : T(0);
      }
    }
  }
  return loss * inv_c;
}

template <class T>
T mean_squared_error(const T* p, std::int64_t C, const RowTarget<T>& target, T* grad) {
  const T inv_c = T(1) / static_cast<T>(C);
  T loss = 0;
  for (std::int64_t j = 0; j < C; ++j) {
    const T d = p[j] - value_target(target, j);
    loss += d * d;
    if (grad) grad[j] = T(2) * d * inv_c;
  }
  return loss * inv_c;
}

bool is_crossentropy(LossKind kind) {
  return kind == LossKind::sparse_categorical_crossentropy || kind == LossKind::categorical_crossentropy;
}

}  // namespace

bool reads_activation_input(LossKind kind) {
  return kind == LossKind::sparse_categorical_crossentropy || kind == LossKind::categorical_crossentropy ||
         kind == LossKind::binary_crossentropy;
}

template <class T>
T row_loss(const LossSpec& spec, const T* pred, std::int64_t C, RowTarget<T> target, T* grad) {
  switch (spec.kind) {
    case LossKind::sparse_categorical_crossentropy:
      if (!target.dense && !spec.from_logits) return sparse_crossentropy_from_probabilities(pred, C, target, grad);
      [[fallthrough]];
    case LossKind::categorical_crossentropy:
      return spec.from_logits ? crossentropy_from_logits(pred, C, target, grad)
                              : crossentropy_from_probabilities(pred, C, target, grad);
    case LossKind::binary_crossentropy:
      return binary_crossentropy(pred, C, target, spec.from_logits, grad);
    case LossKind::mean_squared_error:
      return mean_squared_error(pred, C, target, grad);
  }
  DTRAIN_CHECK(false, "unknown loss kind");
  return T(0);
}

template <class T>
void batch_loss(const LossSpec& spec, std::int64_t N, std::int64_t C, const T* pred, const T* dense_targets,
                const std::int32_t* labels, const float* weights, T scale, T* per_example, T* grad) {
  DTRAIN_CHECK((dense_targets == nullptr) != (labels == nullptr), "exactly one of dense targets and labels");
  for (std::int64_t i = 0; i < N; ++i) {
    RowTarget<T> target;
    if (dense_targets) target.dense = dense_targets + i * C;
    else target.label = labels[i];
    T* row_grad = grad ? grad + i * C : nullptr;
    const T loss = row_loss(spec, pred + i * C, C, target, row_grad);
    if (per_example) per_example[i] = loss;
    if (row_grad) {
      const T factor = scale * (weights ? static_cast<T>(weights[i]) : T(1));
      for (std::int64_t j = 0; j < C; ++j) row_grad[j] *= factor;
    }
  }
}

template float row_loss<float>(const LossSpec&, const float*, std::int64_t, RowTarget<float>, float*);
template double row_loss<double>(const LossSpec&, const double*, std::int64_t, RowTarget<double>, double*);
template void batch_loss<float>(const LossSpec&, std::int64_t, std::int64_t, const float*, const float*,
                                const std::int32_t*, const float*, float, float*, float*);
template void batch_loss<double>(const LossSpec&, std::int64_t, std::int64_t, const double*, const double*,
                                 const std::int32_t*, const float*, double, double*, double*);

// ---------------------------------------------------------------- Loss

const char* loss_name(LossKind kind) {
  switch (kind) {
    case LossKind::sparse_categorical_crossentropy: return "sparse_categorical_crossentropy";
    case LossKind::categorical_crossentropy: return "categorical_crossentropy";
    case LossKind::binary_crossentropy: return "binary_crossentropy";
    case LossKind::mean_squared_error: return "mean_squared_error";
  }
  return "?";
}

Loss::Loss(const config::LossConfig& config, device::Numerics& numerics) : config_(config), numerics_(numerics) {}

std::pair<std::int64_t, std::int64_t> Loss::validate(const Tensor& y_pred, const Tensor& y_true) const {
  const char* name = loss_name(config_.kind);
  if (!y_pred.defined() || y_pred.dtype() != DType::f32 || y_pred.shape().rank() != 2) {
    throw InputError(fmt::format("loss {}: predictions must be an f32 tensor of shape (N, C), got {} {}; "
                                 "the model's last layer must output one row per example",
                                 name, y_pred.defined() ? dtype_name(y_pred.dtype()) : "undefined",
                                 y_pred.shape().to_string()));
  }
  const std::int64_t N = y_pred.shape()[0];
  const std::int64_t C = y_pred.shape()[1];
  if (C < 1) throw InputError(fmt::format("loss {}: predictions {} have no columns", name, y_pred.shape().to_string()));
  if (!y_true.defined()) throw InputError(fmt::format("loss {}: labels are missing", name));

  const Shape& ts = y_true.shape();
  const bool single_column = C == 1;
  if (y_true.dtype() == DType::i32) {
    const bool label_shape = (ts.rank() == 1 && ts[0] == N) || (ts.rank() == 2 && ts[0] == N && ts[1] == 1);
    if (!label_shape) {
      throw InputError(fmt::format("loss {}: integer labels must have shape ({},) to match predictions {}, got {}",
                                   name, N, y_pred.shape().to_string(), ts.to_string()));
    }
    if (!is_crossentropy(config_.kind) && !single_column) {
      throw InputError(fmt::format("loss {}: integer labels of shape {} need predictions with 1 column, got {}; "
                                   "give f32 targets of shape ({}, {}) instead",
                                   name, ts.to_string(), y_pred.shape().to_string(), N, C));
    }
    // Labels the host cannot read in place were checked when their split was loaded (the
    // trainer's check_label_range), before they were staged to the device.
    const std::int32_t* labels = y_true.host_accessible() ? y_true.data<std::int32_t>() : nullptr;
    for (std::int64_t i = 0; labels && i < N; ++i) {
      const std::int32_t l = labels[i];
      if (is_crossentropy(config_.kind) && (l < 0 || l >= C)) {
        throw InputError(fmt::format("loss {}: label {} of example {} is out of range [0, {}); the model has {} "
                                     "outputs, check the number of classes in the data and the last layer",
                                     name, l, i, C, C));
      }
      if (config_.kind == LossKind::binary_crossentropy && l != 0 && l != 1) {
        throw InputError(fmt::format("loss {}: label {} of example {} is not 0 or 1", name, l, i));
      }
    }
  } else if (y_true.dtype() == DType::f32) {
    if (config_.kind == LossKind::sparse_categorical_crossentropy) {
      throw InputError(fmt::format("loss {}: needs i32 class ids of shape ({},), got f32 {}; for one-hot targets "
                                   "use loss kind categorical_crossentropy",
                                   name, N, ts.to_string()));
    }
    const bool dense_shape = (ts.rank() == 2 && ts[0] == N && ts[1] == C) || (single_column && ts.rank() == 1 && ts[0] == N);
    if (!dense_shape) {
      throw InputError(fmt::format("loss {}: targets have shape {} but predictions have shape {}; they must match",
                                   name, ts.to_string(), y_pred.shape().to_string()));
    }
  } else {
    throw InputError(fmt::format("loss {}: labels must be i32 class ids or f32 targets, got {}", name,
                                 dtype_name(y_true.dtype())));
  }
  return {N, C};
}

device::LossBatch Loss::batch_of(const Tensor& y_pred, const Tensor& y_true) const {
  const bool dense = y_true.dtype() == DType::f32;
  device::LossBatch b;
  b.kind = config_.kind;
  b.from_logits = config_.from_logits;
  b.rows = y_pred.shape()[0];
  b.columns = y_pred.shape()[1];
  b.pred = y_pred.address<float>();
  b.dense_targets = dense ? y_true.address<float>() : nullptr;
  b.labels = dense ? nullptr : y_true.address<std::int32_t>();
  return b;
}

void Loss::per_example(const Tensor& y_pred, const Tensor& y_true, std::span<float> out) const {
  const auto [N, C] = validate(y_pred, y_true);
  DTRAIN_CHECK(static_cast<std::int64_t>(out.size()) == N,
               fmt::format("per-example output has {} entries for a batch of {}", out.size(), N));
  device::LossBatch b = batch_of(y_pred, y_true);
  b.per_example = out.data();
  numerics_.loss(b);
}

namespace {

// The loss gradient's buffer for `y_pred`: a host buffer is sized here; a device one (a model's
// output gradient) already fits.
void fit_gradient_buffer(const Tensor& y_pred, Tensor& d_pred) {
  if (d_pred.host_accessible() && !(d_pred.defined() && d_pred.shape() == y_pred.shape()))
    d_pred.ensure(y_pred.shape(), DType::f32);
  DTRAIN_CHECK(d_pred.shape() == y_pred.shape() && d_pred.dtype() == DType::f32,
               fmt::format("loss gradient buffer {} for predictions {}", d_pred.shape().to_string(),
                           y_pred.shape().to_string()));
}

}  // namespace

void Loss::gradient(const Tensor& y_pred, const Tensor& y_true, std::span<const float> weights, float scale,
                    Tensor& d_pred) const {
  const auto [N, C] = validate(y_pred, y_true);
  if (!weights.empty() && static_cast<std::int64_t>(weights.size()) != N) {
    throw InputError(fmt::format("loss {}: {} sample weights for a batch of {} examples; give one weight per example",
                                 loss_name(config_.kind), weights.size(), N));
  }
  fit_gradient_buffer(y_pred, d_pred);
  device::LossBatch b = batch_of(y_pred, y_true);
  b.weights = weights.empty() ? nullptr : weights.data();
  b.scale = scale;
  b.grad = d_pred.address<float>();
  numerics_.loss(b);
}

void Loss::per_example_and_gradient(const Tensor& y_pred, const Tensor& y_true, std::span<float> out, float scale,
                                    Tensor& d_pred, bool deferred) const {
  const auto [N, C] = validate(y_pred, y_true);
  DTRAIN_CHECK(static_cast<std::int64_t>(out.size()) == N,
               fmt::format("per-example output has {} entries for a batch of {}", out.size(), N));
  fit_gradient_buffer(y_pred, d_pred);
  device::LossBatch b = batch_of(y_pred, y_true);
  b.per_example = out.data();
  b.scale = scale;
  b.grad = d_pred.address<float>();
  b.deferred = deferred;
  numerics_.loss(b);
}

std::unique_ptr<Loss> make_loss(const config::LossConfig& config, device::Numerics& numerics) {
  return std::make_unique<Loss>(config, numerics);
}

// ---------------------------------------------------------------- reductions

namespace {

double weighted_sum(std::span<const float> per_example, std::span<const float> sample_weight, const char* who) {
  if (!sample_weight.empty() && sample_weight.size() != per_example.size()) {
    throw InputError(fmt::format("{}: {} sample weights for {} per-example losses; give one weight per example",
                                 who, sample_weight.size(), per_example.size()));
  }
  double sum = 0.0;
  for (std::size_t i = 0; i < per_example.size(); ++i) {
    sum += static_cast<double>(per_example[i]) * (sample_weight.empty() ? 1.0 : static_cast<double>(sample_weight[i]));
  }
  return sum;
}

}  // namespace

double compute_average_loss(std::span<const float> per_example, std::int64_t global_batch_size,
                            std::span<const float> sample_weight) {
  DTRAIN_CHECK(global_batch_size >= 1,
               fmt::format("compute_average_loss needs global_batch_size >= 1, got {}", global_batch_size));
  return weighted_sum(per_example, sample_weight, "compute_average_loss") / static_cast<double>(global_batch_size);
}

double scale_regularization_loss(double regularization_loss, int num_replicas_in_sync) {
  DTRAIN_CHECK(num_replicas_in_sync >= 1,
               fmt::format("scale_regularization_loss needs num_replicas_in_sync >= 1, got {}", num_replicas_in_sync));
  return regularization_loss / num_replicas_in_sync;
}

double reduce_loss(std::span<const float> per_example, config::Reduction reduction,
                   std::span<const float> sample_weight) {
  switch (reduction) {
    case config::Reduction::sum:
      return weighted_sum(per_example, sample_weight, "reduce_loss");
    case config::Reduction::sum_over_batch_size:
    case config::Reduction::auto_reduction: {
      const double sum = weighted_sum(per_example, sample_weight, "reduce_loss");
      return per_example.empty() ? 0.0 : sum / static_cast<double>(per_example.size());
    }
    case config::Reduction::none:
      break;
  }
  throw InternalError(
      "reduce_loss: reduction 'none' has no scalar value; take Loss::per_example and reduce it with "
      "compute_average_loss(per_example, global_batch_size)");
}

}  // namespace dtrain::losses
