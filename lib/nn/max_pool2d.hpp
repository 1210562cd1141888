// MaxPooling2D (Keras semantics).
//   input  x (N, H, W, C)
//   output y (N, OH, OW, C), y = max over each pool window; OH, OW from nn/padding.hpp.
//   'same' padding never wins the max (padding is excluded, as in TensorFlow).
#pragma once

#include <string_view>

#include "nn/pooling.hpp"

namespace dtrain::nn {

struct MaxPool2DOptions : Pool2DParams {
  static constexpr std::string_view kind = "max_pool2d";
  bool operator==(const MaxPool2DOptions&) const = default;
};

class MaxPool2D final : public Pool2DLayer {
 public:
  using Options = MaxPool2DOptions;
  MaxPool2D(std::string name, const Options& options) : Pool2DLayer(std::move(name), options) {}
  std::string_view kind() const override { return Options::kind; }
  void reference_forward(const ReferenceForward& io, const StepContext& step) const override;
  void reference_backward(const ReferenceBackward& io, const StepContext& step) const override;
  Flops flops_per_sample() const override;
  // The CPU loops mark the relu's derivative in the winner byte forward keeps anyway (no winner
  // where the max is not above zero): nothing more to read.
  BackwardReads derivative_below_reads() const override { return BackwardReads::nothing; }
};

}  // namespace dtrain::nn
