#include "nn/layer.hpp"

#include <fmt/format.h>

#include "core/checked.hpp"
#include "core/error.hpp"
#include "core/machine.hpp"
#include "nn/initializers.hpp"

namespace dtrain::nn {

Flops weighted_layer_flops(double multiply_adds, double outputs, bool bias, bool nonlinear_activation) {
  const double elementwise = nonlinear_activation ? outputs : 0.0;
  return {.forward = 2.0 * multiply_adds + (bias ? outputs : 0.0) + elementwise,
          .backward_data = 2.0 * multiply_adds + elementwise,
          .backward_weights = 2.0 * multiply_adds + (bias ? outputs : 0.0)};
}

Shape Layer::declare(std::size_t position, const Shape& input_shape) {
  DTRAIN_CHECK(vars_.empty() && !materialized_, "a layer is declared once");
  position_ = position;
  input_shape_ = input_shape;
  output_shape_ = build_layer(input_shape);
  return output_shape_;
}

bool Layer::materialize(Rng& init_rng, const std::function<bool()>& should_stop) {
  DTRAIN_CHECK(!materialized_, "a layer is materialized once");
  for (std::size_t i = 0; i < vars_.size(); ++i) {
    if (should_stop && should_stop()) return false;
    const Declared& d = declared_[i];
    Variable& v = vars_[i];
    v.value = Tensor(d.shape);
    v.grad = Tensor(d.shape);
    switch (d.init.kind) {
      case Initializer::Kind::zeros: break;  // Tensor storage starts zeroed
      case Initializer::Kind::ones: v.value.fill(1.0f); break;
      case Initializer::Kind::glorot_uniform: glorot_uniform(v.value, d.init.fan_in, d.init.fan_out, init_rng); break;
    }
  }
  materialized_ = true;
  return true;
}

Shape Layer::build(std::size_t position, const Shape& input_shape, Rng& init_rng) {
  declare(position, input_shape);
  materialize(init_rng);
  return output_shape_;
}

std::int64_t Layer::declared_elements() const {
  std::int64_t n = 0;
  for (const Declared& d : declared_) n += d.shape.numel();
  return n;
}

std::size_t Layer::add_variable(const std::string& weight, Shape shape, Initializer init, bool trainable) {
  // Refused before allocating: a variable is held about four times (value, gradient, two
  // optimizer slots), and allocating and initializing one the machine cannot hold takes minutes.
  const auto bytes = checked_mul(shape.numel(), 4 * 4);
  const MemoryLimit memory = usable_memory();
  if (!bytes || *bytes > memory.bytes)
    throw ConfigError(fmt::format("variable '{}' of shape {} needs {} with its gradient and optimizer slots, more "
                                  "than {}; make the layer smaller",
                                  weight, shape.to_string(), bytes ? format_bytes(*bytes) : "more than 8 EB",
                                  describe(memory)));
  Variable v;
  v.name = name_ + "/" + weight;
  v.trainable = trainable;
  vars_.push_back(std::move(v));
  declared_.push_back(Declared{std::move(shape), init});
  return vars_.size() - 1;
}

double Layer::l2_penalty(device::Numerics& numerics, std::size_t index, double l2) const {
  if (l2 == 0.0) return 0.0;
  const Tensor& w = vars_[index].value;
  return l2 * numerics.sum_of_squares(w.address<float>(), static_cast<std::size_t>(w.numel()));
}

void Layer::add_l2_gradient(device::Numerics& numerics, std::size_t index, double l2, float scale) {
  if (l2 == 0.0) return;
  Variable& v = vars_[index];
  // d(l2 * sum w^2)/dw = 2 l2 w
  numerics.axpy(static_cast<float>(2.0 * l2) * scale, v.value.address<float>(), v.grad.address<float>(),
                static_cast<std::size_t>(v.value.numel()));
}

config::LayerOptions Layer::options_without_final_activation() const {
  throw InternalError(fmt::format("layer '{}' ({}) has no activation of its own to leave out", name_, kind()));
}

}  // namespace dtrain::nn
