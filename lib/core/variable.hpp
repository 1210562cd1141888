// A trainable variable: its value and the gradient the last backward pass accumulated into it.
// Values are canonical (Keras layouts: conv kernels HWIO, dense kernels (in, out)).
#pragma once

#include <string>

#include "core/tensor.hpp"

namespace dtrain {

struct Variable {
  std::string name;  // "<layer>/<weight>", e.g. "conv2d/kernel", "dense_1/bias"
  Tensor value;
  Tensor grad;  // same shape as value
};

}  // namespace dtrain
