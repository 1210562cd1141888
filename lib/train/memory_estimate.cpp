#include "train/memory_estimate.hpp"

#include <algorithm>
#include <limits>
#include <optional>

#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/checked.hpp"
#include "core/error.hpp"
#include "core/machine.hpp"

namespace dtrain::train {

namespace {

std::int64_t saturate(std::optional<std::int64_t> v) { return v.value_or(std::numeric_limits<std::int64_t>::max()); }

std::int64_t times(std::int64_t a, std::int64_t b) { return saturate(checked_mul(a, b)); }
std::int64_t plus(std::int64_t a, std::int64_t b) { return saturate(checked_add(a, b)); }

}  // namespace

std::int64_t RunCopies::batch_per_lane() const {
  const std::int64_t replica = std::max(train_batch, eval_batch);
  return replica / lanes + (replica % lanes != 0 ? 1 : 0);
}

MemoryEstimate estimate_memory(const nn::Sequential& declared, const RunCopies& copies) {
  const std::int64_t lanes = times(copies.replicas, copies.lanes);
  const std::int64_t parameters = declared.num_parameters();
  MemoryEstimate e;
  e.models = times(lanes, times(parameters, 2 * 4));
  e.slots = times(copies.replicas, times(parameters, std::int64_t{copies.optimizer_slots} * 4));
  e.activations = times(lanes, declared.activation_bytes(copies.batch_per_lane()));
  e.checkpoint = times(2, times(parameters, (1 + std::int64_t{copies.optimizer_slots}) * 4));
  e.total = plus(plus(plus(e.models, e.slots), e.activations), e.checkpoint);
  return e;
}

void check_run_memory(const nn::Sequential& declared, const RunCopies& copies, const MemoryLimit& memory) {
  declared.check_batch_memory(copies.train_batch, copies.train_key);
  declared.check_batch_memory(copies.eval_batch, copies.eval_key);
  const MemoryEstimate e = estimate_memory(declared, copies);
  if (e.total <= memory.bytes) return;
  // The layer to make smaller: the one with the most parameters when variables and slots weigh
  // more than the activations, else the one whose outputs are largest.
  const bool parameters_decide = plus(plus(e.models, e.slots), e.checkpoint) >= e.activations;
  const std::size_t i = parameters_decide ? declared.largest_parameter_layer() : declared.largest_activation_layer();
  const nn::Layer& layer = declared.layer(i);
  const std::int64_t lanes = std::int64_t{copies.replicas} * copies.lanes;
  const std::string option = layer.size_option().empty() ? std::string("a smaller input to it")
                                                          : fmt::format("fewer {}", layer.size_option());
  throw ConfigError(fmt::format(
      "{}layer '{}': this run needs about {} of memory, more than {}: {} cop{} of the model's {} "
      "parameters with their gradients ({}), {} optimizer slot{} per replica ({}), activations of batches of {} "
      "on {} lane{} ({}), a checkpoint being saved ({}); layer '{}' {}; give it {}, or use fewer replicas or threads",
      config::location_prefix(declared.layer_where(i), {}), layer.name(), format_bytes(e.total), describe(memory),
      lanes, lanes == 1 ? "y" : "ies", declared.num_parameters(), format_bytes(e.models), copies.optimizer_slots,
      copies.optimizer_slots == 1 ? "" : "s", format_bytes(e.slots), copies.batch_per_lane(), lanes,
      lanes == 1 ? "" : "s", format_bytes(e.activations), format_bytes(e.checkpoint), layer.name(),
      parameters_decide ? fmt::format("holds the most parameters ({})", layer.declared_elements())
                        : fmt::format("has the largest outputs ({} per example)", layer.output_shape().to_string()),
      option));
}

}  // namespace dtrain::train
