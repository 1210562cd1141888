// Learning-rate schedules with Keras 3 formulas. The step passed in is the optimizer's iteration
// count BEFORE the update being computed (0 for the first update), as in Keras.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "config/experiment.hpp"

namespace dtrain::optim {

class LearningRateSchedule {
 public:
  virtual ~LearningRateSchedule() = default;
  virtual double operator()(std::int64_t step) const = 0;
};

class ConstantSchedule : public LearningRateSchedule {
 public:
  explicit ConstantSchedule(double learning_rate) : learning_rate_(learning_rate) {}
  double operator()(std::int64_t) const override { return learning_rate_; }

 private:
  double learning_rate_;
};

// lr0 * decay_rate ^ (step / decay_steps); the exponent is floored when staircase.
class ExponentialDecay : public LearningRateSchedule {
 public:
  ExponentialDecay(double initial_learning_rate, std::int64_t decay_steps, double decay_rate, bool staircase);
  double operator()(std::int64_t step) const override;

 private:
  double initial_learning_rate_;
  std::int64_t decay_steps_;
  double decay_rate_;
  bool staircase_;
};

// values[0] for step <= boundaries[0], values[i] for boundaries[i-1] < step <= boundaries[i],
// values.back() for step > boundaries.back() (Keras PiecewiseConstantDecay).
class PiecewiseConstant : public LearningRateSchedule {
 public:
  PiecewiseConstant(std::vector<std::int64_t> boundaries, std::vector<double> values);
  double operator()(std::int64_t step) const override;

 private:
  std::vector<std::int64_t> boundaries_;
  std::vector<double> values_;
};

// lr0 * ((1 - alpha) * 0.5 * (1 + cos(pi * min(step, decay_steps) / decay_steps)) + alpha).
class CosineDecay : public LearningRateSchedule {
 public:
  CosineDecay(double initial_learning_rate, std::int64_t decay_steps, double alpha);
  double operator()(std::int64_t step) const override;

 private:
  double initial_learning_rate_;
  std::int64_t decay_steps_;
  double alpha_;
};

// ConfigError (naming the optimizer.learning_rate key) for impossible settings.
std::unique_ptr<LearningRateSchedule> make_schedule(const config::LearningRateConfig& config);

}  // namespace dtrain::optim
