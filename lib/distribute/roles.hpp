// What each MPI rank of a multi-worker job does: chief, worker, parameter server (for a strategy
// kind that has them) or evaluator (TensorFlow's task types), from the experiment's
// strategy.roles and, when it is set, the TF_CONFIG environment variable, checked against the MPI
// world mpirun started.
//
// Ranks are given out in one order: the chief (rank 0), the workers, the parameter servers, then
// the evaluator; so TF_CONFIG task (chief, 0) is rank 0, (worker, i) is rank chiefs + i, (ps, i)
// rank chiefs + workers + i, (evaluator, 0) the last.
// The addresses in TF_CONFIG's cluster are not used: MPI connects the ranks.
#pragma once

#include <string>

#include "config/experiment.hpp"

namespace dtrain::distribute {

enum class Role { chief, worker, ps, evaluator };
const char* name_of(Role role);

struct RolePlan {
  int chiefs = 1, workers = 0, evaluators = 0, ps = 0;
  std::string source;  // "strategy.roles", "TF_CONFIG", or both, for messages

  int world_size() const { return chiefs + workers + ps + evaluators; }
  // The ranks that train together (the parameter servers among them).
  int training_ranks() const { return chiefs + workers + ps; }
  Role role_of(int world_rank) const;
  // "1 chief, 2 workers, 2 parameter servers, 1 evaluator"
  std::string describe() const;
};

// The roles of a world of `world_size` ranks. tf_config is the TF_CONFIG value (nullptr or empty
// when unset). ConfigError, saying what disagrees and how to fix it, when the roles do not add up
// to the world, TF_CONFIG is malformed, names a parameter server when roles.parameter_servers is
// not set (or none when it is), or places this rank elsewhere.
RolePlan resolve_roles(const config::RolesConfig& roles, const char* tf_config, int world_size, int world_rank);

}  // namespace dtrain::distribute
