// Trainer::set_variables, apart from the trainer's other code: the one place where values from
// outside dtrain (model.initial_weights) enter the replicas' variables.
#include <set>

#include <fmt/format.h>

#include "core/error.hpp"
#include "train/trainer.hpp"

namespace dtrain::train {

void Trainer::set_variables(const std::vector<std::vector<float>>& values) {
  // Every replica's copy, through its context (the memory is the backend's); replicas and lanes
  // that compute with another's copy (central storage, lanes) share its storage and get it once.
  std::set<const void*> written;
  for (Replica& rep : replicas_) {
    const std::vector<Variable*>& vars = rep.model->variables();
    DTRAIN_CHECK(vars.size() == values.size(),
                 fmt::format("{} initial values for a model of {} variables", values.size(), vars.size()));
    for (std::size_t v = 0; v < vars.size(); ++v) {
      DTRAIN_CHECK(static_cast<std::int64_t>(values[v].size()) == vars[v]->value.numel(),
                   fmt::format("{} initial values for {}", values[v].size(), vars[v]->name));
      if (written.insert(vars[v]->value.raw()).second) rep.ctx->copy_from_host(values[v].data(), vars[v]->value);
    }
  }
}

}  // namespace dtrain::train
