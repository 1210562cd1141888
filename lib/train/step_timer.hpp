// How the trainer times its steps for whoever asks (observe/step_profile.hpp, for `dtrain bench`):
// the phases of a step (waiting for the input, forward, loss, backward, the reduction across
// replicas and workers, the optimizer), the StepTimer it reports each step's times to while one is
// attached (Trainer::set_profile), and PhaseClock, which charges the time between marks to phases.
// The loop only measures; adding the steps up and printing them is observe/'s.
//
// With no timer attached the step reads no clock. The data phase and the step's wall time are
// taken on the thread that runs the loop; the other phases and the layers on local replica 0,
// whose timeline is the step's: the replicas compute at the same time and meet in the reduction.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "nn/model.hpp"

namespace dtrain::train {

enum class Phase : std::size_t { data, forward, loss, backward, reduction, optimizer };
inline constexpr std::size_t kPhases = 6;

// What the trainer reports a step's times to.
class StepTimer {
 public:
  virtual ~StepTimer() = default;
  // A step begins: its phase and layer times start from zero.
  virtual void begin_step() = 0;
  virtual void add(Phase phase, double seconds_spent) = 0;
  // The step took `wall_seconds` for `step_samples` samples; `keep` is false for a step whose
  // shape differs from the others' (an epoch's short last batch).
  virtual void end_step(double wall_seconds, std::int64_t step_samples, bool keep) = 0;
  // What the model adds this step's layer times into.
  virtual nn::LayerTimes& step_layers() = 0;

 protected:
  StepTimer() = default;
  StepTimer(const StepTimer&) = default;
  StepTimer& operator=(const StepTimer&) = default;
};

// Charges the time between marks on one thread to phases. With a null timer it does nothing and
// reads no clock.
class PhaseClock {
 public:
  using Clock = std::chrono::steady_clock;
  explicit PhaseClock(StepTimer* timer) : timer_(timer) {
    if (timer_) last_ = Clock::now();
  }
  // The time since the last mark (or since skip()) was spent in `phase`.
  void mark(Phase phase) {
    if (!timer_) return;
    const auto now = Clock::now();
    timer_->add(phase, std::chrono::duration<double>(now - last_).count());
    last_ = now;
  }
  // The time since the last mark belongs to no phase (it was measured elsewhere).
  void skip() {
    if (timer_) last_ = Clock::now();
  }

 private:
  StepTimer* timer_;
  Clock::time_point last_{};
};

}  // namespace dtrain::train
