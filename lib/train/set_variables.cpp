// Trainer::set_variables, apart from the trainer's other code: the one place where values from
// outside dtrain (model.initial_weights) enter the replicas' variables.
#include <algorithm>

#include <fmt/format.h>

#include "core/error.hpp"
#include "train/trainer.hpp"

namespace dtrain::train {

void Trainer::set_variables(const std::vector<std::vector<float>>& values) {
  for (std::size_t r = 0; r < replicas_.size(); ++r) {
    // Replicas that hold no copy (central storage) compute with the holder's values.
    if (!strategy_->holds_variables(static_cast<int>(r))) continue;
    const std::vector<Variable*>& vars = replicas_[r].model->variables();
    DTRAIN_CHECK(vars.size() == values.size(),
                 fmt::format("{} initial values for a model of {} variables", values.size(), vars.size()));
    for (std::size_t v = 0; v < vars.size(); ++v) {
      DTRAIN_CHECK(static_cast<std::int64_t>(values[v].size()) == vars[v]->value.numel(),
                   fmt::format("{} initial values for {}", values[v].size(), vars[v]->name));
      std::copy(values[v].begin(), values[v].end(), vars[v]->value.data<float>());
    }
  }
}

}  // namespace dtrain::train
