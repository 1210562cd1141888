#include "distribute/roles.hpp"

#include <yaml-cpp/yaml.h>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::distribute {

const char* name_of(Role role) {
  switch (role) {
    case Role::chief: return "chief";
    case Role::worker: return "worker";
    case Role::ps: return "ps";
    case Role::evaluator: return "evaluator";
  }
  return "?";
}

Role RolePlan::role_of(int world_rank) const {
  if (world_rank < chiefs) return Role::chief;
  if (world_rank < chiefs + workers) return Role::worker;
  return world_rank < training_ranks() ? Role::ps : Role::evaluator;
}

std::string RolePlan::describe() const {
  auto count = [](int n, const char* what) { return fmt::format("{} {}{}", n, what, n == 1 ? "" : "s"); };
  std::string out = count(chiefs, "chief") + ", " + count(workers, "worker");
  if (ps > 0) out += ", " + count(ps, "parameter server");
  if (evaluators > 0) out += ", " + count(evaluators, "evaluator");
  return out;
}

namespace {

struct TfConfig {
  int chiefs = 0, workers = 0, evaluators = 0, ps = 0;
  std::string task_type;
  int task_index = 0;
};

// TF_CONFIG is JSON, which yaml-cpp reads as YAML flow syntax.
TfConfig parse_tf_config(const std::string& text, bool parameter_servers) {
  const std::string fix = "TF_CONFIG must look like {\"cluster\": {\"chief\": [\"host:port\"], \"worker\": [...], "
                          "\"evaluator\": [...]}, \"task\": {\"type\": \"worker\", \"index\": 0}}";
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("TF_CONFIG is not valid JSON ({}); {}", e.msg, fix));
  }
  if (!root.IsMap() || !root["cluster"] || !root["cluster"].IsMap())
    throw ConfigError(fmt::format("TF_CONFIG has no \"cluster\" object; {}", fix));
  TfConfig out;
  for (const auto& entry : root["cluster"]) {
    const std::string type = entry.first.as<std::string>();
    if (!entry.second.IsSequence())
      throw ConfigError(fmt::format("TF_CONFIG cluster.{} must be a list of addresses; {}", type, fix));
    const int n = static_cast<int>(entry.second.size());
    if (type == "chief") {
      out.chiefs = n;
    } else if (type == "worker") {
      out.workers = n;
    } else if (type == "evaluator") {
      out.evaluators = n;
    } else if (type == "ps" && parameter_servers) {
      out.ps = n;
    } else if (type == "ps") {
      throw ConfigError("TF_CONFIG names parameter servers (\"ps\"), which MultiWorkerMirroredStrategy does not use; "
                        "remove them from the cluster");
    } else {
      throw ConfigError(fmt::format("TF_CONFIG cluster has a task type '{}'; dtrain knows chief, worker and evaluator",
                                    type));
    }
  }
  if (out.chiefs > 1 || out.evaluators > 1)
    throw ConfigError(fmt::format("TF_CONFIG lists {} chiefs and {} evaluators; there can be at most one of each",
                                  out.chiefs, out.evaluators));
  const YAML::Node task = root["task"];
  if (!task || !task.IsMap() || !task["type"] || !task["index"])
    throw ConfigError(fmt::format("TF_CONFIG has no \"task\" with \"type\" and \"index\"; {}", fix));
  try {
    out.task_type = task["type"].as<std::string>();
    out.task_index = task["index"].as<int>();
  } catch (const YAML::Exception&) {
    throw ConfigError(fmt::format("TF_CONFIG task.type must be a string and task.index an integer; {}", fix));
  }
  return out;
}

}  // namespace

RolePlan resolve_roles(const config::RolesConfig& roles, const char* tf_config, int world_size, int world_rank) {
  RolePlan plan;
  plan.chiefs = roles.chief;
  plan.evaluators = roles.evaluator;
  plan.ps = roles.ps;
  plan.workers = roles.worker >= 0 ? roles.worker : world_size - roles.chief - roles.evaluator - roles.ps;
  plan.source = "strategy.roles";
  // Where the roles were written: file:line:column, or the --set that gave them.
  const bool experiment_says = !roles.where.file.empty();
  const std::string where = !experiment_says    ? std::string()
                            : roles.where.line > 0 ? fmt::format("{}:{}:{}: ", roles.where.file, roles.where.line,
                                                                 roles.where.column)
                                                   : roles.where.file + ": ";
  if (plan.workers < 0 || plan.world_size() != world_size)
    throw ConfigError(fmt::format("{}strategy.roles ({}) {} ranks, but mpirun started {}; {}", where, plan.describe(),
                                  roles.worker >= 0 ? fmt::format("name {}", plan.world_size())
                                                    : fmt::format("need at least {}", roles.chief + roles.evaluator + roles.ps),
                                  world_size,
                                  roles.worker >= 0 ? "leave worker out to give every other rank to it, or change -n"
                                                    : "start more ranks"));
  if (plan.training_ranks() < 1)
    throw ConfigError(fmt::format("{}strategy.roles leave no rank to train; a job needs a chief or a worker", where));

  if (tf_config && *tf_config) {
    const TfConfig tf = parse_tf_config(tf_config, roles.parameter_servers);
    const int tf_world = tf.chiefs + tf.workers + tf.ps + tf.evaluators;
    const std::string tf_ps = tf.ps > 0 ? fmt::format(", {} ps", tf.ps) : "";
    if (tf_world != world_size)
      throw ConfigError(fmt::format("TF_CONFIG describes {} tasks ({} chief, {} workers{}, {} evaluator) but mpirun started "
                                    "{} ranks; start mpirun -n {}, or fix TF_CONFIG",
                                    tf_world, tf.chiefs, tf.workers, tf_ps, tf.evaluators, world_size, tf_world));
    if (experiment_says && (tf.chiefs != plan.chiefs || tf.workers != plan.workers || tf.evaluators != plan.evaluators ||
                            tf.ps != plan.ps))
      throw ConfigError(fmt::format("TF_CONFIG ({} chief, {} workers{}, {} evaluator) disagrees with {}strategy.roles ({}); "
                                    "make them agree or remove one",
                                    tf.chiefs, tf.workers, tf_ps, tf.evaluators, where, plan.describe()));
    plan.chiefs = tf.chiefs;
    plan.workers = tf.workers;
    plan.ps = tf.ps;
    plan.evaluators = tf.evaluators;
    plan.source = experiment_says ? "strategy.roles and TF_CONFIG" : "TF_CONFIG";
    int expected = -1;
    if (tf.task_type == "chief" && tf.task_index >= 0 && tf.task_index < tf.chiefs) expected = tf.task_index;
    if (tf.task_type == "worker" && tf.task_index >= 0 && tf.task_index < tf.workers) expected = tf.chiefs + tf.task_index;
    if (tf.task_type == "ps" && tf.task_index >= 0 && tf.task_index < tf.ps) expected = tf.chiefs + tf.workers + tf.task_index;
    if (tf.task_type == "evaluator" && tf.task_index >= 0 && tf.task_index < tf.evaluators)
      expected = tf.chiefs + tf.workers + tf.ps + tf.task_index;
    if (expected < 0)
      throw ConfigError(fmt::format("TF_CONFIG task {{type: {}, index: {}}} is not in its cluster ({} chief, {} workers{}, "
                                    "{} evaluator)",
                                    tf.task_type, tf.task_index, tf.chiefs, tf.workers, tf_ps, tf.evaluators));
    if (expected != world_rank)
      throw ConfigError(fmt::format("TF_CONFIG says this process is {} {}, which is rank {} in dtrain's order (chief, "
                                    "workers, ps, evaluator), but mpirun started it as rank {}; give each rank the TF_CONFIG "
                                    "of its task (for example from OMPI_COMM_WORLD_RANK)",
                                    tf.task_type, tf.task_index, expected, world_rank));
  }
  if (roles.parameter_servers) {
    // The chief coordinates; the servers hold the variables; the workers compute.
    if (plan.ps < 1)
      throw ConfigError(fmt::format("{}strategy kind {} needs parameter servers: write strategy.roles.ps "
                                    "(1 or more), or give TF_CONFIG \"ps\" tasks",
                                    where, roles.kind));
    if (plan.chiefs != 1 || plan.workers < 1)
      throw ConfigError(fmt::format("{}strategy kind {} needs one chief (the coordinator) and at least one "
                                    "worker; the roles are {} ({})",
                                    where, roles.kind, plan.describe(), plan.source));
  }
  return plan;
}

}  // namespace dtrain::distribute
