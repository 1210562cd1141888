// Roles of a multi-worker job: strategy.roles and TF_CONFIG against the MPI world; the worker group
// of a process that no MPI launcher started.
#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "config/experiment.hpp"
#include "core/error.hpp"
#include "distribute/roles.hpp"
#include "distribute/single_communicator.hpp"

using namespace dtrain;
using distribute::Role;

namespace {

std::string error_of(const config::RolesConfig& roles, const char* tf_config, int world, int rank) {
  try {
    distribute::resolve_roles(roles, tf_config, world, rank);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

config::RolesConfig written(int chief, int worker, int evaluator) {
  config::RolesConfig r;
  r.chief = chief;
  r.worker = worker;
  r.evaluator = evaluator;
  r.where = {"exp.yaml", 4, 12};
  return r;
}

// TF_CONFIG of a cluster with the given tasks, for task (type, index).
std::string tf_config(int chiefs, int workers, int evaluators, const std::string& type, int index) {
  auto hosts = [](int n, int port) {
    std::string out;
    for (int i = 0; i < n; ++i) out += (i ? ", " : "") + std::string("\"host") + std::to_string(i) + ":" + std::to_string(port + i) + "\"";
    return "[" + out + "]";
  };
  std::string cluster = "\"worker\": " + hosts(workers, 2000);
  if (chiefs) cluster = "\"chief\": " + hosts(chiefs, 1000) + ", " + cluster;
  if (evaluators) cluster += ", \"evaluator\": " + hosts(evaluators, 3000);
  return "{\"cluster\": {" + cluster + "}, \"task\": {\"type\": \"" + type + "\", \"index\": " + std::to_string(index) + "}}";
}

}  // namespace

TEST_CASE("roles: by default every rank trains and rank 0 is the chief") {
  const distribute::RolePlan plan = distribute::resolve_roles({}, nullptr, 4, 2);
  CHECK(plan.training_ranks() == 4);
  CHECK(plan.role_of(0) == Role::chief);
  CHECK(plan.role_of(3) == Role::worker);
  CHECK(plan.describe() == "1 chief, 3 workers");
  CHECK(distribute::resolve_roles({}, "", 1, 0).training_ranks() == 1);
}

TEST_CASE("roles: chief, workers, then the evaluator, which the world must match") {
  const distribute::RolePlan plan = distribute::resolve_roles(written(1, -1, 1), nullptr, 4, 0);
  CHECK(plan.workers == 2);
  CHECK(plan.training_ranks() == 3);
  CHECK(plan.role_of(3) == Role::evaluator);
  CHECK(plan.describe() == "1 chief, 2 workers, 1 evaluator");
  const distribute::RolePlan no_chief = distribute::resolve_roles(written(0, 2, 0), nullptr, 2, 0);
  CHECK(no_chief.role_of(0) == Role::worker);

  CHECK(error_of(written(1, 3, 0), nullptr, 2, 0) ==
        "exp.yaml:4:12: strategy.roles (1 chief, 3 workers) name 4 ranks, but mpirun started 2; leave worker out to give "
        "every other rank to it, or change -n");
  CHECK(error_of(written(1, -1, 1), nullptr, 1, 0).find("need at least 2 ranks, but mpirun started 1") != std::string::npos);
  CHECK(error_of(written(0, -1, 1), nullptr, 1, 0).find("leave no rank to train") != std::string::npos);
}

TEST_CASE("TF_CONFIG gives the roles and must agree with the MPI world and with strategy.roles") {
  const std::string evaluator = tf_config(1, 2, 1, "evaluator", 0);
  const distribute::RolePlan plan = distribute::resolve_roles({}, evaluator.c_str(), 4, 3);
  CHECK(plan.source == "TF_CONFIG");
  CHECK(plan.role_of(3) == Role::evaluator);
  CHECK(plan.training_ranks() == 3);
  CHECK(distribute::resolve_roles({}, tf_config(1, 2, 0, "worker", 1).c_str(), 3, 2).role_of(2) == Role::worker);
  CHECK(distribute::resolve_roles({}, tf_config(0, 2, 0, "worker", 0).c_str(), 2, 0).chiefs == 0);
  CHECK(distribute::resolve_roles(written(1, 2, 1), evaluator.c_str(), 4, 3).source == "strategy.roles and TF_CONFIG");

  CHECK(error_of({}, tf_config(1, 3, 0, "worker", 0).c_str(), 2, 1) ==
        "TF_CONFIG describes 4 tasks (1 chief, 3 workers, 0 evaluator) but mpirun started 2 ranks; start mpirun -n 4, or "
        "fix TF_CONFIG");
  CHECK(error_of({}, tf_config(1, 2, 0, "worker", 0).c_str(), 3, 2) ==
        "TF_CONFIG says this process is worker 0, which is rank 1 in dtrain's order (chief, workers, ps, evaluator), but "
        "mpirun started it as rank 2; give each rank the TF_CONFIG of its task (for example from OMPI_COMM_WORLD_RANK)");
  CHECK(error_of({}, tf_config(1, 2, 0, "worker", 5).c_str(), 3, 2).find("task {type: worker, index: 5} is not in its "
                                                                         "cluster") != std::string::npos);
  CHECK(error_of(written(1, -1, 0), evaluator.c_str(), 4, 3).find("disagrees with exp.yaml:4:12: strategy.roles (1 chief, "
                                                                   "3 workers)") != std::string::npos);
  CHECK(error_of({}, R"({"cluster": {"worker": ["a:1"], "ps": ["b:2"]}, "task": {"type": "worker", "index": 0}})", 2, 0)
            .find("parameter servers") != std::string::npos);
  CHECK(error_of({}, "{not json", 2, 0).find("TF_CONFIG is not valid JSON") != std::string::npos);
  CHECK(error_of({}, R"({"task": {"type": "worker", "index": 0}})", 1, 0).find("no \"cluster\" object") != std::string::npos);
  CHECK(error_of({}, R"({"cluster": {"worker": ["a:1"]}})", 1, 0).find("no \"task\"") != std::string::npos);
  CHECK(error_of({}, R"({"cluster": {"worker": ["a:1"], "master": ["b:1"]}, "task": {"type": "worker", "index": 0}})", 2, 0)
            .find("task type 'master'") != std::string::npos);
}

TEST_CASE("a process not started by an MPI launcher is a worker group of one, without roles") {
  distribute::SingleCommunicator alone;
  distribute::WorkerGroup& workers = alone;
  CHECK(workers.size() == 1);
  CHECK(workers.rank() == 0);
  CHECK(workers.world_size() == 1);
  CHECK(workers.world_rank() == 0);
  CHECK(std::string(workers.name()) == "single");
  // Roles only exist in an MPI job: the experiment's and TF_CONFIG are not consulted here.
  const std::string tf = tf_config(1, 2, 1, "evaluator", 0);
  CHECK_FALSE(workers.assign_roles(written(1, -1, 1), tf.c_str()).has_value());
  CHECK(workers.training_done());
  // Every collective of a group of one leaves the values as they are.
  std::vector<float> f = {1.5f, -2.0f};
  std::vector<double> d = {0.25};
  std::vector<std::int64_t> k = {7};
  workers.all_reduce_sum(std::span<float>(f), "f");
  workers.ring_all_reduce_sum(std::span<float>(f), "ring");
  workers.reduce_sum_to(std::span<float>(f), 0, "to root");
  workers.all_reduce_sum(std::span<double>(d), "d");
  workers.all_reduce_sum(std::span<std::int64_t>(k), "k");
  CHECK(f == std::vector<float>{1.5f, -2.0f});
  CHECK(d == std::vector<double>{0.25});
  CHECK(k == std::vector<std::int64_t>{7});
  CHECK(workers.all_reduce_max(3, "max") == 3);
  CHECK_THROWS_AS(workers.reduce_sum_to(std::span<float>(f), 1, "to root"), InternalError);
}
