#include "nn/conv2d.hpp"

#include <fmt/format.h>

#include "nn/reference/layers.hpp"
#include "nn/registry.hpp"

namespace dtrain::nn {

namespace {

config::LayerOptions parse(const config::Section& s) {
  Conv2DOptions c;
  c.filters = s.require_int("filters", 1);
  s.get("kernel_size", c.kernel_size, config::read_pair);
  s.get("strides", c.strides, config::read_pair);
  s.get_enum("padding", c.padding, "padding", config::padding_names);
  s.get_enum("activation", c.activation, "activation", config::activation_names);
  s.get_bool("use_bias", c.use_bias);
  s.get("kernel_regularizer", c.kernel_regularizer, config::read_regularizer);
  return c;
}

void write(const config::LayerOptions& options, config::OptionsWriter& out) {
  const auto& c = options_as<Conv2DOptions>(options);
  out.integer("filters", c.filters);
  out.pair("kernel_size", c.kernel_size);
  out.pair("strides", c.strides);
  out.enumeration("padding", config::padding_names, c.padding);
  out.enumeration("activation", config::activation_names, c.activation);
  out.boolean("use_bias", c.use_bias);
  out.regularizer("kernel_regularizer", c.kernel_regularizer);
}

const LayerRegistration<Conv2D> registered({.kind = "conv2d",
                                            .aliases = {},
                                            .auto_name = "conv2d",
                                            .keys = {"filters", "kernel_size", "strides", "padding", "activation",
                                                     "use_bias", "kernel_regularizer"},
                                            .parse = &parse,
                                            .write = &write});

}  // namespace

Shape Conv2D::build_layer(const Shape& in) {
  if (in.rank() != 3)
    throw ConfigError(fmt::format("layer '{}': conv2d needs an input of shape (height, width, channels), got {}", name(),
                                  in.to_string()));
  const auto [kh, kw] = opt_.kernel_size;
  const auto [sh, sw] = opt_.strides;
  pad_h_ = padding_1d(in[0], kh, sh, opt_.padding);
  pad_w_ = padding_1d(in[1], kw, sw, opt_.padding);
  if (pad_h_.out < 1 || pad_w_.out < 1)
    throw ConfigError(fmt::format("layer '{}': kernel {}x{} does not fit the input {} with padding valid", name(), kh,
                                  kw, in.to_string()));
  add_variable("kernel", Shape{kh, kw, in[2], opt_.filters},
               Initializer::glorot_uniform(kh * kw * in[2], kh * kw * opt_.filters));
  if (opt_.use_bias) add_variable("bias", Shape{opt_.filters});
  return Shape{pad_h_.out, pad_w_.out, opt_.filters};
}

double Conv2D::regularization_loss(device::Numerics& numerics) const {
  return l2_penalty(numerics, kKernel, opt_.kernel_regularizer.l2);
}

void Conv2D::add_regularization_gradient(device::Numerics& numerics, float scale) {
  add_l2_gradient(numerics, kKernel, opt_.kernel_regularizer.l2, scale);
}

namespace {

reference::ConvDims dims_of(const Conv2D& layer, std::int64_t batch) {
  const Shape& in = layer.input_shape();
  const auto& o = layer.options();
  return {batch,        in[0],        in[1],        in[2],    o.filters, o.kernel_size[0], o.kernel_size[1],
          o.strides[0], o.strides[1], layer.padding_h().out, layer.padding_w().out, layer.padding_h().before,
          layer.padding_w().before};
}

}  // namespace

void Conv2D::reference_forward(const ReferenceForward& io, const StepContext&) const {
  const double* bias = opt_.use_bias ? io.variables[kBias].data() : nullptr;
  reference::conv2d_forward(io.x.data(), io.variables[kKernel].data(), bias, io.y.data(), dims_of(*this, io.batch));
  reference::activation_forward(opt_.activation, io.y.data(), static_cast<std::int64_t>(io.y.size()), opt_.filters);
}

void Conv2D::reference_backward(const ReferenceBackward& io, const StepContext&) const {
  std::vector<double> dz(io.dy.size());
  reference::activation_backward(opt_.activation, io.y.data(), io.dy.data(), dz.data(),
                                 static_cast<std::int64_t>(dz.size()), opt_.filters);
  double* dbias = opt_.use_bias ? io.dvariables[kBias].data() : nullptr;
  reference::conv2d_backward(io.x.data(), io.variables[kKernel].data(), dz.data(), io.dx.data(),
                             io.dvariables[kKernel].data(), dbias, dims_of(*this, io.batch));
}

Flops Conv2D::flops_per_sample() const {
  // Each output element is a dot product over a KH x KW x C window.
  const Shape& out = output_shape();
  const double outputs = static_cast<double>(out.numel());
  const double window = static_cast<double>(opt_.kernel_size[0]) * opt_.kernel_size[1] * input_shape()[2];
  return weighted_layer_flops(outputs * window, outputs, opt_.use_bias, opt_.activation != config::Activation::linear);
}

}  // namespace dtrain::nn
