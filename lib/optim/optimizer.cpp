// Shapes: for each variable, value, grad and every slot hold the same n floats (flat, canonical).
#include "optim/optimizer.hpp"

#include <algorithm>
#include <array>
#include <cmath>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::optim {

// ---------------------------------------------------------------- Optimizer

Optimizer::Optimizer(std::unique_ptr<LearningRateSchedule> schedule, device::Numerics& numerics)
    : schedule_(std::move(schedule)), numerics_(numerics) {
  DTRAIN_CHECK(schedule_ != nullptr, "optimizer needs a learning-rate schedule");
}

void Optimizer::set_iterations(std::int64_t iterations) {
  DTRAIN_CHECK(iterations >= 0, fmt::format("optimizer iterations must be >= 0, got {}", iterations));
  iterations_ = iterations;
}

void Optimizer::build(std::span<Variable* const> vars) {
  if (built_) {
    check_same_variables(vars);
    return;
  }
  slots_per_variable_ = slot_names().size();
  DTRAIN_CHECK(slots_per_variable_ <= kMostSlots, fmt::format("optimizer {} has more slots than {}", name(), kMostSlots));
  tracked_.reserve(vars.size());
  slots_.reserve(vars.size() * slots_per_variable_);
  for (const Variable* v : vars) {
    DTRAIN_CHECK(v != nullptr && v->value.defined() && v->value.dtype() == DType::f32,
                 fmt::format("optimizer {}: variable {} must hold f32 values", name(), v ? v->name : "(null)"));
    tracked_.push_back({v->name, v->value.shape()});
    for (std::size_t s = 0; s < slots_per_variable_; ++s)
      slots_.push_back(slot_memory_ ? slot_memory_->tensor(v->value.shape()) : Tensor(v->value.shape()));
  }
  built_ = true;
}

void Optimizer::check_same_variables(std::span<Variable* const> vars) const {
  DTRAIN_CHECK(vars.size() == tracked_.size(),
               fmt::format("optimizer {} was built for {} variables but got {}; the set of trained variables must "
                           "not change after the first update",
                           name(), tracked_.size(), vars.size()));
  for (std::size_t i = 0; i < vars.size(); ++i) {
    const Variable* v = vars[i];
    DTRAIN_CHECK(v != nullptr && v->name == tracked_[i].name && v->value.shape() == tracked_[i].shape,
                 fmt::format("optimizer {}: variable {} is {} {} but was {} {} at the first update; the trained "
                             "variables must stay the same, in the same order",
                             name(), i, v ? v->name : "(null)", v ? v->value.shape().to_string() : "",
                             tracked_[i].name, tracked_[i].shape.to_string()));
  }
}

void Optimizer::begin_update(std::span<Variable* const> vars) {
  build(vars);
  // Every gradient is checked before any variable moves, so a failed check leaves the model intact.
  for (const Variable* v : vars) {
    DTRAIN_CHECK(v->grad.defined() && v->grad.dtype() == DType::f32 && v->grad.shape() == v->value.shape(),
                 fmt::format("optimizer {}: gradient of {} is missing or not shaped like its value {}", name(), v->name,
                             v->value.shape().to_string()));
  }
  begin_step((*schedule_)(iterations_), iterations_);
}

void Optimizer::apply_gradients(std::span<Variable* const> vars) {
  begin_update(vars);
  if (!update_all(vars)) update_part(vars, 0, 1);
  end_update();
}

void Optimizer::update_part(std::span<Variable* const> vars, int part, int parts) {
  DTRAIN_CHECK(parts >= 1 && part >= 0 && part < parts,
               fmt::format("optimizer {}: part {} of {}", name(), part, parts));
  // This part's elements of all the variables laid end to end, cut at multiples of 16.
  std::size_t total = 0;
  for (const Variable* v : vars) total += static_cast<std::size_t>(v->value.numel());
  const auto cut = [&](int p) {
    constexpr std::size_t kLine = 16;
    const std::size_t lines = (total + kLine - 1) / kLine;
    return std::min(total, lines * static_cast<std::size_t>(p) / static_cast<std::size_t>(parts) * kLine);
  };
  const std::size_t begin = cut(part), end = cut(part + 1);
  std::array<float*, kMostSlots> slots{};  // this part's own: the parts run at once
  std::size_t at = 0;
  for (std::size_t i = 0; i < vars.size() && at < end; ++i) {
    Variable& v = *vars[i];
    const std::size_t n = static_cast<std::size_t>(v.value.numel());
    const std::size_t first = std::max(at, begin), last = std::min(at + n, end);
    if (first < last) {
      const std::size_t offset = first - at;
      for (std::size_t s = 0; s < slots_per_variable_; ++s)
        slots[s] = slots_[i * slots_per_variable_ + s].address<float>() + offset;
      update(v.value.address<float>() + offset, v.grad.address<float>() + offset, last - first, slots.data());
    }
    at += n;
  }
}

Tensor& Optimizer::slot(std::size_t variable_index, std::size_t slot_index) {
  DTRAIN_CHECK(built_ && variable_index < tracked_.size() && slot_index < slots_per_variable_,
               fmt::format("optimizer {}: no slot ({}, {}); build() it for the variables first", name(),
                           variable_index, slot_index));
  return slots_[variable_index * slots_per_variable_ + slot_index];
}

const Tensor& Optimizer::slot(std::size_t variable_index, std::size_t slot_index) const {
  return const_cast<Optimizer*>(this)->slot(variable_index, slot_index);
}

// ---------------------------------------------------------------- SGD

SGD::SGD(std::unique_ptr<LearningRateSchedule> schedule, device::Numerics& numerics, double momentum, bool nesterov)
    : Optimizer(std::move(schedule), numerics) {
  step_.momentum = static_cast<float>(momentum);
  step_.nesterov = nesterov;
}

std::vector<std::string> SGD::slot_names() const {
  if (step_.momentum > 0.0f) return {"momentum"};
  return {};
}

void SGD::begin_step(double learning_rate, std::int64_t) { step_.learning_rate = static_cast<float>(learning_rate); }

void SGD::update(float* w, const float* g, std::size_t n, float* const* slots) {
  numerics().sgd_update(step_, w, g, step_.momentum > 0.0f ? slots[0] : nullptr, n);
}

// ---------------------------------------------------------------- Adam

Adam::Adam(std::unique_ptr<LearningRateSchedule> schedule, device::Numerics& numerics, double beta_1, double beta_2,
           double epsilon)
    : Optimizer(std::move(schedule), numerics), beta_1_(beta_1), beta_2_(beta_2) {
  step_.one_minus_beta_1 = static_cast<float>(1.0 - beta_1_);
  step_.one_minus_beta_2 = static_cast<float>(1.0 - beta_2_);
  step_.epsilon = static_cast<float>(epsilon);
}

void Adam::begin_step(double learning_rate, std::int64_t iteration) {
  // The bias corrections fold into one step size, computed once per update in float32 as Keras 3
  // computes it (the variables' dtype): beta_2 = 0.999 rounds to 0.99900001 in float32, so
  // 1 - beta_2^t, and the step, differ from double's by up to 1e-5 relative, which TensorFlow
  // run beside dtrain shows (tests/anchors).
  const float t = static_cast<float>(iteration + 1);
  const float beta_1_power = std::pow(static_cast<float>(beta_1_), t);
  const float beta_2_power = std::pow(static_cast<float>(beta_2_), t);
  step_.alpha = static_cast<float>(learning_rate) * std::sqrt(1.0f - beta_2_power) / (1.0f - beta_1_power);
}

void Adam::update(float* w, const float* g, std::size_t n, float* const* slots) {
  numerics().adam_update(step_, w, g, slots[0], slots[1], n);
}

bool Adam::update_all(std::span<Variable* const> vars) {
  all_.resize(vars.size());
  for (std::size_t i = 0; i < vars.size(); ++i) {
    Variable& v = *vars[i];
    all_[i] = {v.value.address<float>(), v.grad.address<float>(), slot_address(i, 0), slot_address(i, 1),
               static_cast<std::size_t>(v.value.numel())};
  }
  numerics().adam_update_all(step_, all_);
  return true;
}

// ---------------------------------------------------------------- RMSprop

RMSprop::RMSprop(std::unique_ptr<LearningRateSchedule> schedule, device::Numerics& numerics, double rho,
                 double momentum, double epsilon, bool centered)
    : Optimizer(std::move(schedule), numerics) {
  step_.rho = static_cast<float>(rho);
  step_.momentum = static_cast<float>(momentum);
  step_.epsilon = static_cast<float>(epsilon);
  step_.centered = centered;
}

std::vector<std::string> RMSprop::slot_names() const {
  std::vector<std::string> names{"velocity"};
  if (step_.momentum > 0.0f) names.push_back("momentum");
  if (step_.centered) names.push_back("average_gradient");
  return names;
}

void RMSprop::begin_step(double learning_rate, std::int64_t) { step_.learning_rate = static_cast<float>(learning_rate); }

void RMSprop::update(float* w, const float* g, std::size_t n, float* const* slots) {
  const bool momentum = step_.momentum > 0.0f;
  numerics().rmsprop_update(step_, w, g, slots[0], momentum ? slots[1] : nullptr,
                            step_.centered ? slots[momentum ? 2 : 1] : nullptr, n);
}

// ---------------------------------------------------------------- factory

namespace {

void require_range(double value, double lo, double hi, bool hi_inclusive, const char* key) {
  const bool ok = value >= lo && (hi_inclusive ? value <= hi : value < hi);
  if (!ok) {
    throw ConfigError(fmt::format("optimizer.{} must be in [{}, {}{}, got {}", key, lo, hi, hi_inclusive ? "]" : ")",
                                  value));
  }
}

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const config::OptimizerConfig& config, device::Numerics& numerics) {
  auto schedule = make_schedule(config.learning_rate);
  switch (config.kind) {
    case config::OptimizerKind::sgd:
      require_range(config.momentum, 0.0, 1.0, true, "momentum");
      return std::make_unique<SGD>(std::move(schedule), numerics, config.momentum, config.nesterov);
    case config::OptimizerKind::adam:
      require_range(config.beta_1, 0.0, 1.0, false, "beta_1");
      require_range(config.beta_2, 0.0, 1.0, false, "beta_2");
      if (!(config.epsilon >= 0.0)) throw ConfigError(fmt::format("optimizer.epsilon must be >= 0, got {}", config.epsilon));
      return std::make_unique<Adam>(std::move(schedule), numerics, config.beta_1, config.beta_2, config.epsilon);
    case config::OptimizerKind::rmsprop:
      require_range(config.rho, 0.0, 1.0, false, "rho");
      require_range(config.momentum, 0.0, 1.0, true, "momentum");
      if (!(config.epsilon > 0.0)) throw ConfigError(fmt::format("optimizer.epsilon must be > 0 for rmsprop, got {}", config.epsilon));
      return std::make_unique<RMSprop>(std::move(schedule), numerics, config.rho, config.momentum, config.epsilon,
                                       config.centered);
  }
  throw ConfigError("optimizer: unknown kind");
}

}  // namespace dtrain::optim
