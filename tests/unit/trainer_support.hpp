// What the tests that train through the real Trainer share: building one from YAML text, reading
// a replica's weights, and the norm-based relative difference the equivalence checks use.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "config/parse.hpp"
#include "train/trainer.hpp"

namespace dtrain::testing {

inline std::unique_ptr<train::Trainer> make_trainer(const std::string& yaml, std::vector<std::string> overrides = {}) {
  train::TrainerOptions opt;
  opt.out = nullptr;
  return std::make_unique<train::Trainer>(config::parse_experiment(yaml, "test.yaml", overrides), opt);
}

// Every variable of replica `replica`'s model (moving statistics included), flattened.
inline std::vector<double> weights(train::Trainer& t, int replica = 0) {
  std::vector<double> w;
  for (const Variable* v : t.model(replica).variables())
    for (float x : v->value.span<float>()) w.push_back(x);
  return w;
}

// ||a - b|| / ||b||: an element-wise relative test is meaningless for weights near zero.
inline double rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

// The weights of a reference run: at the start, after one step, and after `more` steps after it
// (the epoch replayed from its start each time: the same samples in the same order).
struct Trajectory {
  std::vector<double> initial, one_step, later;
  int more = 0;
};
inline Trajectory trajectory_of(train::Trainer& reference, int more) {
  Trajectory t;
  t.more = more;
  t.initial = weights(reference);
  reference.train_steps(0, 1);
  t.one_step = weights(reference);
  reference.train_steps(0, more);
  t.later = weights(reference);
  CHECK(rel_diff(t.one_step, t.initial) > 1e-3);  // the steps really move the weights
  return t;
}
// Trainer `t` takes the same steps: the same start, 1e-5 after one step, 1e-4 after the rest;
// and its mirrored copies stay identical, bit for bit.
inline void check_follows(train::Trainer& t, const Trajectory& reference) {
  CHECK(weights(t) == reference.initial);
  t.train_steps(0, 1);
  CHECK(rel_diff(weights(t), reference.one_step) < 1e-5);
  t.train_steps(0, reference.more);
  CHECK(rel_diff(weights(t), reference.later) < 1e-4);
  for (int r = 1; r < t.strategy().num_local_replicas(); ++r) CHECK(weights(t, r) == weights(t, 0));
}

// "[cpu:0, cpu:1, ...]" for n replicas.
inline std::string devices(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += fmt::format("{}cpu:{}", i ? ", " : "", i);
  return "[" + s + "]";
}

// The head of an experiment on the Fashion-MNIST subset in data/: name, seed, strategy and the data
// section (no shuffling differences, no prefetch thread); the model and the rest follow.
inline std::string small_data_experiment(const std::string& name, int seed, const std::string& strategy,
                                         int per_replica) {
  return fmt::format(R"(
name: {}
seed: {}
strategy: {}
data:
  source: hdf5
  path: {}/data/fashion_mnist_small.h5
  batch_size_per_replica: {}
  shuffle_buffer: 2000
  prefetch: false
)",
                     name, seed, strategy, DTRAIN_SOURCE_DIR, per_replica);
}

// A strategy spec and how many replicas it makes.
struct StrategyCase {
  std::string strategy;
  int replicas;
};

// mirrored with every cross-device op, and central_storage, with each replica count.
inline std::vector<StrategyCase> replicated_strategies(std::initializer_list<int> counts) {
  std::vector<StrategyCase> out;
  for (int n : counts) {
    for (const char* op : {"reduction_to_one_device", "hierarchical_copy", "ring"})
      out.push_back({fmt::format("{{kind: mirrored, devices: {}, cross_device_ops: {}}}", devices(n), op), n});
    out.push_back({fmt::format("{{kind: central_storage, devices: {}}}", devices(n)), n});
  }
  return out;
}

}  // namespace dtrain::testing
