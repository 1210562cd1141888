// Optimizers with Keras 3 update rules, computed in float over each variable's flat storage by
// the replica's backend (device/numerics.hpp runs the loops; the formulas are below).
//
// Shapes: every slot has its variable's shape; gradients are read from Variable::grad (same shape
// as Variable::value). The learning rate of an update is schedule(iterations()) taken BEFORE the
// update; afterwards iterations() grows by one.
//
// Slots are created (zero-filled) on the first apply_gradients, or earlier by build() — a
// checkpoint restore calls build() and then writes slot(i, s). From then on the same variables, in
// the same order and with the same shapes, must be passed every time (checked: InternalError), and
// nothing is allocated.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "device/context.hpp"
#include "device/numerics.hpp"
#include "config/experiment.hpp"
#include "core/tensor.hpp"
#include "core/variable.hpp"
#include "optim/schedule.hpp"

namespace dtrain::optim {

class Optimizer {
 public:
  Optimizer(std::unique_ptr<LearningRateSchedule> schedule, device::Numerics& numerics);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  virtual std::string name() const = 0;  // "sgd", "adam", "rmsprop"
  // Names of the per-variable slots, in slot_index order (Keras' names).
  virtual std::vector<std::string> slot_names() const = 0;

  // Where the slots are allocated: the memory of the context that holds the variables (before
  // build()). Without it they are host memory (tests of the formulas on the CPU backend).
  void place_slots(device::Context& ctx) { slot_memory_ = &ctx; }
  // Creates the slots for these variables; a no-op when already built for the same variables.
  void build(std::span<Variable* const> vars);
  bool built() const { return built_; }
  void apply_gradients(std::span<Variable* const> vars);

  // The same update split over `parts` threads that share the variables (a replica's lanes):
  // begin_update() once, then update_part(vars, part, parts) for every part, concurrently (the
  // parts write disjoint elements, split at multiples of 16 floats so no two share a cache line
  // of a variable aligned to one), then end_update() once. Every element gets the arithmetic
  // apply_gradients gives it, so the variables end bit for bit as they would on one thread.
  void begin_update(std::span<Variable* const> vars);
  void update_part(std::span<Variable* const> vars, int part, int parts);
  void end_update() { ++iterations_; }

  std::int64_t iterations() const { return iterations_; }
  void set_iterations(std::int64_t iterations);
  // The learning rate the next update will use.
  double learning_rate() const { return (*schedule_)(iterations_); }

  std::size_t num_variables() const { return tracked_.size(); }
  Tensor& slot(std::size_t variable_index, std::size_t slot_index);
  const Tensor& slot(std::size_t variable_index, std::size_t slot_index) const;

 protected:
  device::Numerics& numerics() { return numerics_; }
  // Called once per apply_gradients before the per-variable updates, with the learning rate and
  // the iteration count before the update.
  virtual void begin_step(double learning_rate, std::int64_t iteration) = 0;
  // w, g and every slots[s] hold n floats.
  virtual void update(float* w, const float* g, std::size_t n, float* const* slots) = 0;
  // Every variable's update at once, where the optimizer has a way (one launch on a GPU instead
  // of one per variable): false leaves it to update(), variable by variable.
  virtual bool update_all(std::span<Variable* const>) { return false; }
  // Variable i's slot s: where update_all() finds them.
  float* slot_address(std::size_t variable_index, std::size_t slot_index) {
    return slots_[variable_index * slots_per_variable_ + slot_index].address<float>();
  }

 private:
  static constexpr std::size_t kMostSlots = 3;  // RMSprop's velocity, momentum and average gradient
  struct Tracked {
    std::string name;
    Shape shape;
  };
  void check_same_variables(std::span<Variable* const> vars) const;

  std::unique_ptr<LearningRateSchedule> schedule_;
  device::Numerics& numerics_;
  device::Context* slot_memory_ = nullptr;
  std::int64_t iterations_ = 0;
  std::size_t slots_per_variable_ = 0;
  std::vector<Tracked> tracked_;
  std::vector<Tensor> slots_;  // [variable * slots_per_variable + slot]
  bool built_ = false;
};

// w -= lr g; with momentum: m = momentum m - lr g; w += m, or w += momentum m - lr g (nesterov).
class SGD : public Optimizer {
 public:
  SGD(std::unique_ptr<LearningRateSchedule> schedule, device::Numerics& numerics, double momentum, bool nesterov);
  std::string name() const override { return "sgd"; }
  std::vector<std::string> slot_names() const override;

 protected:
  void begin_step(double learning_rate, std::int64_t iteration) override;
  void update(float* w, const float* g, std::size_t n, float* const* slots) override;

 private:
  device::SgdStep step_;
};

// Keras 3 Adam: m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2);
// w -= alpha m / (sqrt(v) + eps), alpha = lr sqrt(1 - b2^t) / (1 - b1^t), t = iterations + 1.
class Adam : public Optimizer {
 public:
  Adam(std::unique_ptr<LearningRateSchedule> schedule, device::Numerics& numerics, double beta_1, double beta_2,
       double epsilon);
  std::string name() const override { return "adam"; }
  std::vector<std::string> slot_names() const override { return {"m", "v"}; }

 protected:
  void begin_step(double learning_rate, std::int64_t iteration) override;
  void update(float* w, const float* g, std::size_t n, float* const* slots) override;
  bool update_all(std::span<Variable* const> vars) override;

 private:
  double beta_1_;
  double beta_2_;
  device::AdamStep step_;
  std::vector<device::AdamVariable> all_;  // update_all()'s, reused every step
};

// Keras 3 RMSprop: v = rho v + (1 - rho) g^2; centered: a = rho a + (1 - rho) g, denom = v - a^2 + eps,
// else denom = v + eps; inc = lr g / sqrt(denom); momentum: mom = momentum mom + inc, w -= mom;
// else w -= inc.
class RMSprop : public Optimizer {
 public:
  RMSprop(std::unique_ptr<LearningRateSchedule> schedule, device::Numerics& numerics, double rho, double momentum,
          double epsilon, bool centered);
  std::string name() const override { return "rmsprop"; }
  std::vector<std::string> slot_names() const override;

 protected:
  void begin_step(double learning_rate, std::int64_t iteration) override;
  void update(float* w, const float* g, std::size_t n, float* const* slots) override;

 private:
  device::RmspropStep step_;
};

// ConfigError (naming the optimizer key) for impossible hyperparameters. The updates run on
// `numerics` (the replica's context).
std::unique_ptr<Optimizer> make_optimizer(const config::OptimizerConfig& config, device::Numerics& numerics);

}  // namespace dtrain::optim
