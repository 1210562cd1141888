// The semantics that make distributed training correct, checked through the real Trainer:
// N replicas with a global batch compute the update one replica computes on that global batch.
#include <doctest/doctest.h>

#include <hdf5.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <span>
#include <string>

#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/error.hpp"
#include "device/context.hpp"
#include "distribute/single_communicator.hpp"
#include "distribute/strategy.hpp"
#include "train/trainer.hpp"
#include "trainer_support.hpp"

using namespace dtrain;
using testing::devices;
using testing::make_trainer;
using testing::rel_diff;
using testing::weights;

namespace {

// A small CNN on the Fashion-MNIST subset: conv and dense, relu, pooling, L2: every gradient path.
std::string cnn_experiment(const std::string& strategy, int per_replica, const std::string& optimizer) {
  return testing::small_data_experiment("equivalence", 5, strategy, per_replica) + fmt::format(R"(model:
  input_shape: [28, 28, 1]
  layers:
    - conv2d: {{filters: 4, kernel_size: 3, strides: 2, activation: relu}}
    - max_pool2d: {{pool_size: 2}}
    - flatten: {{}}
    - dense: {{units: 16, activation: relu, kernel_regularizer: {{l2: 1.0e-3}}}}
    - dense: {{units: 10}}
loss: {{kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}}
optimizer: {}
metrics: [sparse_categorical_accuracy]
train: {{epochs: 1, threads: 1, progress: none}}
)",
                     optimizer);
}

}  // namespace

TEST_CASE("every strategy and cross-device op matches the default strategy on the same global batch") {
  const int global = 32;
  std::vector<testing::StrategyCase> candidates = {{"{kind: one_device, device: cpu:0}", 1}};
  for (auto& c : testing::replicated_strategies({1, 2, 4})) candidates.push_back(c);
  for (const std::string optimizer : {"{kind: sgd, learning_rate: 0.05, momentum: 0.9}", "{kind: adam, learning_rate: 0.002}"}) {
    CAPTURE(optimizer);
    // The same calls on every trainer: one step, then 49 more (the epoch restarted: same order).
    auto reference = make_trainer(cnn_experiment("{kind: default}", global, optimizer));
    const auto steps = testing::trajectory_of(*reference, 49);
    CHECK(rel_diff(steps.later, steps.one_step) > 1e-2);
    for (const auto& c : candidates) {
      CAPTURE(c.strategy);
      auto t = make_trainer(cnn_experiment(c.strategy, global / c.replicas, optimizer));
      REQUIRE(t->strategy().num_replicas_in_sync() == c.replicas);
      testing::check_follows(*t, steps);
    }
  }
}

TEST_CASE("the tutorial's worked example: the step loss is 3.5, not a Mean metric's 1.75") {
  // Two replicas, per-example losses [2, 3] and [4, 5], global batch 4. A Dense(1) whose input is
  // 0 predicts its bias, 0, so squared error against y = sqrt(k) is exactly k.
  const std::string path = (std::filesystem::temp_directory_path() / "dtrain_worked_example.h5").string();
  {
    hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    for (const char* group : {"train", "test"}) {
      hid_t g = H5Gcreate2(file, group, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      const float x[4] = {0, 0, 0, 0};
      const float y[4] = {std::sqrt(2.0f), std::sqrt(3.0f), 2.0f, std::sqrt(5.0f)};
      hsize_t dims[2] = {4, 1};
      hid_t space = H5Screate_simple(2, dims, nullptr);
      for (auto [name, data] : {std::pair{"x", x}, std::pair{"y", y}}) {
        hid_t ds = H5Dcreate2(g, name, H5T_NATIVE_FLOAT, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data);
        H5Dclose(ds);
      }
      H5Sclose(space);
      H5Gclose(g);
    }
    H5Fclose(file);
  }
  const std::string yaml = fmt::format(R"(
name: worked_example
strategy: {{kind: mirrored, devices: [cpu:0, cpu:1]}}
data: {{source: hdf5, path: {}, batch_size_per_replica: 2, shuffle_buffer: 0, prefetch: false}}
model: {{input_shape: [1], layers: [dense: {{units: 1}}]}}
loss: {{kind: mean_squared_error, reduction: none}}
optimizer: {{kind: sgd, learning_rate: 0.1}}
metrics: []
train: {{epochs: 1, threads: 1, progress: none}}
)",
                                       path);
  auto t = make_trainer(yaml);
  const auto losses = t->train_steps(0, 1);
  REQUIRE(losses.size() == 1);
  CHECK(losses[0] == doctest::Approx(3.5).epsilon(1e-6));
  CHECK(losses[0] != doctest::Approx(1.75));
  // The bias gradient is the sum over replicas of -2 * sum(y) / 4: SGD moves it by 0.1 times that.
  const double grad_bias = -2.0 * (std::sqrt(2.0) + std::sqrt(3.0) + 2.0 + std::sqrt(5.0)) / 4.0;
  CHECK(t->model().variables()[1]->value.data<float>()[0] == doctest::Approx(-0.1 * grad_bias).epsilon(1e-6));
  std::filesystem::remove(path);
}

TEST_CASE("a short last batch is weighted by its real global sample count") {
  // 10 samples, global batch 4, 3 replicas: steps of 4, 4 and 2 samples; the 3 replicas get
  // [2, 1, 1], [2, 1, 1] and [1, 1, 0]. The weights after each step must equal the default
  // strategy's on the same samples.
  const std::string common = R"(
seed: 3
data: {source: synthetic, shape: [4, 4, 1], classes: 3, train_size: 10, test_size: 4, global_batch_size: 4, shuffle_buffer: 10, prefetch: false}
model: {input_shape: [4, 4, 1], layers: [flatten: {}, dense: {units: 5, activation: tanh, kernel_regularizer: {l2: 0.01}}, dense: {units: 3}]}
loss: {kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}
optimizer: {kind: sgd, learning_rate: 0.5}
metrics: [sparse_categorical_accuracy]
train: {epochs: 1, threads: 1, progress: none}
)";
  auto reference = make_trainer("name: ref\nstrategy: {kind: default}" + common);
  auto mirrored = make_trainer("name: m\nstrategy: {kind: mirrored, devices: [cpu:0, cpu:1, cpu:2]}" + common);
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    // Both run step `step` of epoch 0 by replaying the epoch up to it.
    auto a = make_trainer("name: ref\nstrategy: {kind: default}" + common);
    auto b = make_trainer("name: m\nstrategy: {kind: mirrored, devices: [cpu:0, cpu:1, cpu:2]}" + common);
    const auto la = a->train_steps(0, step + 1);
    const auto lb = b->train_steps(0, step + 1);
    REQUIRE(la.size() == static_cast<std::size_t>(step + 1));
    REQUIRE(lb.size() == la.size());
    CHECK(lb.back() == doctest::Approx(la.back()).epsilon(1e-6));
    CHECK(rel_diff(weights(*b), weights(*a)) < 1e-5);
  }
  const auto la = reference->train_steps(0, 3);
  const auto lb = mirrored->train_steps(0, 3);
  CHECK(la.size() == 3);
  CHECK(rel_diff(weights(*mirrored), weights(*reference)) < 1e-5);
}

TEST_CASE("per_replica input gives the replicas the same samples as split_global_batch") {
  const std::string base = cnn_experiment("{kind: mirrored, devices: [cpu:0, cpu:1]}", 16, "{kind: sgd, learning_rate: 0.05}");
  auto split = make_trainer(base);
  auto per_replica = make_trainer(base, {"data.distribute=per_replica"});
  split->train_steps(0, 5);
  per_replica->train_steps(0, 5);
  CHECK(rel_diff(weights(*per_replica), weights(*split)) < 1e-6);
}

TEST_CASE("a model with fewer outputs than the data has classes is refused before any replica steps") {
  // This used to fail inside replica 1's step (a label out of range); the trainer now compares
  // the loaded labels with the loss at start. A replica that fails inside a collective is
  // covered by test_cross_device_ops ("a failing replica breaks a collective ...").
  const std::string yaml = cnn_experiment("{kind: mirrored, devices: [cpu:0, cpu:1]}", 16, "{kind: sgd}");
  CHECK_THROWS_WITH_AS(make_trainer(yaml, {"model.layers.4.dense.units=3"}),
                       doctest::Contains("needs one output per class: data source hdf5 has 10 classes"), ConfigError);
}

namespace {

// {kind: `kind`, devices: [cpu:0, ..., cpu:(devices - 1)]}
config::StrategyConfig strategy_config(const char* kind, int devices) {
  std::vector<std::string> names;
  for (int i = 0; i < devices; ++i) names.push_back(fmt::format("cpu:{}", i));
  return config::parse_strategy_section(fmt::format("{{kind: {}, devices: [{}]}}", kind, fmt::join(names, ", ")),
                                        "test.yaml");
}

}  // namespace

TEST_CASE("central storage honours parameter_device: any replica may hold the one copy") {
  const std::string sgd = "{kind: sgd, learning_rate: 0.05, momentum: 0.9}";
  for (int n : {2, 3}) {
    CAPTURE(n);
    auto on_first = make_trainer(cnn_experiment(fmt::format("{{kind: central_storage, devices: {}}}", devices(n)), 32 / n, sgd));
    auto on_last = make_trainer(cnn_experiment(
        fmt::format("{{kind: central_storage, devices: {}, parameter_device: cpu:{}}}", devices(n), n - 1), 32 / n, sgd));
    distribute::Strategy& s = on_last->strategy();
    CHECK(s.primary_replica() == n - 1);
    for (int r = 0; r < n; ++r) CHECK(s.holds_variables(r) == (r == n - 1));
    CHECK(on_first->strategy().primary_replica() == 0);
    CHECK(weights(*on_last) == weights(*on_first));
    on_first->train_steps(0, 1);
    on_last->train_steps(0, 1);
    // The same update, summed in another order: ((x_d + x_0) + ...) instead of ((x_0 + x_1) + ...).
    CHECK(rel_diff(weights(*on_last), weights(*on_first)) < 1e-6);
    on_first->train_steps(0, 20);
    on_last->train_steps(0, 20);
    CHECK(rel_diff(weights(*on_last), weights(*on_first)) < 1e-5);
    // One copy: every replica computes with the holder's values.
    for (int r = 0; r < n; ++r) CHECK(weights(*on_last, r) == weights(*on_last, n - 1));
  }
}

TEST_CASE("central storage: checkpoints hold the parameter device's copy and restore into it") {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("dtrain_test_parameter_device_{}", ::getpid());
  std::filesystem::remove_all(dir);
  const std::string yaml =
      cnn_experiment("{kind: central_storage, devices: [cpu:0, cpu:1], parameter_device: cpu:1}", 16, "{kind: adam}");
  train::TrainerOptions opt;
  std::FILE* quiet = std::fopen("/dev/null", "w");
  opt.out = quiet;
  opt.run_dir = dir.string();
  train::Trainer trained(config::parse_experiment(yaml, "test.yaml", {"train.steps_per_epoch=3"}), opt);
  trained.fit();
  std::fclose(quiet);
  const std::string ckpt = (dir / "checkpoints" / "ckpt-3.h5").string();
  REQUIRE(std::filesystem::exists(ckpt));
  auto mirrored = make_trainer(cnn_experiment("{kind: mirrored, devices: [cpu:0, cpu:1]}", 16, "{kind: adam}"));
  mirrored->restore(ckpt);
  CHECK(weights(*mirrored, 1) == weights(trained, 1));
  auto again = make_trainer(yaml);
  again->restore(ckpt);
  CHECK(weights(*again, 0) == weights(trained, 1));
  // The restored copy goes on exactly as the trained one would.
  trained.train_steps(1, 2);
  again->train_steps(1, 2);
  CHECK(weights(*again) == weights(trained));
  std::filesystem::remove_all(dir);
}

TEST_CASE("central storage: a parameter_device that is not a replica's device is refused where it is written") {
  const std::string given =
      cnn_experiment("{kind: central_storage, devices: [cpu:0, cpu:1], parameter_device: cpu:2}", 16, "{kind: sgd}");
  // The value's line:column (line 4 of the experiment: the strategy's flow map).
  CHECK_THROWS_WITH_AS(make_trainer(given),
                       doctest::Contains("test.yaml:4:78: strategy.parameter_device cpu:2 is not one of the replicas' "
                                         "devices (cpu:0, cpu:1): on CPU devices the single copy of the variables lives "
                                         "with the replica of that device; set parameter_device to one of them"),
                       ConfigError);
  // Left to its default cpu:0 with replicas elsewhere: the location is the strategy's kind.
  const std::string by_default = cnn_experiment("{kind: central_storage, devices: [cpu:1, cpu:2]}", 16, "{kind: sgd}");
  CHECK_THROWS_WITH_AS(make_trainer(by_default),
                       doctest::Contains("test.yaml:4:18: strategy.parameter_device cpu:0 (the default) is not one of "
                                         "the replicas' devices (cpu:1, cpu:2)"),
                       ConfigError);
  const std::string gpu =
      cnn_experiment("{kind: central_storage, devices: [cpu:0], parameter_device: gpu:0}", 16, "{kind: sgd}");
  CHECK_THROWS_WITH_AS(make_trainer(gpu), doctest::Contains("gpu:0 is not one of the replicas' devices (cpu:0)"),
                       ConfigError);
}

TEST_CASE("replica contexts, and sums inside run() over every local replica in replica order") {
  distribute::SingleCommunicator alone;
  for (const char* kind : {"mirrored", "central_storage", "multi_worker_mirrored"}) {
    CAPTURE(kind);
    auto strategy = distribute::make_strategy(strategy_config(kind, 3), 3, alone);
    REQUIRE(strategy->num_local_replicas() == 3);
    CHECK_FALSE(strategy->schedules_steps());
    CHECK(strategy->replica_device(2) == Device{Device::Kind::cpu, 2});
    std::vector<std::vector<double>> seen(3);
    std::vector<distribute::ReplicaContext> contexts(3);
    // 1e17 + 1 loses the 1 unless the two large terms meet first: replica order, ((x0 + x1) + x2).
    const double firsts[3] = {1e17, 1.0, -1e17};
    strategy->run([&](const distribute::ReplicaContext& rc) {
      const auto r = static_cast<std::size_t>(rc.replica_id);
      contexts[r] = rc;
      seen[r] = {firsts[r], double(rc.global_replica_id + 1)};
      strategy->all_reduce_sum_in_replica(rc, std::span<double>(seen[r]), "test");
      strategy->all_reduce_sum_in_replica(rc, std::span<double>(seen[r]).subspan(1), "again");
    });
    for (int r = 0; r < 3; ++r) {
      const auto i = static_cast<std::size_t>(r);
      CHECK(contexts[i].replica_id == r);
      CHECK(contexts[i].global_replica_id == r);
      CHECK(contexts[i].num_replicas_in_sync == 3);
      CHECK(seen[i] == std::vector<double>{0.0, 18.0});
    }
    const std::vector<double> per_replica = {1.0, 2.0, 4.0};
    CHECK(strategy->reduce_sum(per_replica) == 7.0);
    CHECK(strategy->all_gather(5, "test") == std::vector<std::int64_t>{5});
  }
}

TEST_CASE("make_strategy: the devices, and what the config says about replicas in sync and evaluation") {
  distribute::SingleCommunicator alone;
  const config::StrategyConfig mirrored_auto = config::strategy_config_of("mirrored");
  // devices: auto takes every visible GPU where there is one (a GPU machine runs this suite too),
  // else one CPU replica per core.
  const int gpus = device::device_count(Device::Kind::gpu);
  const int auto_replicas = gpus > 0 ? gpus : 3;
  CHECK(distribute::num_replicas_in_sync(mirrored_auto, 3, 1) == auto_replicas);
  CHECK(distribute::make_strategy(mirrored_auto, 3, alone)->num_replicas_in_sync() == auto_replicas);
  const config::StrategyConfig mwm_auto = config::strategy_config_of("multi_worker_mirrored");
  CHECK(distribute::num_replicas_in_sync(mwm_auto, 8, 4) == 4);
  CHECK(distribute::num_replicas_in_sync(strategy_config("multi_worker_mirrored", 2), 8, 3) == 6);
  CHECK(distribute::num_replicas_in_sync(strategy_config("central_storage", 2), 8, 3) == 2);
  const config::StrategyConfig by_default = config::strategy_config_of("default");
  CHECK(distribute::num_replicas_in_sync(by_default, 8, 3) == 1);
  // Each scheduled step is one worker's batch.
  CHECK(distribute::num_replicas_in_sync(config::strategy_config_of("parameter_server"), 8, 5) == 1);
  CHECK(distribute::spans_workers(mwm_auto));
  CHECK_FALSE(distribute::spans_workers(mirrored_auto));
  CHECK(distribute::roles_of(mirrored_auto) == nullptr);
  CHECK(distribute::roles_of(mwm_auto)->chief == 1);
  CHECK(distribute::runs_own_loop(config::strategy_config_of("parameter_server")));
  CHECK_FALSE(distribute::runs_own_loop(mwm_auto));
  CHECK(distribute::kinds_spanning_workers() ==
        std::vector<std::string_view>{"multi_worker_mirrored", "parameter_server"});
  CHECK(distribute::kinds_spanning_workers(true) == std::vector<std::string_view>{"multi_worker_mirrored"});
  CHECK(distribute::kinds_with_own_loop() == std::vector<std::string_view>{"parameter_server"});
  CHECK(distribute::evaluation_strategy(1) == by_default);
  CHECK(distribute::evaluation_strategy(2) == mwm_auto);
  auto one = distribute::make_strategy(by_default, 4, alone);
  CHECK(one->threads_per_replica() == 4);
  CHECK(one->describe() == "strategy default | replicas 1 (cpu:0) | cross-device ops none");
  CHECK(one->primary_replica() == 0);
  CHECK(one->holds_variables(0));
  CHECK_FALSE(one->overlaps_backward());
  CHECK(one->take_cross_worker_seconds() == 0.0);
}
