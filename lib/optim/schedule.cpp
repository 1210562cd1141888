#include "optim/schedule.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::optim {

namespace {

void require_decay_steps(std::int64_t decay_steps, const char* schedule) {
  if (decay_steps < 1) {
    throw ConfigError(fmt::format("optimizer.learning_rate.decay_steps must be >= 1 for {}, got {}", schedule,
                                  decay_steps));
  }
}

}  // namespace

ExponentialDecay::ExponentialDecay(double initial_learning_rate, std::int64_t decay_steps, double decay_rate,
                                   bool staircase)
    : initial_learning_rate_(initial_learning_rate),
      decay_steps_(decay_steps),
      decay_rate_(decay_rate),
      staircase_(staircase) {
  require_decay_steps(decay_steps, "exponential_decay");
}

double ExponentialDecay::operator()(std::int64_t step) const {
  double exponent = static_cast<double>(step) / static_cast<double>(decay_steps_);
  if (staircase_) exponent = std::floor(exponent);
  return initial_learning_rate_ * std::pow(decay_rate_, exponent);
}

PiecewiseConstant::PiecewiseConstant(std::vector<std::int64_t> boundaries, std::vector<double> values)
    : boundaries_(std::move(boundaries)), values_(std::move(values)) {
  if (values_.size() != boundaries_.size() + 1) {
    throw ConfigError(fmt::format("optimizer.learning_rate: piecewise_constant needs one more value than boundaries, "
                                  "got {} boundaries and {} values",
                                  boundaries_.size(), values_.size()));
  }
  for (std::size_t i = 1; i < boundaries_.size(); ++i) {
    if (boundaries_[i] <= boundaries_[i - 1]) {
      throw ConfigError(fmt::format("optimizer.learning_rate.boundaries must be strictly increasing, but entry {} ({}) "
                                    "is not above entry {} ({})",
                                    i, boundaries_[i], i - 1, boundaries_[i - 1]));
    }
  }
}

double PiecewiseConstant::operator()(std::int64_t step) const {
  // The first boundary that is >= step owns it; past the last boundary, the last value.
  const auto it = std::lower_bound(boundaries_.begin(), boundaries_.end(), step);
  return values_[static_cast<std::size_t>(it - boundaries_.begin())];
}

CosineDecay::CosineDecay(double initial_learning_rate, std::int64_t decay_steps, double alpha)
    : initial_learning_rate_(initial_learning_rate), decay_steps_(decay_steps), alpha_(alpha) {
  require_decay_steps(decay_steps, "cosine_decay");
}

double CosineDecay::operator()(std::int64_t step) const {
  const double completed = static_cast<double>(std::min(step, decay_steps_)) / static_cast<double>(decay_steps_);
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * completed));
  return initial_learning_rate_ * ((1.0 - alpha_) * cosine + alpha_);
}

std::unique_ptr<LearningRateSchedule> make_schedule(const config::LearningRateConfig& config) {
  if (!(config.initial_learning_rate >= 0.0) || !std::isfinite(config.initial_learning_rate)) {
    throw ConfigError(fmt::format("optimizer.learning_rate must be a finite number >= 0, got {}",
                                  config.initial_learning_rate));
  }
  switch (config.kind) {
    case config::ScheduleKind::constant:
      return std::make_unique<ConstantSchedule>(config.initial_learning_rate);
    case config::ScheduleKind::exponential_decay:
      if (!(config.decay_rate > 0.0)) {
        throw ConfigError(fmt::format("optimizer.learning_rate.decay_rate must be > 0, got {}", config.decay_rate));
      }
      return std::make_unique<ExponentialDecay>(config.initial_learning_rate, config.decay_steps, config.decay_rate,
                                                config.staircase);
    case config::ScheduleKind::piecewise_constant:
      return std::make_unique<PiecewiseConstant>(config.boundaries, config.values);
    case config::ScheduleKind::cosine_decay:
      return std::make_unique<CosineDecay>(config.initial_learning_rate, config.decay_steps, config.alpha);
  }
  throw ConfigError("optimizer.learning_rate: unknown schedule kind");
}

}  // namespace dtrain::optim
