// precision: mixed_bfloat16 through the real Trainer: it trains, it follows float32's steps to
// bfloat16's precision, every strategy computes the default strategy's bf16 steps, and the same
// seed gives the same bits. Skipped (with a message) on a CPU without bfloat16 instructions.
#include <doctest/doctest.h>

#include <string>

#include <fmt/format.h>

#include "test_support.hpp"
#include "trainer_support.hpp"

using namespace dtrain;
using testing::cpu_has_bf16;
using testing::make_trainer;
using testing::rel_diff;
using testing::weights;

namespace {

std::string cnn(const std::string& precision, const std::string& strategy, int per_replica) {
  return testing::small_data_experiment("bf16", 9, strategy, per_replica) + fmt::format(R"(precision: {}
model:
  input_shape: [28, 28, 1]
  layers:
    - conv2d: {{filters: 8, kernel_size: 3, activation: relu}}
    - max_pool2d: {{pool_size: 2}}
    - conv2d: {{filters: 8, kernel_size: 3, activation: relu, kernel_regularizer: {{l2: 1.0e-3}}}}
    - max_pool2d: {{pool_size: 2}}
    - flatten: {{}}
    - dense: {{units: 32, activation: relu}}
    - dense: {{units: 10}}
loss: {{kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}}
optimizer: {{kind: adam, learning_rate: 0.002}}
metrics: [sparse_categorical_accuracy]
train: {{epochs: 1, threads: 1, progress: none}}
)",
                                                                                   precision);
}

}  // namespace

TEST_CASE("mixed_bfloat16 follows float32's steps to bfloat16's precision, with float32 variables") {
  if (!cpu_has_bf16()) {
    MESSAGE("this CPU has no bfloat16 instructions: skipped");
    return;
  }
  auto f32 = make_trainer(cnn("float32", "{kind: default}", 32));
  auto bf16 = make_trainer(cnn("mixed_bfloat16", "{kind: default}", 32));
  CHECK(weights(*bf16) == weights(*f32));  // the same initial float32 variables
  f32->train_steps(0, 1);
  bf16->train_steps(0, 1);
  const double one = rel_diff(weights(*bf16), weights(*f32));
  CHECK(one > 0);  // it really rounds
  CHECK(one < 5e-3);
  f32->train_steps(0, 30);
  bf16->train_steps(0, 30);
  CHECK(rel_diff(weights(*bf16), weights(*f32)) < 5e-2);
}

TEST_CASE("mixed_bfloat16: the same seed gives the same bits, and every strategy computes the default strategy's steps") {
  if (!cpu_has_bf16()) {
    MESSAGE("this CPU has no bfloat16 instructions: skipped");
    return;
  }
  const int global = 32;
  auto reference = make_trainer(cnn("mixed_bfloat16", "{kind: default}", global));
  auto again = make_trainer(cnn("mixed_bfloat16", "{kind: default}", global));
  reference->train_steps(0, 1);
  const auto one_step = weights(*reference);
  reference->train_steps(0, 10);
  const auto later = weights(*reference);
  again->train_steps(0, 1);
  again->train_steps(0, 10);
  CHECK(weights(*again) == later);

  std::vector<testing::StrategyCase> candidates = {{"{kind: one_device, device: cpu:0}", 1}};
  for (auto& c : testing::replicated_strategies({2})) candidates.push_back(c);
  for (const auto& c : candidates) {
    CAPTURE(c.strategy);
    auto t = make_trainer(cnn("mixed_bfloat16", c.strategy, global / c.replicas));
    t->train_steps(0, 1);
    // Smaller per-replica batches round the same samples in other blocks: bf16's precision, not
    // float32's.
    CHECK(rel_diff(weights(*t), one_step) < 1e-4);
    t->train_steps(0, 10);
    CHECK(rel_diff(weights(*t), later) < 1e-2);
    for (int r = 1; r < t->strategy().num_local_replicas(); ++r) CHECK(weights(*t, r) == weights(*t, 0));
  }
}

TEST_CASE("mixed_bfloat16 under replica_invariant: the same bits on any lanes, threads and replicas") {
  // The first convolution computes the max pooling above it in bfloat16 on the CPU backend's own
  // loops (conv2d.cpp): a micro-batch's gradients must not depend on the lane or replica that
  // computed them.
  if (!cpu_has_bf16()) {
    MESSAGE("this CPU has no bfloat16 instructions: skipped");
    return;
  }
  const int global = 32;
  const std::string invariant = "reproducibility: {mode: replica_invariant, micro_batch_size: 8}\n";
  const auto on_threads = [](std::string yaml, int threads) {
    const std::string one = "threads: 1,";
    REQUIRE(yaml.find(one) != std::string::npos);
    return yaml.replace(yaml.find(one), one.size(), fmt::format("threads: {},", threads));
  };
  auto reference = make_trainer(cnn("mixed_bfloat16", "{kind: default}", global) + invariant);
  const auto losses = reference->train_steps(0, 3);
  const std::vector<std::string> layouts = {
      on_threads(cnn("mixed_bfloat16", "{kind: default}", global), 2) + invariant,
      on_threads(cnn("mixed_bfloat16", "{kind: mirrored, devices: [cpu:0, cpu:1]}", global / 2), 2) + invariant,
  };
  for (const std::string& yaml : layouts) {
    CAPTURE(yaml);
    auto t = make_trainer(yaml);
    CHECK(t->train_steps(0, 3) == losses);
    CHECK(weights(*t) == weights(*reference));
  }
}
