#include <doctest/doctest.h>

#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "metrics/metric.hpp"
#include "test_support.hpp"

using namespace dtrain;
using namespace dtrain::metrics;

namespace {

Tensor make_f32(Shape shape, const std::vector<float>& values) {
  Tensor t(std::move(shape), DType::f32);
  REQUIRE(static_cast<std::size_t>(t.numel()) == values.size());
  for (std::size_t i = 0; i < values.size(); ++i) t.data<float>()[i] = values[i];
  return t;
}

Tensor make_labels(const std::vector<std::int32_t>& labels) {
  Tensor t(Shape{static_cast<std::int64_t>(labels.size())}, DType::i32);
  for (std::size_t i = 0; i < labels.size(); ++i) t.data<std::int32_t>()[i] = labels[i];
  return t;
}

config::LossConfig loss_of(config::LossKind kind, bool from_logits = false) {
  config::LossConfig c;
  c.kind = kind;
  c.from_logits = from_logits;
  return c;
}

}  // namespace

TEST_CASE("sparse categorical accuracy counts exact integers; first maximum wins") {
  SparseCategoricalAccuracy m(testing::cpu_numerics());
  CHECK(m.result() == 0.0);
  // argmax rows: 2, 0 (tie 0/1 -> 0), 1, 0 (all equal -> 0)
  const Tensor pred = make_f32({4, 3}, {0.1f, 0.2f, 0.7f, 0.5f, 0.5f, 0.0f, 0.0f, 3.0f, 1.0f, 1, 1, 1});
  m.update(make_labels({2, 1, 1, 0}), pred);
  CHECK(m.state().counts == std::vector<std::int64_t>{3, 4});
  CHECK(m.result() == 0.75);
  m.update(make_labels({0, 0, 0, 1}), pred);
  CHECK(m.state().counts == std::vector<std::int64_t>{4, 8});
  CHECK(m.result() == 0.5);
  m.reset();
  CHECK(m.state().counts == std::vector<std::int64_t>{0, 0});
  CHECK(m.result() == 0.0);
}

TEST_CASE("merging replica states equals one metric over everything") {
  const std::int64_t N = 101, C = 10;
  Rng rng(3, RngStream::test);
  std::vector<float> pred(static_cast<std::size_t>(N * C));
  for (auto& v : pred) v = rng.uniform();
  std::vector<std::int32_t> labels(static_cast<std::size_t>(N));
  for (auto& l : labels) l = static_cast<std::int32_t>(rng.below(C));
  std::vector<float> weights(static_cast<std::size_t>(N));
  for (auto& w : weights) w = static_cast<float>(rng.below(4));
  const Tensor y_pred = make_f32({N, C}, pred);
  const Tensor y_true = make_labels(labels);

  for (bool weighted : {false, true}) {
    CAPTURE(weighted);
    const std::span<const float> w = weighted ? std::span<const float>(weights) : std::span<const float>();
    SparseCategoricalAccuracy whole(testing::cpu_numerics()), first(testing::cpu_numerics()), second(testing::cpu_numerics());
    whole.update(y_true, y_pred, w);
    first.update(y_true.slice_rows(0, 37), y_pred.slice_rows(0, 37), weighted ? w.first(37) : w);
    second.update(y_true.slice_rows(37, N), y_pred.slice_rows(37, N), weighted ? w.subspan(37) : w);
    first.merge(second.state());
    CHECK(first.state().counts == whole.state().counts);
    CHECK(first.state().sums[0] == doctest::Approx(whole.state().sums[0]));
    CHECK(first.state().sums[1] == doctest::Approx(whole.state().sums[1]));
    CHECK(first.result() == doctest::Approx(whole.result()));
    CHECK(whole.result() > 0.0);
    if (!weighted) CHECK(first.state() == whole.state());
  }
}

TEST_CASE("weighted accuracies use double sums; unweighted stay integer") {
  SparseCategoricalAccuracy m(testing::cpu_numerics());
  const Tensor pred = make_f32({3, 2}, {1, 0, 1, 0, 0, 1});
  const std::vector<float> weights{2.0f, 0.5f, 1.0f};
  m.update(make_labels({0, 1, 1}), pred, weights);  // correct: 0 (w 2) and 2 (w 1)
  CHECK(m.state().counts == std::vector<std::int64_t>{0, 0});
  CHECK(m.result() == doctest::Approx(3.0 / 3.5));
  m.update(make_labels({0, 0, 0}), pred);  // unweighted: 2 of 3
  CHECK(m.state().counts == std::vector<std::int64_t>{2, 3});
  CHECK(m.result() == doctest::Approx((3.0 + 2.0) / (3.5 + 3.0)));
  CHECK_THROWS_AS(m.update(make_labels({0, 0, 0}), pred, std::vector<float>{1, 1}), InputError);
}

TEST_CASE("categorical accuracy with one-hot rows and with class ids") {
  CategoricalAccuracy m(testing::cpu_numerics());
  const Tensor pred = make_f32({3, 3}, {0.1f, 0.8f, 0.1f, 0.6f, 0.3f, 0.1f, 0.2f, 0.2f, 0.6f});
  m.update(make_f32({3, 3}, {0, 1, 0, 0, 0, 1, 0, 0, 1}), pred);
  CHECK(m.state().counts == std::vector<std::int64_t>{2, 3});
  m.update(make_labels({1, 0, 0}), pred);
  CHECK(m.state().counts == std::vector<std::int64_t>{4, 6});
  CHECK(m.name() == "categorical_accuracy");
  CHECK_THROWS_AS(m.update(make_f32({3, 2}, {0, 1, 0, 1, 0, 1}), pred), InputError);
}

TEST_CASE("binary accuracy counts each example with the mean of its outputs' matches, weighted") {
  BinaryAccuracy m(testing::cpu_numerics(), 0.5f);
  m.update(make_f32({2, 2}, {1, 0, 0, 0}), make_f32({2, 2}, {0.9f, 0.8f, 0.1f, 0.2f}));
  CHECK(m.result() == doctest::Approx(0.75));
  m.update(make_labels({1}), make_f32({1, 1}, {0.7f}));
  CHECK(m.state().counts == std::vector<std::int64_t>{4, 5});
  // Weighted: each example counts with its mean match.
  m.reset();
  m.update(make_f32({2, 2}, {1, 0, 0, 0}), make_f32({2, 2}, {0.9f, 0.8f, 0.1f, 0.2f}), std::vector<float>{1.0f, 3.0f});
  CHECK(m.result() == doctest::Approx((0.5 * 1 + 1.0 * 3) / 4));
  CHECK_THROWS_AS(m.update(make_f32({2, 1}, {1, 0}), make_f32({2, 2}, {1, 1, 0, 0})), InputError);
}

TEST_CASE("binary accuracy thresholds probabilities at 0.5, logits at 0") {
  BinaryAccuracy probabilities(testing::cpu_numerics(), 0.5f);
  probabilities.update(make_labels({1, 0, 1, 0}), make_f32({4, 1}, {0.7f, 0.2f, 0.5f, 0.9f}));
  CHECK(probabilities.state().counts == std::vector<std::int64_t>{2, 4});  // 0.5 is not > 0.5
  BinaryAccuracy logits(testing::cpu_numerics(), 0.0f);
  logits.update(make_f32({2, 2}, {1, 0, 0, 1}), make_f32({2, 2}, {2.0f, -1.0f, 0.5f, 3.0f}));
  CHECK(logits.state().counts == std::vector<std::int64_t>{3, 4});
}

TEST_CASE("make_metric resolves accuracy as Keras 3's compile does: from the outputs and the labels, with Keras names") {
  using config::LossKind;
  using config::MetricKind;
  const auto name_of = [](MetricKind kind, config::LossConfig loss, std::int64_t outputs) {
    return make_metric(kind, loss, outputs, testing::cpu_numerics())->name();
  };
  CHECK(name_of(MetricKind::accuracy, loss_of(LossKind::sparse_categorical_crossentropy), 10) ==
        "sparse_categorical_accuracy");
  CHECK(name_of(MetricKind::accuracy, loss_of(LossKind::categorical_crossentropy), 10) == "categorical_accuracy");
  CHECK(name_of(MetricKind::accuracy, loss_of(LossKind::binary_crossentropy), 1) == "binary_accuracy");
  // One output is binary whatever the loss; several float targets each are categorical (Keras
  // picks categorical_accuracy for a multi-label binary_crossentropy too).
  CHECK(name_of(MetricKind::accuracy, loss_of(LossKind::mean_squared_error), 1) == "binary_accuracy");
  CHECK(name_of(MetricKind::accuracy, loss_of(LossKind::mean_squared_error), 3) == "categorical_accuracy");
  CHECK(name_of(MetricKind::accuracy, loss_of(LossKind::binary_crossentropy), 4) == "categorical_accuracy");
  CHECK(name_of(MetricKind::accuracy, loss_of(LossKind::categorical_crossentropy), 1) == "binary_accuracy");
  // Named metrics are what they say.
  CHECK(name_of(MetricKind::sparse_categorical_accuracy, loss_of(LossKind::mean_squared_error), 1) ==
        "sparse_categorical_accuracy");
  CHECK(name_of(MetricKind::categorical_accuracy, loss_of(LossKind::sparse_categorical_crossentropy), 10) ==
        "categorical_accuracy");

  // With logits the binary threshold is 0: a logit of 0.3 is class 1, a probability of 0.3 is not.
  auto on_logits = make_metric(MetricKind::accuracy, loss_of(LossKind::binary_crossentropy, true), 1, testing::cpu_numerics());
  auto on_probabilities =
      make_metric(MetricKind::accuracy, loss_of(LossKind::binary_crossentropy, false), 1, testing::cpu_numerics());
  on_logits->update(make_labels({1}), make_f32({1, 1}, {0.3f}));
  on_probabilities->update(make_labels({1}), make_f32({1, 1}, {0.3f}));
  CHECK(on_logits->result() == 1.0);
  CHECK(on_probabilities->result() == 0.0);
  // A regression's one output is thresholded at 0.5, as Keras' BinaryAccuracy does: 0.7 against a
  // target of 1 is a hit, 0.4 against 1 and 0.6 against 0 are not.
  auto regression = make_metric(MetricKind::accuracy, loss_of(LossKind::mean_squared_error), 1, testing::cpu_numerics());
  regression->update(make_f32({3, 1}, {1.0f, 1.0f, 0.0f}), make_f32({3, 1}, {0.7f, 0.4f, 0.6f}));
  CHECK(regression->result() == doctest::Approx(1.0 / 3.0));
  // Several float targets: the largest prediction against the largest target.
  auto several = make_metric(MetricKind::accuracy, loss_of(LossKind::mean_squared_error), 2, testing::cpu_numerics());
  several->update(make_f32({2, 2}, {0.1f, 0.9f, 0.8f, 0.2f}), make_f32({2, 2}, {0.0f, 2.0f, 0.0f, 1.0f}));
  CHECK(several->result() == doctest::Approx(0.5));
}

TEST_CASE("Mean: weighted mean, reset, merge") {
  Mean m("loss");
  CHECK(m.name() == "loss");
  CHECK(m.result() == 0.0);
  m.update(1.0);
  m.update(4.0, 2.0);
  CHECK(m.result() == doctest::Approx(3.0));
  Mean other;
  other.update(10.0);
  m.merge(other.state());
  CHECK(m.result() == doctest::Approx(19.0 / 4.0));
  m.reset();
  CHECK(m.result() == 0.0);
  m.update(Tensor(), make_f32({2, 2}, {1, 2, 3, 4}), std::vector<float>{1.0f, 0.0f});
  CHECK(m.result() == doctest::Approx(1.5));
}

TEST_CASE("bad labels and mismatched states are errors") {
  SparseCategoricalAccuracy m(testing::cpu_numerics());
  const Tensor pred = make_f32({2, 3}, {0, 0, 1, 1, 0, 0});
  CHECK_THROWS_AS(m.update(make_labels({0, 3}), pred), InputError);
  CHECK_THROWS_AS(m.update(make_labels({-1, 0}), pred), InputError);
  CHECK_THROWS_AS(m.update(make_labels({0, 1, 2}), pred), InputError);
  CHECK_THROWS_AS(m.update(make_f32({2, 3}, {0, 0, 1, 1, 0, 0}), pred), InputError);
  CHECK_THROWS_AS(m.update(make_labels({0, 1}), make_f32({6}, {0, 0, 1, 1, 0, 0})), InputError);
  CHECK_THROWS_AS(m.merge(Mean().state()), InternalError);
  CHECK_THROWS_AS(Mean().merge(m.state()), InternalError);
}
