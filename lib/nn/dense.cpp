#include "nn/dense.hpp"

#include <fmt/format.h>

#include "nn/reference/layers.hpp"
#include "nn/registry.hpp"

namespace dtrain::nn {

namespace {

config::LayerOptions parse(const config::Section& s) {
  DenseOptions d;
  d.units = s.require_int("units", 1);
  s.get_enum("activation", d.activation, "activation", config::activation_names);
  s.get_bool("use_bias", d.use_bias);
  s.get("kernel_regularizer", d.kernel_regularizer, config::read_regularizer);
  return d;
}

void write(const config::LayerOptions& options, config::OptionsWriter& out) {
  const auto& d = options_as<DenseOptions>(options);
  out.integer("units", d.units);
  out.enumeration("activation", config::activation_names, d.activation);
  out.boolean("use_bias", d.use_bias);
  out.regularizer("kernel_regularizer", d.kernel_regularizer);
}

const LayerRegistration<Dense> registered({.kind = "dense",
                                           .aliases = {},
                                           .auto_name = "dense",
                                           .keys = {"units", "activation", "use_bias", "kernel_regularizer"},
                                           .parse = &parse,
                                           .write = &write});

}  // namespace

Shape Dense::build_layer(const Shape& in) {
  if (in.rank() != 1)
    throw ConfigError(fmt::format(
        "layer '{}': dense needs a flat input (features,), got {}; put a flatten layer before it", name(),
        in.to_string()));
  add_variable("kernel", Shape{in[0], opt_.units}, Initializer::glorot_uniform(in[0], opt_.units));
  if (opt_.use_bias) add_variable("bias", Shape{opt_.units});
  return Shape{opt_.units};
}

double Dense::regularization_loss(device::Numerics& numerics) const {
  return l2_penalty(numerics, kKernel, opt_.kernel_regularizer.l2);
}

void Dense::add_regularization_gradient(device::Numerics& numerics, float scale) {
  add_l2_gradient(numerics, kKernel, opt_.kernel_regularizer.l2, scale);
}

void Dense::reference_forward(const ReferenceForward& io, const StepContext&) const {
  const double* bias = opt_.use_bias ? io.variables[kBias].data() : nullptr;
  reference::dense_forward(io.x.data(), io.variables[kKernel].data(), bias, io.y.data(), io.batch, input_shape()[0],
                           std::int64_t{opt_.units});
  reference::activation_forward(opt_.activation, io.y.data(), static_cast<std::int64_t>(io.y.size()), opt_.units);
}

void Dense::reference_backward(const ReferenceBackward& io, const StepContext&) const {
  std::vector<double> dz(io.dy.size());
  reference::activation_backward(opt_.activation, io.y.data(), io.dy.data(), dz.data(),
                                 static_cast<std::int64_t>(dz.size()), opt_.units);
  double* dbias = opt_.use_bias ? io.dvariables[kBias].data() : nullptr;
  reference::dense_backward(io.x.data(), io.variables[kKernel].data(), dz.data(), io.dx.data(),
                            io.dvariables[kKernel].data(), dbias, io.batch, input_shape()[0], std::int64_t{opt_.units});
}

Flops Dense::flops_per_sample() const {
  const double in = static_cast<double>(input_shape().numel()), units = opt_.units;
  return weighted_layer_flops(in * units, units, opt_.use_bias, opt_.activation != config::Activation::linear);
}

}  // namespace dtrain::nn
