#include "nn/global_average_pooling2d.hpp"

#include <fmt/format.h>

#include "nn/reference/average_pooling.hpp"
#include "nn/registry.hpp"

namespace dtrain::nn {

namespace {

config::LayerOptions parse(const config::Section&) { return GlobalAveragePooling2DOptions{}; }
void write(const config::LayerOptions&, config::OptionsWriter&) {}

// Keras' alias GlobalAvgPool2D is accepted as well.
const LayerRegistration<GlobalAveragePooling2D> registered({.kind = "global_average_pooling2d",
                                                            .aliases = {"global_avg_pool2d"},
                                                            .auto_name = "global_average_pooling2d",
                                                            .keys = {},
                                                            .parse = &parse,
                                                            .write = &write});

}  // namespace

Shape GlobalAveragePooling2D::build_layer(const Shape& in) {
  if (in.rank() != 3)
    throw ConfigError(fmt::format("layer '{}': global_average_pooling2d needs an input of shape (height, width, "
                                  "channels), got {}",
                                  name(), in.to_string()));
  return Shape{in[2]};
}

void GlobalAveragePooling2D::reference_forward(const ReferenceForward& io, const StepContext&) const {
  const Shape& in = input_shape();
  reference::global_average_pool2d_forward(io.x.data(), io.y.data(), io.batch, in[0], in[1], in[2]);
}

void GlobalAveragePooling2D::reference_backward(const ReferenceBackward& io, const StepContext&) const {
  const Shape& in = input_shape();
  reference::global_average_pool2d_backward(io.dy.data(), io.dx.data(), io.batch, in[0], in[1], in[2]);
}

Flops GlobalAveragePooling2D::flops_per_sample() const {
  const double n = static_cast<double>(input_shape().numel());
  return {.forward = n, .backward_data = n};
}

}  // namespace dtrain::nn
