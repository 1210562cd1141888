// Streaming metrics with Keras semantics (update / result / reset) and an exact state that a
// strategy can gather from every replica and rank and merge.
//
// Shapes: y_pred is a canonical f32 Tensor (N, C); y_true is i32 (N,) (or (N, 1)) class ids, or
// f32 (N, C) one-hot rows / targets; sample_weight is empty (= all 1) or N floats.
//
// Counting rule of the accuracies: unweighted updates add to exact int64 counts (correct, total);
// weighted updates add w_i-weighted values to double sums instead. result() is
// (correct + weighted_correct) / (total + weighted_total), so with no weights ever given it is an
// exact ratio of integers, identical whatever the number of replicas the batch was split over.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <string>
#include <vector>

#include "device/numerics.hpp"
#include "config/experiment.hpp"
#include "core/tensor.hpp"

namespace dtrain::metrics {

// Everything a metric has accumulated. Merging adds states elementwise, so
// merge(state of part A) into a metric holding part B == one metric updated with A and B.
struct MetricState {
  std::vector<std::int64_t> counts;
  std::vector<double> sums;
  bool operator==(const MetricState&) const = default;
};

class Metric {
 public:
  virtual ~Metric() = default;
  virtual std::string name() const = 0;
  virtual void update(const Tensor& y_true, const Tensor& y_pred, std::span<const float> sample_weight = {}) = 0;
  // An unweighted update whose device results may land later (a training step's): counted by
  // settle(), which the caller calls after the numerics' complete_reads() and before reading the
  // metric or updating it again. By default it updates at once, and settle() has nothing to do.
  virtual void update_deferred(const Tensor& y_true, const Tensor& y_pred) { update(y_true, y_pred); }
  virtual void settle() {}
  virtual double result() const = 0;  // 0 when nothing was counted
  virtual void reset() = 0;
  virtual MetricState state() const = 0;
  // Adds another metric's state (same kind); InternalError if the layout does not match.
  virtual void merge(const MetricState& other) = 0;
};

// Weighted mean of scalars: result = sum(w * value) / sum(w). State: sums {total, count}.
class Mean : public Metric {
 public:
  explicit Mean(std::string name = "mean") : name_(std::move(name)) {}
  std::string name() const override { return name_; }
  void update(double value, double weight = 1.0);
  // Every element of y_pred is a value; example i's values get weight w_i. y_true is ignored.
  void update(const Tensor& y_true, const Tensor& y_pred, std::span<const float> sample_weight = {}) override;
  double result() const override;
  void reset() override;
  MetricState state() const override;
  void merge(const MetricState& other) override;

 private:
  std::string name_;
  double total_ = 0.0;
  double count_ = 0.0;
};

// Shared bookkeeping of the accuracies (see the counting rule at the top of this file).
// State: counts {correct, total}, sums {weighted_correct, weighted_total}. The comparisons run on
// the replica's backend (`numerics`); the counting happens here.
class CountingMetric : public Metric {
 public:
  explicit CountingMetric(device::Numerics& numerics) : numerics_(numerics) {}
  double result() const override;
  void reset() override;
  MetricState state() const override;
  void merge(const MetricState& other) override;

 protected:
  // One example: `matches` of `elements` compared values matched; weight null = unweighted.
  void count_example(std::int64_t matches, std::int64_t elements, const float* weight);
  // The elementwise accuracies: each row's matching columns, exactly or after `threshold`.
  void count_matches(const Tensor& y_true, const Tensor& y_pred, std::int64_t rows, std::int64_t columns,
                     const float* threshold, std::span<const float> sample_weight);
  // The elements of `t` where the host can read them: `t` itself when it may, else a copy in
  // `scratch` (labels staged to a GPU: one small read-back per update).
  template <class T>
  const T* on_host(const Tensor& t, std::vector<T>& scratch) {
    if (t.host_accessible()) return t.data<T>();
    scratch.resize(static_cast<std::size_t>(t.numel()));
    numerics_.to_host(t.raw(), scratch.data(), t.bytes());
    return scratch.data();
  }
  device::Numerics& numerics_;
  // Per-row results of the backend (argmax, match counts) and labels read back, reused across
  // updates.
  std::vector<std::int32_t> argmax_pred_, argmax_true_, labels_;
  std::vector<std::int64_t> row_matches_;

 private:
  std::int64_t correct_ = 0;
  std::int64_t total_ = 0;
  double weighted_correct_ = 0.0;
  double weighted_total_ = 0.0;
};

// argmax(y_pred[i, :]) == y_true[i] (first maximum wins). Labels outside [0, C) are an InputError.
class SparseCategoricalAccuracy : public CountingMetric {
 public:
  using CountingMetric::CountingMetric;
  static constexpr const char* kName = "sparse_categorical_accuracy";
  std::string name() const override { return kName; }
  void update(const Tensor& y_true, const Tensor& y_pred, std::span<const float> sample_weight = {}) override;
  // Labels the host cannot read in place (staged to a GPU) are compared where they are, and only
  // each row's hit comes back, deferred; labels the host reads update at once.
  void update_deferred(const Tensor& y_true, const Tensor& y_pred) override;
  void settle() override;

 private:
  // Checks predictions and labels; returns (N, C).
  std::pair<std::int64_t, std::int64_t> check(const Tensor& y_true, const Tensor& y_pred,
                                              std::span<const float> sample_weight) const;
  std::vector<std::int32_t> hits_;  // a deferred update's rows: 1 hit, 0 miss, -1 label out of range
  std::int64_t classes_ = 0;        // its predictions' columns
  bool pending_ = false;
};

// argmax(y_true[i, :]) == argmax(y_pred[i, :]); i32 labels (N,) are accepted as class ids.
class CategoricalAccuracy : public CountingMetric {
 public:
  using CountingMetric::CountingMetric;
  static constexpr const char* kName = "categorical_accuracy";
  std::string name() const override { return kName; }
  void update(const Tensor& y_true, const Tensor& y_pred, std::span<const float> sample_weight = {}) override;
};

// (y_pred > threshold) == y_true elementwise; an example's share is its fraction of matching columns.
class BinaryAccuracy : public CountingMetric {
 public:
  explicit BinaryAccuracy(device::Numerics& numerics, float threshold = 0.5f)
      : CountingMetric(numerics), threshold_(threshold) {}
  static constexpr const char* kName = "binary_accuracy";
  std::string name() const override { return kName; }
  void update(const Tensor& y_true, const Tensor& y_pred, std::span<const float> sample_weight = {}) override;

 private:
  float threshold_;
};

// Like Keras 3's compile(metrics=[...]): `accuracy` resolves from the shapes, `outputs` being the
// model's outputs per example (its last dimension): one output -> binary_accuracy; else integer
// class ids (sparse_categorical_crossentropy) -> sparse_categorical_accuracy; else (one-hot or
// other float targets of each output) categorical_accuracy, whatever the loss, as Keras picks it.
// binary_accuracy thresholds at 0.5, but at 0 on the logits of binary_crossentropy with
// from_logits (sigmoid(x) > 0.5 exactly when x > 0; Keras would compare the logits with 0.5).
// The comparisons run on `numerics` (the replica's context).
std::unique_ptr<Metric> make_metric(config::MetricKind kind, const config::LossConfig& loss, std::int64_t outputs,
                                    device::Numerics& numerics);

}  // namespace dtrain::metrics
