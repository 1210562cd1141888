#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "losses/loss.hpp"
#include "test_support.hpp"

using namespace dtrain;
using namespace dtrain::losses;
using config::LossKind;
using config::Reduction;

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

config::LossConfig loss_config(LossKind kind, bool from_logits, Reduction reduction = Reduction::none) {
  config::LossConfig c;
  c.kind = kind;
  c.from_logits = from_logits;
  c.reduction = reduction;
  return c;
}

std::vector<float> per_example(const Loss& loss, const Tensor& y_pred, const Tensor& y_true) {
  std::vector<float> out(static_cast<std::size_t>(y_pred.shape()[0]));
  loss.per_example(y_pred, y_true, out);
  return out;
}

template <class A, class B>
double relative_error(const A& a, const B& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0.0, ref = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    diff += d * d;
    ref += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return std::sqrt(diff) / std::max(std::sqrt(ref), 1e-300);
}

// One gradient-check scenario: predictions, and labels or dense targets.
struct Case {
  const char* what;
  LossKind kind;
  bool from_logits;
  std::int64_t N, C;
  bool integer_labels;
  bool soft_targets = false;  // dense targets that are not one-hot
};

struct Inputs {
  std::vector<float> pred;
  std::vector<float> dense;  // empty with integer labels
  std::vector<std::int32_t> labels;
  std::vector<float> weights;
};

Inputs random_inputs(const Case& c, std::uint64_t seed) {
  Rng rng(seed, RngStream::test, static_cast<std::uint64_t>(c.kind) * 10 + (c.from_logits ? 1 : 0));
  Inputs in;
  const auto n = static_cast<std::size_t>(c.N), nc = static_cast<std::size_t>(c.N * c.C);
  const bool crossentropy = c.kind == LossKind::sparse_categorical_crossentropy || c.kind == LossKind::categorical_crossentropy;
  for (std::size_t k = 0; k < nc; ++k) {
    if (c.from_logits || c.kind == LossKind::mean_squared_error) in.pred.push_back(rng.uniform(-3.0f, 3.0f));
    // Unnormalized positive rows: the categorical renormalization, and the sparse softmax of the
    // logs of rows that do not sum to 1, are part of what is checked. Every value, and every
    // normalized probability, stays far from the clip range (the differences' steps too).
    else if (crossentropy) in.pred.push_back(rng.uniform(0.2f, 0.9f));
    else in.pred.push_back(rng.uniform(0.05f, 0.95f));
  }
  for (std::size_t i = 0; i < n; ++i) in.weights.push_back(rng.uniform(0.5f, 1.5f));
  if (c.integer_labels) {
    for (std::size_t i = 0; i < n; ++i) {
      if (crossentropy) in.labels.push_back(static_cast<std::int32_t>(rng.below(static_cast<std::uint64_t>(c.C))));
      else if (c.kind == LossKind::binary_crossentropy) in.labels.push_back(static_cast<std::int32_t>(rng.below(2)));
      else in.labels.push_back(static_cast<std::int32_t>(rng.below(7)) - 3);
    }
    return in;
  }
  in.dense.assign(nc, 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    float* row = in.dense.data() + i * static_cast<std::size_t>(c.C);
    if (c.kind == LossKind::mean_squared_error) {
      for (std::int64_t j = 0; j < c.C; ++j) row[j] = rng.uniform(-2.0f, 2.0f);
    } else if (c.soft_targets) {
      for (std::int64_t j = 0; j < c.C; ++j) row[j] = rng.uniform(0.0f, 1.0f);
    } else if (crossentropy) {
      row[rng.below(static_cast<std::uint64_t>(c.C))] = 1.0f;
    } else {
      for (std::int64_t j = 0; j < c.C; ++j) row[j] = static_cast<float>(rng.below(2));
    }
  }
  return in;
}

// scale * sum_i w_i loss_i in double, the objective whose gradient Loss::gradient returns.
double objective(const LossSpec& spec, const Case& c, const std::vector<double>& pred, const std::vector<double>& dense,
                 const Inputs& in, double scale) {
  std::vector<double> losses(static_cast<std::size_t>(c.N));
  batch_loss<double>(spec, c.N, c.C, pred.data(), dense.empty() ? nullptr : dense.data(),
                     in.labels.empty() ? nullptr : in.labels.data(), nullptr, 1.0, losses.data(), nullptr);
  double sum = 0.0;
  for (std::size_t i = 0; i < losses.size(); ++i) sum += static_cast<double>(in.weights[i]) * losses[i];
  return scale * sum;
}

}  // namespace

TEST_CASE("every loss passes a finite-difference gradient check in double, and float matches double") {
  const Case cases[] = {
      {"sparse CE, logits", LossKind::sparse_categorical_crossentropy, true, 5, 7, true},
      {"sparse CE, probabilities", LossKind::sparse_categorical_crossentropy, false, 5, 7, true},
      {"categorical CE, logits, one-hot", LossKind::categorical_crossentropy, true, 5, 7, false},
      {"categorical CE, probabilities, one-hot", LossKind::categorical_crossentropy, false, 5, 7, false},
      {"categorical CE, logits, soft targets", LossKind::categorical_crossentropy, true, 5, 7, false, true},
      {"categorical CE, probabilities, soft targets", LossKind::categorical_crossentropy, false, 5, 7, false, true},
      {"categorical CE, logits, int labels", LossKind::categorical_crossentropy, true, 5, 7, true},
      {"categorical CE, probabilities, int labels", LossKind::categorical_crossentropy, false, 5, 7, true},
      {"binary CE, logits", LossKind::binary_crossentropy, true, 5, 4, false},
      {"binary CE, probabilities", LossKind::binary_crossentropy, false, 5, 4, false},
      {"binary CE, logits, soft targets", LossKind::binary_crossentropy, true, 5, 4, false, true},
      {"binary CE, probabilities, soft targets", LossKind::binary_crossentropy, false, 5, 4, false, true},
      {"binary CE, logits, int labels C=1", LossKind::binary_crossentropy, true, 6, 1, true},
      {"binary CE, probabilities, int labels C=1", LossKind::binary_crossentropy, false, 6, 1, true},
      {"mse", LossKind::mean_squared_error, false, 5, 3, false},
      {"mse, from_logits ignored", LossKind::mean_squared_error, true, 5, 3, false},
      {"mse, int targets C=1", LossKind::mean_squared_error, false, 6, 1, true},
  };
  for (const Case& c : cases) {
    const std::string what = c.what;
    CAPTURE(what);
    const Inputs in = random_inputs(c, 7);
    const LossSpec spec{c.kind, c.from_logits};
    const double scale = 1.0 / static_cast<double>(c.N);

    // Double: analytic vs central differences.
    std::vector<double> pred(in.pred.begin(), in.pred.end());
    std::vector<double> dense(in.dense.begin(), in.dense.end());
    std::vector<double> grad(pred.size());
    batch_loss<double>(spec, c.N, c.C, pred.data(), dense.empty() ? nullptr : dense.data(),
                       in.labels.empty() ? nullptr : in.labels.data(), in.weights.data(), scale, nullptr, grad.data());
    std::vector<double> numeric(pred.size());
    const double h = 1e-6;
    for (std::size_t k = 0; k < pred.size(); ++k) {
      const double saved = pred[k];
      pred[k] = saved + h;
      const double plus = objective(spec, c, pred, dense, in, scale);
      pred[k] = saved - h;
      const double minus = objective(spec, c, pred, dense, in, scale);
      pred[k] = saved;
      numeric[k] = (plus - minus) / (2 * h);
    }
    CHECK(relative_error(grad, numeric) < 1e-6);

    // Float path through the public API vs the double oracle.
    const Loss loss(loss_config(c.kind, c.from_logits), testing::cpu_numerics());
    const Tensor y_pred = make_f32(Shape{c.N, c.C}, in.pred);
    const Tensor y_true = c.integer_labels ? make_labels(in.labels) : make_f32(Shape{c.N, c.C}, in.dense);
    Tensor d_pred;
    loss.gradient(y_pred, y_true, in.weights, static_cast<float>(scale), d_pred);
    REQUIRE(d_pred.shape() == y_pred.shape());
    const auto float_grad = d_pred.span<float>();
    CHECK(relative_error(float_grad, grad) < 1e-5);

    std::vector<double> double_losses(static_cast<std::size_t>(c.N));
    batch_loss<double>(spec, c.N, c.C, pred.data(), dense.empty() ? nullptr : dense.data(),
                       in.labels.empty() ? nullptr : in.labels.data(), nullptr, 1.0, double_losses.data(), nullptr);
    CHECK(relative_error(per_example(loss, y_pred, y_true), double_losses) < 1e-5);
  }
}

TEST_CASE("the gradient check can fail: a wrong gradient is detected") {
  // Guards the checker itself: perturb one analytic entry and the error must exceed the tolerance.
  const std::vector<double> good{0.1, -0.2, 0.3};
  std::vector<double> bad = good;
  bad[1] += 1e-3;
  CHECK(relative_error(bad, good) > 1e-6);
}

TEST_CASE("crossentropy values match hand computations") {
  const Loss sparse_logits(loss_config(LossKind::sparse_categorical_crossentropy, true), testing::cpu_numerics());
  auto l = per_example(sparse_logits, make_f32({2, 3}, {0, 0, 0, 1, 2, 3}), make_labels({1, 2}));
  CHECK(l[0] == doctest::Approx(std::log(3.0)));
  CHECK(l[1] == doctest::Approx(std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 3.0));

  SUBCASE("logits are stable for large values") {
    l = per_example(sparse_logits, make_f32({2, 2}, {1000, 0, 1000, 0}), make_labels({1, 0}));
    CHECK(l[0] == doctest::Approx(1000.0));
    CHECK(l[1] == doctest::Approx(0.0));
    CHECK(std::isfinite(l[0]));
  }
  SUBCASE("probabilities: categorical renormalizes then clips, sparse clips then takes a softmax of the logs, "
          "as Keras") {
    // Keras 3 (TensorFlow 2.21): sparse [0.6931472, 1.0986123, 16.118095], categorical of the same
    // labels one-hot [0.6931472, 0.6931472, 16.118095]. The rows that do not sum to 1 tell them apart.
    const auto p = make_f32({3, 3}, {0.2f, 0.3f, 0.5f, 1, 1, 2, 1, 0, 0});
    const Loss sparse_probs(loss_config(LossKind::sparse_categorical_crossentropy, false), testing::cpu_numerics());
    l = per_example(sparse_probs, p, make_labels({2, 2, 1}));
    CHECK(l[0] == doctest::Approx(-std::log(0.5)));
    CHECK(l[1] == doctest::Approx(std::log(3.0)));  // every p clipped to 1 - 1e-7: log 3 (1 - 1e-7) - log(1 - 1e-7)
    CHECK(l[2] == doctest::Approx(std::log(1 + 1e-7) - std::log(1e-7)).epsilon(1e-5));
    const Loss categorical_probs(loss_config(LossKind::categorical_crossentropy, false), testing::cpu_numerics());
    l = per_example(categorical_probs, p, make_f32({3, 3}, {0, 0, 1, 0, 0, 1, 0, 1, 0}));
    CHECK(l[0] == doctest::Approx(-std::log(0.5)));
    CHECK(l[1] == doctest::Approx(-std::log(0.5)));
    CHECK(l[2] == doctest::Approx(-std::log(1e-7)).epsilon(1e-5));
    // A row of zeros (a relu output): finite for sparse (every p clipped to 1e-7: log 3), as in Keras.
    l = per_example(sparse_probs, make_f32({1, 3}, {0, 0, 0}), make_labels({0}));
    CHECK(l[0] == doctest::Approx(std::log(3.0)).epsilon(1e-5));
    // The sparse gradient: 1 / S - [j = label] / p_j inside the clip range, and 0 outside it, where
    // TensorFlow's clip_by_value passes none (S: the clipped row's sum).
    Tensor d;
    const std::vector<float> one_weight{1.0f};
    sparse_probs.gradient(make_f32({1, 3}, {2.0f, 0.5f, 0.0f}), make_labels({1}), one_weight, 1.0f, d);
    const double s = (1 - 1e-7) + 0.5 + 1e-7;
    CHECK(d.data<float>()[0] == 0.0f);
    CHECK(d.data<float>()[1] == doctest::Approx(1 / s - 1 / 0.5));
    CHECK(d.data<float>()[2] == 0.0f);
  }
  SUBCASE("categorical with one-hot targets equals sparse with labels") {
    const Loss categorical(loss_config(LossKind::categorical_crossentropy, true), testing::cpu_numerics());
    const auto a = per_example(categorical, make_f32({2, 3}, {0, 0, 0, 1, 2, 3}), make_f32({2, 3}, {0, 1, 0, 0, 0, 1}));
    const auto b = per_example(categorical, make_f32({2, 3}, {0, 0, 0, 1, 2, 3}), make_labels({1, 2}));
    CHECK(a[0] == doctest::Approx(std::log(3.0)));
    CHECK(a[1] == doctest::Approx(b[1]));
  }
}

TEST_CASE("binary crossentropy and mse values") {
  const Loss bce_logits(loss_config(LossKind::binary_crossentropy, true), testing::cpu_numerics());
  auto l = per_example(bce_logits, make_f32({3, 1}, {0, 100, -100}), make_f32({3, 1}, {1, 0, 0}));
  CHECK(l[0] == doctest::Approx(std::log(2.0)));
  CHECK(l[1] == doctest::Approx(100.0));
  CHECK(l[2] == doctest::Approx(0.0));

  const Loss bce_probs(loss_config(LossKind::binary_crossentropy, false), testing::cpu_numerics());
  // Mean over the columns, as Keras.
  l = per_example(bce_probs, make_f32({1, 2}, {0.8f, 0.4f}), make_f32({1, 2}, {1, 0}));
  CHECK(l[0] == doctest::Approx((-std::log(0.8) - std::log(0.6)) / 2).epsilon(1e-6));
  l = per_example(bce_probs, make_f32({2, 1}, {0.8f, 0.0f}), make_labels({1, 1}));
  CHECK(l[0] == doctest::Approx(-std::log(0.8)).epsilon(1e-6));
  CHECK(l[1] == doctest::Approx(-std::log(1e-7)).epsilon(1e-5));

  const Loss mse(loss_config(LossKind::mean_squared_error, false), testing::cpu_numerics());
  l = per_example(mse, make_f32({2, 2}, {1, 2, 0, 0}), make_f32({2, 2}, {0, 0, 0, 0}));
  CHECK(l[0] == doctest::Approx(2.5));
  CHECK(l[1] == 0.0f);
  l = per_example(mse, make_f32({1, 1}, {1}), make_labels({3}));
  CHECK(l[0] == doctest::Approx(4.0));
}

TEST_CASE("gradient scale and weights; no reallocation after the first call") {
  const Loss loss(loss_config(LossKind::sparse_categorical_crossentropy, true), testing::cpu_numerics());
  const Tensor y_pred = make_f32({2, 2}, {0, 0, 0, 0});
  const Tensor y_true = make_labels({0, 1});
  Tensor d;
  const std::vector<float> weights{2.0f, 0.0f};
  loss.gradient(y_pred, y_true, weights, 0.25f, d);
  // softmax = 0.5 each: d = scale * w * (0.5 - onehot)
  CHECK(d.data<float>()[0] == doctest::Approx(0.25 * 2 * -0.5));
  CHECK(d.data<float>()[1] == doctest::Approx(0.25 * 2 * 0.5));
  CHECK(d.data<float>()[2] == 0.0f);
  CHECK(d.data<float>()[3] == 0.0f);

  const void* storage = d.raw();
  loss.gradient(y_pred, y_true, {}, 1.0f, d);
  CHECK(d.raw() == storage);
  CHECK(d.data<float>()[0] == doctest::Approx(-0.5));
  loss.gradient(y_pred.slice_rows(0, 1), make_labels({1}), {}, 1.0f, d);  // a short last batch
  CHECK(d.raw() == storage);
  CHECK(d.shape() == Shape{1, 2});
}

TEST_CASE("bad shapes, dtypes and labels are InputErrors") {
  const Loss sparse(loss_config(LossKind::sparse_categorical_crossentropy, true), testing::cpu_numerics());
  const Tensor pred = make_f32({2, 3}, {0, 0, 0, 0, 0, 0});
  std::vector<float> out(2);
  CHECK_THROWS_AS(sparse.per_example(pred, make_labels({0, 3}), out), InputError);
  CHECK_THROWS_AS(sparse.per_example(pred, make_labels({-1, 0}), out), InputError);
  CHECK_THROWS_AS(sparse.per_example(pred, make_labels({0, 1, 2}), out), InputError);
  CHECK_THROWS_AS(sparse.per_example(pred, make_f32({2, 3}, {1, 0, 0, 0, 1, 0}), out), InputError);
  CHECK_THROWS_AS(sparse.per_example(make_f32({6}, {0, 0, 0, 0, 0, 0}), make_labels({0, 1}), out), InputError);
  CHECK_THROWS_WITH_AS(sparse.per_example(pred, make_labels({0, 7}), out),
                       doctest::Contains("label 7 of example 1 is out of range [0, 3)"), InputError);
  Tensor d;
  const std::vector<float> three_weights{1, 1, 1};
  CHECK_THROWS_AS(sparse.gradient(pred, make_labels({0, 1}), three_weights, 1.0f, d), InputError);
  // The label tensor of shape (N, 1) is accepted.
  Tensor column_labels = make_labels({0, 2}).reshaped(Shape{2, 1});
  CHECK_NOTHROW(sparse.per_example(pred, column_labels, out));

  const Loss categorical(loss_config(LossKind::categorical_crossentropy, false), testing::cpu_numerics());
  CHECK_THROWS_AS(categorical.per_example(pred, make_f32({2, 2}, {1, 0, 0, 1}), out), InputError);

  const Loss bce(loss_config(LossKind::binary_crossentropy, true), testing::cpu_numerics());
  CHECK_THROWS_AS(bce.per_example(pred, make_labels({0, 1}), out), InputError);  // int labels need C == 1
  CHECK_THROWS_AS(bce.per_example(make_f32({2, 1}, {0, 0}), make_labels({0, 2}), out), InputError);

  const Loss mse(loss_config(LossKind::mean_squared_error, false), testing::cpu_numerics());
  CHECK_THROWS_AS(mse.per_example(pred, make_f32({2, 2}, {0, 0, 0, 0}), out), InputError);
  std::vector<float> wrong_size(3);
  CHECK_THROWS_AS(mse.per_example(pred, make_f32({2, 3}, {0, 0, 0, 0, 0, 0}), wrong_size), InternalError);
}

TEST_CASE("compute_average_loss divides by the global batch, with weights") {
  const std::vector<float> losses{1, 2, 3, 4};
  CHECK(compute_average_loss(losses, 4) == doctest::Approx(2.5));
  CHECK(compute_average_loss(losses, 8) == doctest::Approx(1.25));
  const std::vector<float> weights{1, 0, 2, 0.5f};
  CHECK(compute_average_loss(losses, 4, weights) == doctest::Approx((1 + 6 + 2) / 4.0));
  CHECK_THROWS_AS(compute_average_loss(losses, 0), InternalError);
  CHECK_THROWS_AS(compute_average_loss(losses, 4, std::vector<float>{1, 1}), InputError);

  // Two replicas with half batches each sum to the one-replica value.
  const std::span<const float> all(losses);
  CHECK(compute_average_loss(all.first(2), 4) + compute_average_loss(all.last(2), 4) ==
        doctest::Approx(compute_average_loss(all, 4)));
  CHECK(compute_average_loss({}, 4) == 0.0);
}

TEST_CASE("scale_regularization_loss and reduce_loss") {
  CHECK(scale_regularization_loss(3.0, 4) == doctest::Approx(0.75));
  CHECK_THROWS_AS(scale_regularization_loss(1.0, 0), InternalError);

  const std::vector<float> losses{1, 2, 3, 6};
  const std::vector<float> weights{1, 1, 0, 0.5f};
  CHECK(reduce_loss(losses, Reduction::sum) == doctest::Approx(12.0));
  CHECK(reduce_loss(losses, Reduction::sum, weights) == doctest::Approx(6.0));
  CHECK(reduce_loss(losses, Reduction::sum_over_batch_size) == doctest::Approx(3.0));
  // Keras divides by the number of examples, not by the sum of the weights.
  CHECK(reduce_loss(losses, Reduction::sum_over_batch_size, weights) == doctest::Approx(1.5));
  CHECK(reduce_loss(losses, Reduction::auto_reduction) == doctest::Approx(3.0));
  CHECK(reduce_loss({}, Reduction::sum_over_batch_size) == 0.0);
  CHECK_THROWS_WITH_AS(reduce_loss(losses, Reduction::none), doctest::Contains("per_example"), InternalError);
}

TEST_CASE("make_loss keeps the configuration") {
  const auto loss = make_loss(loss_config(LossKind::binary_crossentropy, true, Reduction::sum), testing::cpu_numerics());
  CHECK(loss->name() == "binary_crossentropy");
  CHECK(loss->config().from_logits);
  CHECK(loss->config().reduction == Reduction::sum);
}
