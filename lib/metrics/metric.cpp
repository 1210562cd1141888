// Shapes: y_pred (N, C) f32; y_true i32 (N,) / (N, 1) or f32 (N, C) (or (N,) when C == 1);
// sample_weight empty or (N,).
#include "metrics/metric.hpp"

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::metrics {

namespace {

struct Batch {
  std::int64_t N = 0;
  std::int64_t C = 0;
};

Batch check_predictions(const char* metric, const Tensor& y_pred, std::span<const float> sample_weight) {
  if (!y_pred.defined() || y_pred.dtype() != DType::f32 || y_pred.shape().rank() != 2 || y_pred.shape()[1] < 1) {
    throw InputError(fmt::format("metric {}: predictions must be an f32 tensor of shape (N, C), got {} {}", metric,
                                 y_pred.defined() ? dtype_name(y_pred.dtype()) : "undefined",
                                 y_pred.shape().to_string()));
  }
  Batch b{y_pred.shape()[0], y_pred.shape()[1]};
  if (!sample_weight.empty() && static_cast<std::int64_t>(sample_weight.size()) != b.N) {
    throw InputError(fmt::format("metric {}: {} sample weights for a batch of {} examples; give one weight per example",
                                 metric, sample_weight.size(), b.N));
  }
  return b;
}

bool is_label_tensor(const Tensor& y_true, std::int64_t N) {
  const Shape& s = y_true.shape();
  return y_true.dtype() == DType::i32 && ((s.rank() == 1 && s[0] == N) || (s.rank() == 2 && s[0] == N && s[1] == 1));
}

// y_true holds exactly one value per prediction: (N, C), or (N,) when C == 1; i32 or f32.
void check_elementwise_targets(const char* metric, const Tensor& y_true, const Batch& b) {
  const Shape& s = y_true.shape();
  const bool shape_ok = (s.rank() == 2 && s[0] == b.N && s[1] == b.C) || (b.C == 1 && s.rank() == 1 && s[0] == b.N);
  const bool dtype_ok = y_true.dtype() == DType::f32 || y_true.dtype() == DType::i32;
  if (!y_true.defined() || !shape_ok || !dtype_ok) {
    throw InputError(fmt::format("metric {}: labels {} {} do not match predictions ({}, {}); they must have the same "
                                 "shape",
                                 metric, y_true.defined() ? dtype_name(y_true.dtype()) : "undefined",
                                 s.to_string(), b.N, b.C));
  }
}

std::int32_t checked_label(const char* metric, const std::int32_t* labels, std::int64_t i, std::int64_t C) {
  const std::int32_t label = labels[i];
  if (label < 0 || label >= C) {
    throw InputError(fmt::format("metric {}: label {} of example {} is out of range [0, {}); check the number of "
                                 "classes in the data and the model's last layer",
                                 metric, label, i, C));
  }
  return label;
}

void check_state_layout(const char* metric, const MetricState& s, std::size_t counts, std::size_t sums) {
  DTRAIN_CHECK(s.counts.size() == counts && s.sums.size() == sums,
               fmt::format("metric {}: cannot merge a state with {} counts and {} sums (expected {} and {})", metric,
                           s.counts.size(), s.sums.size(), counts, sums));
}

}  // namespace

// ---------------------------------------------------------------- Mean

void Mean::update(double value, double weight) {
  total_ += value * weight;
  count_ += weight;
}

void Mean::update(const Tensor&, const Tensor& y_pred, std::span<const float> sample_weight) {
  const Batch b = check_predictions(name_.c_str(), y_pred, sample_weight);
  const float* v = y_pred.data<float>();  // a Mean of values the host holds
  for (std::int64_t i = 0; i < b.N; ++i) {
    const double w = sample_weight.empty() ? 1.0 : sample_weight[i];
    for (std::int64_t j = 0; j < b.C; ++j) update(v[i * b.C + j], w);
  }
}

double Mean::result() const { return count_ == 0.0 ? 0.0 : total_ / count_; }

void Mean::reset() { total_ = count_ = 0.0; }

MetricState Mean::state() const { return {{}, {total_, count_}}; }

void Mean::merge(const MetricState& other) {
  check_state_layout(name_.c_str(), other, 0, 2);
  total_ += other.sums[0];
  count_ += other.sums[1];
}

// ---------------------------------------------------------------- CountingMetric

void CountingMetric::count_example(std::int64_t matches, std::int64_t elements, const float* weight) {
  if (!weight) {
    correct_ += matches;
    total_ += elements;
    return;
  }
  // Keras reduces each example to its mean match before weighting it.
  weighted_correct_ += static_cast<double>(*weight) * static_cast<double>(matches) / static_cast<double>(elements);
  weighted_total_ += static_cast<double>(*weight);
}

double CountingMetric::result() const {
  const double denominator = static_cast<double>(total_) + weighted_total_;
  if (denominator == 0.0) return 0.0;
  if (weighted_total_ == 0.0) return static_cast<double>(correct_) / static_cast<double>(total_);
  return (static_cast<double>(correct_) + weighted_correct_) / denominator;
}

void CountingMetric::reset() {
  correct_ = total_ = 0;
  weighted_correct_ = weighted_total_ = 0.0;
}

MetricState CountingMetric::state() const { return {{correct_, total_}, {weighted_correct_, weighted_total_}}; }

void CountingMetric::merge(const MetricState& other) {
  check_state_layout(name().c_str(), other, 2, 2);
  correct_ += other.counts[0];
  total_ += other.counts[1];
  weighted_correct_ += other.sums[0];
  weighted_total_ += other.sums[1];
}

void CountingMetric::count_matches(const Tensor& y_true, const Tensor& y_pred, std::int64_t rows,
                                   std::int64_t columns, const float* threshold, std::span<const float> sample_weight) {
  row_matches_.resize(static_cast<std::size_t>(rows));
  numerics_.row_matches(y_pred.address<float>(), y_true.raw(), y_true.dtype() == DType::i32, rows, columns, threshold,
                        row_matches_.data());
  for (std::int64_t i = 0; i < rows; ++i)
    count_example(row_matches_[static_cast<std::size_t>(i)], columns,
                  sample_weight.empty() ? nullptr : &sample_weight[static_cast<std::size_t>(i)]);
}

// ---------------------------------------------------------------- accuracies

std::pair<std::int64_t, std::int64_t> SparseCategoricalAccuracy::check(const Tensor& y_true, const Tensor& y_pred,
                                                                       std::span<const float> sample_weight) const {
  const char* metric = kName;
  const Batch b = check_predictions(metric, y_pred, sample_weight);
  if (!y_true.defined() || !is_label_tensor(y_true, b.N)) {
    throw InputError(fmt::format("metric {}: labels must be i32 class ids of shape ({},), got {} {}; for one-hot "
                                 "labels use categorical_accuracy",
                                 metric, b.N, y_true.defined() ? dtype_name(y_true.dtype()) : "undefined",
                                 y_true.shape().to_string()));
  }
  return {b.N, b.C};
}

void SparseCategoricalAccuracy::update_deferred(const Tensor& y_true, const Tensor& y_pred) {
  if (y_true.host_accessible()) return update(y_true, y_pred);
  DTRAIN_CHECK(!pending_, "metric sparse_categorical_accuracy: a deferred update before the last one was settled");
  const auto [N, C] = check(y_true, y_pred, {});
  hits_.resize(static_cast<std::size_t>(N));
  classes_ = C;
  numerics_.label_hits(y_pred.address<float>(), y_true.address<std::int32_t>(), N, C, hits_.data(), true);
  pending_ = true;
}

void SparseCategoricalAccuracy::settle() {
  if (!pending_) return;
  pending_ = false;
  for (std::size_t i = 0; i < hits_.size(); ++i) {
    if (hits_[i] < 0)
      throw InputError(fmt::format("metric {}: the label of example {} is out of range [0, {}); check the number of "
                                   "classes in the data and the model's last layer",
                                   kName, i, classes_));
    count_example(hits_[i], 1, nullptr);
  }
}

void SparseCategoricalAccuracy::update(const Tensor& y_true, const Tensor& y_pred,
                                       std::span<const float> sample_weight) {
  const char* metric = kName;
  DTRAIN_CHECK(!pending_, "metric sparse_categorical_accuracy: an update before the deferred one was settled");
  const auto [N, C] = check(y_true, y_pred, sample_weight);
  const Batch b{N, C};
  argmax_pred_.resize(static_cast<std::size_t>(b.N));
  numerics_.argmax_rows(y_pred.address<float>(), b.N, b.C, argmax_pred_.data());
  const std::int32_t* labels = on_host<std::int32_t>(y_true, labels_);
  for (std::int64_t i = 0; i < b.N; ++i) {
    const std::int32_t label = checked_label(metric, labels, i, b.C);
    const bool hit = argmax_pred_[static_cast<std::size_t>(i)] == label;
    count_example(hit ? 1 : 0, 1, sample_weight.empty() ? nullptr : &sample_weight[i]);
  }
}

void CategoricalAccuracy::update(const Tensor& y_true, const Tensor& y_pred, std::span<const float> sample_weight) {
  const char* metric = kName;
  const Batch b = check_predictions(metric, y_pred, sample_weight);
  const bool labels = y_true.defined() && is_label_tensor(y_true, b.N);
  const bool one_hot = y_true.defined() && y_true.dtype() == DType::f32 && y_true.shape() == y_pred.shape();
  if (!labels && !one_hot) {
    throw InputError(fmt::format("metric {}: labels must be f32 one-hot rows of shape ({}, {}) or i32 class ids of "
                                 "shape ({},), got {} {}",
                                 metric, b.N, b.C, b.N, y_true.defined() ? dtype_name(y_true.dtype()) : "undefined",
                                 y_true.shape().to_string()));
  }
  argmax_pred_.resize(static_cast<std::size_t>(b.N));
  numerics_.argmax_rows(y_pred.address<float>(), b.N, b.C, argmax_pred_.data());
  const std::int32_t* host_labels = labels ? on_host<std::int32_t>(y_true, labels_) : nullptr;
  if (!labels) {
    argmax_true_.resize(static_cast<std::size_t>(b.N));
    numerics_.argmax_rows(y_true.address<float>(), b.N, b.C, argmax_true_.data());
  }
  for (std::int64_t i = 0; i < b.N; ++i) {
    const std::int64_t expected =
        labels ? checked_label(metric, host_labels, i, b.C) : argmax_true_[static_cast<std::size_t>(i)];
    const bool hit = argmax_pred_[static_cast<std::size_t>(i)] == expected;
    count_example(hit ? 1 : 0, 1, sample_weight.empty() ? nullptr : &sample_weight[i]);
  }
}

void BinaryAccuracy::update(const Tensor& y_true, const Tensor& y_pred, std::span<const float> sample_weight) {
  const char* metric = kName;
  const Batch b = check_predictions(metric, y_pred, sample_weight);
  check_elementwise_targets(metric, y_true, b);
  count_matches(y_true, y_pred, b.N, b.C, &threshold_, sample_weight);
}

// ---------------------------------------------------------------- factory

std::unique_ptr<Metric> make_metric(config::MetricKind kind, const config::LossConfig& loss, std::int64_t outputs,
                                    device::Numerics& numerics) {
  switch (kind) {
    case config::MetricKind::sparse_categorical_accuracy:
      return std::make_unique<SparseCategoricalAccuracy>(numerics);
    case config::MetricKind::categorical_accuracy:
      return std::make_unique<CategoricalAccuracy>(numerics);
    case config::MetricKind::accuracy:
      if (outputs == 1) {
        const bool logits = loss.kind == config::LossKind::binary_crossentropy && loss.from_logits;
        return std::make_unique<BinaryAccuracy>(numerics, logits ? 0.0f : 0.5f);
      }
      if (loss.kind == config::LossKind::sparse_categorical_crossentropy)
        return std::make_unique<SparseCategoricalAccuracy>(numerics);
      return std::make_unique<CategoricalAccuracy>(numerics);
  }
  DTRAIN_CHECK(false, "unknown metric kind");
  return nullptr;
}

}  // namespace dtrain::metrics
