// `dtrain eval --predictions FILE.h5`: what the model outputs for every sample of a split, for
// checking an exported model (docs/checkpoints.md, "dtrain eval").
//
//   /inputs   float32 (N, input_shape...)   the samples as the model takes them (x_scale applied)
//   /logits   float32 (N, output_shape...)  the model's outputs in inference mode
//   /labels   int32 (N,) class labels, or float32 (N, k) targets
//   attributes split ("test", ...) and checkpoint (the file evaluated)
#pragma once

#include <string>

#include "core/tensor.hpp"

namespace dtrain::train {

struct Predictions {
  Tensor inputs, logits, labels;
};

// Writes `p` into `path` atomically (the file is made in memory, then replaced whole). IoError
// naming the path when it cannot be written.
void write_predictions(const std::string& path, const Predictions& p, const std::string& split,
                       const std::string& checkpoint);

}  // namespace dtrain::train
