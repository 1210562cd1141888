// Keras 3 computes a crossentropy from the input of the softmax or sigmoid that made its
// predictions (keras/src/backend/tensorflow/nn.py, _get_logits), whatever from_logits says: a model
// ending in one trains exactly as the same model ending linear with from_logits: true, while its
// outputs (what the metrics and predictions read) stay probabilities.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "nn/model.hpp"
#include "train/trainer.hpp"
#include "trainer_support.hpp"

using namespace dtrain;
using testing::make_trainer;
using testing::weights;

namespace {

// A learning rate high enough that predictions saturate within a few steps: probabilities of the
// label below 1e-7, where a loss computed from the probabilities (clipped to [1e-7, 1 - 1e-7], as
// Keras' formula for probabilities does) would cap at 16.1 and give no gradient.
std::string experiment(int classes, const std::string& last_layers, const std::string& loss, int threads,
                       const std::string& more = "") {
  return fmt::format(R"(
name: pre_activation
seed: 11
data: {{source: synthetic, shape: [6], classes: {}, train_size: 48, test_size: 24, global_batch_size: 8, shuffle_buffer: 48, prefetch: false}}
model: {{input_shape: [6], layers: [dense: {{units: 12, activation: tanh}}, {}]}}
loss: {}
optimizer: {{kind: sgd, learning_rate: 25.0}}
metrics: [accuracy]
train: {{epochs: 1, threads: {}, progress: none}}
{})",
                     classes, last_layers, loss, threads, more);
}

// What `f` writes to stderr.
std::string stderr_of(const std::function<void()>& f) {
  std::fflush(stderr);
  std::FILE* into = std::tmpfile();
  REQUIRE(into != nullptr);
  const int saved = dup(STDERR_FILENO);
  dup2(fileno(into), STDERR_FILENO);
  f();
  std::fflush(stderr);
  dup2(saved, STDERR_FILENO);
  close(saved);
  std::rewind(into);
  std::string text;
  char chunk[4096];
  for (std::size_t n; (n = std::fread(chunk, 1, sizeof chunk, into)) > 0;) text.append(chunk, n);
  std::fclose(into);
  return text;
}

struct Case {
  const char* what;
  int classes;
  std::string activated, linear;  // the model's last layers: ending in the activation, and without it
  std::string loss;               // the loss of the run that ends in the activation
  std::string logits_loss;        // the same loss from logits
  config::Activation activation;
};

std::vector<Case> cases() {
  const std::string sparse = "{kind: sparse_categorical_crossentropy, from_logits: false, reduction: none}";
  const std::string sparse_logits = "{kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}";
  const std::string binary = "{kind: binary_crossentropy, from_logits: false, reduction: none}";
  const std::string binary_logits = "{kind: binary_crossentropy, from_logits: true, reduction: none}";
  using config::Activation;
  return {
      {"softmax dense, sparse crossentropy", 4, "dense: {units: 4, activation: softmax}", "dense: {units: 4}", sparse,
       sparse_logits, Activation::softmax},
      {"softmax Activation layer", 4, "dense: {units: 4}, activation: {activation: softmax}",
       "dense: {units: 4}, activation: {activation: linear}", sparse, sparse_logits, Activation::softmax},
      // Layers that return their input (Keras' return the tensor itself) leave the activation last.
      {"softmax dense, then a linear Activation", 4, "dense: {units: 4, activation: softmax}, activation: {activation: linear}",
       "dense: {units: 4}, activation: {activation: linear}", sparse, sparse_logits, Activation::softmax},
      {"softmax dense, then dropout of rate 0", 4, "dense: {units: 4, activation: softmax}, dropout: {rate: 0.0}",
       "dense: {units: 4}, dropout: {rate: 0.0}", sparse, sparse_logits, Activation::softmax},
      {"sigmoid dense, binary crossentropy", 2, "dense: {units: 1, activation: sigmoid}", "dense: {units: 1}", binary,
       binary_logits, Activation::sigmoid},
      // Keras takes the input whichever activation made the predictions: a softmax crossentropy of
      // the pre-sigmoid values, and from_logits: true on a softmax's output (Keras warns).
      {"sigmoid dense, sparse crossentropy", 4, "dense: {units: 4, activation: sigmoid}", "dense: {units: 4}", sparse,
       sparse_logits, Activation::sigmoid},
      {"softmax dense, from_logits: true", 4, "dense: {units: 4, activation: softmax}", "dense: {units: 4}",
       sparse_logits, sparse_logits, Activation::softmax},
      // ... and the accuracy of a sigmoid's probabilities thresholds them at 0.5, not at 0.
      {"sigmoid dense, binary crossentropy from_logits: true", 2, "dense: {units: 1, activation: sigmoid}",
       "dense: {units: 1}", binary_logits, binary_logits, Activation::sigmoid},
  };
}

}  // namespace

TEST_CASE("a crossentropy on a softmax or sigmoid output is computed from its input, as Keras computes it") {
  for (const Case& c : cases()) {
    for (int threads : {1, 2}) {
      CAPTURE(c.what);
      CAPTURE(threads);
      auto activated = make_trainer(experiment(c.classes, c.activated, c.loss, threads));
      auto linear = make_trainer(experiment(c.classes, c.linear, c.logits_loss, threads));
      CHECK(activated->model().output_activation() == c.activation);
      CHECK(linear->model().output_activation() == config::Activation::linear);
      REQUIRE(weights(*activated) == weights(*linear));
      const std::vector<double> a = activated->train_steps(0, 6), b = linear->train_steps(0, 6);
      CHECK(a == b);  // the same kernels on the same logits: the same bits
      CHECK(weights(*activated) == weights(*linear));
      // The accuracy of the probabilities is the accuracy of the logits (argmax, or 0.5 against 0).
      const train::EvalResult ea = activated->evaluate_split("test"), eb = linear->evaluate_split("test");
      CHECK(ea.loss == eb.loss);
      REQUIRE(ea.accuracy.has_value());
      CHECK(*ea.accuracy == *eb.accuracy);
      CHECK(*ea.accuracy > 0.0);

      // The outputs stay the activation's: probabilities, where the linear model's are logits.
      const train::Predictions p = activated->predict_split("test", 8), q = linear->predict_split("test", 8);
      const std::int64_t rows = p.logits.shape()[0], outputs = p.logits.shape()[1];
      const float* prob = p.logits.data<float>();
      const float* z = q.logits.data<float>();
      double smallest_label_probability = 1.0;
      for (std::int64_t r = 0; r < rows; ++r) {
        double sum = 0.0;
        for (std::int64_t o = 0; o < outputs; ++o) {
          const float e = z[r * outputs + o];
          const double expected = c.activation == config::Activation::sigmoid ? 1.0 / (1.0 + std::exp(-double{e}))
                                                                                 : std::exp(double{e});
          if (c.activation == config::Activation::sigmoid) CHECK(prob[r * outputs + o] == doctest::Approx(expected).epsilon(1e-5));
          sum += expected;
        }
        if (c.activation == config::Activation::softmax) {
          for (std::int64_t o = 0; o < outputs; ++o)
            CHECK(prob[r * outputs + o] == doctest::Approx(std::exp(double{z[r * outputs + o]}) / sum).epsilon(1e-5));
          const auto label = static_cast<std::int64_t>(p.labels.data<std::int32_t>()[r]);
          smallest_label_probability = std::min(smallest_label_probability, double{prob[r * outputs + label]});
        }
      }
      // Where the loss from the probabilities would have been clipped: this case is one where
      // Keras' shortcut changes what trains.
      if (c.activation == config::Activation::softmax && c.loss == c.logits_loss) continue;
      if (c.activation == config::Activation::softmax) CHECK(smallest_label_probability < 1e-7);
    }
  }
}

TEST_CASE("a softmax under layers that make a new tensor stays in its layer") {
  // Keras' flatten and reshape, and a dropout while training, make a new tensor: its crossentropy
  // then reads the probabilities, and so does dtrain's.
  const std::string sparse = "{kind: sparse_categorical_crossentropy, from_logits: false, reduction: none}";
  for (const char* last : {"dense: {units: 4, activation: softmax}, dropout: {rate: 0.3}",
                           "dense: {units: 4, activation: softmax}, reshape: {target_shape: [2, 2]}, flatten: {}"}) {
    CAPTURE(last);
    auto t = make_trainer(experiment(4, last, sparse, 1));
    CHECK(t->model().output_activation() == config::Activation::linear);
  }
  auto t = make_trainer(experiment(4, "dense: {units: 4, activation: softmax}, dropout: {rate: 0.0}", sparse, 1));
  CHECK(t->model().output_activation() == config::Activation::softmax);
  CHECK(t->model().output_activation_from() == 1);
}

TEST_CASE("the same under mixed_bfloat16 and replica_invariant, where the activation is the last layer's") {
  const std::string sparse = "{kind: sparse_categorical_crossentropy, from_logits: false, reduction: none}";
  const std::string sparse_logits = "{kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}";
  for (const char* more : {"precision: mixed_bfloat16\n", "reproducibility: {mode: replica_invariant, micro_batch_size: 3}\n"}) {
    CAPTURE(more);
    auto activated = make_trainer(experiment(4, "dense: {units: 4, activation: softmax}", sparse, 2, more));
    auto linear = make_trainer(experiment(4, "dense: {units: 4}", sparse_logits, 2, more));
    CHECK(activated->model().output_activation() == config::Activation::softmax);
    CHECK(activated->train_steps(0, 4) == linear->train_steps(0, 4));
    CHECK(weights(*activated) == weights(*linear));
    CHECK(activated->evaluate_split("test").loss == linear->evaluate_split("test").loss);
  }
  // Under a bfloat16 policy only the last layer computes in float32 (Keras' advice): a softmax
  // below a layer that returns its input stays in its own layer, in float32, and the loss reads
  // the probabilities, as Keras' does once its float32 last layer has cast them.
  auto below = make_trainer(experiment(4, "dense: {units: 4, activation: softmax}, dropout: {rate: 0.0}", sparse, 1,
                                       "precision: mixed_bfloat16\n"));
  CHECK(below->model().output_activation() == config::Activation::linear);
}

TEST_CASE("from_logits: true on a softmax output is warned of, naming the layer; from_logits: false is not") {
  const std::string layers = "dense: {units: 4, activation: softmax}, activation: {activation: linear}";
  const std::string warned = stderr_of([&] {
    make_trainer(experiment(4, layers, "{kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}", 1));
  });
  CHECK(warned.find("test.yaml:6:1: loss.from_logits is true, but the model's outputs come from the softmax of layer "
                    "'dense_1', so they are probabilities") != std::string::npos);
  const std::string quiet = stderr_of([&] {
    make_trainer(experiment(4, layers, "{kind: sparse_categorical_crossentropy, from_logits: false, reduction: none}", 1));
  });
  CHECK(quiet.find("warning") == std::string::npos);
}

TEST_CASE("mean squared error on a softmax output reads the probabilities") {
  // One example, x = [1], y = [1, 0]: the softmax's outputs are what the loss compares with y.
  const auto yaml = [](const char* last) {
    return fmt::format(R"(
name: mse_softmax
data: {{source: tensors, x: [1.0], y: [1.0, 0.0], size: 4, batch_size_per_replica: 4, shuffle_buffer: 0}}
model: {{input_shape: [1], layers: [{}]}}
loss: {{kind: mean_squared_error, reduction: none}}
optimizer: {{kind: sgd, learning_rate: 0.5}}
metrics: []
train: {{epochs: 1, threads: 1, progress: none}}
)",
                       last);
  };
  auto activated = make_trainer(yaml("dense: {units: 2, activation: softmax}"));
  auto linear = make_trainer(yaml("dense: {units: 2}"));
  CHECK(activated->model().output_activation() == config::Activation::linear);
  REQUIRE(weights(*activated) == weights(*linear));
  // The mean of (softmax(z) - y)^2 and of (z - y)^2: not the same loss.
  const std::vector<double> a = activated->train_steps(0, 1), b = linear->train_steps(0, 1);
  const train::Predictions p = activated->predict_split("train", 4);
  const float* prob = p.logits.data<float>();
  CHECK(prob[0] + prob[1] == doctest::Approx(1.0f));
  CHECK(a != b);
}
