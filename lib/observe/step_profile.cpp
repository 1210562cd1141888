#include "observe/step_profile.hpp"

#include <algorithm>

namespace dtrain::observe {

using train::kPhases;
using train::Phase;

std::string_view phase_name(Phase phase) {
  static constexpr std::array<std::string_view, kPhases> names = {"data",     "forward",   "loss",
                                                                  "backward", "reduction", "optimizer"};
  return names[static_cast<std::size_t>(phase)];
}

void StepProfile::begin_step() {
  step_.fill(0.0);
  std::fill(step_layers_.forward.begin(), step_layers_.forward.end(), 0.0);
  std::fill(step_layers_.backward.begin(), step_layers_.backward.end(), 0.0);
  std::fill(step_layers_.backward_weights.begin(), step_layers_.backward_weights.end(), 0.0);
}

void StepProfile::end_step(double wall_seconds, std::int64_t step_samples, bool keep) {
  if (!keep) {
    ++steps_left_out;
    return;
  }
  for (std::size_t p = 0; p < kPhases; ++p) seconds[p] += step_[p];
  step_seconds += wall_seconds;
  ++steps;
  samples += step_samples;
  layers.forward.resize(step_layers_.forward.size(), 0.0);
  layers.backward.resize(step_layers_.backward.size(), 0.0);
  layers.backward_weights.resize(step_layers_.backward_weights.size(), 0.0);
  layers.split = step_layers_.split;
  for (std::size_t i = 0; i < step_layers_.forward.size(); ++i) layers.forward[i] += step_layers_.forward[i];
  for (std::size_t i = 0; i < step_layers_.backward.size(); ++i) layers.backward[i] += step_layers_.backward[i];
  for (std::size_t i = 0; i < step_layers_.backward_weights.size(); ++i)
    layers.backward_weights[i] += step_layers_.backward_weights[i];
}

}  // namespace dtrain::observe
