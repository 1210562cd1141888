// A run's memory from declared shapes, before anything is allocated (train/memory_estimate.hpp),
// and the declaration that makes it possible: a layer declares its variables, the model
// materializes them afterwards (nn/layer.hpp).
#include <doctest/doctest.h>

#include <cstring>
#include <string>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "nn/conv2d.hpp"
#include "nn/dense.hpp"
#include "nn/model.hpp"
#include "nn/registry.hpp"
#include "nn/reshape.hpp"
#include "test_support.hpp"
#include "train/memory_estimate.hpp"

using namespace dtrain;

namespace {

// (8, 8, 2) -> conv2d 4 filters 3x3 valid -> (6, 6, 4) -> flatten (144) -> dense 10.
config::ModelConfig small_model() {
  config::ModelConfig mc;
  mc.input_shape = {8, 8, 2};
  nn::Conv2DOptions conv;
  conv.filters = 4;
  nn::DenseOptions dense;
  dense.units = 10;
  mc.layers.push_back(nn::layer_config("conv", conv));
  mc.layers.push_back(nn::layer_config("flat", nn::FlattenOptions{}));
  mc.layers.push_back(nn::layer_config("dense", dense));
  mc.layers[0].where = {"exp.yaml", 17, 7};
  mc.layers[2].where = {"exp.yaml", 19, 7};
  return mc;
}

constexpr std::int64_t kConvParameters = 3 * 3 * 2 * 4 + 4, kDenseParameters = 144 * 10 + 10;
constexpr std::int64_t kParameters = kConvParameters + kDenseParameters;
// Each layer's outputs, twice (activation and gradient), 4 bytes each, per example.
constexpr std::int64_t kActivationBytes = (6 * 6 * 4 + 144 + 10) * 2 * 4;

bool same_values(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

}  // namespace

TEST_CASE("a layer declares its variables without memory; materialize gives build()'s values") {
  nn::Conv2DOptions o;
  o.filters = 4;
  nn::Conv2D declared("conv", o), built("conv", o);
  CHECK(declared.declare(0, Shape{8, 8, 2}) == Shape{6, 6, 4});
  REQUIRE(declared.variables().size() == 2);
  CHECK(declared.declared_elements() == kConvParameters);
  CHECK_FALSE(declared.materialized());
  for (const Variable& v : declared.variables()) CHECK_FALSE(v.value.defined());

  Rng a(5, RngStream::init, 0), b(5, RngStream::init, 0);
  REQUIRE(declared.materialize(a));
  built.build(0, Shape{8, 8, 2}, b);
  for (std::size_t i = 0; i < 2; ++i) CHECK(same_values(declared.variables()[i].value, built.variables()[i].value));
  CHECK(declared.variables()[0].value.data<float>()[0] != 0.0f);  // glorot_uniform ran
}

TEST_CASE("the model asks before_allocating with every layer declared and nothing allocated") {
  bool asked = false;
  nn::ModelOptions options;
  options.before_allocating = [&](const nn::Sequential& m) {
    asked = true;
    CHECK(m.num_parameters() == kParameters);
    CHECK(m.variables().empty());  // listed only once they exist
    CHECK(m.activation_bytes(1) == kActivationBytes);
    for (std::size_t i = 0; i < m.num_layers(); ++i) CHECK_FALSE(m.layer(i).materialized());
    CHECK(m.largest_parameter_layer() == 2);
    CHECK(m.largest_activation_layer() == 0);  // (6, 6, 4) before flatten's equal (144)
  };
  nn::Sequential model(small_model(), 3, testing::cpu(), options);
  CHECK(asked);
  CHECK(model.variables().size() == 4);

  // A refusal there leaves the model unbuilt: the exception is the caller's.
  options.before_allocating = [](const nn::Sequential&) { throw ConfigError("too large"); };
  CHECK_THROWS_WITH_AS(nn::Sequential(small_model(), 3, testing::cpu(), options), "too large", ConfigError);
}

TEST_CASE("a stop asked while the variables are made ends the construction with StoppedBeforeTraining") {
  int asked = 0;
  nn::ModelOptions options;
  options.should_stop = [&] { return ++asked == 2; };  // after the conv's kernel
  CHECK_THROWS_AS(nn::Sequential(small_model(), 3, testing::cpu(), options), StoppedBeforeTraining);
  CHECK(asked == 2);
}

TEST_CASE("estimate_memory counts every lane's model and activations and every replica's slots") {
  nn::ModelOptions options;
  train::RunCopies copies;
  copies.replicas = 2;
  copies.lanes = 3;
  copies.optimizer_slots = 2;
  copies.train_batch = 7;  // 3 lanes: 3, 2, 2 -> the largest lane computes 3
  copies.eval_batch = 5;
  CHECK(copies.batch_per_lane() == 3);
  options.before_allocating = [&](const nn::Sequential& m) {
    const train::MemoryEstimate e = train::estimate_memory(m, copies);
    CHECK(e.models == 6 * kParameters * 8);
    CHECK(e.slots == 2 * kParameters * 2 * 4);
    CHECK(e.activations == 6 * 3 * kActivationBytes);
    CHECK(e.checkpoint == 2 * kParameters * 3 * 4);  // the image and its sealed copy: value and 2 slots
    CHECK(e.total == e.models + e.slots + e.activations + e.checkpoint);
  };
  nn::Sequential model(small_model(), 3, testing::cpu(), options);
}

TEST_CASE("check_run_memory names the layer that decides, at its place, with the estimate's parts") {
  nn::ModelOptions options;
  options.before_allocating = [](const nn::Sequential& m) {
    train::RunCopies copies;
    copies.optimizer_slots = 2;
    const train::MemoryEstimate e = train::estimate_memory(m, copies);
    CHECK_NOTHROW(train::check_run_memory(m, copies, MemoryLimit{e.total}));  // exactly enough
    // Parameters weigh more than one example's activations: the dense layer, by its units.
    CHECK_THROWS_WITH_AS(train::check_run_memory(m, copies, MemoryLimit{e.total - 1}),
                         doctest::Contains("exp.yaml:19:7: layer 'dense': this run needs about"), ConfigError);
    CHECK_THROWS_WITH_AS(train::check_run_memory(m, copies, MemoryLimit{e.total - 1}), doctest::Contains("give it fewer units"),
                         ConfigError);
    // Activations of large batches weigh more: the layer with the largest outputs, by its filters.
    copies.train_batch = copies.eval_batch = 1000;
    const train::MemoryEstimate big = train::estimate_memory(m, copies);
    CHECK_THROWS_WITH_AS(train::check_run_memory(m, copies, MemoryLimit{big.total - 1}),
                         doctest::Contains("exp.yaml:17:7: layer 'conv': this run needs about"), ConfigError);
    CHECK_THROWS_WITH_AS(train::check_run_memory(m, copies, MemoryLimit{big.total - 1}),
                         doctest::Contains("has the largest outputs ((6, 6, 4) per example); give it fewer filters"),
                         ConfigError);
    // A container's limit is named as such, not as the machine's memory.
    CHECK_THROWS_WITH_AS(train::check_run_memory(m, copies, MemoryLimit{big.total - 1, MemoryLimit::Source::cgroup}),
                         doctest::Contains("memory limit of this process's cgroup"), ConfigError);
  };
  nn::Sequential model(small_model(), 3, testing::cpu(), options);
}
