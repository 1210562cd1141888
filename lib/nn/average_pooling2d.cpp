#include "nn/average_pooling2d.hpp"

#include "nn/reference/average_pooling.hpp"
#include "nn/registry.hpp"

namespace dtrain::nn {

namespace {

config::LayerOptions parse(const config::Section& s) { return AveragePooling2DOptions{parse_pool2d(s)}; }

void write(const config::LayerOptions& options, config::OptionsWriter& out) {
  write_pool2d(options_as<AveragePooling2DOptions>(options), out);
}

// Keras' alias AvgPool2D is accepted as well.
const LayerRegistration<AveragePooling2D> registered({.kind = "average_pooling2d",
                                                      .aliases = {"avg_pool2d"},
                                                      .auto_name = "average_pooling2d",
                                                      .keys = {std::begin(kPool2DKeys), std::end(kPool2DKeys)},
                                                      .parse = &parse,
                                                      .write = &write});

}  // namespace

void AveragePooling2D::reference_forward(const ReferenceForward& io, const StepContext&) const {
  reference::average_pool2d_forward(io.x.data(), io.y.data(), dims(io.batch));
}

void AveragePooling2D::reference_backward(const ReferenceBackward& io, const StepContext&) const {
  reference::average_pool2d_backward(io.dy.data(), io.dx.data(), dims(io.batch));
}

Flops AveragePooling2D::flops_per_sample() const {
  // An add per window element each way.
  const double work = static_cast<double>(output_shape().numel()) * params().pool_size[0] * params().pool_size[1];
  return {.forward = work, .backward_data = work};
}

}  // namespace dtrain::nn
