#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "config/layers.hpp"
#include "config/model_checks.hpp"
#include "config/parse.hpp"
#include "config/schema.hpp"
#include "config/strategies.hpp"
#include "core/error.hpp"
#include "distribute/central_storage.hpp"
#include "distribute/mirrored.hpp"
#include "distribute/multi_worker_mirrored.hpp"
#include "distribute/one_device.hpp"
#include "distribute/parameter_server.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/conv2d.hpp"
#include "nn/dropout.hpp"
#include "nn/dense.hpp"
#include "nn/max_pool2d.hpp"
#include "nn/registry.hpp"
#include "nn/reshape.hpp"

using namespace dtrain;
using namespace dtrain::config;

namespace {

const std::string source_dir = DTRAIN_SOURCE_DIR;

// The ConfigError message a parse produces, or "" when it succeeds (so a CHECK on the text fails
// visibly instead of the test aborting).
std::string error_of(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  try {
    parse_experiment(yaml, "t.yaml", overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The smallest valid experiment, for tests that change one thing.
const std::string minimal = R"(model:
  input_shape: [4]
  layers:
    - dense: {units: 2}
)";

using distribute::CentralStorageOptions;
using distribute::CrossDeviceOpsKind;
using distribute::MirroredOptions;
using distribute::MultiWorkerMirroredOptions;
using distribute::OneDeviceOptions;
using distribute::ParameterServerOptions;
using distribute::options_as;

// The strategy's options with their source locations cleared.
template <class Options>
void forget_locations(StrategyConfig& strategy, void (*clear)(Options&)) {
  if (const Options* given = strategy.options.get_if<Options>()) {
    Options o = *given;
    clear(o);
    strategy.options = o;
  }
}

// Source locations differ between a file and its to_yaml text; everything else must match.
Experiment without_locations(Experiment e) {
  e.source_file.clear();
  e.loss.where = {};
  e.strategy.where = {};
  e.strategy.devices_where = {};
  forget_locations<MirroredOptions>(e.strategy, [](MirroredOptions& o) { o.cross_device_ops_where = {}; });
  forget_locations<CentralStorageOptions>(e.strategy, [](CentralStorageOptions& o) { o.parameter_device_where = {}; });
  forget_locations<MultiWorkerMirroredOptions>(e.strategy, [](MultiWorkerMirroredOptions& o) {
    o.communication.implementation_where = {};
    o.roles.where = {};
  });
  forget_locations<ParameterServerOptions>(e.strategy, [](ParameterServerOptions& o) {
    o.communication.implementation_where = {};
    o.roles.where = {};
  });
  e.precision_where = {};
  e.batch_where = {};
  e.eval_batch_where = {};
  e.data_where = {};
  e.initial_weights_where = {};
  e.input_shape_where = {};
  e.validation_split_where = {};
  e.metrics_where = {};
  e.steps_per_epoch_where = {};
  for (LayerConfig& layer : e.model.layers) layer.where = {};
  return e;
}

}  // namespace

TEST_CASE("config: fashion_mnist experiment loads with the expected values") {
  const std::string path = source_dir + "/experiments/fashion_mnist.yaml";
  const Experiment e = load_experiment(path);
  CHECK(e.source_file == path);
  CHECK(e.name == "fashion_mnist");
  CHECK(e.seed == 42);
  CHECK(e.strategy.kind == "default");
  CHECK(e.data.source == SourceKind::fashion_mnist);
  CHECK(e.data.path == "/usr/share/datasets/fashion-mnist");
  CHECK(e.data.batch_size_per_replica == 64);
  CHECK(e.data.shuffle_buffer == 60000);
  CHECK(e.model.input_shape == std::vector<std::int64_t>{28, 28, 1});
  REQUIRE(e.model.layers.size() == 7);
  const auto& names = e.model.layers;
  CHECK(names[0].name == "conv2d");
  CHECK(names[1].name == "max_pooling2d");
  CHECK(names[2].name == "conv2d_1");
  CHECK(names[3].name == "max_pooling2d_1");
  CHECK(names[4].name == "flatten");
  CHECK(names[5].name == "dense");
  CHECK(names[6].name == "dense_1");
  const auto& conv = nn::options_as<nn::Conv2DOptions>(e.model.layers[0].options);
  CHECK(conv.filters == 32);
  CHECK(conv.kernel_size == std::array<int, 2>{3, 3});
  CHECK(conv.activation == Activation::relu);
  CHECK(nn::options_as<nn::Conv2DOptions>(e.model.layers[2].options).filters == 64);
  const auto& pool = nn::options_as<nn::MaxPool2DOptions>(e.model.layers[1].options);
  CHECK(pool.pool_size == std::array<int, 2>{2, 2});
  CHECK_FALSE(pool.strides.has_value());
  CHECK((e.model.layers[4].options).get_if<nn::FlattenOptions>() != nullptr);
  CHECK(nn::options_as<nn::DenseOptions>(e.model.layers[5].options).units == 64);
  const auto& logits = nn::options_as<nn::DenseOptions>(e.model.layers[6].options);
  CHECK(logits.units == 10);
  CHECK(logits.activation == Activation::linear);
  CHECK(e.model.layers[0].where.file == path);
  CHECK(e.model.layers[0].where.line == 16);
  CHECK(e.model.layers[0].where.column == 7);
  CHECK(e.loss.kind == LossKind::sparse_categorical_crossentropy);
  CHECK(e.loss.from_logits);
  CHECK(e.loss.reduction == Reduction::none);
  CHECK(e.loss.where.line == 24);
  CHECK(e.loss.where.column == 1);
  CHECK(e.optimizer.kind == OptimizerKind::adam);
  CHECK(e.optimizer.learning_rate.kind == ScheduleKind::constant);
  CHECK(e.optimizer.learning_rate.initial_learning_rate == 0.001);
  CHECK(e.metrics == std::vector<MetricKind>{MetricKind::sparse_categorical_accuracy});
  CHECK(e.train.epochs == 10);
}

TEST_CASE("config: regression_toy experiment loads with the expected values") {
  const Experiment e = load_experiment(source_dir + "/experiments/regression_toy.yaml");
  CHECK(e.data.source == SourceKind::tensors);
  CHECK(e.data.x == std::vector<double>{1.0});
  CHECK(e.data.y == std::vector<double>{1.0});
  CHECK(e.data.train_size == 100);
  CHECK(e.data.batch_size_per_replica == 10);
  CHECK(e.data.shuffle_buffer == 0);
  CHECK(e.model.input_shape == std::vector<std::int64_t>{1});
  REQUIRE(e.model.layers.size() == 1);
  CHECK(e.model.layers[0].name == "dense");
  const auto& dense = nn::options_as<nn::DenseOptions>(e.model.layers[0].options);
  CHECK(dense.units == 1);
  CHECK(dense.kernel_regularizer.l2 == 1.0e-4);
  CHECK(e.loss.kind == LossKind::mean_squared_error);
  CHECK(e.loss.reduction == Reduction::none);
  CHECK(e.optimizer.kind == OptimizerKind::sgd);
  CHECK(e.optimizer.learning_rate.initial_learning_rate == 0.01);
  CHECK(e.metrics.empty());
  CHECK(e.train.epochs == 10);
}

TEST_CASE("config: to_yaml round trips both experiments and every schedule") {
  for (const char* file : {"fashion_mnist.yaml", "regression_toy.yaml", "fashion_mnist_mirrored.yaml",
                           "fashion_mnist_central_storage.yaml", "fashion_mnist_one_device.yaml",
                           "fashion_mnist_multi_worker.yaml"}) {
    CAPTURE(file);
    const Experiment original = load_experiment(source_dir + "/experiments/" + file);
    const std::string text = to_yaml(original);
    CAPTURE(text);
    const Experiment again = parse_experiment(text, "resolved.yaml");
    CHECK(without_locations(again) == without_locations(original));
    CHECK(to_yaml(again) == text);
  }
  const std::vector<std::string> variants = {
      "optimizer: {kind: sgd, momentum: 0.9, nesterov: true, learning_rate: {schedule: exponential_decay, "
      "initial_learning_rate: 0.1, decay_steps: 100, decay_rate: 0.96, staircase: true}}",
      "optimizer: {kind: rmsprop, rho: 0.8, centered: true, learning_rate: {schedule: piecewise_constant, "
      "boundaries: [100, 200], values: [0.1, 0.01, 0.001]}}",
      "optimizer: {learning_rate: {schedule: cosine_decay, initial_learning_rate: 0.3, decay_steps: 1000, "
      "alpha: 0.1}}\ndata: {source: synthetic, shape: [8, 8, 3], classes: 5, train_size: 7, test_size: 3}",
      "data: {source: hdf5, path: 'my data.h5', distribute: per_replica, validation_split: 0.1}\n"
      "train: {progress: none, steps_per_epoch: 5, threads: 3}\nname: 'yes: quoted'\nseed: 18446744073709551615"};
  for (const std::string& extra : variants) {
    CAPTURE(extra);
    const std::string yaml =
        extra + "\nmodel:\n  input_shape: [8, 8, 3]\n  layers:\n"
                "    - max_pool2d: {pool_size: [2, 3], strides: 1, padding: same}\n"
                "    - reshape: {target_shape: [-1, 3]}\n    - activation: {activation: tanh}\n"
                "    - conv2d: {filters: 2, kernel_size: [1, 2], kernel_regularizer: {l2: 0.5}, use_bias: false}\n";
    const Experiment original = parse_experiment(yaml, "v.yaml");
    const std::string text = to_yaml(original);
    CAPTURE(text);
    CHECK(without_locations(parse_experiment(text, "resolved.yaml")) == without_locations(original));
  }
}

TEST_CASE("config: the layer kinds registered by nn/ read, write and refuse their own options") {
  // Every kind with options away from its defaults: the resolved YAML reads back to the same model.
  const std::string yaml =
      "model:\n  input_shape: [8, 8, 3]\n  layers:\n"
      "    - conv2d: {filters: 4, use_bias: false}\n"
      "    - batch_normalization: {momentum: 0.9, epsilon: 0.01, center: false, synchronized: true}\n"
      "    - avg_pool2d: {pool_size: 3, strides: [1, 2], padding: same}\n"
      "    - dropout: {rate: 0.25}\n"
      "    - global_avg_pool2d: {}\n"
      "    - dense: {units: 3}\n";
  const Experiment original = parse_experiment(yaml, "l.yaml");
  const std::string text = to_yaml(original);
  CAPTURE(text);
  CHECK(without_locations(parse_experiment(text, "resolved.yaml")) == without_locations(original));
  // Aliases read as the kind they name; names follow Keras' class names.
  const auto& layers = original.model.layers;
  CHECK(layers[2].kind == "average_pooling2d");
  CHECK(layers[2].name == "average_pooling2d");
  CHECK(layers[4].kind == "global_average_pooling2d");
  CHECK(layers[1].name == "batch_normalization");
  const auto& bn = nn::options_as<nn::BatchNormalizationOptions>(layers[1].options);
  CHECK(bn.momentum == 0.9);
  CHECK(bn.synchronized);
  CHECK_FALSE(bn.center);
  CHECK(bn.scale);
  CHECK(nn::options_as<nn::DropoutOptions>(layers[3].options).rate == 0.25);
  CHECK(contains(text, "- batch_normalization: {name: batch_normalization, momentum: 0.9, epsilon: 0.01, center: "
                       "false, scale: true, synchronized: true}"));

  auto error_of = [](const std::string& layer) {
    try {
      parse_experiment("model:\n  input_shape: [4, 4, 1]\n  layers:\n    - " + layer + "\n", "e.yaml");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(error_of("dropout: {rate: 1.0}") == "e.yaml:4:23: model.layers.0.dropout.rate: must be in [0, 1), got '1.0'");
  CHECK(error_of("dropout: {}") == "e.yaml:4:16: model.layers.0.dropout: missing required key 'rate'");
  CHECK(error_of("batch_normalization: {synchronised: true}") ==
        "e.yaml:4:29: unknown key 'synchronised' in model.layers.0.batch_normalization; did you mean "
        "'synchronized'?");
  CHECK(error_of("batch_normalization: {epsilon: 0}") ==
        "e.yaml:4:38: model.layers.0.batch_normalization.epsilon: must be > 0, got '0'");
  CHECK(error_of("average_pooling2d: {pool_size: 0}") ==
        "e.yaml:4:38: model.layers.0.average_pooling2d.pool_size: must be >= 1, got '0'");
}

TEST_CASE("config: precision is a Keras policy name, located for the errors that come later") {
  CHECK(parse_experiment("precision: float32\n" + minimal, "p.yaml").precision == Precision::float32);
  CHECK(parse_experiment(minimal, "p.yaml").precision == Precision::float32);
  const Experiment bf16 = parse_experiment("precision: mixed_bfloat16\n" + minimal, "p.yaml");
  CHECK(bf16.precision == Precision::mixed_bfloat16);
  CHECK(bf16.precision_where == SourceLocation{"p.yaml", 1, 12});
  CHECK_THROWS_WITH_AS(parse_experiment("precision: float16\n" + minimal, "p.yaml"),
                       "p.yaml:1:12: unknown precision policy 'float16'; valid: float32, mixed_bfloat16; did you mean "
                       "'float32'?",
                       ConfigError);
}

TEST_CASE("config: reproducibility's mode and micro-batch, written back only when not the default") {
  const Experiment fast = parse_experiment(minimal, "r.yaml");
  CHECK(!fast.reproducibility.invariant());
  CHECK(!contains(to_yaml(fast), "reproducibility"));
  const Experiment invariant =
      parse_experiment("reproducibility: {mode: replica_invariant, micro_batch_size: 4}\n" + minimal, "r.yaml");
  CHECK(invariant.reproducibility.invariant());
  CHECK(invariant.reproducibility.micro_batch_size == 4);
  CHECK(invariant.reproducibility.where == SourceLocation{"r.yaml", 1, 25});
  CHECK(parse_experiment(to_yaml(invariant), "resolved.yaml").reproducibility == invariant.reproducibility);
  CHECK(parse_experiment(minimal, "r.yaml", {"reproducibility.mode=replica_invariant"}).reproducibility.micro_batch_size == 8);
  CHECK(error_of("reproducibility: {mode: exact}\n" + minimal) ==
        "t.yaml:1:25: unknown reproducibility mode 'exact'; valid: fast, replica_invariant");
  CHECK(contains(error_of("reproducibility: {micro_batch_size: 4}\n" + minimal),
                 "micro_batch_size applies to mode replica_invariant only"));
  CHECK(contains(error_of("reproducibility: {mode: replica_invariant, micro_batch_size: 0}\n" + minimal),
                 "micro_batch_size: must be >= 1"));
  // The instruction-set cap, in either mode, written back.
  const Experiment capped = parse_experiment("reproducibility: {isa: avx2}\n" + minimal, "r.yaml");
  CHECK(capped.reproducibility.isa == IsaCap::avx2);
  CHECK(!capped.reproducibility.invariant());
  CHECK(capped.reproducibility.isa_where == SourceLocation{"r.yaml", 1, 24});
  CHECK(parse_experiment(to_yaml(capped), "resolved.yaml").reproducibility == capped.reproducibility);
  CHECK(contains(error_of("reproducibility: {isa: avx3}\n" + minimal), "unknown instruction set 'avx3'"));
}

TEST_CASE("config: defaults follow the structs and Keras") {
  const Experiment e = parse_experiment(minimal, "m.yaml");
  CHECK(e.name == "experiment");
  CHECK(e.data == DataConfig{});
  CHECK(e.loss.kind == LossKind::sparse_categorical_crossentropy);
  CHECK(e.loss.where.line == 0);
  CHECK(e.optimizer.kind == OptimizerKind::adam);
  CHECK(e.optimizer.learning_rate.initial_learning_rate == 0.001);
  CHECK(e.train == TrainConfig{});
  CHECK(parse_experiment(minimal + "optimizer: {kind: sgd}\n", "m.yaml").optimizer.learning_rate.initial_learning_rate ==
        0.01);
  CHECK(parse_experiment(minimal + "optimizer: {kind: rmsprop}\n", "m.yaml")
            .optimizer.learning_rate.initial_learning_rate == 0.001);
  const Experiment pw = parse_experiment(
      minimal + "optimizer: {learning_rate: {schedule: piecewise_constant, boundaries: [10], values: [0.5, 0.1]}}\n",
      "m.yaml");
  CHECK(pw.optimizer.learning_rate.kind == ScheduleKind::piecewise_constant);
  CHECK(pw.optimizer.learning_rate.initial_learning_rate == 0.5);
}

TEST_CASE("config: kernel_size, strides and pool_size take an int or a pair") {
  const std::string yaml = R"(model:
  input_shape: [9, 9, 1]
  layers:
    - conv2d: {filters: 1, kernel_size: 5, strides: [1, 2]}
    - conv2d: {filters: 1, kernel_size: [3, 1]}
    - max_pool2d: {pool_size: 3, strides: 2}
)";
  const Experiment e = parse_experiment(yaml, "k.yaml");
  const auto& a = nn::options_as<nn::Conv2DOptions>(e.model.layers[0].options);
  CHECK(a.kernel_size == std::array<int, 2>{5, 5});
  CHECK(a.strides == std::array<int, 2>{1, 2});
  CHECK(nn::options_as<nn::Conv2DOptions>(e.model.layers[1].options).kernel_size == std::array<int, 2>{3, 1});
  const auto& pool = nn::options_as<nn::MaxPool2DOptions>(e.model.layers[2].options);
  CHECK(pool.pool_size == std::array<int, 2>{3, 3});
  CHECK(pool.strides == std::array<int, 2>{2, 2});
  CHECK(contains(error_of(R"(model:
  input_shape: [9, 9, 1]
  layers:
    - conv2d: {filters: 1, kernel_size: [3, 3, 3]}
)"),
                 "t.yaml:4:41: model.layers.0.conv2d.kernel_size: expected an integer or a list of two integers, got a list"));
  CHECK(contains(error_of(R"(model:
  input_shape: [9, 9, 1]
  layers:
    - conv2d: {filters: 1, kernel_size: [3, 0]}
)"),
                 "t.yaml:4:45: model.layers.0.conv2d.kernel_size.1: must be >= 1, got '0'"));
}

TEST_CASE("config: automatic layer names are Keras-style and skip explicit ones") {
  const std::string yaml = R"(model:
  input_shape: [4, 4, 1]
  layers:
    - conv2d: {filters: 1, name: dense_1}
    - dense: {units: 3}
    - max_pooling2d: {}
    - dense: {units: 3}
    - conv2d: {filters: 1}
    - dense: {units: 3, name: out}
    - activation: {activation: softmax}
    - reshape: {target_shape: [3]}
    - activation: {activation: relu}
    - flatten:
)";
  const Experiment e = parse_experiment(yaml, "n.yaml");
  std::vector<std::string> names;
  for (const auto& layer : e.model.layers) names.push_back(layer.name);
  CHECK(names == std::vector<std::string>{"dense_1", "dense", "max_pooling2d", "dense_2", "conv2d", "out",
                                          "activation", "reshape", "activation_1", "flatten"});
  CHECK(e.model.layers[2].where.line == 6);
  CHECK(e.model.layers[2].where.column == 7);

  CHECK(contains(error_of(R"(model:
  input_shape: [4]
  layers:
    - dense: {units: 3, name: head}
    - dense: {units: 3, name: head}
)"),
                 "t.yaml:5:31: model.layers.1.dense.name: duplicate layer name 'head' (also used at t.yaml:4:31)"));
}

TEST_CASE("config: unknown keys, kinds and values suggest the nearest valid spelling") {
  CHECK(error_of(minimal + "train:\n  epoch: 3\n") ==
        "t.yaml:6:3: unknown key 'epoch' in train; did you mean 'epochs'?");
  CHECK(error_of(minimal + "train:\n  zzzzzz: 3\n") ==
        "t.yaml:6:3: unknown key 'zzzzzz' in train; valid keys: epochs, steps_per_epoch, threads, parallelism, progress, "
        "tensorboard, log_every_steps, plot");
  CHECK(error_of(minimal + "optimiser: {kind: sgd}\n") ==
        "t.yaml:5:1: unknown key 'optimiser' at top level; did you mean 'optimizer'?");
  CHECK(error_of(minimal + "optimizer: {kind: adamw}\n") ==
        "t.yaml:5:19: unknown optimizer kind 'adamw'; valid: sgd, adam, rmsprop; did you mean 'adam'?");
  CHECK(error_of(minimal + "loss: {reduction: mean}\n") ==
        "t.yaml:5:19: unknown loss reduction 'mean'; valid: none, sum, sum_over_batch_size, auto");
  CHECK(error_of(minimal + "metrics: [acuracy]\n") ==
        "t.yaml:5:11: unknown metric 'acuracy'; valid: sparse_categorical_accuracy, accuracy, "
        "categorical_accuracy; did you mean 'accuracy'?");
  const std::string layer_error = error_of("model:\n  input_shape: [4]\n  layers:\n    - dens: {units: 2}\n");
  // Every registered kind and alias, sorted: the built-in ones, and any a program adds (this test
  // binary registers a probe layer of its own).
  const std::vector<std::string_view> known = layer_kind_names();
  CHECK(std::is_sorted(known.begin(), known.end()));
  for (std::string_view kind : {"activation", "average_pooling2d", "avg_pool2d", "batch_normalization", "conv2d", "dense",
                                "dropout", "flatten", "global_average_pooling2d", "global_avg_pool2d", "max_pool2d",
                                "max_pooling2d", "reshape"})
    CHECK(std::find(known.begin(), known.end(), kind) != known.end());
  CHECK(layer_error == "t.yaml:4:7: unknown layer kind 'dens' in model.layers.0; known: " + join(known) +
                           "; did you mean 'dense'?");
  CHECK(contains(error_of("model:\n  input_shape: [4]\n  layers:\n    - dense: {units: 2, activation: rellu}\n"),
                 "t.yaml:4:37: unknown activation 'rellu'; valid: linear, relu, sigmoid, tanh, softmax; did you "
                 "mean 'relu'?"));
  CHECK(contains(error_of("model:\n  input_shape: [4]\n  layers:\n    - dense: {units: 2, unit: 3}\n"),
                 "t.yaml:4:25: unknown key 'unit' in model.layers.0.dense; did you mean 'units'?"));
  CHECK(contains(error_of("model:\n  input_shape: [4]\n  layers:\n    - dense: {units: 2}\n      name: x\n"),
                 "t.yaml:5:7: model.layers.0: a layer has one key, its kind, but 'name' follows 'dense'"));
}

TEST_CASE("config: strategies of later versions are named as not available") {
  // Every registered kind in listing order: the built-in ones first, then any a program adds (this
  // test binary registers a probe strategy of its own, test_strategy_registry.cpp).
  const std::string available = join(strategy_kind_names());
  CHECK(available.starts_with(
      "default, one_device, mirrored, central_storage, multi_worker_mirrored, parameter_server"));
  CHECK(error_of(minimal + "strategy: {kind: tpu}\n") ==
        "t.yaml:5:18: strategy kind 'tpu' is not available in this version of dtrain (available: " + available + ")");
  CHECK(error_of(minimal, {"strategy.kind=tpu"}) ==
        "--set strategy.kind=tpu: strategy kind 'tpu' is not available in this version of dtrain (available: " +
            available + ")");
  CHECK(error_of(minimal + "strategy: {kind: defualt}\n") ==
        "t.yaml:5:18: unknown strategy kind 'defualt'; valid: " + available + "; did you mean 'default'?");
  CHECK(contains(error_of(minimal + "strategy: {kind: multi_worker_mirored}\n"),
                 "did you mean 'multi_worker_mirrored'?"));
  CHECK(contains(error_of(minimal + "strategy: {kind: mirored}\n"), "did you mean 'mirrored'?"));
}

// ---------------------------------------------------------------- strategies

namespace {

// `minimal` with a strategy and a loss reduction that every strategy accepts.
std::string with_strategy(const std::string& strategy) {
  return minimal + "strategy: " + strategy + "\nloss: {reduction: none}\n";
}

}  // namespace

TEST_CASE("config: the mirrored experiment loads with the expected values") {
  const std::string path = source_dir + "/experiments/fashion_mnist_mirrored.yaml";
  const Experiment e = load_experiment(path);
  const Experiment plain = load_experiment(source_dir + "/experiments/fashion_mnist.yaml");
  CHECK(e.name == "fashion_mnist_mirrored");
  CHECK(e.strategy.kind == "mirrored");
  const auto& mirrored = options_as<MirroredOptions>(e.strategy);
  CHECK_FALSE(mirrored.devices.automatic);
  CHECK(mirrored.devices.names == std::vector<std::string>{"cpu:0", "cpu:1"});
  CHECK(mirrored.cross_device_ops == CrossDeviceOpsKind::auto_select);
  CHECK(e.strategy.where == SourceLocation{path, 7, 9});
  CHECK(e.strategy.devices_where == SourceLocation{path, 8, 12});
  CHECK(mirrored.cross_device_ops_where == SourceLocation{path, 9, 21});
  CHECK(e.data.batch_size_per_replica == 64);
  CHECK(e.loss.reduction == Reduction::none);
  CHECK(e.train.epochs == 10);
  // Everything but the strategy and the name is fashion_mnist.yaml's.
  CHECK(e.data == plain.data);
  CHECK(without_locations(e).model == without_locations(plain).model);
  CHECK(e.loss.kind == plain.loss.kind);
  CHECK(e.loss.from_logits == plain.loss.from_logits);
  CHECK(e.optimizer == plain.optimizer);
  CHECK(e.metrics == plain.metrics);
  CHECK(e.train == plain.train);
}

TEST_CASE("config: the central_storage and one_device experiments load with the expected values") {
  const Experiment plain = load_experiment(source_dir + "/experiments/fashion_mnist.yaml");
  const Experiment c = load_experiment(source_dir + "/experiments/fashion_mnist_central_storage.yaml");
  CHECK(c.name == "fashion_mnist_central_storage");
  CHECK(c.strategy.kind == "central_storage");
  CHECK(options_as<CentralStorageOptions>(c.strategy).devices.names == std::vector<std::string>{"cpu:0", "cpu:1"});
  CHECK_FALSE(options_as<CentralStorageOptions>(c.strategy).devices.automatic);
  CHECK(options_as<CentralStorageOptions>(c.strategy).parameter_device == "cpu:0");
  CHECK(c.data.batch_size_per_replica == 64);
  CHECK(c.loss.reduction == Reduction::none);
  CHECK(c.data == plain.data);
  CHECK(without_locations(c).model == without_locations(plain).model);
  CHECK(c.optimizer == plain.optimizer);
  CHECK(c.train.epochs == 10);

  const Experiment o = load_experiment(source_dir + "/experiments/fashion_mnist_one_device.yaml");
  CHECK(o.name == "fashion_mnist_one_device");
  CHECK(o.strategy.kind == "one_device");
  CHECK(options_as<OneDeviceOptions>(o.strategy).device == "cpu:0");
  CHECK(o.data.batch_size_per_replica == 64);
  CHECK(o.loss.reduction == Reduction::none);
  CHECK(o.data == plain.data);
  CHECK(without_locations(o).model == without_locations(plain).model);
  CHECK(o.optimizer == plain.optimizer);
  CHECK(o.train.epochs == 10);
}

TEST_CASE("config: strategy defaults and device spellings") {
  const Experiment d = parse_experiment(minimal, "m.yaml");
  CHECK(d.strategy.kind == "default");
  CHECK_FALSE(d.strategy.options.has_value());  // the default kind has no options
  CHECK(d.strategy.where == SourceLocation{"m.yaml", 0, 0});  // left out: the file
  CHECK(options_as<OneDeviceOptions>(parse_strategy_section("{kind: one_device}", "s.yaml")).device == "cpu:0");
  CHECK(options_as<CentralStorageOptions>(strategy_config_of("central_storage")).parameter_device == "cpu:0");

  const Experiment m = parse_experiment(with_strategy("{kind: mirrored}"), "m.yaml");
  CHECK(options_as<MirroredOptions>(m.strategy).devices == DeviceList{});
  CHECK(options_as<MirroredOptions>(m.strategy).devices.automatic);
  CHECK(options_as<MirroredOptions>(m.strategy).cross_device_ops == CrossDeviceOpsKind::auto_select);
  const Experiment explicit_auto = parse_experiment(with_strategy("{kind: mirrored, devices: auto}"), "m.yaml");
  CHECK(options_as<MirroredOptions>(explicit_auto.strategy).devices == DeviceList{});
  CHECK(explicit_auto.strategy.devices_where == SourceLocation{"m.yaml", 5, 37});
  CHECK(without_locations(explicit_auto) == without_locations(m));
  CHECK(options_as<CentralStorageOptions>(parse_experiment(with_strategy("{kind: central_storage}"), "m.yaml").strategy)
            .devices.automatic);

  const Experiment spelled = parse_experiment(
      with_strategy("{kind: mirrored, devices: ['/cpu:0', '/device:CPU:1', GPU:0, '/gpu:1', gpu:12, '/device:gpu:3'], "
                    "cross_device_ops: nccl}"),
      "m.yaml");
  CHECK(options_as<MirroredOptions>(spelled.strategy).devices.names ==
        std::vector<std::string>{"cpu:0", "cpu:1", "gpu:0", "gpu:1", "gpu:12", "gpu:3"});
  CHECK(options_as<MirroredOptions>(spelled.strategy).cross_device_ops == CrossDeviceOpsKind::nccl);
  CHECK(options_as<OneDeviceOptions>(
            parse_experiment(with_strategy("{kind: one_device, device: '/device:GPU:2'}"), "m.yaml").strategy)
            .device == "gpu:2");
  CHECK(options_as<CentralStorageOptions>(
            parse_experiment(with_strategy("{kind: central_storage, parameter_device: /gpu:0}"), "m.yaml").strategy)
            .parameter_device == "gpu:0");
  for (const char* ops : {"auto", "reduction_to_one_device", "hierarchical_copy", "ring", "nccl"}) {
    CAPTURE(ops);
    const Experiment e = parse_experiment(with_strategy(std::string("{kind: mirrored, cross_device_ops: ") + ops + "}"),
                                          "m.yaml");
    CHECK(std::string(name_of(options_as<MirroredOptions>(e.strategy).cross_device_ops)) == ops);
  }
  const Experiment set = parse_experiment(minimal + "loss: {reduction: sum}\n", "m.yaml",
                                          {"strategy.kind=mirrored", "strategy.devices=[cpu:1, cpu:0]"});
  CHECK(set.strategy.kind == "mirrored");
  CHECK(options_as<MirroredOptions>(set.strategy).devices.names == std::vector<std::string>{"cpu:1", "cpu:0"});
  CHECK(set.strategy.devices_where.file == "--set strategy.devices=[cpu:1, cpu:0]");
}

TEST_CASE("config: every strategy round trips through to_yaml") {
  const std::vector<std::string> strategies = {
      "{kind: default}",
      "{kind: one_device}",
      "{kind: one_device, device: gpu:3}",
      "{kind: mirrored}",
      "{kind: mirrored, devices: [gpu:0, '/gpu:1', cpu:0], cross_device_ops: hierarchical_copy}",
      "{kind: mirrored, devices: auto, cross_device_ops: ring}",
      "{kind: central_storage}",
      "{kind: central_storage, devices: [gpu:1, gpu:0], parameter_device: gpu:0}",
  };
  for (const std::string& strategy : strategies) {
    CAPTURE(strategy);
    const Experiment original = parse_experiment(with_strategy(strategy), "s.yaml");
    const std::string text = to_yaml(original);
    CAPTURE(text);
    const Experiment again = parse_experiment(text, "resolved.yaml");
    CHECK(without_locations(again) == without_locations(original));
    CHECK(to_yaml(again) == text);
  }
  const std::string mirrored = to_yaml(parse_experiment(with_strategy("{kind: mirrored, devices: [cpu:0]}"), "s.yaml"));
  CHECK(contains(mirrored, "cross_device_ops: auto"));
  CHECK_FALSE(contains(mirrored, "parameter_device"));
  CHECK_FALSE(contains(mirrored, "device:"));
  CHECK(contains(to_yaml(parse_experiment(with_strategy("{kind: central_storage}"), "s.yaml")), "devices: auto"));
  const std::string plain = to_yaml(parse_experiment(minimal, "s.yaml"));
  CHECK_FALSE(contains(plain, "devices"));
  CHECK_FALSE(contains(plain, "cross_device_ops"));
}

TEST_CASE("config: bad strategy devices are refused where they are written") {
  CHECK(error_of(with_strategy("{kind: mirrored, devices: [cpu:0, tpu:1]}")) ==
        "t.yaml:5:45: strategy.devices.1: must be a device name cpu:N or gpu:N with N >= 0 (TensorFlow's /cpu:0 and "
        "/device:GPU:0 work too), got 'tpu:1'");
  for (const char* bad : {"cpu", "cpu:", "cpu:-1", "cpu:x", "cpu:0:1", "gpu0", "/device:", "cpu:99999999999", "auto"}) {
    CAPTURE(bad);
    CHECK(contains(error_of(with_strategy(std::string("{kind: one_device, device: '") + bad + "'}")),
                   "t.yaml:5:38: strategy.device: must be a device name cpu:N or gpu:N"));
  }
  CHECK(contains(error_of(with_strategy("{kind: central_storage, parameter_device: disk:0}")),
                 "t.yaml:5:53: strategy.parameter_device: must be a device name"));
  CHECK(error_of(with_strategy("{kind: mirrored, devices: [cpu:0, cpu:1, '/device:CPU:0']}")) ==
        "t.yaml:5:52: strategy.devices.2: device 'cpu:0' is listed twice (also at t.yaml:5:38); give each replica "
        "its own device");
  CHECK(error_of(with_strategy("{kind: central_storage, devices: []}")) ==
        "t.yaml:5:44: strategy.devices: must be a non-empty list of devices, or auto, got a list");
  CHECK(error_of(with_strategy("{kind: mirrored, devices: cpu:0}")) ==
        "t.yaml:5:37: strategy.devices: expected a list of device names (for example [cpu:0, cpu:1]) or auto, got "
        "'cpu:0'");
  CHECK(contains(error_of(with_strategy("{kind: mirrored, devices: [[cpu:0]]}")),
                 "strategy.devices.0: expected a device name (cpu:N or gpu:N), got a list"));
  CHECK(error_of(minimal + "loss: {reduction: none}\n", {"strategy={kind: mirrored, devices: [gpu:0, gpu:0]}"}) ==
        "--set strategy={kind: mirrored, devices: [gpu:0, gpu:0]}: strategy.devices.1: device 'gpu:0' is listed "
        "twice (also at --set strategy={kind: mirrored, devices: [gpu:0, gpu:0]}); give each replica its own device");
}

TEST_CASE("config: strategy keys of another kind name the kinds they apply to") {
  CHECK(error_of(with_strategy("{kind: one_device, cross_device_ops: nccl}")) ==
        "t.yaml:5:30: strategy.cross_device_ops: applies only to strategy kind mirrored, not to one_device; remove "
        "it or change the kind");
  CHECK(error_of(with_strategy("{devices: [cpu:0]}")) ==
        "t.yaml:5:12: strategy.devices: applies only to strategy kinds mirrored, central_storage, "
        "multi_worker_mirrored, not to default; remove it or change the kind");
  CHECK(contains(error_of(with_strategy("{kind: mirrored, device: cpu:0}")),
                 "t.yaml:5:28: strategy.device: applies only to strategy kind one_device, not to mirrored"));
  CHECK(contains(error_of(with_strategy("{kind: mirrored, parameter_device: cpu:0}")),
                 "strategy.parameter_device: applies only to strategy kind central_storage, not to mirrored"));
  CHECK(contains(error_of(with_strategy("{kind: central_storage, cross_device_ops: ring}")),
                 "strategy.cross_device_ops: applies only to strategy kind mirrored, not to central_storage"));
  CHECK(contains(error_of(with_strategy("{kind: default, device: cpu:0}")),
                 "strategy.device: applies only to strategy kind one_device, not to default"));
  CHECK(error_of(with_strategy("{kind: mirrored, cross_device_ops: nccl_all_reduce}")) ==
        "t.yaml:5:46: unknown cross_device_ops 'nccl_all_reduce'; valid: auto, reduction_to_one_device, "
        "hierarchical_copy, ring, nccl");
  CHECK(error_of(with_strategy("{kind: mirrored, cross_device_ops: hierarchical_cpy}")) ==
        "t.yaml:5:46: unknown cross_device_ops 'hierarchical_cpy'; valid: auto, reduction_to_one_device, "
        "hierarchical_copy, ring, nccl; did you mean 'hierarchical_copy'?");
  CHECK(error_of(with_strategy("{kind: mirrored, devies: [cpu:0]}")) ==
        "t.yaml:5:28: unknown key 'devies' in strategy; did you mean 'devices'?");
}

TEST_CASE("config: under a strategy, reductions auto and sum_over_batch_size are refused") {
  struct Case {
    const char* strategy;
    const char* name;
  };
  const Case strategies[] = {{"{kind: one_device}", "one_device"},
                             {"{kind: mirrored}", "mirrored"},
                             {"{kind: central_storage}", "central_storage"},
                             {"{kind: multi_worker_mirrored}", "multi_worker_mirrored"}};
  for (const Case& c : strategies) {
    CAPTURE(c.name);
    const std::string head = minimal + "strategy: " + c.strategy + "\nloss:\n  kind: sparse_categorical_crossentropy\n";
    for (const char* reduction : {"auto", "sum_over_batch_size"}) {
      CAPTURE(reduction);
      const std::string error = error_of(head + "  reduction: " + reduction + "\n");
      CHECK(contains(error, fmt::format("t.yaml:8:14: loss.reduction '{}' is refused under strategy '{}': ", reduction,
                                        c.name)));
      CHECK(contains(error, "write reduction: none (dtrain divides the summed per-example losses by the GLOBAL "
                            "batch, like tf.nn.compute_average_loss) or reduction: sum"));
      CHECK(error.find('\n') == std::string::npos);
    }
    // Left out, the reduction is auto: the message points at the loss section, or at the file.
    CHECK(contains(error_of(head),
                   fmt::format("t.yaml:6:1: loss.reduction 'auto' (the default when left out) is refused under "
                               "strategy '{}'",
                               c.name)));
    CHECK(contains(error_of(minimal + "strategy: " + c.strategy + "\n"),
                   fmt::format("t.yaml: loss.reduction 'auto' (the default when left out) is refused under strategy "
                               "'{}'",
                               c.name)));
    for (const char* accepted : {"none", "sum"}) {
      CAPTURE(accepted);
      CHECK(error_of(head + "  reduction: " + accepted + "\n").empty());
    }
  }
  CHECK(contains(error_of(minimal + "strategy: {kind: mirrored}\nloss: {reduction: auto}\n"),
                 "summing the replicas' gradients then comes out num_replicas times too large"));

  SUBCASE("the default strategy accepts every reduction") {
    for (const char* reduction : {"auto", "sum_over_batch_size", "none", "sum"}) {
      CAPTURE(reduction);
      CHECK(error_of(minimal + "loss: {reduction: " + reduction + "}\n").empty());
    }
    CHECK(parse_experiment(minimal, "m.yaml").loss.reduction == Reduction::auto_reduction);
  }
  SUBCASE("the rule holds when the strategy or the reduction comes from --set") {
    CHECK(error_of(minimal, {"strategy.kind=mirrored"}) ==
          "t.yaml: loss.reduction 'auto' (the default when left out) is refused under strategy 'mirrored': each "
          "replica would average over its own part of the batch, and summing the replicas' gradients then comes out "
          "num_replicas times too large; write reduction: none (dtrain divides the summed per-example losses by the "
          "GLOBAL batch, like tf.nn.compute_average_loss) or reduction: sum");
    CHECK(contains(error_of(minimal + "loss:\n  reduction: sum_over_batch_size\n", {"strategy.kind=central_storage"}),
                   "t.yaml:6:14: loss.reduction 'sum_over_batch_size' is refused under strategy 'central_storage'"));
    CHECK(error_of(minimal + "loss: {reduction: auto}\n", {"strategy.kind=mirrored", "loss.reduction=none"}).empty());

    const std::string path = source_dir + "/experiments/fashion_mnist.yaml";
    CHECK(load_experiment(path, {"strategy.kind=mirrored"}).strategy.kind == "mirrored");
    try {
      load_experiment(path, {"strategy.kind=one_device", "loss.reduction=sum_over_batch_size"});
      FAIL("expected a ConfigError");
    } catch (const ConfigError& e) {
      CHECK(contains(e.what(), "--set loss.reduction=sum_over_batch_size: loss.reduction 'sum_over_batch_size' is "
                               "refused under strategy 'one_device'"));
      CHECK(contains(e.what(), "reduction: none"));
    }
    try {
      load_experiment(source_dir + "/experiments/fashion_mnist_mirrored.yaml", {"loss.reduction=auto"});
      FAIL("expected a ConfigError");
    } catch (const ConfigError& e) {
      CHECK(contains(e.what(), "--set loss.reduction=auto: loss.reduction 'auto' is refused under strategy 'mirrored'"));
    }
  }
}

TEST_CASE("config: wrong types name the key, the expected type and the value") {
  CHECK(error_of(minimal + "train:\n  epochs: ten\n") == "t.yaml:6:11: train.epochs: expected an integer, got 'ten'");
  CHECK(error_of(minimal + "train: {epochs: 2.5}\n") == "t.yaml:5:17: train.epochs: expected an integer, got '2.5'");
  CHECK(error_of(minimal + "data: {prefetch: yes}\n") == "t.yaml:5:18: data.prefetch: expected true or false, got 'yes'");
  CHECK(error_of(minimal + "data: {validation_split: half}\n") ==
        "t.yaml:5:26: data.validation_split: expected a number, got 'half'");
  CHECK(error_of(minimal + "metrics: accuracy\n") ==
        "t.yaml:5:10: metrics: expected a list of metric names, got 'accuracy'");
  CHECK(error_of(minimal + "train: [1, 2]\n") == "t.yaml:5:8: train: expected a map of settings, got a list");
  CHECK(error_of("model:\n  input_shape: 28\n  layers: [{flatten: {}}]\n") ==
        "t.yaml:2:16: model.input_shape: expected a list of integers, got '28'");
  CHECK(error_of("model:\n  input_shape: [28]\n  layers: {dense: {units: 1}}\n") ==
        "t.yaml:3:11: model.layers: expected a list of layers, each '- kind: {options}', got a map");
  CHECK(error_of(minimal + "optimizer: {learning_rate: [0.1]}\n") ==
        "t.yaml:5:28: optimizer.learning_rate: expected a number or a schedule map ({schedule: "
        "exponential_decay, ...}), got a list");
  CHECK(error_of("- 1\n- 2\n") ==
        "t.yaml:1:1: expected a map of settings at the top level (name, data, model, ...), got a list");
}

TEST_CASE("config: values out of range are refused with the rule") {
  struct Case {
    std::string yaml, message;
  };
  const std::vector<Case> cases = {
      {"train: {epochs: 0}", "t.yaml:5:17: train.epochs: must be >= 1, got '0'"},
      {"train: {threads: -1}", "t.yaml:5:18: train.threads: must be >= 0, got '-1'"},
      {"data: {batch_size_per_replica: 0}", "t.yaml:5:32: data.batch_size_per_replica: must be >= 1, got '0'"},
      {"data: {shuffle_buffer: -5}", "t.yaml:5:24: data.shuffle_buffer: must be >= 0, got '-5'"},
      {"data: {validation_split: 1.0}", "t.yaml:5:26: data.validation_split: must be in [0, 1), got '1.0'"},
      {"optimizer: {learning_rate: 0}", "t.yaml:5:28: optimizer.learning_rate: must be > 0, got '0'"},
      {"optimizer: {beta_1: 1}", "t.yaml:5:21: optimizer.beta_1: must be in [0, 1), got '1'"},
      {"optimizer: {epsilon: 0.0}", "t.yaml:5:22: optimizer.epsilon: must be > 0, got '0.0'"},
      {"optimizer: {kind: sgd, momentum: -0.1}", "t.yaml:5:34: optimizer.momentum: must be in [0, 1), got '-0.1'"},
      {"optimizer: {learning_rate: {schedule: exponential_decay, initial_learning_rate: 0.1, decay_steps: 0, "
       "decay_rate: 0.9}}",
       "optimizer.learning_rate.decay_steps: must be >= 1, got '0'"},
      {"optimizer: {learning_rate: {schedule: piecewise_constant, boundaries: [100, 200], values: [0.1, 0.01]}}",
       "t.yaml:5:91: optimizer.learning_rate.values: needs one more entry than boundaries (2 boundaries -> 3 "
       "values), got 2"},
      {"optimizer: {learning_rate: {schedule: piecewise_constant, boundaries: [200, 100], values: [1, 2, 3]}}",
       "t.yaml:5:77: optimizer.learning_rate.boundaries.1: must be greater than the previous boundary (200)"},
      {"data: {source: hdf5, path: ' '}", "t.yaml:5:28: data.path: must be a path, not only blanks"},
      {"data: {source: idx, path: '~'}", "t.yaml:5:27: data.path: must be a path dtrain can open: it does not expand '~'"},
      {"data: {source: hdf5, path: ~/data/x.h5}", "t.yaml:5:28: data.path: must be a path dtrain can open"},
      {"optimizer: {learning_rate: {schedule: cosine_decay, decay_steps: 10}}",
       "t.yaml:5:28: optimizer.learning_rate: missing required key 'initial_learning_rate'"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.yaml);
    CHECK(contains(error_of(minimal + c.yaml + "\n"), c.message));
  }
  CHECK(error_of("model:\n  input_shape: [28, 0]\n  layers: [{flatten: {}}]\n") ==
        "t.yaml:2:21: model.input_shape.1: must be >= 1, got '0'");
  CHECK(error_of("model:\n  input_shape: [4]\n  layers:\n    - dense: {units: 0}\n") ==
        "t.yaml:4:22: model.layers.0.dense.units: must be >= 1, got '0'");
  CHECK(error_of("model:\n  input_shape: [4]\n  layers:\n    - dense: {units: 2, kernel_regularizer: {l2: -1}}\n") ==
        "t.yaml:4:50: model.layers.0.dense.kernel_regularizer.l2: must be >= 0, got '-1'");
  CHECK(error_of("model:\n  input_shape: [4, 4, 1]\n  layers:\n    - conv2d: {filters: -3}\n") ==
        "t.yaml:4:25: model.layers.0.conv2d.filters: must be >= 1, got '-3'");
}

TEST_CASE("config: missing required keys point at the section") {
  CHECK(error_of("name: x\n") == "t.yaml:1:1: missing required key 'model'");
  CHECK(error_of("") == "t.yaml:1:1: missing required key 'model'");
  CHECK(error_of("name: x\nmodel:\n  layers: [{flatten: {}}]\n") ==
        "t.yaml:3:3: model: missing required key 'input_shape'");
  CHECK(error_of("model:\n  input_shape: [2]\n  layers: []\n") ==
        "t.yaml:3:11: model.layers: must be a non-empty list of layers, got a list");
  CHECK(error_of("model:\n  input_shape: [2]\n  layers: [{dense: {}}]\n") ==
        "t.yaml:3:20: model.layers.0.dense: missing required key 'units'");
  CHECK(error_of(minimal + "data: {source: idx}\n") == "t.yaml:5:7: data: missing required key 'path'");
  CHECK(error_of(minimal + "data: {source: tensors, x: [1.0]}\n") == "t.yaml:5:7: data: missing required key 'y'");
}

TEST_CASE("config: keys of another kind say which kinds they belong to") {
  CHECK(error_of(minimal + "optimizer: {kind: adam, nesterov: true}\n") ==
        "t.yaml:5:25: optimizer.nesterov: applies only to optimizer kind sgd, not to adam; remove it or change the "
        "kind");
  CHECK(contains(error_of(minimal + "optimizer: {kind: adam, momentum: 0.9}\n"),
                 "optimizer.momentum: applies only to optimizer kinds sgd, rmsprop, not to adam"));
  CHECK(contains(error_of(minimal + "optimizer: {kind: sgd, epsilon: 0.1}\n"),
                 "t.yaml:5:24: optimizer.epsilon: applies only to optimizer kinds adam, rmsprop, not to sgd"));
  CHECK(contains(error_of(minimal + "data: {shape: [2]}\n"),
                 "t.yaml:5:8: data.shape: applies only to data source synthetic, not to fashion_mnist"));
  CHECK(contains(error_of(minimal + "loss: {kind: mean_squared_error, from_logits: true}\n"),
                 "loss.from_logits: applies only to the crossentropy losses, not to mean_squared_error"));
}

TEST_CASE("config: YAML syntax errors and duplicate keys carry file:line:col") {
  const std::string bad = error_of("name: x\nmodel:\n  input_shape: [28, 28\n  layers: []\n");
  CHECK(contains(bad, "t.yaml:"));
  CHECK(contains(bad, "invalid YAML"));
  CHECK(error_of("name: x\nname: y\n") == "t.yaml:2:1: duplicate key 'name' (first given at t.yaml:1:1); keep only one");
  CHECK(contains(error_of("a: b: c\n"), "t.yaml:1:5: invalid YAML"));
  CHECK(error_of("model:\n\tinput_shape: [1]\n") ==
        "t.yaml:2:13: invalid YAML: illegal map value (YAML does not allow tabs for indentation; use spaces)");
  CHECK(contains(error_of("model: {input_shape: [1]\n"), "(a '{' has no matching '}')"));
  CHECK(contains(error_of("a: &x [*x]\n"), "t.yaml:1:4: YAML nested deeper than 64 levels"));
}

TEST_CASE("config: --set KEY=null takes the key out") {
  const std::string path = source_dir + "/experiments/fashion_mnist.yaml";
  // The other spelling of the batch, which the file's own key would contradict.
  const Experiment global = load_experiment(path, {"data.batch_size_per_replica=null", "data.global_batch_size=128"});
  CHECK(global.data.global_batch_size == 128);
  // ~ and nothing are YAML's null too; a removed key falls back to its default.
  CHECK(load_experiment(path, {"data.shuffle_buffer=~"}).data.shuffle_buffer == Experiment{}.data.shuffle_buffer);
  CHECK(load_experiment(path, {"train.epochs="}).train.epochs == Experiment{}.train.epochs);
  // A key the file does not have: nothing to remove, nothing changes.
  CHECK(without_locations(load_experiment(path, {"train.steps_per_epoch=null"})) ==
        without_locations(load_experiment(path)));
  // A list item: the ones after it move up (the seed CNN without its first max pooling).
  const Experiment fewer = load_experiment(path, {"model.layers.1=null"});
  REQUIRE(fewer.model.layers.size() == load_experiment(path).model.layers.size() - 1);
  CHECK(fewer.model.layers[1].kind == "conv2d");
  CHECK_THROWS_WITH_AS(load_experiment(path, {"model.layers.9=null"}),
                       doctest::Contains("'model.layers' has 7 items; there is no item '9' to remove"), ConfigError);
}

TEST_CASE("config: --set overrides") {
  const std::string path = source_dir + "/experiments/fashion_mnist.yaml";
  const Experiment e = load_experiment(path, {"optimizer.learning_rate=0.01", "model.input_shape=[32, 32, 3]",
                                              "model.layers.5.dense.units=128", "data.shuffle_buffer=0",
                                              "name=tuned", "train.threads=2"});
  CHECK(e.optimizer.learning_rate.initial_learning_rate == 0.01);
  CHECK(e.model.input_shape == std::vector<std::int64_t>{32, 32, 3});
  CHECK(nn::options_as<nn::DenseOptions>(e.model.layers[5].options).units == 128);
  CHECK(e.data.shuffle_buffer == 0);
  CHECK(e.name == "tuned");
  CHECK(e.train.threads == 2);

  SUBCASE("a missing key is created, even a whole section") {
    const Experiment r = parse_experiment(minimal, "m.yaml", {"data.path=/x", "train.epochs=3"});
    CHECK(r.data.path == "/x");
    CHECK(r.train.epochs == 3);
    const Experiment s = parse_experiment("", "m.yaml", {"model={input_shape: [2], layers: [{dense: {units: 1}}]}"});
    CHECK(s.model.layers.size() == 1);
    CHECK(s.model.layers[0].where.file == "--set model={input_shape: [2], layers: [{dense: {units: 1}}]}");
    CHECK(s.model.layers[0].where.line == 0);
  }
  SUBCASE("appending a layer with the index one past the end") {
    const Experiment r = parse_experiment(minimal, "m.yaml", {"model.layers.1={dense: {units: 7}}"});
    REQUIRE(r.model.layers.size() == 2);
    CHECK(nn::options_as<nn::DenseOptions>(r.model.layers[1].options).units == 7);
    CHECK(r.model.layers[1].name == "dense_1");
  }
  SUBCASE("errors in overridden values name the --set") {
    CHECK(error_of(minimal, {"train.epoch=3"}) ==
          "--set train.epoch=3: unknown key 'epoch' in train; did you mean 'epochs'?");
    CHECK(error_of(minimal, {"trian.epochs=3"}) ==
          "--set trian.epochs=3: unknown key 'trian' at top level; did you mean 'train'?");
    CHECK(error_of(minimal, {"train.epochs=ten"}) == "--set train.epochs=ten: train.epochs: expected an integer, got 'ten'");
    CHECK(error_of(minimal, {"model.layers.0.dense.units=0"}) ==
          "--set model.layers.0.dense.units=0: model.layers.0.dense.units: must be >= 1, got '0'");
  }
  SUBCASE("malformed overrides") {
    CHECK(error_of(minimal, {"train.epochs"}) ==
          "--set train.epochs: expected key.path=value, for example --set train.epochs=5");
    CHECK(contains(error_of(minimal, {"model.input_shape=[28, 28"}), "--set model.input_shape=[28, 28: invalid YAML"));
    CHECK(contains(error_of(minimal, {"=3"}), "--set =3: missing key path"));
    CHECK(contains(error_of(minimal, {"train..epochs=3"}), "empty component"));
    CHECK(error_of(minimal, {"model.layers.5.dense.units=3"}) ==
          "--set model.layers.5.dense.units=3: index 5 is out of range: 'model.layers' has 1 items (use 0..0, or 1 "
          "to append)");
    CHECK(contains(error_of(minimal, {"model.layers.dense.units=3"}),
                   "'model.layers' is a list of 1 items; address an item by its index"));
    CHECK(contains(error_of(minimal, {"model.input_shape.0.x=3"}), "'model.input_shape.0' is a single value ('4')"));
  }
}

TEST_CASE("config: a missing or unreadable file names the path") {
  const std::string missing = source_dir + "/experiments/no_such_experiment.yaml";
  try {
    load_experiment(missing);
    FAIL("expected a ConfigError");
  } catch (const ConfigError& e) {
    CHECK(contains(e.what(), missing));
    CHECK(contains(e.what(), "cannot open"));
  }
  CHECK_THROWS_AS(load_experiment(source_dir + "/experiments"), ConfigError);
}

// ---------------------------------------------------------------- multi-worker

TEST_CASE("config: the multi_worker experiment loads with the expected values") {
  const std::string path = source_dir + "/experiments/fashion_mnist_multi_worker.yaml";
  const Experiment e = load_experiment(path);
  const Experiment plain = load_experiment(source_dir + "/experiments/fashion_mnist.yaml");
  CHECK(e.name == "fashion_mnist_multi_worker");
  CHECK(e.strategy.kind == "multi_worker_mirrored");
  const auto& mwm = options_as<MultiWorkerMirroredOptions>(e.strategy);
  CHECK(mwm.devices == DeviceList{});
  CHECK(mwm.communication.implementation == CommunicationImplementation::auto_select);
  CHECK(mwm.communication.timeout_seconds == 300.0);
  CHECK(mwm.communication.bytes_per_pack == 262144);
  CHECK(mwm.communication.overlap);
  CHECK(mwm.communication.implementation_where == SourceLocation{path, 12, 21});
  CHECK(e.strategy.where == SourceLocation{path, 10, 9});
  CHECK(e.data.source == SourceKind::fashion_mnist);
  CHECK(e.data.batch_size_per_replica == 64);
  CHECK(e.data.shuffle_buffer == 60000);
  CHECK(e.data.auto_shard == AutoShardPolicy::auto_select);
  CHECK(e.data.shards.empty());
  CHECK(e.data == plain.data);
  // The seed CNN, with an L2 penalty on the first dense layer's kernel.
  ModelConfig expected_model = without_locations(plain).model;
  nn::DenseOptions regularized = nn::options_as<nn::DenseOptions>(expected_model.layers[5].options);
  regularized.kernel_regularizer.l2 = 1.0e-5;
  expected_model.layers[5].options = regularized;
  CHECK(without_locations(e).model == expected_model);
  CHECK(e.loss.kind == LossKind::sparse_categorical_crossentropy);
  CHECK(e.loss.from_logits);
  CHECK(e.loss.reduction == Reduction::none);
  CHECK(e.optimizer.kind == OptimizerKind::rmsprop);
  CHECK(e.optimizer.learning_rate.kind == ScheduleKind::constant);
  CHECK(e.optimizer.learning_rate.initial_learning_rate == 0.001);
  CHECK(e.metrics == std::vector<MetricKind>{MetricKind::sparse_categorical_accuracy});
  CHECK(e.train.epochs == 3);
  CHECK(e.train.steps_per_epoch == 70);
  CHECK(e.checkpoint.every_epochs == 1);
  CHECK(e.checkpoint.max_to_keep == 3);
}

TEST_CASE("config: multi_worker_mirrored defaults, communication options and round trips") {
  const Experiment d = parse_experiment(with_strategy("{kind: multi_worker_mirrored}"), "m.yaml");
  CHECK(d.strategy.kind == "multi_worker_mirrored");
  const auto& defaults = options_as<MultiWorkerMirroredOptions>(d.strategy);
  CHECK(defaults.devices.automatic);
  CHECK(defaults.communication == CommunicationConfig{});
  CHECK(defaults.communication.timeout_seconds == 300.0);
  CHECK(defaults.communication.bytes_per_pack == 0);
  CHECK(defaults.communication.overlap);
  for (const char* implementation : {"auto", "ring", "mpi", "nccl"}) {
    CAPTURE(implementation);
    const Experiment e = parse_experiment(
        with_strategy(std::string("{kind: multi_worker_mirrored, communication: {implementation: ") + implementation +
                      "}}"),
        "m.yaml");
    const auto& communication = options_as<MultiWorkerMirroredOptions>(e.strategy).communication;
    CHECK(std::string(name_of(communication.implementation)) == implementation);
    CHECK(communication.implementation_where == SourceLocation{"m.yaml", 5, 73});
  }

  const std::vector<std::string> strategies = {
      "{kind: multi_worker_mirrored}",
      "{kind: multi_worker_mirrored, communication: }",
      "{kind: multi_worker_mirrored, devices: [cpu:0, '/cpu:1'], communication: {implementation: nccl, "
      "bytes_per_pack: 33554432, overlap: false, timeout_seconds: 12.5}}",
      "{kind: multi_worker_mirrored, devices: auto, communication: {implementation: ring, bytes_per_pack: 0}}",
      "{kind: multi_worker_mirrored, communication: {timeout_seconds: 0.25}}",
  };
  for (const std::string& strategy : strategies) {
    CAPTURE(strategy);
    const Experiment original = parse_experiment(with_strategy(strategy), "s.yaml");
    const std::string text = to_yaml(original);
    CAPTURE(text);
    const Experiment again = parse_experiment(text, "resolved.yaml");
    CHECK(without_locations(again) == without_locations(original));
    CHECK(to_yaml(again) == text);
    CHECK_FALSE(contains(text, "cross_device_ops"));
    CHECK_FALSE(contains(text, "parameter_device"));
  }
  const Experiment full = parse_experiment(with_strategy(strategies[2]), "s.yaml");
  const auto& given = options_as<MultiWorkerMirroredOptions>(full.strategy);
  CHECK(given.devices.names == std::vector<std::string>{"cpu:0", "cpu:1"});
  CHECK(given.communication.implementation == CommunicationImplementation::nccl);
  CHECK(given.communication.bytes_per_pack == 33554432);
  CHECK(given.communication.timeout_seconds == 12.5);
  CHECK_FALSE(given.communication.overlap);
  CHECK(contains(to_yaml(full),
                 "communication: {implementation: nccl, bytes_per_pack: 33554432, overlap: false, timeout_seconds: 12.5}"));
  CHECK(contains(to_yaml(d), "devices: auto"));
  CHECK_FALSE(contains(to_yaml(parse_experiment(with_strategy("{kind: mirrored}"), "s.yaml")), "communication"));

  const Experiment set = parse_experiment(minimal + "loss: {reduction: sum}\n", "m.yaml",
                                          {"strategy.kind=multi_worker_mirrored",
                                           "strategy.communication.implementation=mpi"});
  CHECK(set.strategy.kind == "multi_worker_mirrored");
  const auto& communication = options_as<MultiWorkerMirroredOptions>(set.strategy).communication;
  CHECK(communication.implementation == CommunicationImplementation::mpi);
  CHECK(communication.implementation_where.file == "--set strategy.communication.implementation=mpi");
  CHECK(communication.implementation_where.line == 0);
}

TEST_CASE("config: bad multi_worker_mirrored settings are refused where they are written") {
  CHECK(error_of(with_strategy("{kind: mirrored, communication: {implementation: ring}}")) ==
        "t.yaml:5:28: strategy.communication: applies only to strategy kinds multi_worker_mirrored, parameter_server, not "
        "to mirrored; remove it or change the kind");
  CHECK(contains(error_of(with_strategy("{communication: {}}")),
                 "t.yaml:5:12: strategy.communication: applies only to strategy kinds multi_worker_mirrored, "
                 "parameter_server, not to default"));
  CHECK(error_of(with_strategy("{kind: multi_worker_mirrored, cross_device_ops: ring}")) ==
        "t.yaml:5:41: strategy.cross_device_ops: applies only to strategy kind mirrored, not to "
        "multi_worker_mirrored; remove it or change the kind");
  CHECK(contains(error_of(with_strategy("{kind: multi_worker_mirrored, parameter_device: cpu:0}")),
                 "strategy.parameter_device: applies only to strategy kind central_storage, not to "
                 "multi_worker_mirrored"));
  CHECK(contains(error_of(with_strategy("{kind: multi_worker_mirrored, device: cpu:0}")),
                 "strategy.device: applies only to strategy kind one_device, not to multi_worker_mirrored"));
  CHECK(error_of(with_strategy("{kind: multi_worker_mirrored, communication: {implementation: rign}}")) ==
        "t.yaml:5:73: unknown communication implementation 'rign'; valid: auto, ring, mpi, nccl; did you mean "
        "'ring'?");
  CHECK(error_of(with_strategy("{kind: multi_worker_mirrored, communication: {implementation: gloo}}")) ==
        "t.yaml:5:73: unknown communication implementation 'gloo'; valid: auto, ring, mpi, nccl");
  CHECK(error_of(with_strategy("{kind: multi_worker_mirrored, communication: {implementation: ring, timeout: 5}}")) ==
        "t.yaml:5:79: unknown key 'timeout' in strategy.communication; valid keys: implementation, bytes_per_pack, "
        "overlap, timeout_seconds");
  CHECK(error_of(with_strategy("{kind: multi_worker_mirrored, communication: {bytes_per_pak: 5}}")) ==
        "t.yaml:5:57: unknown key 'bytes_per_pak' in strategy.communication; did you mean 'bytes_per_pack'?");
  CHECK(error_of(with_strategy("{kind: multi_worker_mirrored, communication: {timeout_seconds: 0}}")) ==
        "t.yaml:5:74: strategy.communication.timeout_seconds: must be > 0, got '0'");
  CHECK(contains(error_of(with_strategy("{kind: multi_worker_mirrored, communication: {timeout_seconds: -1.5}}")),
                 "strategy.communication.timeout_seconds: must be > 0, got '-1.5'"));
  CHECK(error_of(with_strategy("{kind: multi_worker_mirrored, communication: {bytes_per_pack: -1}}")) ==
        "t.yaml:5:73: strategy.communication.bytes_per_pack: must be >= 0, got '-1'");
  CHECK(error_of(with_strategy("{kind: multi_worker_mirrored, communication: ring}")) ==
        "t.yaml:5:56: strategy.communication: expected a map of settings, got 'ring'");
  CHECK(error_of(with_strategy("{kind: multi_worker_mirrored, devices: [cpu:0, cpu:0]}")) ==
        "t.yaml:5:58: strategy.devices.1: device 'cpu:0' is listed twice (also at t.yaml:5:51); give each replica "
        "its own device");
  CHECK(error_of(minimal + "loss: {reduction: none}\n",
                 {"strategy.kind=multi_worker_mirrored", "strategy.communication.timeout_seconds=0"}) ==
        "--set strategy.communication.timeout_seconds=0: strategy.communication.timeout_seconds: must be > 0, got "
        "'0'");
}

TEST_CASE("config: under multi_worker_mirrored, reduction auto is refused with the mirrored reason") {
  CHECK(error_of(minimal, {"strategy.kind=multi_worker_mirrored"}) ==
        "t.yaml: loss.reduction 'auto' (the default when left out) is refused under strategy 'multi_worker_mirrored': "
        "each replica would average over its own part of the batch, and summing the replicas' gradients then comes "
        "out num_replicas times too large; write reduction: none (dtrain divides the summed per-example losses by "
        "the GLOBAL batch, like tf.nn.compute_average_loss) or reduction: sum");
  CHECK(contains(error_of(minimal + "strategy: {kind: multi_worker_mirrored}\nloss: {reduction: auto}\n"),
                 "t.yaml:6:19: loss.reduction 'auto' is refused under strategy 'multi_worker_mirrored'"));
  try {
    load_experiment(source_dir + "/experiments/fashion_mnist_multi_worker.yaml", {"loss.reduction=auto"});
    FAIL("expected a ConfigError");
  } catch (const ConfigError& e) {
    CHECK(contains(e.what(),
                   "--set loss.reduction=auto: loss.reduction 'auto' is refused under strategy 'multi_worker_mirrored'"));
  }
}

TEST_CASE("config: strategy.roles") {
  const Experiment d = parse_experiment(with_strategy("{kind: multi_worker_mirrored}"), "m.yaml");
  RolesConfig defaults;
  defaults.kind = "multi_worker_mirrored";
  CHECK(options_as<MultiWorkerMirroredOptions>(d.strategy).roles == defaults);
  CHECK_FALSE(contains(to_yaml(d), "roles"));
  const Experiment e =
      parse_experiment(with_strategy("{kind: multi_worker_mirrored, roles: {chief: 1, worker: 2, evaluator: 1}}"), "m.yaml");
  const RolesConfig& roles = options_as<MultiWorkerMirroredOptions>(e.strategy).roles;
  CHECK(roles.chief == 1);
  CHECK(roles.worker == 2);
  CHECK(roles.evaluator == 1);
  CHECK(roles.where.line > 0);
  CHECK_FALSE(roles.parameter_servers);
  const std::string text = to_yaml(e);
  CHECK(contains(text, "roles: {chief: 1, worker: 2, evaluator: 1}"));
  CHECK(without_locations(parse_experiment(text, "again.yaml")) == without_locations(e));
  const Experiment rest = parse_experiment(with_strategy("{kind: multi_worker_mirrored, roles: {evaluator: 1}}"), "m.yaml");
  CHECK(options_as<MultiWorkerMirroredOptions>(rest.strategy).roles.worker == -1);
  CHECK(contains(to_yaml(rest), "roles: {chief: 1, evaluator: 1}"));

  CHECK(contains(error_of(with_strategy("{kind: multi_worker_mirrored, roles: {evaluator: 2}}")),
                 "strategy.roles.evaluator: must be 0 or 1, got '2'"));
  CHECK(contains(error_of(with_strategy("{kind: multi_worker_mirrored, roles: {ps: 1}}")),
                 "strategy.roles.ps: strategy kind multi_worker_mirrored has no parameter servers"));
  CHECK(contains(error_of(with_strategy("{kind: mirrored, roles: {evaluator: 1}}")),
                 "strategy.roles: applies only to strategy kinds multi_worker_mirrored, parameter_server"));
}

TEST_CASE("config: data.auto_shard and data.shards") {
  const Experiment d = parse_experiment(minimal, "m.yaml");
  CHECK(d.data.auto_shard == AutoShardPolicy::auto_select);
  CHECK(d.data.shards.empty());
  for (const char* policy : {"auto", "data", "off"}) {
    CAPTURE(policy);
    // Any strategy accepts it: it only matters with several workers.
    for (const char* strategy : {"{kind: default}", "{kind: mirrored}", "{kind: multi_worker_mirrored}"}) {
      CAPTURE(strategy);
      const Experiment e =
          parse_experiment(with_strategy(strategy) + "data: {auto_shard: " + policy + "}\n", "m.yaml");
      CHECK(std::string(name_of(e.data.auto_shard)) == policy);
      CHECK(contains(to_yaml(e), std::string("auto_shard: ") + policy));
    }
  }

  const Experiment by_file = parse_experiment(
      minimal + "data: {source: hdf5, auto_shard: file, shards: [part0.h5, 'dir/part 1.h5', part2.h5]}\n", "m.yaml");
  CHECK(by_file.data.auto_shard == AutoShardPolicy::file);
  CHECK(by_file.data.shards == std::vector<std::string>{"part0.h5", "dir/part 1.h5", "part2.h5"});
  CHECK(by_file.data.path.empty());

  const std::vector<std::string> variants = {
      "data: {source: hdf5, auto_shard: file, shards: [part0.h5, 'dir/part 1.h5', part2.h5]}",
      "data: {source: hdf5, auto_shard: file, shards: [a.h5]}\n"
      "strategy: {kind: multi_worker_mirrored, devices: [cpu:0]}\nloss: {reduction: sum}",
      "data: {source: hdf5, shards: [a.h5, b.h5]}",
      "data: {source: hdf5, auto_shard: data, shards: [a.h5, b.h5]}",
      "data: {source: hdf5, path: all.h5, auto_shard: off}",
      "data: {auto_shard: data}",
  };
  for (const std::string& variant : variants) {
    CAPTURE(variant);
    const Experiment original = parse_experiment(minimal + variant + "\n", "v.yaml");
    const std::string text = to_yaml(original);
    CAPTURE(text);
    const Experiment again = parse_experiment(text, "resolved.yaml");
    CHECK(without_locations(again) == without_locations(original));
    CHECK(to_yaml(again) == text);
  }
  CHECK_FALSE(contains(to_yaml(d), "shards"));
}

TEST_CASE("config: bad auto_shard and shards settings are refused where they are written") {
  CHECK(error_of(minimal + "data: {source: hdf5, path: a.h5, shards: [b.h5]}\n") ==
        "t.yaml:5:34: data.shards: give either data.path (one HDF5 file) or data.shards (the data split into files), "
        "not both; data.path is at t.yaml:5:28");
  CHECK(error_of(minimal + "data: {source: hdf5}\n") == "t.yaml:5:7: data: missing required key 'path'");
  CHECK(error_of(minimal + "data: {source: hdf5, auto_shard: file}\n") ==
        "t.yaml:5:7: data: missing required key 'shards' (auto_shard: file reads one HDF5 file per shard, for example "
        "shards: [part0.h5, part1.h5])");
  CHECK(error_of(minimal + "data: {auto_shard: file}\n") ==
        "t.yaml:5:20: data.auto_shard 'file' needs data source hdf5 with one file per shard in data.shards, not "
        "fashion_mnist; write auto_shard: data (every worker keeps every workers-th example) or auto");
  CHECK(contains(error_of(minimal + "data: {source: idx, path: d, auto_shard: file, shards: [a]}\n"),
                 "t.yaml:5:48: data.shards: applies only to data source hdf5, not to idx"));
  CHECK(error_of(minimal + "data: {source: hdf5, auto_shard: file, shards: []}\n") ==
        "t.yaml:5:48: data.shards: must be a non-empty list of HDF5 files, got a list");
  CHECK(error_of(minimal + "data: {source: hdf5, auto_shard: file, shards: a.h5}\n") ==
        "t.yaml:5:48: data.shards: expected a list of HDF5 file paths, got 'a.h5'");
  CHECK(error_of(minimal + "data: {source: hdf5, auto_shard: file, shards: [a.h5, '']}\n") ==
        "t.yaml:5:55: data.shards.1: must be a non-empty path, got ''");
  CHECK(error_of(minimal + "data: {source: hdf5, auto_shard: file, shards: [a.h5, b.h5, a.h5]}\n") ==
        "t.yaml:5:61: data.shards.2: shard 'a.h5' is listed twice (also at t.yaml:5:49); list each file once");
  CHECK(error_of(minimal + "data: {auto_shard: fiel}\n") ==
        "t.yaml:5:20: unknown auto_shard policy 'fiel'; valid: auto, file, data, off; did you mean 'file'?");
  CHECK(error_of(minimal + "data: {auto_shard: sharded}\n") ==
        "t.yaml:5:20: unknown auto_shard policy 'sharded'; valid: auto, file, data, off");
  CHECK(error_of(minimal + "data: {auto_shrd: off}\n") ==
        "t.yaml:5:8: unknown key 'auto_shrd' in data; did you mean 'auto_shard'?");
  CHECK(contains(error_of(minimal + "data: {source: hdf5, path: a.h5}\n", {"data.shards=[b.h5]"}),
                 "--set data.shards=[b.h5]: data.shards: give either data.path"));
}

// ---------------------------------------------------------------- limits (issue 15)

namespace {

// Ten levels of lists of nine aliases of the level below: 9^10 values from 300-odd bytes.
std::string billion_laughs() {
  std::string text = "a: &a [x, x, x, x, x, x, x, x, x]\n";
  std::string previous = "a";
  for (char level = 'b'; level <= 'j'; ++level) {
    const std::string name(1, level);
    text += name + ": &" + name + " [";
    for (int i = 0; i < 9; ++i) text += (i ? ", *" : "*") + previous;
    text += "]\n";
    previous = name;
  }
  return text;
}

}  // namespace

TEST_CASE("config limits: YAML aliases expand within a budget, also from a checkpoint's /experiment") {
  const std::string laughs = billion_laughs();
  CHECK(laughs.size() < 450);
  for (const std::string file : {"t.yaml", "ckpt-1.h5:/experiment"}) {
    std::string what;
    try {
      parse_experiment(laughs, file);
    } catch (const ConfigError& e) {
      what = e.what();
    }
    CHECK(what.rfind(file + ":", 0) == 0);
    CHECK(contains(what, "YAML aliases expand to more than 100000 copied values"));
  }
  // A block reused a few times is fine.
  CHECK(error_of(minimal + "data: &d {source: synthetic, train_size: 8, test_size: 2}\n"
                 "x: [*d, *d, *d]\n") == "t.yaml:6:1: unknown key 'x' at top level; valid keys: name, seed, "
                                         "precision, strategy, data, model, loss, optimizer, metrics, train, checkpoint, reproducibility");
}

TEST_CASE("config limits: many keys are checked for duplicates in linear time") {
  // Quadratic duplicate detection took minutes on maps this large.
  std::string text = minimal + "train:\n";
  for (int i = 0; i < 60000; ++i) text += fmt::format("  k{}: 1\n", i);
  text += "  k17: 2\n";
  CHECK(contains(error_of(text), "duplicate key 'k17' (first given at t.yaml:"));
  text.resize(text.size() - std::string("  k17: 2\n").size());
  CHECK(contains(error_of(text), "unknown key 'k0' in train"));
}

TEST_CASE("config limits: sizes, counts and threads beyond what the machine or the types hold are refused") {
  CHECK(contains(error_of(minimal, {"train.threads=100000"}), "--set train.threads=100000: train.threads"));
  CHECK(contains(error_of(minimal, {"train.threads=2147483647"}), "at most"));
  CHECK(error_of(minimal, {"train.threads=64"}).empty());
  const std::string wide = R"(model:
  input_shape: [28, 4294967296, 1]
  layers:
    - dense: {units: 2}
)";
  CHECK(contains(error_of(wide), "t.yaml:2:16: model.input_shape: one example of this shape needs"));
  CHECK(contains(error_of(wide), "of memory"));
  std::string overflow = wide;
  overflow.replace(overflow.find("28, 4294967296"), 14, "9223372036854775807, 28");
  CHECK(contains(error_of(overflow), "needs more than 8 EB"));
  std::string rank = wide;
  rank.replace(rank.find("28, 4294967296, 1"), 17, "1, 1, 1, 1, 1, 1, 1, 1");
  CHECK(contains(error_of(rank), "model.input_shape: must be at most 7 dimensions"));
  // A reshape's target too (it failed with exit 1 when the model was built).
  CHECK(error_of("model:\n  input_shape: [4]\n  layers:\n    - reshape: {target_shape: [1, 1, 1, 1, 1, 1, 1, 4]}\n") ==
        "t.yaml:4:31: model.layers.0.reshape.target_shape: must be at most 7 dimensions (the batch dimension makes 8), "
        "got a list");
  CHECK(error_of("model:\n  input_shape: [4]\n  layers:\n    - reshape: {target_shape: [1, 1, 1, 1, 1, 1, 4]}\n    - "
                 "flatten: {}\n    - dense: {units: 2}\n")
            .empty());
  const std::string synthetic = minimal + "data: {source: synthetic, shape: [4], train_size: 1000000000000}\n";
  CHECK(contains(error_of(synthetic), "t.yaml:5:51: data.train_size: a synthetic dataset of"));
  CHECK(contains(error_of(minimal + "data: {source: synthetic, shape: [4], test_size: 0}\n"), "data.test_size"));
  CHECK(contains(error_of(minimal + "data: {source: tensors, x: [1, 2, 3, 4], y: [1, 0], size: 4611686018427387904}\n"),
                 "data.size: 4611686018427387904 repeated examples needs"));
}

TEST_CASE("config: an over-long name is refused where it is written, and the error shows only its start") {
  const std::string long_name(100000, 'n');
  const std::string error = error_of("name: " + long_name + "\n" + minimal);
  CHECK(error.rfind("t.yaml:1:7: name: must be at most 200 bytes (it names the run directory runs/<name>;", 0) == 0);
  CHECK(contains(error, "got '" + std::string(60, 'n') + "...' (100000 bytes)"));
  CHECK(error.size() < 300);
  CHECK(contains(error_of(minimal, {"name=" + long_name}), "--set name="));
  CHECK(error_of("name: " + std::string(kMaxExperimentNameBytes, 'n') + "\n" + minimal).empty());
  // The cut never splits a UTF-8 character: after "a", the 60th byte starts a 2-byte 'é'.
  std::string wide = "a", shown = "a";
  for (int i = 0; i < 150; ++i) wide += "\xc3\xa9";
  for (int i = 0; i < 29; ++i) shown += "\xc3\xa9";
  CHECK(contains(error_of("name: " + wide + "\n" + minimal), "got '" + shown + "...' (301 bytes)"));
}

TEST_CASE("config: an empty experiment is blamed on its file, not on the --set that filled it") {
  CHECK(error_of("", {"train.epochs=1"}) == "t.yaml:1:1: missing required key 'model'");
  CHECK(error_of("# nothing\n", {"train.epochs=1"}).rfind("t.yaml:", 0) == 0);
}

TEST_CASE("config: a loss the last layer cannot feed is refused at the loss, naming the layer") {
  auto error_for = [](const std::string& yaml, std::vector<std::int64_t> outputs) {
    try {
      check_loss_fits_model(parse_experiment(yaml, "t.yaml"), outputs);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string synthetic = minimal + "data: {source: synthetic, shape: [4], classes: 3, train_size: 8, test_size: 2}\n";
  const std::string binary = synthetic + "loss: {kind: binary_crossentropy}\n";
  CHECK(error_for(binary, {2}).rfind("t.yaml:6:1: loss binary_crossentropy reads each integer label", 0) == 0);
  CHECK(contains(error_for(binary, {2}), "the last layer 'dense' (at t.yaml:4:7) gives 2"));
  CHECK(error_for(binary, {1}).empty());
  const std::string sparse = synthetic + "loss: {kind: sparse_categorical_crossentropy}\n";
  CHECK(contains(error_for(sparse, {2}), "data source synthetic has 3 classes, but the last layer 'dense'"));
  CHECK(error_for(sparse, {3}).empty());
  CHECK(contains(error_for(sparse, {3, 1}), "t.yaml:4:7: loss sparse_categorical_crossentropy needs one vector"));
  const std::string tensors = minimal + "data: {source: tensors, x: [1, 2, 3, 4], y: [1, 0, 0], size: 4}\n"
                                        "loss: {kind: mean_squared_error}\n";
  CHECK(contains(error_for(tensors, {2}), "compares 2 outputs per example with the 3 targets of data.y"));
  CHECK(error_for(tensors, {3}).empty());
  // A crossentropy reads data.y as probabilities: a value outside [0, 1] is refused at data.
  const std::string bce = minimal + "data: {source: tensors, x: [1, 2, 3, 4], y: [3.0], size: 4}\n"
                                    "loss: {kind: binary_crossentropy}\n";
  CHECK(error_for(bce, {1}).rfind("t.yaml:5:7: data.y holds 3, outside [0, 1]; loss binary_crossentropy", 0) == 0);
  CHECK(error_for(minimal + "data: {source: tensors, x: [1, 2, 3, 4], y: [0, -0.5], size: 4}\n"
                            "loss: {kind: categorical_crossentropy}\n", {2})
            .rfind("t.yaml:5:7: data.y holds -0.5", 0) == 0);
  CHECK(error_for(minimal + "data: {source: tensors, x: [1, 2, 3, 4], y: [0, 0.25, 1], size: 4}\n"
                            "loss: {kind: categorical_crossentropy}\n", {3}).empty());
  CHECK(error_for(minimal + "data: {source: tensors, x: [1, 2, 3, 4], y: [3.0], size: 4}\n"
                            "loss: {kind: mean_squared_error}\n", {1}).empty());
}

TEST_CASE("config: float targets of another width than the model's outputs are refused at the loss, once loaded") {
  auto error_for = [](const std::string& loss, std::vector<std::int64_t> outputs, std::int64_t targets) {
    const std::string yaml = "model:\n  input_shape: [4]\n  layers:\n    - dense: {units: 2}\n"
                             "data: {source: hdf5, path: d.h5}\nloss: {kind: " + loss + "}\n";
    try {
      check_loss_fits_model(parse_experiment(yaml, "t.yaml"), outputs, LabelKind{false, 0, targets});
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string two = error_for("mean_squared_error", {1}, 2);
  CHECK(two.rfind("t.yaml:6:1: loss mean_squared_error compares 1 output per example with the 2 float targets of "
                  "each example of data source hdf5; make the last layer 'dense' (at t.yaml:4:7) give 2",
                  0) == 0);
  CHECK(contains(error_for("categorical_crossentropy", {3}, 1), "compares 3 outputs per example with the 1 float target"));
  CHECK(error_for("mean_squared_error", {2}, 2).empty());
  CHECK(error_for("binary_crossentropy", {1}, 1).empty());
  CHECK(error_for("mean_squared_error", {2}, 0).empty());  // unknown before the data is loaded
  // A metric that reads class ids, over float targets: refused at the metrics list.
  const std::string yaml = "model:\n  input_shape: [4]\n  layers:\n    - dense: {units: 2}\n"
                           "data: {source: hdf5, path: d.h5}\nloss: {kind: categorical_crossentropy}\n"
                           "metrics: [sparse_categorical_accuracy]\n";
  try {
    check_loss_fits_model(parse_experiment(yaml, "t.yaml"), std::vector<std::int64_t>{2}, LabelKind{false, 0, 2});
    FAIL("no error");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()) == "t.yaml:7:10: metric sparse_categorical_accuracy needs integer class ids, but data "
                                   "source hdf5 gives float targets; use categorical_accuracy, or accuracy");
  }
  check_loss_fits_model(parse_experiment(yaml, "t.yaml"), std::vector<std::int64_t>{2}, LabelKind{true, 2, 0});
}

TEST_CASE("config: model.initial_weights names a file, located for the errors of reading it") {
  const std::string yaml = "model:\n  input_shape: [4]\n  layers:\n    - dense: {units: 2}\n"
                           "  initial_weights: start.weights.h5\n";
  const Experiment e = parse_experiment(yaml, "t.yaml");
  CHECK(e.model.initial_weights == "start.weights.h5");
  CHECK(e.initial_weights_where.line == 5);
  CHECK(e.initial_weights_where.column == 20);
  // Written back only when set, and read back the same.
  const std::string text = to_yaml(e);
  CHECK(contains(text, "initial_weights: start.weights.h5"));
  CHECK(without_locations(parse_experiment(text, "resolved.yaml")) == without_locations(e));
  CHECK(!contains(to_yaml(parse_experiment(minimal, "t.yaml")), "initial_weights"));
  const Experiment set = parse_experiment(minimal, "t.yaml", {"model.initial_weights=k.weights.h5"});
  CHECK(set.model.initial_weights == "k.weights.h5");
  CHECK(set.initial_weights_where.file == "--set model.initial_weights=k.weights.h5");

  // Each refusal names the key's place, the key and what it takes.
  const std::vector<std::pair<std::string, std::string>> refused = {
      {yaml + "  initial_weight: x\n", "t.yaml:6:3: unknown key 'initial_weight' in model; did you mean 'initial_weights'?"},
      {minimal + "  initial_weights: [a.h5]\n", "t.yaml:5:20: model.initial_weights: expected a string, got a list"},
      {minimal + "  initial_weights: ''\n",
       "t.yaml:5:20: model.initial_weights: must be a non-empty path (leave the key out for the seed's initialization)"},
      {minimal + "  initial_weights: '  '\n", "t.yaml:5:20: model.initial_weights: must be a path, not only blanks"},
      {minimal + "  initial_weights: ~/k.weights.h5\n", "it does not expand '~'"},
  };
  for (const auto& [text, message] : refused) {
    CAPTURE(text);
    CHECK(contains(error_of(text), message));
  }
  CHECK(contains(error_of(minimal, {"model.initial_weights=[1]"}), "--set model.initial_weights=[1]"));
}
