// A model's weights as Keras 3 keeps them in a `.weights.h5` file (model.save_weights and
// model.load_weights), both ways (docs/checkpoints.md, "dtrain export --format keras"):
//
//   /layers/<group>/vars            one group per layer of the Sequential, attribute name (the layer's)
//   /layers/<group>/vars/<i>        float32 dataset: the layer's i-th variable, in the layer's order
//   /vars                           the model's own (none), attribute name
//
// Keras does not address a layer by its name (automatic names vary between two instances of the
// same model) but by its class in snake case, numbered per class in layer order: conv2d,
// max_pooling2d, conv2d_1, ... That is the prefix of dtrain's automatic layer names (each layer
// kind's registered auto_name), so <group> follows from the layer kinds whatever the layers are
// called. Variables keep Keras' layouts and order in both (conv kernels HWIO, dense kernels
// (in, out); batch normalization gamma, beta, moving_mean, moving_variance).
#pragma once

#include <string>
#include <vector>

#include "nn/model.hpp"

namespace dtrain::interop {

// The group of every layer of `model`, in order ("layers/conv2d", "layers/max_pooling2d", ...).
// ConfigError naming the layer for a kind whose Keras class dtrain does not know.
std::vector<std::string> keras_layer_groups(const nn::Sequential& model);

// The bytes of a Keras 3 weights file holding `model`'s variables (HDF5, built in memory);
// `model_name` is the /vars group's name attribute.
std::string keras_weights_image(const nn::Sequential& model, const std::string& model_name);

// One host array per model.variables(), in that order, read from the Keras 3 weights file at
// `path`. Every variable the model has must be there with its shape, as float32 or float64, and
// finite; the file may hold no weights for layers the model does not have. InputError naming the
// file and what failed (a dtrain checkpoint, a Keras 2 file, another model's layers or shapes).
std::vector<std::vector<float>> read_keras_weights(const std::string& path, const nn::Sequential& model);

}  // namespace dtrain::interop
