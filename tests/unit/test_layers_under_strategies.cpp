// The layers that depend on the step (dropout) or on the batch (batch normalization) under every
// in-process strategy, through the real Trainer: with synchronized statistics, N replicas compute
// what one computes on the global batch, masks included; without, each replica normalizes its own
// batch and the mirrored copies stay identical. (Across MPI workers: tests/integration/
// multi_worker.sh sync_batch_norm.)
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/rng.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/dense.hpp"
#include "nn/registry.hpp"
#include "random_models.hpp"
#include "train/trainer.hpp"
#include "trainer_support.hpp"

using namespace dtrain;
using testing::devices;
using testing::make_trainer;
using testing::rel_diff;
using testing::weights;

namespace {

// conv -> batch norm -> relu -> average pool -> dropout -> dense -> batch norm -> relu -> dropout
// -> global average pool is not here (one spatial map); it is in test_layers.cpp's stack.
std::string bn_dropout_experiment(const std::string& strategy, int per_replica, bool synchronized) {
  return testing::small_data_experiment("bn_dropout", 11, strategy, per_replica) + fmt::format(R"(model:
  input_shape: [28, 28, 1]
  layers:
    - conv2d: {{filters: 6, kernel_size: 3, strides: 2, use_bias: false}}
    - batch_normalization: {{synchronized: {}}}
    - activation: {{activation: relu}}
    - average_pooling2d: {{pool_size: 2}}
    - dropout: {{rate: 0.25}}
    - flatten: {{}}
    - dense: {{units: 16, use_bias: false}}
    - batch_normalization: {{synchronized: {}, momentum: 0.9}}
    - activation: {{activation: relu}}
    - dropout: {{rate: 0.5}}
    - dense: {{units: 10}}
loss: {{kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}}
optimizer: {{kind: adam, learning_rate: 0.003}}
metrics: [sparse_categorical_accuracy]
train: {{epochs: 1, threads: 1, progress: none}}
)",
                     synchronized, synchronized);
}

// A variable of replica 0's model by name.
std::vector<double> variable(train::Trainer& t, const std::string& name) {
  for (const Variable* v : t.model().variables())
    if (v->name == name) {
      auto s = v->value.span<float>();
      return {s.begin(), s.end()};
    }
  FAIL("no variable " << name);
  return {};
}

}  // namespace

TEST_CASE("synchronized batch normalization and dropout: every strategy computes the default strategy's steps") {
  const int global = 32;
  auto reference = make_trainer(bn_dropout_experiment("{kind: default}", global, true));
  const auto steps = testing::trajectory_of(*reference, 19);
  // The moving statistics moved too (they are among the weights compared).
  CHECK(variable(*reference, "batch_normalization/moving_mean") != std::vector<double>(6, 0.0));
  const auto test = reference->evaluate_split("test");

  std::vector<testing::StrategyCase> candidates = {{"{kind: one_device, device: cpu:0}", 1}};
  for (auto& c : testing::replicated_strategies({2, 4})) candidates.push_back(c);
  for (const auto& c : candidates) {
    CAPTURE(c.strategy);
    auto t = make_trainer(bn_dropout_experiment(c.strategy, global / c.replicas, true));
    REQUIRE(t->strategy().num_replicas_in_sync() == c.replicas);
    testing::check_follows(*t, steps);
    // Evaluation: moving statistics, no dropout, every test sample once.
    const auto mine = t->evaluate_split("test");
    CHECK(mine.samples == test.samples);
    CHECK(mine.loss == doctest::Approx(test.loss).epsilon(1e-4));
  }
}

TEST_CASE("per-replica batch normalization: each replica its own statistics, mirrored copies identical") {
  auto reference = make_trainer(bn_dropout_experiment("{kind: default}", 32, false));
  reference->train_steps(0, 1);
  for (const auto& c : testing::replicated_strategies({2, 4})) {
    CAPTURE(c.strategy);
    auto t = make_trainer(bn_dropout_experiment(c.strategy, 32 / c.replicas, false));
    t->train_steps(0, 1);
    // Normalizing by each replica's statistics is another computation than the global batch's ...
    CHECK(rel_diff(weights(*t), weights(*reference)) > 1e-5);
    // ... but the first layer's moving mean moves by the mean of the replicas' means, which for
    // equal shares is the global batch's mean.
    CHECK(rel_diff(variable(*t, "batch_normalization/moving_mean"),
                   variable(*reference, "batch_normalization/moving_mean")) < 1e-5);
    for (int r = 1; r < c.replicas; ++r) CHECK(weights(*t, r) == weights(*t, 0));
  }
}

namespace {

// The experiment (after "name: ... strategy: ...") trained `steps` steps under mirrored and
// central_storage on 4 CPU replicas ends where the default strategy ends: the weights and
// `statistic` (a moving statistic's variable) within 1e-5.
void four_replicas_follow_default(const std::string& common, std::size_t steps, const std::string& statistic) {
  auto reference = make_trainer("name: ref\nstrategy: {kind: default}" + common);
  CHECK(reference->train_steps(0, static_cast<std::int64_t>(steps)).size() == steps);
  for (const char* strategy : {"{kind: mirrored, devices: [cpu:0, cpu:1, cpu:2, cpu:3]}",
                               "{kind: central_storage, devices: [cpu:0, cpu:1, cpu:2, cpu:3]}"}) {
    CAPTURE(strategy);
    auto t = make_trainer(std::string("name: s\nstrategy: ") + strategy + common);
    CHECK(t->train_steps(0, static_cast<std::int64_t>(steps)).size() == steps);
    CHECK(rel_diff(weights(*t), weights(*reference)) < 1e-5);
    CHECK(rel_diff(variable(*t, statistic), variable(*reference, statistic)) < 1e-5);
  }
}

}  // namespace

TEST_CASE("replicas without samples on a short last batch still join the synchronized statistics") {
  // 66 samples, global batch 64: the second step has 2 samples, so of 4 replicas two get none and
  // must still enter every collective; the moving statistics come from replica 0 alone.
  const std::string common = R"(
seed: 4
data: {source: synthetic, shape: [6, 6, 1], classes: 4, train_size: 66, test_size: 8, global_batch_size: 64, shuffle_buffer: 66, prefetch: false}
model:
  input_shape: [6, 6, 1]
  layers:
    - conv2d: {filters: 3, kernel_size: 3, use_bias: false}
    - batch_normalization: {synchronized: true}
    - activation: {activation: relu}
    - flatten: {}
    - dropout: {rate: 0.2}
    - dense: {units: 5, use_bias: false}
    - batch_normalization: {synchronized: true, momentum: 0.5}
    - dense: {units: 4}
loss: {kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}
optimizer: {kind: sgd, learning_rate: 0.1}
metrics: [sparse_categorical_accuracy]
train: {epochs: 1, threads: 1, progress: none}
)";
  four_replicas_follow_default(common, 2, "batch_normalization_1/moving_variance");
}

TEST_CASE("a synchronized batch normalization lowest of the layers with variables, with replicas left without samples") {
  // A global batch of 9 over 4 replicas is 3, 3, 3, 0 at every step (tf.distribute's split). The
  // batch normalization is the lowest layer whose backward runs, with a flatten (or nothing)
  // below it: no input gradient, so no backward collective, on the replicas with samples and on
  // the one without (which had made one, pairing with the next step's sums: an internal error).
  for (const char* below : {"    - flatten: {}\n", ""}) {
    CAPTURE(below);
    const std::string common = std::string(R"(
seed: 5
data: {source: synthetic, shape: [4, 4, 2], classes: 3, train_size: 27, test_size: 9, global_batch_size: 9, shuffle_buffer: 27, prefetch: false}
model:
  input_shape: [4, 4, 2]
  layers:
)") + below + R"(    - batch_normalization: {synchronized: true}
    - flatten: {}
    - dense: {units: 3}
loss: {kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}
optimizer: {kind: sgd, learning_rate: 0.1}
metrics: [sparse_categorical_accuracy]
train: {epochs: 1, threads: 1, progress: none}
)";
    four_replicas_follow_default(common, 3, "batch_normalization/moving_mean");
    // So with the lanes of one replica: a global batch of 3 over 4 lanes is 1, 1, 1, 0.
    std::string small = common;
    const std::string batch = "global_batch_size: 9", threads = "threads: 1";
    small.replace(small.find(batch), batch.size(), "global_batch_size: 3");
    auto one = make_trainer("name: one\nstrategy: {kind: default}" + small);
    CHECK(one->train_steps(0, 3).size() == 3);
    small.replace(small.find(threads), threads.size(), "threads: 4, parallelism: batch");
    auto lanes = make_trainer("name: lanes\nstrategy: {kind: default}" + small);
    CHECK(lanes->train_steps(0, 3).size() == 3);
    CHECK(rel_diff(weights(*lanes), weights(*one)) < 1e-5);
  }
}

namespace {

// Random model `index` (tests/unit/random_models.hpp) as an experiment on synthetic data: its
// batch normalizations synchronized (so that N replicas compute one replica's steps), a dense
// layer of 3 logits on top, plain SGD (Adam would turn a gradient that is rounding noise, as a
// bias's below a batch normalization, into a full step), written by config::to_yaml and read
// back as a user's file would be.
struct RandomExperiment {
  std::string label, yaml;
};
RandomExperiment random_experiment(Rng& rng, int index, const std::string& reproducibility) {
  testing::RandomModel m = testing::random_model(rng, index, false);
  for (config::LayerConfig& layer : m.layers)
    if (const auto* bn = layer.options.get_if<nn::BatchNormalizationOptions>()) {
      nn::BatchNormalizationOptions synchronized = *bn;
      synchronized.synchronized = true;
      layer.options = synchronized;
    }
  nn::DenseOptions logits;
  logits.units = 3;
  m.layers.push_back(nn::layer_config("", logits));
  std::string shape;
  for (std::size_t d = 0; d < m.input.rank(); ++d) shape += fmt::format("{}{}", d ? ", " : "", m.input[d]);
  config::Experiment e = config::parse_experiment(fmt::format(R"(
name: random_{}
seed: {}
strategy: {{kind: default}}
data: {{source: synthetic, shape: [{}], classes: 3, train_size: 60, test_size: 10, global_batch_size: 20,
        shuffle_buffer: 60, prefetch: false}}
model: {{input_shape: [{}], layers: [{{flatten: {{}}}}, {{dense: {{units: 3}}}}]}}
loss: {{kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}}
optimizer: {{kind: sgd, learning_rate: 0.2}}
metrics: [sparse_categorical_accuracy]
train: {{epochs: 1, threads: 1, progress: none}}
{}
)",
                                                              index, 100 + index, shape, shape, reproducibility),
                                                  "random.yaml", {});
  e.model.layers = m.layers;
  for (std::size_t l = 0; l < e.model.layers.size(); ++l) e.model.layers[l].name = fmt::format("l{}", l);
  return {m.label, config::to_yaml(e)};
}

}  // namespace

TEST_CASE("random models: every in-process strategy follows the default strategy's steps") {
  Rng rng(testing::random_model_seed(2027), RngStream::test);
  for (int i = 0, n = testing::random_model_count(6); i < n; ++i) {
    const auto [label, yaml] = random_experiment(rng, i, "");
    INFO(label);
    auto reference = make_trainer(yaml);
    const auto steps = testing::trajectory_of(*reference, 2);
    REQUIRE(steps.one_step != steps.initial);
    std::vector<testing::StrategyCase> candidates = {{"{kind: one_device, device: cpu:0}", 1}};
    for (auto& c : testing::replicated_strategies({2, 4})) candidates.push_back(c);
    for (const auto& c : candidates) {
      CAPTURE(c.strategy);
      auto t = make_trainer(yaml, {"strategy=" + c.strategy});
      REQUIRE(t->strategy().num_replicas_in_sync() == c.replicas);
      testing::check_follows(*t, steps);
    }
  }
}

TEST_CASE("random models under replica_invariant: the default strategy's bits on 2 lanes and 2, 3 and 4 replicas") {
  Rng rng(testing::random_model_seed(2028), RngStream::test);
  for (int i = 0, n = testing::random_model_count(6); i < n; ++i) {
    const auto [label, yaml] =
        random_experiment(rng, i, "reproducibility: {mode: replica_invariant, micro_batch_size: 8}");
    INFO(label);
    auto reference = make_trainer(yaml);
    const std::vector<double> initial = weights(*reference);
    reference->train_steps(0, 3);
    const std::vector<double> want = weights(*reference);
    REQUIRE(want != initial);
    for (const std::string& strategy :
         {std::string("{kind: mirrored, devices: [cpu:0, cpu:1], cross_device_ops: ring}"),
          std::string("{kind: mirrored, devices: [cpu:0, cpu:1, cpu:2]}"),
          std::string("{kind: central_storage, devices: [cpu:0, cpu:1, cpu:2, cpu:3]}")}) {
      CAPTURE(strategy);
      auto t = make_trainer(yaml, {"strategy=" + strategy});
      t->train_steps(0, 3);
      CHECK(weights(*t) == want);
    }
    auto lanes = make_trainer(yaml, {"train.threads=2"});
    lanes->train_steps(0, 3);
    CHECK(weights(*lanes) == want);
  }
}
