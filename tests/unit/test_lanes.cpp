// train.parallelism: batch — a replica's batch split over lanes (train/lanes.hpp) computes what one
// thread computes on the whole batch: the same steps up to float rounding, batch statistics over
// the whole replica batch, masks by sample, exact metric counts, every evaluation sample once;
// and so does `operations`. Lanes without samples (a batch smaller than the lanes) still take part
// in the lanes' sums.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <fmt/format.h>

#include "train/lanes.hpp"
#include "train/trainer.hpp"
#include "trainer_support.hpp"

using namespace dtrain;
using testing::make_trainer;
using testing::rel_diff;
using testing::weights;

namespace {

// Conv, pooling, per-replica batch normalization, dropout, L2: what lanes must combine or key by
// sample. `synchronized` makes the normalization's statistics span every replica.
std::string experiment(const std::string& strategy, int per_replica, int threads, const char* parallelism,
                       bool synchronized = false) {
  return testing::small_data_experiment("lanes", 3, strategy, per_replica) + fmt::format(R"(model:
  input_shape: [28, 28, 1]
  layers:
    - conv2d: {{filters: 8, kernel_size: 3, strides: 2, activation: relu}}
    - max_pool2d: {{pool_size: 2}}
    - batch_normalization: {{synchronized: {}}}
    - dropout: {{rate: 0.25}}
    - flatten: {{}}
    - dense: {{units: 16, activation: relu, kernel_regularizer: {{l2: 1.0e-3}}}}
    - dense: {{units: 10}}
loss: {{kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}}
optimizer: {{kind: adam, learning_rate: 0.003}}
metrics: [sparse_categorical_accuracy]
train: {{epochs: 1, threads: {}, parallelism: {}, progress: none}}
)",
                                                                                         synchronized, threads,
                                                                                         parallelism);
}

}  // namespace

TEST_CASE("Lanes::rows splits a batch as the replicas split a global batch") {
  train::Lanes lanes(3);
  std::vector<std::int64_t> sizes;
  for (int l = 0; l < 3; ++l) sizes.push_back(lanes.rows(65, l).size());
  CHECK(sizes == std::vector<std::int64_t>{22, 22, 21});
  CHECK(lanes.rows(65, 1).begin == 22);
  CHECK(lanes.rows(65, 2).end == 65);
  CHECK(lanes.rows(2, 2).size() == 0);
}

TEST_CASE("a batch split over lanes computes the steps one thread computes on the whole batch") {
  auto reference = make_trainer(experiment("{kind: default}", 30, 1, "batch"));
  const auto steps = testing::trajectory_of(*reference, 14);
  const auto test = reference->evaluate_split("test");
  // 2 lanes of 15, 3 of 10, 4 of 8, 8, 7, 7; and the threads sharing each layer instead (not under
  // ThreadSanitizer: an OpenMP team of several threads runs in libgomp, which is not instrumented,
  // so TSan cannot see its synchronization).
#if defined(__SANITIZE_THREAD__)
  const std::vector<const char*> parallelisms = {"batch"};
#else
  const std::vector<const char*> parallelisms = {"batch", "operations"};
#endif
  for (int threads : {2, 3, 4}) {
    for (const char* parallelism : parallelisms) {
      CAPTURE(threads);
      CAPTURE(parallelism);
      auto t = make_trainer(experiment("{kind: default}", 30, threads, parallelism));
      testing::check_follows(*t, steps);
      const auto mine = t->evaluate_split("test");
      CHECK(mine.samples == test.samples);
      CHECK(mine.loss == doctest::Approx(test.loss).epsilon(1e-4));
    }
  }
}

TEST_CASE("replicas with lanes compute what one replica computes on the global batch") {
  // Synchronized statistics span every lane of every replica: 2 replicas x 2 lanes of 8.
  auto reference = make_trainer(experiment("{kind: default}", 32, 1, "batch", true));
  const auto steps = testing::trajectory_of(*reference, 9);
  for (const char* strategy : {"{kind: mirrored, devices: [cpu:0, cpu:1]}", "{kind: central_storage, devices: [cpu:0, cpu:1]}"}) {
    CAPTURE(strategy);
    auto t = make_trainer(experiment(strategy, 16, 4, "batch", true));
    REQUIRE(t->strategy().threads_per_replica() == 2);
    testing::check_follows(*t, steps);
  }
}

TEST_CASE("lanes without samples on a short last batch still join the lanes' sums") {
  // 66 samples, global batch 64: the second step has 2 samples, so 2 of 4 lanes get none.
  const std::string common = R"(
seed: 4
strategy: {kind: default}
data: {source: synthetic, shape: [6, 6, 1], classes: 4, train_size: 66, test_size: 8, global_batch_size: 64, shuffle_buffer: 66, prefetch: false}
model:
  input_shape: [6, 6, 1]
  layers:
    - conv2d: {filters: 3, kernel_size: 3, use_bias: false}
    - batch_normalization: {}
    - activation: {activation: relu}
    - flatten: {}
    - dropout: {rate: 0.2}
    - dense: {units: 4}
loss: {kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}
optimizer: {kind: sgd, learning_rate: 0.1}
metrics: [sparse_categorical_accuracy]
)";
  auto reference = make_trainer("name: ref" + common + "train: {epochs: 1, threads: 1, progress: none}\n");
  const auto reference_losses = reference->train_steps(0, 2);
  auto t = make_trainer("name: lanes" + common + "train: {epochs: 1, threads: 4, parallelism: batch, progress: none}\n");
  const auto losses = t->train_steps(0, 2);
  REQUIRE(losses.size() == 2);
  CHECK(losses[1] == doctest::Approx(reference_losses[1]).epsilon(1e-5));
  CHECK(rel_diff(weights(*t), weights(*reference)) < 1e-5);
}

TEST_CASE("reproducibility: replica_invariant gives the same bits on any lanes, threads and replicas") {
  // 70 samples in global batches of 29 (the third step short): micro-batches of 6 leave a short
  // one in every step; batch normalization synchronized (a lane per micro-batch) or not (each
  // thread's lane takes its micro-batches in turn).
  for (const bool synchronized : {false, true}) {
    CAPTURE(synchronized);
    const std::string common = fmt::format(R"(
seed: 5
strategy: {{kind: default}}
data: {{source: synthetic, shape: [6, 6, 1], classes: 4, train_size: 70, test_size: 9, global_batch_size: 29, shuffle_buffer: 70, prefetch: false}}
model:
  input_shape: [6, 6, 1]
  layers:
    - conv2d: {{filters: 3, kernel_size: 3, use_bias: false, kernel_regularizer: {{l2: 1.0e-3}}}}
    - batch_normalization: {{synchronized: {}}}
    - activation: {{activation: relu}}
    - flatten: {{}}
    - dropout: {{rate: 0.2}}
    - dense: {{units: 4}}
loss: {{kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}}
optimizer: {{kind: adam, learning_rate: 0.01}}
metrics: [sparse_categorical_accuracy]
reproducibility: {{mode: replica_invariant, micro_batch_size: 6}}
)",
                                           synchronized);
    auto reference = make_trainer("name: one" + common + "train: {epochs: 1, threads: 1, progress: none}\n");
    const auto reference_losses = reference->train_steps(0, 3);
    const auto reference_test = reference->evaluate_split("test");
    for (const std::string& layout : {std::string("train: {epochs: 1, threads: 2, progress: none}\n"),
                                     std::string("train: {epochs: 1, threads: 3, progress: none}\n"),
                                     std::string("strategy: {kind: mirrored, devices: [cpu:0, cpu:1]}\n"
                                                 "train: {epochs: 1, threads: 2, progress: none}\n")}) {
      CAPTURE(layout);
      std::string yaml = "name: other" + common + layout;
      if (layout.starts_with("strategy")) yaml.replace(yaml.find("strategy: {kind: default}\n"), 26, "");
      auto t = make_trainer(yaml);
      CHECK(t->train_steps(0, 3) == reference_losses);
      CHECK(weights(*t) == weights(*reference));
      const auto test = t->evaluate_split("test");
      CHECK(test.loss == reference_test.loss);
      CHECK(test.accuracy == reference_test.accuracy);
    }
  }
}
