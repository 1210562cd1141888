// Where the time of training steps goes, for `dtrain bench`: the totals of the phases of each step
// and of each layer's forward and backward, added up from what the trainer measures while the
// profile is attached (train/step_timer.hpp: Trainer::set_profile).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "nn/model.hpp"
#include "train/step_timer.hpp"

namespace dtrain::observe {

// "data", "forward", "loss", "backward", "reduction", "optimizer".
std::string_view phase_name(train::Phase phase);

class StepProfile final : public train::StepTimer {
 public:
  // Totals over the steps kept: seconds per phase (index: Phase), wall seconds, steps and samples.
  std::array<double, train::kPhases> seconds{};
  double step_seconds = 0.0;
  std::int64_t steps = 0, samples = 0;
  // Steps left out: an epoch's short last batch, whose shape differs from the others'.
  std::int64_t steps_left_out = 0;
  nn::LayerTimes layers;

  // ---- train::StepTimer, called by the trainer
  void begin_step() override;
  void add(train::Phase phase, double seconds_spent) override { step_[static_cast<std::size_t>(phase)] += seconds_spent; }
  // Adds the step to the totals when `keep`, else counts it as left out.
  void end_step(double wall_seconds, std::int64_t step_samples, bool keep) override;
  nn::LayerTimes& step_layers() override { return step_layers_; }

 private:
  std::array<double, train::kPhases> step_{};
  nn::LayerTimes step_layers_;
};

}  // namespace dtrain::observe
