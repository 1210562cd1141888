// A variable of a model: its value and what the last training step computed for it.
// Values are canonical float32 in Keras layouts (conv kernels HWIO, dense kernels (in, out)),
// whatever dtype the layers compute in.
#pragma once

#include <string>

#include "core/tensor.hpp"

namespace dtrain {

struct Variable {
  std::string name;  // "<layer>/<weight>", e.g. "conv2d/kernel", "batch_normalization/moving_mean"
  Tensor value;
  // Same shape as value. Trainable: d(loss)/d(value) of the last backward. Not trainable (moving
  // statistics): this replica's contribution to the update the layer applies after the step (see
  // nn/layer.hpp); the strategy sums both kinds across replicas alike.
  Tensor grad;
  // Trained by the optimizer (Keras' trainable weights); the others are updated by their layer.
  bool trainable = true;
};

}  // namespace dtrain
