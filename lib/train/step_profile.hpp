// Where the time of training steps goes, for `dtrain bench`: the phases of each step (waiting for
// the input, forward, loss, backward, the reduction across replicas and workers, the optimizer)
// and each layer's forward and backward.
//
// A Trainer fills a StepProfile only while one is attached (Trainer::set_profile); otherwise its
// step reads no clock. The data phase and the step's wall time are taken on the thread that runs
// the loop; the other phases and the layers on local replica 0, whose timeline is the step's: the
// replicas compute at the same time and meet in the reduction.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "nn/model.hpp"

namespace dtrain::train {

enum class Phase : std::size_t { data, forward, loss, backward, reduction, optimizer };
inline constexpr std::size_t kPhases = 6;
// "data", "forward", "loss", "backward", "reduction", "optimizer".
std::string_view phase_name(Phase phase);

class StepProfile {
 public:
  // Totals over the steps kept: seconds per phase (index: Phase), wall seconds, steps and samples.
  std::array<double, kPhases> seconds{};
  double step_seconds = 0.0;
  std::int64_t steps = 0, samples = 0;
  // Steps left out: an epoch's short last batch, whose shape differs from the others'.
  std::int64_t steps_left_out = 0;
  nn::LayerTimes layers;

  // ---- used by the trainer
  void begin_step();
  void add(Phase phase, double seconds_spent) { step_[static_cast<std::size_t>(phase)] += seconds_spent; }
  // Adds the step to the totals when `keep`, else counts it as left out.
  void end_step(double wall_seconds, std::int64_t step_samples, bool keep);
  // What the model adds this step's layer times into.
  nn::LayerTimes& step_layers() { return step_layers_; }

 private:
  std::array<double, kPhases> step_{};
  nn::LayerTimes step_layers_;
};

// Charges the time between marks on one thread to phases. With a null profile it does nothing and
// reads no clock.
class PhaseClock {
 public:
  using Clock = std::chrono::steady_clock;
  explicit PhaseClock(StepProfile* profile) : profile_(profile) {
    if (profile_) last_ = Clock::now();
  }
  // The time since the last mark (or since skip()) was spent in `phase`.
  void mark(Phase phase) {
    if (!profile_) return;
    const auto now = Clock::now();
    profile_->add(phase, std::chrono::duration<double>(now - last_).count());
    last_ = now;
  }
  // The time since the last mark belongs to no phase (it was measured elsewhere).
  void skip() {
    if (profile_) last_ = Clock::now();
  }

 private:
  StepProfile* profile_;
  Clock::time_point last_{};
};

}  // namespace dtrain::train
