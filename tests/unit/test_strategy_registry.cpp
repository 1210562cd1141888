// The strategy registry from outside: this test binary registers a strategy kind of its own (as
// test_bench.cpp registers a probe layer), in one statement, and the parser, to_yaml, `dtrain
// init`, make_strategy and the trainer take it like a built-in kind. The built-in kinds' names
// appear in lib/ only in their own files: what the registry answers about them is checked here.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <fmt/format.h>

#include "config/experiment_template.hpp"
#include "config/parse.hpp"
#include "config/strategies.hpp"
#include "core/error.hpp"
#include "distribute/replicated_strategy.hpp"
#include "distribute/single_communicator.hpp"
#include "distribute/strategy.hpp"
#include "trainer_support.hpp"

using namespace dtrain;

namespace {

// N CPU replicas, mirrored: the mirrored strategy's layout with a replica count instead of a list.
struct ProbeOptions {
  static constexpr std::string_view kind = "probe_replicas";
  int replicas = 2;
  bool operator==(const ProbeOptions&) const = default;
};

void parse_probe(const config::Section& s, config::StrategyConfig& out) {
  ProbeOptions o;
  s.get_int("replicas", o.replicas, 1);
  if (s.find("replicas")) out.devices_where = s.find("replicas")->origin.location();
  out.options = o;
}

void write_probe(const config::StrategyOptions& options, config::OptionsWriter& out) {
  out.integer("replicas", distribute::options_as<ProbeOptions>(options).replicas);
}

std::vector<config::TemplateNote> probe_notes() { return {{.key = "replicas", .beside = "CPU replicas, mirrored"}}; }

std::vector<Device> probe_devices(const config::StrategyConfig& config, int) {
  std::vector<Device> devices;
  for (int i = 0; i < distribute::options_as<ProbeOptions>(config).replicas; ++i)
    devices.push_back(Device{Device::Kind::cpu, i});
  return devices;
}

std::unique_ptr<distribute::Strategy> make_probe(const config::StrategyConfig&, std::vector<Device> devices,
                                                 int total_threads, distribute::Communicator&) {
  return std::make_unique<distribute::ReplicatedStrategy>(
      distribute::ReplicaLayout{ProbeOptions::kind.data(), std::move(devices)}, total_threads);
}

const distribute::StrategyRegistration probe_strategy({.kind = ProbeOptions::kind,
                                                       .listed_at = 1000,
                                                       .keys = {"replicas"},
                                                       .parse = &parse_probe,
                                                       .write = &write_probe,
                                                       .summary = "the tests' probe",
                                                       .notes = &probe_notes},
                                                      {.local_devices = &probe_devices, .make = &make_probe});

std::string error_of(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  try {
    config::parse_experiment(yaml, "t.yaml", overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

const std::string model = "model:\n  input_shape: [4]\n  layers:\n    - dense: {units: 2}\nloss: {reduction: none}\n";

}  // namespace

TEST_CASE("strategy registry: the built-in kinds, in order, and what each registered") {
  const std::vector<std::string_view> kinds = config::strategy_kind_names();
  REQUIRE(kinds.size() == 7);
  CHECK(std::vector<std::string_view>(kinds.begin(), kinds.begin() + 6) ==
        std::vector<std::string_view>{"default", "one_device", "mirrored", "central_storage", "multi_worker_mirrored",
                                      "parameter_server"});
  CHECK(kinds.back() == "probe_replicas");  // listed after them
  CHECK(config::default_strategy_schema().kind == "default");
  CHECK(config::choices_of("strategy.kind") == kinds);
  // The section's keys: the devices first, then the others in the kinds' order.
  CHECK(config::strategy_keys() ==
        std::vector<std::string_view>{"kind", "device", "devices", "parameter_device", "cross_device_ops",
                                      "communication", "roles", "variable_partitioner", "replicas"});
  CHECK(config::find_strategy_schema("tpu") == nullptr);
  CHECK_THROWS_AS(config::strategy_schema("tpu"), InternalError);
  distribute::SingleCommunicator alone;
  CHECK_THROWS_AS(distribute::make_strategy(config::StrategyConfig{}, 1, alone), InternalError);  // no kind set
  // A kind registered twice is a programming error.
  CHECK_THROWS_AS(config::register_strategy_schema(config::strategy_schema("probe_replicas")), InternalError);
}

TEST_CASE("strategy registry: a probe kind parses with the shared schema, and its errors read like the others'") {
  const config::Experiment e =
      config::parse_experiment(model + "strategy: {kind: probe_replicas, replicas: 3}\n", "p.yaml");
  CHECK(e.strategy.kind == "probe_replicas");
  CHECK(distribute::options_as<ProbeOptions>(e.strategy).replicas == 3);
  CHECK(e.strategy.devices_where == config::SourceLocation{"p.yaml", 6, 44});
  CHECK(distribute::options_as<ProbeOptions>(config::strategy_config_of("probe_replicas")).replicas == 2);

  CHECK(error_of(model + "strategy: {kind: probe_replicas, replicas: 0}\n") ==
        "t.yaml:6:44: strategy.replicas: must be >= 1, got '0'");
  CHECK(error_of(model + "strategy: {kind: probe_replicas, replica: 2}\n") ==
        "t.yaml:6:34: unknown key 'replica' in strategy; did you mean 'replicas'?");
  CHECK(error_of(model + "strategy: {kind: probe_replica}\n") ==
        fmt::format("t.yaml:6:18: unknown strategy kind 'probe_replica'; valid: {}; did you mean 'probe_replicas'?",
                    config::join(config::strategy_kind_names())));
  // "Only for": from the kinds that take the key, the probe's own and the built-in ones alike.
  CHECK(error_of(model + "strategy: {kind: mirrored, replicas: 2}\n") ==
        "t.yaml:6:28: strategy.replicas: applies only to strategy kind probe_replicas, not to mirrored; remove it or "
        "change the kind");
  CHECK(error_of(model + "strategy: {kind: probe_replicas, devices: [cpu:0]}\n") ==
        "t.yaml:6:34: strategy.devices: applies only to strategy kinds mirrored, central_storage, "
        "multi_worker_mirrored, not to probe_replicas; remove it or change the kind");
  // It did not say it allows averaging reductions: refused with the general reason.
  CHECK(error_of(model + "strategy: {kind: probe_replicas}\n", {"loss.reduction=auto"}) ==
        "--set loss.reduction=auto: loss.reduction 'auto' is refused under strategy 'probe_replicas': each replica "
        "would average over its own part of the batch, and summing the replicas' gradients then comes out "
        "num_replicas times too large; write reduction: none (dtrain divides the summed per-example losses by the "
        "GLOBAL batch, like tf.nn.compute_average_loss) or reduction: sum");
}

TEST_CASE("strategy registry: a probe kind writes itself back, and dtrain init writes it") {
  const config::Experiment e =
      config::parse_experiment(model + "strategy: {kind: probe_replicas, replicas: 3}\n", "p.yaml");
  const std::string text = config::to_yaml(e);
  CHECK(text.find("strategy:\n  kind: probe_replicas\n  replicas: 3\n") != std::string::npos);
  const config::Experiment again = config::parse_experiment(text, "again.yaml");
  CHECK(again.strategy.kind == e.strategy.kind);
  CHECK(again.strategy.options == e.strategy.options);
  CHECK(config::to_yaml(again) == text);

  config::TemplateOptions options;
  options.strategy = "probe_replicas";
  const std::string init = config::experiment_template(options);
  CHECK(init.find("  replicas: 2                     # CPU replicas, mirrored\n") != std::string::npos);
  CHECK(init.find("probe_replicas: the tests' probe.") != std::string::npos);  // in TODO(strategy)
  CHECK(init.find("`dtrain run FILE` trains it") != std::string::npos);
  CHECK(config::launcher_for("probe_replicas").empty());
  CHECK(config::parse_experiment(init, "init.yaml").strategy.options ==
        config::strategy_config_of("probe_replicas").options);
}

TEST_CASE("strategy registry: a probe kind lays out its replicas and trains a step like mirrored") {
  distribute::SingleCommunicator alone;
  const config::StrategyConfig probe = distribute::strategy_config(ProbeOptions{3});
  CHECK(distribute::num_replicas_in_sync(probe, 8, 4) == 3);  // in this process alone
  CHECK_FALSE(distribute::spans_workers(probe));
  CHECK_FALSE(distribute::runs_own_loop(probe));
  CHECK(distribute::roles_of(probe) == nullptr);
  CHECK(distribute::kinds_spanning_workers() ==
        std::vector<std::string_view>{"multi_worker_mirrored", "parameter_server"});
  const auto strategy = distribute::make_strategy(probe, 3, alone);
  CHECK(strategy->describe() == "strategy probe_replicas | replicas 3 (cpu:0, cpu:1, cpu:2) | cross-device ops ring");
  CHECK_FALSE(strategy->schedules_steps());

  // The same layout as mirrored on two devices: the same step, bit for bit.
  const std::string head = testing::small_data_experiment("probe", 5, "{kind: probe_replicas}", 8);
  const std::string rest = R"(model:
  input_shape: [28, 28, 1]
  layers:
    - flatten: {}
    - dense: {units: 10}
loss: {kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}
optimizer: {kind: sgd, learning_rate: 0.1}
metrics: [sparse_categorical_accuracy]
train: {epochs: 1, threads: 2, progress: none}
)";
  auto probed = testing::make_trainer(head + rest);
  auto mirrored = testing::make_trainer(head + rest, {"strategy={kind: mirrored, devices: [cpu:0, cpu:1]}"});
  REQUIRE(probed->strategy().num_replicas_in_sync() == 2);
  CHECK(probed->header_line().find("strategy probe_replicas | replicas 2") != std::string::npos);
  const std::vector<double> before = testing::weights(*probed);
  CHECK(before == testing::weights(*mirrored));
  const std::vector<double> losses = probed->train_steps(0, 1);
  CHECK(losses == mirrored->train_steps(0, 1));
  CHECK(testing::weights(*probed) == testing::weights(*mirrored));
  CHECK(testing::weights(*probed) != before);
  CHECK(testing::weights(*probed, 1) == testing::weights(*probed, 0));
}
