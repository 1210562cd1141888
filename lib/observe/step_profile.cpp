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

namespace {
// The per-layer seconds a step adds up.
constexpr std::array kLayerSeries = {&nn::LayerTimes::forward, &nn::LayerTimes::backward,
                                     &nn::LayerTimes::backward_weights, &nn::LayerTimes::forward_waits,
                                     &nn::LayerTimes::backward_waits};
}  // namespace

void StepProfile::begin_step() {
  step_.fill(0.0);
  for (auto series : kLayerSeries) std::fill((step_layers_.*series).begin(), (step_layers_.*series).end(), 0.0);
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
  layers.split = step_layers_.split;
  for (auto series : kLayerSeries) {
    const std::vector<double>& step = step_layers_.*series;
    std::vector<double>& total = layers.*series;
    total.resize(step.size(), 0.0);
    for (std::size_t i = 0; i < step.size(); ++i) total[i] += step[i];
  }
}

}  // namespace dtrain::observe
