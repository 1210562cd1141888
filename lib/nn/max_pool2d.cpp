#include "nn/max_pool2d.hpp"

#include "nn/registry.hpp"

namespace dtrain::nn {

namespace {

config::LayerOptions parse(const config::Section& s) { return MaxPool2DOptions{parse_pool2d(s)}; }

void write(const config::LayerOptions& options, config::OptionsWriter& out) {
  write_pool2d(options_as<MaxPool2DOptions>(options), out);
}

// Keras' class name MaxPooling2D is accepted as well.
const LayerRegistration<MaxPool2D> registered({.kind = "max_pool2d",
                                               .aliases = {"max_pooling2d"},
                                               .auto_name = "max_pooling2d",
                                               .keys = {std::begin(kPool2DKeys), std::end(kPool2DKeys)},
                                               .parse = &parse,
                                               .write = &write});

}  // namespace

void MaxPool2D::reference_forward(const ReferenceForward& io, const StepContext&) const {
  reference::max_pool2d_forward(io.x.data(), io.y.data(), dims(io.batch));
}

void MaxPool2D::reference_backward(const ReferenceBackward& io, const StepContext&) const {
  reference::max_pool2d_backward(io.x.data(), io.dy.data(), io.dx.data(), dims(io.batch));
}

Flops MaxPool2D::flops_per_sample() const {
  // A compare per window element; backward routes each output's gradient to one input.
  const double outputs = static_cast<double>(output_shape().numel());
  return {.forward = outputs * params().pool_size[0] * params().pool_size[1], .backward_data = outputs};
}

}  // namespace dtrain::nn
