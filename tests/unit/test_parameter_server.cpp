// ParameterServerStrategy's pieces that need no MPI job: the variable partitioners (TensorFlow's
// semantics), the placement of shards on the servers, the roles with parameter servers, and the
// strategy's configuration.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "config/experiment.hpp"
#include "config/parse.hpp"
#include "core/error.hpp"
#include "distribute/parameter_server.hpp"
#include "distribute/partitioner.hpp"
#include "distribute/roles.hpp"

using namespace dtrain;
using distribute::ParameterServerOptions;
using distribute::PartitionerKind;
using distribute::VariablePartitionerConfig;
using distribute::Role;

namespace {

VariablePartitionerConfig fixed(int n) {
  VariablePartitionerConfig p;
  p.kind = PartitionerKind::fixed_shards;
  p.num_shards = n;
  return p;
}
VariablePartitionerConfig min_size(std::int64_t bytes, int max_shards) {
  VariablePartitionerConfig p;
  p.kind = PartitionerKind::min_size;
  p.min_shard_bytes = bytes;
  p.max_shards = max_shards;
  return p;
}
VariablePartitionerConfig max_size(std::int64_t bytes, int max_shards) {
  VariablePartitionerConfig p;
  p.kind = PartitionerKind::max_size;
  p.max_shard_bytes = bytes;
  p.max_shards = max_shards;
  return p;
}

const std::string model = "model:\n  input_shape: [4]\n  layers:\n    - dense: {units: 2}\nloss: {reduction: none}\n";

std::string error_of(const std::string& strategy) {
  try {
    config::parse_experiment(model + "strategy: " + strategy + "\n", "p.yaml");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("partitioners: TensorFlow's examples") {
  // tf.distribute.experimental.partitioners' docstrings and tests, float32 [6, 1] (24 bytes).
  const Shape six{6, 1};
  CHECK(distribute::shard_count(fixed(2), six) == 2);
  CHECK(distribute::shard_count(fixed(10), six) == 6);  // never more shards than rows
  CHECK(distribute::shard_count(min_size(4, 2), six) == 2);
  CHECK(distribute::shard_count(min_size(4, 10), six) == 6);
  CHECK(distribute::shard_count(min_size(4, 0), six) == 1);  // max_shards defaults to 1
  CHECK(distribute::shard_count(max_size(4, 0), six) == 6);
  CHECK(distribute::shard_count(max_size(4, 2), six) == 2);
  CHECK(distribute::shard_count(max_size(1024, 0), six) == 1);
  // min_slice_size's docstring: [1024, 1024] float32 in 256 KiB slices is 16 of them.
  CHECK(distribute::shard_count(min_size(256 << 10, 100), Shape{1024, 1024}) == 16);
  CHECK(distribute::shard_count(min_size(256 << 10, 4), Shape{1024, 1024}) == 4);
  // max_size: rows of 12 bytes; 30 bytes hold 2 rows, so 5 rows need 3 shards.
  CHECK(distribute::shard_count(max_size(30, 0), Shape{5, 3}) == 3);
  CHECK(distribute::shard_count(max_size(4, 0), Shape{5, 3}) == 5);  // a row larger than the limit: one per shard
  // Nothing cuts a scalar, a single row, or anything under `none`.
  CHECK(distribute::shard_count(fixed(4), Shape{}) == 1);
  CHECK(distribute::shard_count(fixed(4), Shape{1, 8}) == 1);
  CHECK(distribute::shard_count(VariablePartitionerConfig{}, Shape{100, 100}) == 1);
}

TEST_CASE("partitioners: shards along the first axis, the first ones a row longer, round-robin over the servers") {
  const std::vector<Shape> shapes{Shape{3, 3, 1, 4}, Shape{4}, Shape{7, 2}};
  const auto shards = distribute::place_shards(fixed(3), shapes, 2);
  REQUIRE(shards.size() == 9);
  // 7 rows in 3 shards: 3, 2, 2.
  CHECK(shards[6].variable == 2);
  CHECK(shards[6].rows == 3);
  CHECK(shards[7].rows == 2);
  CHECK(shards[8].rows == 2);
  CHECK(shards[7].first_row == 3);
  CHECK(shards[7].offset == 6);
  CHECK(shards[7].size == 4);
  CHECK(shards[7].shape == Shape{2, 2});
  // Every shard takes the next server, across variables.
  for (std::size_t i = 0; i < shards.size(); ++i) CHECK(shards[i].server == static_cast<int>(i % 2));
  // The shards cover each variable exactly, in order.
  std::int64_t covered = 0;
  for (const auto& s : shards)
    if (s.variable == 0) {
      CHECK(s.offset == covered);
      covered += s.size;
    }
  CHECK(covered == 36);
  const std::vector<std::string> names{"conv/kernel", "conv/bias", "dense/kernel"};
  const auto whole = distribute::place_shards(VariablePartitionerConfig{}, shapes, 2);
  CHECK(distribute::describe_placement(whole, names) == "conv/kernel -> ps 0; conv/bias -> ps 1; dense/kernel -> ps 0");
  CHECK(distribute::describe_placement(distribute::place_shards(fixed(2), {shapes.begin() + 2, shapes.end()}, 2),
                                       {names.begin() + 2, names.end()}) == "dense/kernel [0:4) -> ps 0, [4:7) -> ps 1");
}

TEST_CASE("roles: parameter servers come after the workers") {
  config::RolesConfig roles;
  roles.parameter_servers = true;
  roles.kind = "parameter_server";
  roles.ps = 2;
  roles.where = {"exp.yaml", 3, 5};
  const distribute::RolePlan plan = distribute::resolve_roles(roles, nullptr, 5, 0);
  CHECK(plan.workers == 2);
  CHECK(plan.training_ranks() == 5);
  CHECK(plan.role_of(0) == Role::chief);
  CHECK(plan.role_of(2) == Role::worker);
  CHECK(plan.role_of(3) == Role::ps);
  CHECK(plan.describe() == "1 chief, 2 workers, 2 parameter servers");
  roles.evaluator = 1;
  CHECK(distribute::resolve_roles(roles, nullptr, 6, 0).role_of(5) == Role::evaluator);

  // TF_CONFIG with "ps" tasks: (ps, i) is rank chief + workers + i.
  config::RolesConfig from_env;
  from_env.parameter_servers = true;
  from_env.kind = "parameter_server";
  const char* tf = R"({"cluster": {"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1", "p:2"]}, "task": {"type": "ps", "index": 1}})";
  const distribute::RolePlan env = distribute::resolve_roles(from_env, tf, 5, 4);
  CHECK(env.ps == 2);
  CHECK(env.role_of(4) == Role::ps);
  CHECK(env.source == "TF_CONFIG");
  auto error = [](const config::RolesConfig& r, const char* tf_config, int world, int rank) -> std::string {
    try {
      distribute::resolve_roles(r, tf_config, world, rank);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  CHECK(error(from_env, tf, 5, 3).find("TF_CONFIG says this process is ps 1, which is rank 4") != std::string::npos);
  // A task past its cluster: the message counts every kind of task, the servers too.
  const char* past = R"({"cluster": {"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1", "p:2"]}, "task": {"type": "ps", "index": 2}})";
  CHECK(error(from_env, past, 5, 4) ==
        "TF_CONFIG task {type: ps, index: 2} is not in its cluster (1 chief, 2 workers, 2 ps, 0 evaluator)");
  CHECK(error(from_env, nullptr, 3, 0) ==
        "strategy kind parameter_server needs parameter servers: write strategy.roles.ps (1 or more), or give TF_CONFIG "
        "\"ps\" tasks");
  roles.evaluator = 0;
  CHECK(error(roles, tf, 5, 4).find("disagrees") == std::string::npos);
  roles.ps = 3;
  CHECK(error(roles, tf, 5, 4).find("disagrees with") != std::string::npos);
  roles.ps = 4;
  CHECK(error(roles, nullptr, 5, 0).find("at least one worker") != std::string::npos);
  // multi_worker_mirrored still refuses them.
  CHECK(error(config::RolesConfig{}, tf, 5, 4).find("which MultiWorkerMirroredStrategy does not use") != std::string::npos);
}

TEST_CASE("config: strategy kind parameter_server") {
  const config::Experiment e = config::parse_experiment(
      model + "strategy: {kind: parameter_server, roles: {chief: 1, ps: 2, worker: 2}, variable_partitioner: {kind: "
              "min_size, min_shard_bytes: 1024, max_shards: 4}, communication: {timeout_seconds: 20}}\n",
      "p.yaml");
  CHECK(e.strategy.kind == "parameter_server");
  const auto& options = distribute::options_as<ParameterServerOptions>(e.strategy);
  CHECK(options.roles.ps == 2);
  CHECK(options.roles.parameter_servers);
  CHECK(options.roles.kind == "parameter_server");
  CHECK(options.variable_partitioner == min_size(1024, 4));
  const std::string text = config::to_yaml(e);
  CHECK(text.find("roles: {chief: 1, ps: 2, worker: 2, evaluator: 0}") != std::string::npos);
  CHECK(text.find("variable_partitioner: {kind: min_size, min_shard_bytes: 1024, max_shards: 4}") != std::string::npos);
  const config::Experiment again = config::parse_experiment(text, "again.yaml");
  const auto& read_back = distribute::options_as<ParameterServerOptions>(again.strategy);
  CHECK(read_back.variable_partitioner == options.variable_partitioner);
  CHECK(read_back.roles.ps == 2);
  CHECK(read_back.communication.timeout_seconds == 20.0);

  CHECK(error_of("{kind: parameter_server, roles: {worker: 2}}") ==
        "p.yaml:6:43: strategy.roles.ps: parameter_server needs at least one parameter server; write ps: 1 or more");
  CHECK(error_of("{kind: parameter_server, variable_partitioner: {kind: fixed_shards}}")
            .find("p.yaml:6:58: strategy.variable_partitioner: missing required key 'num_shards'") != std::string::npos);
  CHECK(error_of("{kind: parameter_server, variable_partitioner: {kind: fixed_shards, num_shards: 0}}")
            .find("num_shards: must be >= 1") != std::string::npos);
  CHECK(error_of("{kind: parameter_server, variable_partitioner: {kind: min_size, max_shard_bytes: 8}}")
            .find("strategy.variable_partitioner.max_shard_bytes: applies only to partitioner max_size, not to min_size") !=
        std::string::npos);
  CHECK(error_of("{kind: parameter_server, variable_partitioner: {kind: fixed_shard, num_shards: 2}}")
            .find("did you mean 'fixed_shards'?") != std::string::npos);
  CHECK(error_of("{kind: multi_worker_mirrored, variable_partitioner: {kind: none}}")
            .find("strategy.variable_partitioner: applies only to strategy kind parameter_server") != std::string::npos);
}
