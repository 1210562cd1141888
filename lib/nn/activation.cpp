#include "nn/activation.hpp"

#include <algorithm>

#include "nn/reference/layers.hpp"
#include "nn/registry.hpp"

namespace dtrain::nn {

namespace {

config::LayerOptions parse(const config::Section& s) {
  ActivationOptions c;
  c.activation = config::read_enum(s.require("activation"), s.path("activation"), "activation", config::activation_names);
  return c;
}

void write(const config::LayerOptions& options, config::OptionsWriter& out) {
  out.enumeration("activation", config::activation_names, options_as<ActivationOptions>(options).activation);
}

const LayerRegistration<ActivationLayer> registered({.kind = "activation",
                                                     .aliases = {},
                                                     .auto_name = "activation",
                                                     .keys = {"activation"},
                                                     .parse = &parse,
                                                     .write = &write});

}  // namespace

void ActivationLayer::reference_forward(const ReferenceForward& io, const StepContext&) const {
  std::copy(io.x.begin(), io.x.end(), io.y.begin());
  reference::activation_forward(opt_.activation, io.y.data(), static_cast<std::int64_t>(io.y.size()),
                                output_shape()[output_shape().rank() - 1]);
}

void ActivationLayer::reference_backward(const ReferenceBackward& io, const StepContext&) const {
  reference::activation_backward(opt_.activation, io.y.data(), io.dy.data(), io.dx.data(),
                                 static_cast<std::int64_t>(io.dx.size()), output_shape()[output_shape().rank() - 1]);
}

Flops ActivationLayer::flops_per_sample() const {
  if (opt_.activation == config::Activation::linear) return {};
  const double n = static_cast<double>(input_shape().numel());
  return {.forward = n, .backward_data = n};
}

}  // namespace dtrain::nn
